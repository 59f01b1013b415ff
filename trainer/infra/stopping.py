"""Stopping a run on SIGTERM (`docker stop`) or Ctrl-C, from the first line of setup to the end.

Until the loop starts (the model loads, the data is indexed) there is nothing to save: a signal stops the
run at once by raising `StopBeforeTraining`. Once the loop runs, a signal only sets a flag that the loop
checks at micro-batch boundaries; it then saves a checkpoint of the last completed step and exits. A second
Ctrl-C stops at once (KeyboardInterrupt), without a checkpoint.

A signal reaches Python between two bytecodes of the main thread: a long call into native code (the Rust
loader's indexing pass, a `torch` kernel) sees it only when it returns.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


def signal_exit_code(signal_name: str) -> int:
    """The exit code of a run a signal stopped: 128 + the signal's number, as a shell reports it."""
    return 128 + int(getattr(signal, signal_name))


class PeerLost(RuntimeError):
    """A collective failed because another process of the run ended or cannot be reached: this rank stops
    too (its one line is logged where the collective failed). The first rank that failed says why in its own
    log."""


class StopBeforeTraining(BaseException):
    """A SIGTERM or Ctrl-C before the loop started: the run ends at once, with nothing to save.

    A BaseException, as KeyboardInterrupt is: code that catches `Exception` (reporting, file probes) lets it
    through."""

    def __init__(self, signal_name: str):
        super().__init__(f"stopped by {signal_name} before training started")
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        return signal_exit_code(self.signal_name)


class StopRequested:
    """SIGTERM/SIGINT handling for a run, installed for the `with` block (in the main thread).

    Before `training_started()`, a signal raises StopBeforeTraining; after it, a signal sets the flag (the
    object is true, `signal_name` says which) that the loop checks, and a second Ctrl-C raises
    KeyboardInterrupt. A signal while a checkpoint or final/ is written lets the write finish."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._deferred = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequested:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def training_started(self) -> None:
        """From now on a signal is a request to save and stop at the next micro-batch boundary."""
        self._deferred = True

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops without waiting for the checkpoint
        self.signal_name = signal.Signals(signum).name
        if not self._deferred:
            self._deferred = True  # a second signal while this one unwinds setup does not raise again
            raise StopBeforeTraining(self.signal_name)
        log.warning("%s received: saving a checkpoint at the next micro-batch boundary", self.signal_name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __bool__(self) -> bool:
        return self.signal_name is not None

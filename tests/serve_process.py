"""`trainer serve` in a subprocess on 127.0.0.1 (a free port), for the tests that talk to it over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

SERVING = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+) ")


class ServeProcess:
    """`python -m trainer serve --model MODEL --port 0 ARGS...`; `url` once it listens, `log` its output."""

    def __init__(self, model: Path, *args: str, timeout: float = 300.0, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer", "serve", "--model", str(model), "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError("trainer serve did not start:\n" + self.log)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := SERVING.search(line):
                self.url = m[1]
                self._ready.set()
        self._ready.set()  # exited

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        """SIGTERM, as `docker stop` sends; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

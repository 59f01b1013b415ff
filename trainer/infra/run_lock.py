"""One trainer per output_dir: an exclusive lock, held for the run's lifetime.

Two trainers writing into one output_dir (two terminals, `docker compose up` twice) delete each other's
checkpoints in progress, interleave their rows in the train log, and `resume: auto` continues whichever saved
last. So a run takes `flock(LOCK_EX)` on `<output_dir>/.trainer.lock` before it reads or writes anything
there; a second trainer gets one line naming the holder (pid, host, start time, from the file) and exits 2.

The kernel releases the lock when the holder's process ends, however it ends (SIGKILL, the OOM killer):
nothing stale is left to delete, and the file itself is never deleted (deleting a lock file lets two
processes lock two different files). A process forked from the holder without exec shares the lock while it
lives; exec'd children (wandb's service, torchrun's workers) do not inherit it.

Network filesystems: Linux NFS clients implement flock with the server's byte-range locks (NFSv4, or NFSv3
with lockd), so the lock holds across machines; a mount with `nolock` or `local_lock=flock|all` locks only
within one machine. Where the filesystem refuses locks (ENOLCK, EOPNOTSUPP), the run goes on without one and
says so in a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_FILE = ".trainer.lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class OutputDirLocked(RuntimeError):
    """Another live process holds the output_dir's lock; the message names it (pid, host, start time)."""


class RunLock:
    """The lock on one output_dir, held from `acquire()` until `release()` or the end of the process."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock (creating output_dir), or raise OutputDirLocked at once; never waits. Where the
        filesystem has no locks, warn and return without holding one."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise OutputDirLocked(_in_use_message(self.output_dir, self.path, holder)) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _UNSUPPORTED:
                    raise
                log.warning(
                    "output_dir %s: this filesystem refuses file locks (%s); nothing stops a second trainer "
                    "from writing into the same output_dir",
                    self.output_dir,
                    os.strerror(e.errno),
                )
                return self
            # The file was replaced while we waited for the lock (someone deleted it): lock the new one.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode("utf-8"), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock up (the file stays, emptied). Safe to call twice."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # no stale holder details once it is free
        finally:
            os.close(fd)  # closing drops the lock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_output_dir(output_dir: str | Path) -> RunLock:
    """Lock `output_dir` for this run; keep the returned RunLock until the run ends.

    Collective under torchrun (call it on every rank, after the process group is up): rank 0 takes the lock,
    and its outcome is broadcast, so that when rank 0 cannot take it every rank raises the same
    OutputDirLocked (exit 2) together, none waits in a later collective. Other ranks hold nothing."""
    # torch: the CLI imports this module for its error class, also for commands that never load torch
    from trainer.infra import distributed

    lock = RunLock(output_dir)
    failure: BaseException | None = None
    if distributed.rank() == 0:
        try:
            lock.acquire()
        except Exception as e:  # any failure, so that the other ranks hear of it instead of hanging
            failure = e
    verdict = distributed.broadcast_object(
        None if failure is None else (isinstance(failure, OutputDirLocked), str(failure))
    )
    if failure is not None:
        raise failure
    if verdict is not None:
        in_use, message = verdict
        if in_use:
            raise OutputDirLocked(message)
        raise RuntimeError(f"rank 0 could not lock output_dir {output_dir}: {message}")
    return lock


def lock_holder(output_dir: str | Path) -> dict[str, Any] | None:
    """Who holds `output_dir`'s lock now ({"pid", "host", "started"}, possibly empty), or None when it is
    free or absent. Creates nothing (for `--dry-run`)."""
    path = Path(output_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops the shared lock, when it was taken
    return None


def describe_holder(output_dir: str | Path, holder: dict[str, Any]) -> str:
    """The one line for a locked output_dir, as OutputDirLocked says it."""
    return _in_use_message(Path(output_dir), Path(output_dir) / LOCK_FILE, holder)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _in_use_message(output_dir: Path, path: Path, holder: dict[str, Any]) -> str:
    if holder.get("pid"):
        started = holder.get("started")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            if isinstance(started, (int, float))
            else "at an unknown time"
        )
        who = f"pid {holder['pid']} on host {holder.get('host', '?')}, started {when}"
    else:
        who = "a process that has not written its details yet"
    return (
        f"output_dir {output_dir} is in use by another trainer ({who}; lock file {path}): wait for it to "
        "end or stop it, or set another output_dir"
    )

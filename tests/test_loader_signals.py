"""Ctrl-C and SIGTERM reach Python while the loader indexes (minutes of native code on a big dump): the pass
stops with the exception the signal handler raised, and writes no index cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.data.sample import write_sample

CHILD = """
import signal, sys
from trainer import _loader

class Stop(Exception):
    pass

def on_term(signum, frame):
    raise Stop("SIGTERM")

signal.signal(signal.SIGTERM, on_term)
# Python's own Ctrl-C handler, also where the launcher ignores SIGINT (a shell's background job), as the
# trainer's stop handlers do.
signal.signal(signal.SIGINT, signal.default_int_handler)
data, tokenizer, cache = sys.argv[1:]
try:
    _loader.RecipeLoader([data], tokenizer, batch_size=8, cache_dir=cache, num_threads=2)
except BaseException as e:
    print("raised", type(e).__name__, flush=True)
    sys.exit(3)
print("indexed", flush=True)
"""


def read_position(pid: int, path: Path) -> int | None:
    """Where process `pid` reads `path` (the offset of its open file), or None when it has it not open."""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            if os.readlink(fd) == str(path):
                fields = dict(line.split(":", 1) for line in (Path(f"/proc/{pid}/fdinfo") / fd.name).open())
                return int(fields["pos"])
    except (FileNotFoundError, ProcessLookupError):
        pass  # the process or the file descriptor went away meanwhile
    return None


@pytest.mark.skipif(not Path("/proc/self/fdinfo").is_dir(), reason="needs /proc to see the reading position")
@pytest.mark.parametrize(
    ("sig", "raised"),
    [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Stop")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_stops_indexing_with_the_handlers_exception(tmp_path, tiny_model_dir, sig, raised):
    data, cache = tmp_path / "big.csv", tmp_path / "cache"
    write_sample(data, 150_000, seed=4, fmt="recipenlg-csv")  # ~150 MB: seconds of indexing
    size = data.stat().st_size
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data), str(tiny_model_dir), str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sent_at = None
    try:
        # The signal goes in while the indexing pass is part-way through the file (anywhere before its end: on
        # a busy machine the polls are far apart).
        while child.poll() is None:
            pos = read_position(child.pid, data)
            if pos is not None and 0 < pos < size:
                child.send_signal(sig)
                sent_at = pos
                break
        out, _ = child.communicate(timeout=600)
    finally:
        child.kill()
    assert sent_at is not None, f"the pass ended before a poll saw it under way: {out}"
    assert child.returncode == 3, (sent_at, size, out)
    assert out.strip().splitlines()[-1] == f"raised {raised}", out
    # The pass stopped: an index finished after the signal would have been cached.
    assert not list(tmp_path.rglob("*.rlidx")), out

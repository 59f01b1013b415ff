"""The training loop's heartbeat file, and the container HEALTHCHECK that reads it.

The loop writes `<output_dir>/heartbeat` (JSON {"step": ..., "time": unix seconds}) after optimizer steps (at
most every 10 s) while it trains (`Heartbeat`). A run that hangs (a stuck collective, a dead data thread)
stops refreshing it; "CUDA is available" would still be true. `trainer healthcheck` (`check_heartbeat`) says
whether it is fresh.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from trainer.infra.disk import write_text_atomic

HEARTBEAT_NAME = "heartbeat"
HEARTBEAT_EVERY_S = 10.0


def heartbeat_path(output_dir: str | Path) -> Path:
    """Where the training loop writes its heartbeat for a run with this output_dir."""
    return Path(output_dir) / HEARTBEAT_NAME


def write_heartbeat(output_dir: str | Path, step: int) -> None:
    """Write the heartbeat for `step` now, replacing the file atomically (the health check never reads half a
    file)."""
    write_text_atomic(heartbeat_path(output_dir), json.dumps({"step": step, "time": time.time()}))


class Heartbeat:
    """The loop's heartbeat writer: `beat(step)` after steps writes at most every `every_s` seconds. As a
    context manager it beats on entry and, when the block ends without an error, once more at exit."""

    def __init__(
        self, output_dir: str | Path, step: int = 0, every_s: float = HEARTBEAT_EVERY_S, enabled: bool = True
    ):
        self.output_dir, self.step, self.every_s, self.enabled = output_dir, step, every_s, enabled
        self._last = 0.0

    def beat(self, step: int, force: bool = False) -> None:
        self.step = step
        now = time.monotonic()
        if self.enabled and (force or now - self._last >= self.every_s):
            write_heartbeat(self.output_dir, step)
            self._last = now

    def __enter__(self) -> Heartbeat:
        self.beat(self.step, force=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.beat(self.step, force=True)


def check_heartbeat(path: str | Path, max_age: float, now: float | None = None) -> tuple[bool, str]:
    """(fresh, one-line reason). The age is taken from the file's "time" field, else from its mtime."""
    path = Path(path)
    now = time.time() if now is None else now
    if not (math.isfinite(max_age) and max_age > 0):
        return False, f"--max-age must be a positive number of seconds, got {max_age}"
    try:
        stamp = path.stat().st_mtime
        raw = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return False, f"no heartbeat at {path} (training has not started, or writes elsewhere)"
    except OSError as e:
        return False, f"cannot read heartbeat {path}: {e.strerror}"
    step = None
    try:
        beat = json.loads(raw)
        # A time that is not a number, or from the future, cannot say the loop is alive: use the mtime.
        beat_time = beat.get("time") if isinstance(beat, dict) else None
        if isinstance(beat_time, (int, float)) and math.isfinite(beat_time) and beat_time <= now + 60:
            stamp = float(beat_time)
            step = beat.get("step")
    except ValueError:
        pass  # half-written or foreign file: its mtime still says when it was last touched
    age = now - stamp
    at = f" at step {step}" if step is not None else ""
    if age > max_age:
        return False, f"heartbeat {path} is stale: last beat{at} {age:.0f} s ago (max {max_age:.0f} s)"
    return True, f"heartbeat ok: last beat{at} {max(age, 0.0):.0f} s ago"

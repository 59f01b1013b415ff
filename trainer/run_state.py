"""The run's state in one object, and the small files that let a restarted run continue as the same run.

`RunState` is what the loop advances step by step and what a checkpoint stores (as `trainer_state.json`,
whose keys and their meaning stay the same across versions, so older checkpoints resume). Beside the
checkpoints, `output_dir` keeps two small files from the moment a run starts: the W&B run id (so a container
restarted before its first checkpoint continues the same W&B run) and how often the run was started there.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WANDB_RUN_ID_FILE = "wandb_run_id"
STARTS_FILE = "run_starts.json"


@dataclass
class OomBackoff:
    """How far the run has backed off after CUDA out-of-memory errors: each loader batch is split into
    `split` micro-batches (the same data, more micro-steps), after `halvings` halvings so far."""

    split: int = 1
    halvings: int = 0


@dataclass
class RunState:
    """Everything about the run that changes as it trains. Saved with each checkpoint, restored on resume."""

    step: int = 0  # optimizer steps completed
    start_step: int = 0  # the step this process started at (not saved: each process has its own)
    saved_step: int | None = None  # the step of the newest checkpoint (the one resumed from included)
    best: dict[str, Any] | None = None  # the best evaluation so far: {"eval_loss", "path", "step"}
    nan_skipped: int = 0  # steps whose update was skipped for a NaN/inf loss or gradient
    consecutive_nan: int = 0  # such steps in a row (not saved: a resumed run counts anew)
    oom: OomBackoff = field(default_factory=OomBackoff)
    loader: dict[str, Any] | None = None  # the train stream's position after the last completed step
    world_size: int = 1  # the number of processes `loader` is a position for
    rng: dict[str, Any] | None = None  # RNG states at the last step boundary (saved in rng.pt, not JSON)
    wandb_run_id: str | None = None
    last_loss: float | None = None  # the last finite training loss

    @classmethod
    def from_trainer_state(cls, saved: dict[str, Any]) -> RunState:
        """The state a checkpoint's `trainer_state.json` holds; the process starts at its step."""
        step = int(saved["step"])
        return cls(
            step=step,
            start_step=step,
            saved_step=step,
            best=saved.get("best"),
            nan_skipped=int(saved.get("nan_skipped", 0)),
            oom=OomBackoff(int(saved.get("oom_split", 1)), int(saved.get("oom_halvings", 0))),
            loader=saved.get("loader"),
            world_size=int(saved.get("world_size", 1)),
            wandb_run_id=saved.get("wandb_run_id"),
            last_loss=saved.get("last_loss"),
        )

    def trainer_state(self, config: dict[str, Any], micro_batch: str) -> dict[str, Any]:
        """What a checkpoint stores as `trainer_state.json` (its "step" is added by the checkpoint writer).
        `config`: the config the run trains with (secrets masked); `micro_batch`: it in words."""
        return {
            "loader": self.loader,
            "world_size": self.world_size,
            "config": config,
            "wandb_run_id": self.wandb_run_id,
            "oom_split": self.oom.split,
            "oom_halvings": self.oom.halvings,
            "micro_batch": micro_batch,
            "best": self.best,
            "nan_skipped": self.nan_skipped,
            "last_loss": self.last_loss,
        }

    def is_best(self, eval_loss: float) -> bool:
        """Whether `eval_loss` beats every evaluation so far (lower is better)."""
        return math.isfinite(eval_loss) and (self.best is None or eval_loss < self.best["eval_loss"])


def read_wandb_run_id(output_dir: str | Path) -> str | None:
    """The W&B run id an earlier start of the run in `output_dir` wrote, or None."""
    try:
        run_id = (Path(output_dir) / WANDB_RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return run_id or None


def write_wandb_run_id(output_dir: str | Path, run_id: str) -> None:
    """Keep the run's W&B run id in `output_dir`, so that a restart continues the same W&B run."""
    _write_atomic(Path(output_dir) / WANDB_RUN_ID_FILE, run_id + "\n")


def count_start(output_dir: str | Path, fresh: bool = False) -> int:
    """Record one more start of the run in `output_dir` and return its number: 1 for the first start, k for
    the (k-1)-th restart. `fresh`: the run starts over (resume: never), so the count does too."""
    path = Path(output_dir) / STARTS_FILE
    starts = 0
    if not fresh:
        try:
            starts = int(json.loads(path.read_text(encoding="utf-8"))["starts"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s is unreadable (%s); counting starts from 1 again", path, e)
    _write_atomic(path, json.dumps({"starts": starts + 1}) + "\n")
    return starts + 1


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

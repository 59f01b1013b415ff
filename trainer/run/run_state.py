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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.infra.disk import write_text_atomic

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
    saved_step: int | None = None  # the step of the newest checkpoint (the one resumed from included)
    # The best evaluation so far by metric_for_best_model: {"metric": "eval_loss", "value", "step", "path",
    # "metrics": every metric of that evaluation}. Checkpoints before metric_for_best_model hold
    # {"eval_loss", "path", "step"}, read as such.
    best: dict[str, Any] | None = None
    # Evaluations in a row without an improvement over `best` by more than early_stopping_threshold (HF's
    # EarlyStoppingCallback.early_stopping_patience_counter).
    early_stopping_patience_counter: int = 0
    nan_skipped: int = 0  # steps whose update was skipped for a NaN/inf loss or gradient
    consecutive_nan: int = 0  # such steps in a row (not saved: a resumed run counts anew)
    oom: OomBackoff = field(default_factory=OomBackoff)
    loader: dict[str, Any] | None = None  # the train stream's position after the last completed step
    world_size: int = 1  # the number of processes `loader` is a position for
    rng: dict[str, Any] | None = None  # RNG states at the last step boundary (saved in rng.pt, not JSON)
    wandb_run_id: str | None = None
    last_loss: float | None = None  # the last finite training loss
    # The whole run's real (non-padding) tokens trained on and training seconds, all processes so far (HF's
    # num_input_tokens_seen), as of the last `count_progress`; and the tokens earlier processes had (not
    # saved; the step meter keeps their seconds).
    num_input_tokens_seen: int = 0
    train_seconds: float = 0.0
    tokens_before: int = 0
    # With max_time: the optimizer step the learning-rate schedule ends at, where the time budget will (None:
    # the planned total steps), and the training seconds per optimizer step it was estimated from (rank 0's).
    schedule_horizon: int | None = None
    seconds_per_step: float | None = None

    @classmethod
    def from_trainer_state(cls, saved: dict[str, Any]) -> RunState:
        """The state a checkpoint's `trainer_state.json` holds; the process starts at its step."""
        step = int(saved["step"])
        best = saved.get("best")
        if best is not None and "metric" not in best:  # saved before metric_for_best_model
            best = {
                "metric": "eval_loss",
                "value": best["eval_loss"],
                "step": best["step"],
                "path": best["path"],
            }
        tokens, seconds = int(saved.get("num_input_tokens_seen", 0)), float(saved.get("train_seconds", 0.0))
        return cls(
            step=step,
            saved_step=step,
            best=best,
            early_stopping_patience_counter=int(saved.get("early_stopping_patience_counter", 0)),
            num_input_tokens_seen=tokens,
            train_seconds=seconds,
            tokens_before=tokens,
            nan_skipped=int(saved.get("nan_skipped", 0)),
            oom=OomBackoff(int(saved.get("oom_split", 1)), int(saved.get("oom_halvings", 0))),
            loader=saved.get("loader"),
            world_size=int(saved.get("world_size", 1)),
            wandb_run_id=saved.get("wandb_run_id"),
            last_loss=saved.get("last_loss"),
            schedule_horizon=saved.get("schedule_horizon"),
            seconds_per_step=saved.get("seconds_per_step"),
        )

    def trainer_state(
        self, config: dict[str, Any], micro_batch: str, log_history: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """What a checkpoint stores as `trainer_state.json` (its "step" is added by the checkpoint writer).
        `config`: the config the run trains with (secrets masked); `micro_batch`: it in words; `log_history`:
        the train log's rows up to this step. Hugging Face's TrainerState keys come first, under its names
        and types, for the scripts and tools that read its checkpoints."""
        best = self.best or {}
        return {
            "global_step": self.step,
            "epoch": next((row["epoch"] for row in reversed(log_history) if "epoch" in row), 0.0),
            "best_metric": best.get("value"),
            "best_global_step": best.get("step"),
            "best_model_checkpoint": best.get("path"),
            "log_history": log_history,
            "loader": self.loader,
            "world_size": self.world_size,
            "config": config,
            "wandb_run_id": self.wandb_run_id,
            "oom_split": self.oom.split,
            "oom_halvings": self.oom.halvings,
            "micro_batch": micro_batch,
            "best": self.best,
            "early_stopping_patience_counter": self.early_stopping_patience_counter,
            "nan_skipped": self.nan_skipped,
            "last_loss": self.last_loss,
            "num_input_tokens_seen": self.num_input_tokens_seen,
            "train_seconds": self.train_seconds,
            "schedule_horizon": self.schedule_horizon,
            "seconds_per_step": self.seconds_per_step,
        }

    def count_progress(self, tokens: int, train_seconds: float) -> None:
        """Bring the run's totals up to date: `tokens` real tokens trained by this process, and the run's
        training seconds over all processes (the step meter's `train_seconds`)."""
        self.num_input_tokens_seen = self.tokens_before + tokens
        self.train_seconds = train_seconds

    def track_evaluation(
        self, metrics: dict[str, float], key: str, greater_is_better: bool, threshold: float, path: str
    ) -> bool:
        """Take an evaluation's `metrics` into the best and the early-stopping count, as Hugging Face's
        Trainer does; returns whether it is the new best (its checkpoint, at `path`, is then the one to keep).

        `key` is metric_for_best_model as the metrics name it ("eval_rougeL"). Early stopping first
        (EarlyStoppingCallback.check_metric_value): the count resets at the first evaluation and when the
        value beats the best so far by more than `threshold`, else it grows (NaN included). Then the best
        (Trainer._determine_best_metric): a finite value beyond the best so far is the new best, however small
        the step. Metrics without `key` change nothing. A best by another metric (metric_for_best_model
        changed on resume) is forgotten, with a warning."""
        if self.best is not None and self.best["metric"] != key:
            log.warning(
                "metric_for_best_model is now %s; the best so far (step %d) was by %s: tracking anew",
                key,
                self.best["step"],
                self.best["metric"],
            )
            self.best, self.early_stopping_patience_counter = None, 0
        value = metrics.get(key)
        if value is None:
            return False
        previous = self.best["value"] if self.best is not None else None

        def beats(a: float, b: float) -> bool:
            return a > b if greater_is_better else a < b

        if previous is None or (beats(value, previous) and abs(value - previous) > threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1
        if math.isfinite(value) and (previous is None or beats(value, previous)):
            self.best = {"metric": key, "value": value, "step": self.step, "path": path}
            self.best["metrics"] = dict(metrics)
            return True
        return False

    def early_stopping_due(self, patience: int | None) -> bool:
        """Whether `patience` evaluations in a row have not improved the metric (None: early stopping off)."""
        return patience is not None and self.early_stopping_patience_counter >= patience


def read_wandb_run_id(output_dir: str | Path) -> str | None:
    """The W&B run id an earlier start of the run in `output_dir` wrote, or None."""
    try:
        run_id = (Path(output_dir) / WANDB_RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return run_id or None


def write_wandb_run_id(output_dir: str | Path, run_id: str) -> None:
    """Keep the run's W&B run id in `output_dir`, so that a restart continues the same W&B run."""
    write_text_atomic(Path(output_dir) / WANDB_RUN_ID_FILE, run_id + "\n")


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
    write_text_atomic(path, json.dumps({"starts": starts + 1}) + "\n")
    return starts + 1

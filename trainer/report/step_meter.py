"""Counting the loop's steps: throughput over the logging window, the ETA, the train log, the run summary, and
the progress a person watching the console sees.

`<output_dir>/train_log.jsonl` (rank 0) has one row per optimizer step, `{"step", "epoch", "loss",
"learning_rate", "grad_norm", "time",
"samples", "source_tokens", "target_tokens", "padded_tokens"}` (token counts of the whole job, real tokens
apart from the padded total), and one row per evaluation, `{"step", "eval_loss", "time"}` (further evaluation
metrics are further keys), as in HF's `log_history`: a row with "loss" is a training step, one with
"eval_loss" an evaluation. Each row is one write of a complete line (trainer.infra.jsonl), so a killed run
leaves whole rows; `continue_train_log` makes a restarted run's log continue where its checkpoint is.
`<output_dir>/run_summary.json` is written at the end: steps, wall time, throughput, memory.

The meter also measures the run's training time, summed over restarts (`train_seconds`, saved in checkpoints
through RunState), against the `max_time` budget.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from trainer.infra.disk import write_text_atomic
from trainer.infra.jsonl import append_jsonl_row, repair_jsonl
from trainer.infra.memory import GpuMemory

log = logging.getLogger(__name__)

TRAIN_LOG = "train_log.jsonl"
SUMMARY = "run_summary.json"
# Optimizer steps a process measures before its time per step is used; its first step, which compiles and
# warms the allocator up, is not among them.
MEASURED_STEPS = 5
# What pauses the optimizer steps (`StepMeter.paused`): checkpoints (staging, or a whole write in the loop),
# evaluations, CUDA graph captures, and waits for a step's data the GPU was not busy meanwhile.
PAUSES = ("save", "evaluation", "capture", "data")


def format_duration(seconds: float | None) -> str:
    """`3h 4m`, `12m 5s`, `40s`; "unknown" for None, a negative or a non-finite number."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "unknown"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


@dataclass
class StepCounts:
    """What optimizer steps processed: rows, real (non-pad) source and target tokens, and padded positions."""

    samples: int = 0
    source_tokens: int = 0
    target_tokens: int = 0
    padded_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.source_tokens + self.target_tokens

    def add(self, other: StepCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def row(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class LoggedStep:
    """One logged step: what the console, W&B and Discord are told (`Reporter.log_step`)."""

    step: int
    total_steps: int
    loss: float
    lr: float
    grad_norm: float
    epoch: float  # epochs done, fractional
    tokens_per_s: float  # real tokens, over the steps since the last logged one
    samples_per_s: float
    real_token_share: float  # real tokens / padded positions
    eta_s: float | None
    memory: GpuMemory | None  # None on CPU

    def metrics(self) -> dict[str, float]:
        """The W&B metrics of this step (plotted against train/global_step)."""
        metrics = {
            "train/loss": self.loss,
            "train/learning_rate": self.lr,
            "train/epoch": self.epoch,
            "train/grad_norm": self.grad_norm,
            "train/tokens_per_s": self.tokens_per_s,
            "train/samples_per_s": self.samples_per_s,
            "train/real_token_share": self.real_token_share,
        }
        if self.memory is not None:
            metrics["gpu/memory_peak_gib"] = self.memory.peak_gib
            metrics["gpu/memory_allocated_gib"] = self.memory.allocated_gib
            metrics["gpu/memory_reserved_gib"] = self.memory.reserved_gib
        return metrics

    def line(self) -> str:
        """One log line: `step 20/250: loss 2.0618, lr 5.00e-03, 512 tokens/s, ETA 1m 3s` (+ GPU memory)."""
        text = (
            f"step {self.step}/{self.total_steps}: loss {self.loss:.4f}, lr {self.lr:.2e}, "
            f"{self.tokens_per_s:,.0f} tokens/s, ETA {format_duration(self.eta_s)}"
        )
        if self.memory is not None:
            text += f", GPU memory {self.memory.peak_gib:.1f} GiB peak"
        return text


class StepMeter:
    """Counts the steps of this process: `step_done` after every optimizer step, `log_window` at each logging
    step, `evaluated` after each evaluation, `write_summary` at the end.

    The ETA is (time since this process started training) / (steps it has done) x (steps left): right after a
    resume and after checkpoints alike; with a time budget (`max_time_s`), at most the budget left. The
    training time of the run is `seconds_before` (what earlier processes of the run trained, from the
    checkpoint) plus this process's. `output_dir` None (ranks other than 0): no files. `clock` is the
    monotonic clock the rates, the ETA and the training time use."""

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        output_dir: str | Path | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        seconds_before: float = 0.0,
        max_time_s: float | None = None,
        steps_per_epoch: float = 0.0,
    ):
        self.total_steps, self.start_step = total_steps, start_step
        self.steps_per_epoch = steps_per_epoch  # optimizer steps in one epoch (0: unknown)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        # The train log's rows, as Hugging Face's log_history: the earlier processes' read once, this one's
        # kept as they are written (a checkpoint takes a copy, without reading the file at each save).
        self.log_history = (
            read_train_log(self.output_dir / TRAIN_LOG, start_step) if self.output_dir is not None else []
        )
        self.seconds_before, self.max_time_s = seconds_before, max_time_s
        self._clock = clock
        self.started = self._window_started = clock()
        self.window = StepCounts()  # since the last logged step
        self.run = StepCounts()  # since this process started training
        self._steps_done = 0
        self._first_done = self._last_done = self.started
        self.pause_seconds = dict.fromkeys(PAUSES, 0.0)
        self.pause_counts = dict.fromkeys(PAUSES, 0)

    def step_done(
        self, step: int, loss: float, lr: float, counts: StepCounts, grad_norm: float = math.nan
    ) -> None:
        self._steps_done += 1
        self._last_done = self._clock()
        if self._steps_done == 1:
            self._first_done = self._last_done
        self.window.add(counts)
        self.run.add(counts)
        # Hugging Face's names for the same things (log_history), so that dashboards and scripts carry over
        row = {"step": step, "epoch": round(self.epoch_at(step), 6), "loss": loss, "learning_rate": lr}
        row |= {"grad_norm": grad_norm, "time": time.time(), **counts.row()}
        self._append(row)

    def epoch_at(self, step: int) -> float:
        """Epochs done after `step` optimizer steps (fractional), from `steps_per_epoch`."""
        return step / self.steps_per_epoch if self.steps_per_epoch else 0.0

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """Log an evaluation's metrics (e.g. {"eval_loss": 2.1}) as a row of the train log."""
        self._append({"step": step, **metrics, "time": time.time()})

    def paused(self, kind: str, seconds: float, count: int = 1) -> None:
        """Training paused `seconds` for `kind` (one of PAUSES)."""
        self.pause_seconds[kind] += seconds
        self.pause_counts[kind] += count

    def goodput(self) -> dict[str, float]:
        """This process's wall clock since training started, and the share of it in optimizer steps (what
        the pauses leave): {"goodput", "wall_s", "steps_s", "<pause>_s" and "<pause>_count" per kind}."""
        wall = max(self.elapsed_s, 1e-9)
        steps = max(wall - sum(self.pause_seconds.values()), 0.0)
        values = {"goodput": steps / wall, "wall_s": wall, "steps_s": steps}
        for kind in PAUSES:
            values[f"{kind}_s"] = self.pause_seconds[kind]
            values[f"{kind}_count"] = self.pause_counts[kind]
        return values

    def should_log(self, step: int, logging_steps: int) -> bool:
        return step % logging_steps == 0 or step == self.total_steps

    def eta_s(self, step: int) -> float | None:
        """Seconds to the end of the run: to the last step, or to the end of the time budget if sooner."""
        left = self.time_left_s()
        done = step - self.start_step
        if done <= 0:
            return left
        to_last_step = (self._clock() - self.started) / done * max(self.total_steps - step, 0)
        return to_last_step if left is None else min(to_last_step, left)

    @property
    def train_seconds(self) -> float:
        """The run's training time so far: earlier processes' (from the checkpoint) and this one's."""
        return self.seconds_before + self.elapsed_s

    def seconds_per_step(self) -> float | None:
        """This process's training seconds per optimizer step after its first, evaluations and checkpoints
        included; None until MEASURED_STEPS steps are measured."""
        measured = self._steps_done - 1
        if measured < MEASURED_STEPS:
            return None
        return (self._last_done - self._first_done) / measured

    def time_left_s(self) -> float | None:
        """Seconds of the max_time budget left (0 when spent), or None without a budget."""
        if self.max_time_s is None:
            return None
        return max(self.max_time_s - self.train_seconds, 0.0)

    def out_of_time(self) -> bool:
        """Whether the max_time budget is spent."""
        return self.time_left_s() == 0.0

    def log_window(
        self, step: int, *, loss: float, lr: float, grad_norm: float, memory: GpuMemory | None
    ) -> LoggedStep:
        """The numbers of the steps since the last logged one; starts the next window."""
        now = self._clock()
        seconds = max(now - self._window_started, 1e-9)
        logged = LoggedStep(
            step=step,
            total_steps=self.total_steps,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            epoch=self.epoch_at(step),
            tokens_per_s=self.window.tokens / seconds,
            samples_per_s=self.window.samples / seconds,
            real_token_share=self.window.tokens / max(self.window.padded_tokens, 1),
            eta_s=self.eta_s(step),
            memory=memory,
        )
        self.window, self._window_started = StepCounts(), now
        return logged

    @property
    def elapsed_s(self) -> float:
        """Seconds since this process started training."""
        return self._clock() - self.started

    def write_summary(self, step: int, duration_s: float, values: dict[str, Any]) -> None:
        """`run_summary.json`: steps, `duration_s` (of this process's training), its tokens/s, and `values`. A
        rerun that trained nothing (it only wrote a missing final/) keeps the summary of the run."""
        path = self.output_dir / SUMMARY if self.output_dir is not None else None
        if path is None or (self.run.tokens == 0 and path.exists()):
            return
        summary = {
            "steps": step,
            "duration_s": duration_s,
            "tokens_per_s": self.run.tokens / max(duration_s, 1e-9),
            **values,
        }
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    def _append(self, row: dict[str, Any]) -> None:
        if self.output_dir is not None:
            append_jsonl_row(self.output_dir / TRAIN_LOG, row)
            self.log_history.append(row)


def goodput_line(values: dict[str, float]) -> str:
    """`goodput 97.2%: 1h 2m of 1h 4m in optimizer steps; paused for checkpoints 12.0s (3), evaluations 1m 10s
    (3), CUDA graph captures 4.1s (2), data 0.8s (1)` (StepMeter.goodput's values; a count of pauses each)."""
    names = {
        "save": "checkpoints",
        "evaluation": "evaluations",
        "capture": "CUDA graph captures",
        "data": "data",
    }

    def seconds(s: float) -> str:
        return f"{s:.1f}s" if s < 60 else format_duration(s)

    pauses = ", ".join(
        f"{names[kind]} {seconds(values[f'{kind}_s'])} ({int(values[f'{kind}_count'])})" for kind in PAUSES
    )
    return (
        f"goodput {100 * values['goodput']:.1f}%: {seconds(values['steps_s'])} of "
        f"{seconds(values['wall_s'])} in optimizer steps; paused for {pauses}"
    )


def continue_train_log(train_log: Path, resumed_step: int | None) -> Path | None:
    """Make the train log continue the run. Resuming from a checkpoint at `resumed_step`: drop a line a
    killed run cut off mid-write, then the rows logged after that step (the resumed run logs those steps
    again). Starting over (`resumed_step` None) where an earlier attempt logged rows: move its log aside to
    `train_log.jsonl.<n>` (the first free n) and return that path; nothing is deleted."""
    if resumed_step is None:
        if not train_log.exists() or train_log.stat().st_size == 0:
            return None
        n = 1
        while (kept := train_log.with_name(f"{train_log.name}.{n}")).exists():
            n += 1
        train_log.rename(kept)
        return kept
    repair_jsonl(train_log)
    if not train_log.exists():
        return None
    lines = train_log.read_text(encoding="utf-8").splitlines(keepends=True)
    kept_lines = [line for line in lines if _row_step(line) <= resumed_step]
    if len(kept_lines) != len(lines):
        log.info(
            "train log: dropping %d rows after step %d (the resumed run logs them again)",
            len(lines) - len(kept_lines),
            resumed_step,
        )
        write_text_atomic(train_log, "".join(kept_lines))  # replaced whole: a kill here loses no row
    return None


def read_train_log(train_log: Path, up_to_step: int) -> list[dict[str, Any]]:
    """The train log's rows up to `up_to_step` (Hugging Face's `log_history`); none if there is no log. A
    line being written (a row cut short) is not a row yet."""
    if not train_log.exists():
        return []
    rows = []
    for line in train_log.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= up_to_step:
            rows.append(row)
    return rows


def _row_step(line: str) -> int:
    step = json.loads(line).get("step")  # every line is a JSON object after repair_jsonl
    return step if isinstance(step, int) else 0


class ConsoleProgress:
    """What a person watching the console sees: one log line per logged step, and on a terminal a progress
    bar below the log lines, with the last logged numbers (elsewhere, `docker compose logs` or a file, a bar
    would be one endless line). `enabled` False (ranks other than 0): nothing. `bar` False: no bar."""

    def __init__(self, total: int, initial: int, *, enabled: bool = True, bar: bool = True):
        self.enabled = enabled
        self._bar = None
        self._consoles: list[tuple[logging.Handler, logging.Handler]] = []
        if enabled and bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
            root = logging.getLogger()
            for handler in list(root.handlers):
                if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.stdout):
                    above = _AboveTheBar(handler, tqdm)
                    root.removeHandler(handler)
                    root.addHandler(above)
                    self._consoles.append((handler, above))

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def show(self, logged: LoggedStep) -> None:
        if not self.enabled:
            return
        log.info("%s", logged.line())  # on a terminal too: above the bar, kept in the scrollback
        if self._bar is None:
            return
        numbers = {
            "loss": f"{logged.loss:.4f}",
            "lr": f"{logged.lr:.2e}",
            "tok/s": f"{logged.tokens_per_s:,.0f}",
        }
        if logged.memory is not None:
            numbers["mem"] = f"{logged.memory.peak_gib:.1f}G"
        self._bar.set_postfix(numbers, refresh=False)

    def close(self) -> None:
        root = logging.getLogger()
        for console, above in self._consoles:
            root.removeHandler(above)
            root.addHandler(console)
        self._consoles = []
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ConsoleProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _AboveTheBar(logging.Handler):
    """A console handler's lines written above the progress bar (tqdm.write clears the bar, writes the line,
    draws the bar again), with that handler's level, format and filters: the secrets' masking among them,
    which tqdm's own logging redirect would drop."""

    def __init__(self, console: logging.StreamHandler, tqdm_class: Any):
        super().__init__(console.level)
        self.setFormatter(console.formatter)
        for f in console.filters:
            self.addFilter(f)
        self._stream = console.stream
        self._tqdm = tqdm_class

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._tqdm.write(self.format(record), file=self._stream)
        except Exception:
            self.handleError(record)

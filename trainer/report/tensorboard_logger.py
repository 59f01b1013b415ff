"""TensorBoard event files that never stop training (`report_to: tensorboard`), for runs kept off the cloud.

`TensorBoardLogger` writes the scalars W&B gets, under the same names (train/loss, train/learning_rate,
eval/rougeL, ...), against the optimizer step, into one directory per run (`logging_dir`, default
output_dir/runs): `tensorboard --logdir outputs` shows every run beside the others. The config (secrets
dropped, values redacted) and each evaluation's generated recipes are text. A resumed run purges what an
earlier attempt wrote after the step it resumes from, so a curve never doubles back. The files come from
tensorboardX (its own writer thread; no TensorFlow, no `tensorboard` package needed to write). Any failure is
logged once and TensorBoard is switched off for the rest of the run; training goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import yaml

from trainer.infra.redact import redact
from trainer.report.wandb_logger import SAMPLE_COLUMNS, clean_config

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 30  # event files reach the disk at least this often (and at the end)


def _cell(value: Any) -> str:
    """A value as one cell of a Markdown table (TensorBoard renders text summaries as Markdown)."""
    if isinstance(value, float):
        value = f"{value:.4g}"
    return redact(str(value if value is not None else "")).replace("|", "\\|").replace("\n", " ")


class TensorBoardLogger:
    """One run's event files in `directory`. Methods never raise; after the first failure it is off."""

    def __init__(self, *, directory: str, config: dict[str, Any], start_step: int = 0):
        self.writer: Any = None
        self.directory = directory
        try:
            from tensorboardX import SummaryWriter

            os.makedirs(directory, exist_ok=True)
            # purge_step: TensorBoard drops the events of earlier files from this step on. A run resumed from
            # step N's checkpoint logs N + 1 onwards: the earlier attempt's points after N go (this run
            # draws them again), N's own stays (nobody logs it again).
            purge = start_step + 1 if start_step else None
            self.writer = SummaryWriter(directory, purge_step=purge, flush_secs=FLUSH_SECONDS)
            text = yaml.safe_dump(clean_config(config), sort_keys=False)
            self.writer.add_text("config", "```\n" + text + "```", start_step)
            logger.info("TensorBoard: event files in %s (tensorboard --logdir %s)", directory, directory)
        except Exception as e:
            self._fail("start", e)

    @property
    def enabled(self) -> bool:
        return self.writer is not None

    def _fail(self, where: str, e: BaseException) -> None:
        logger.warning(
            "TensorBoard %s failed, training goes on without it: %s: %s",
            where,
            type(e).__name__,
            redact(str(e))[:500],
        )
        writer, self.writer = self.writer, None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Each number of `metrics` as a scalar at `step` (anything else is not a scalar: skipped)."""
        if self.writer is None:
            return
        try:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)
        except Exception as e:
            self._fail("log", e)

    def log_samples(self, step: int, samples: list[dict[str, Any]], key: str = "eval/generations") -> None:
        """The generated recipes (SAMPLE_COLUMNS) as a Markdown table at `step`."""
        if self.writer is None or not samples:
            return
        try:
            columns = SAMPLE_COLUMNS[1:]
            rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            rows += ["| " + " | ".join(_cell(s.get(c)) for c in columns) + " |" for s in samples]
            self.writer.add_text(key, "\n".join(rows), step)
        except Exception as e:
            self._fail("log", e)

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is None:
            return
        try:
            writer.close()  # flushes what is queued
        except Exception as e:
            logger.warning("TensorBoard close failed: %s: %s", type(e).__name__, redact(str(e))[:500])

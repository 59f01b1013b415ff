"""The one object the training loop calls for monitoring: W&B and TensorBoard metrics plus Discord messages.

Every method returns quickly and never raises: W&B failures are logged once and W&B is switched off, Discord
messages go through a bounded queue to a background thread (trainer.report.notify). Only the main process
reports.

    with Reporter(cfg, is_main=rank == 0, run_id=run_id) as reporter:  # a crash or 2nd Ctrl-C is reported
        reporter.started(model=..., data=..., effective_batch=..., planned_steps=..., attempt=...)
        reporter.log_step(logged)  # each logged step: W&B metrics, and Discord progress at most so often
        ...
        reporter.finished(final_loss=..., duration_s=..., model_dir=...)
    # leaving the block closes it: queued Discord messages get a few seconds, the W&B run is finished

W&B metrics (plotted against `train/global_step`, which the Reporter adds): those of
`trainer.report.step_meter.LoggedStep.metrics` (train/loss, train/learning_rate, train/epoch, train/grad_norm,
train/tokens_per_s, train/samples_per_s, train/real_token_share, gpu/memory_*_gib), each evaluation's metrics
as eval/<name> (eval/loss, eval/rougeL, eval/ingredient_coverage, ...) and the eval/generations table of
generated recipes (`evaluated`), train/oom_backoffs (`oom_backoff`) and train/skipped_nan_steps
(`nan_skipped`). System metrics (GPU utilisation, power, CPU) come from wandb itself. Model artifacts
(`checkpoint_saved`, `model_saved`) follow WANDB_LOG_MODEL (trainer.report.wandb_logger.log_model_mode).
TensorBoard (trainer.report.tensorboard_logger) gets the same metrics under the same names, and the
generated recipes as text.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import os
import socket
import threading
import time
import traceback
from typing import Any

from trainer.config import TrainConfig
from trainer.infra.redact import install_log_redaction, redact
from trainer.infra.stopping import StopBeforeTraining, signal_exit_code
from trainer.report.notify import DiscordNotifier, Priority, make_embed, webhook_url_from_env
from trainer.report.start_failure import forget_start_failure
from trainer.report.step_meter import LoggedStep, format_duration
from trainer.report.tensorboard_logger import TensorBoardLogger
from trainer.report.wandb_logger import WandbLogger, artifact_name, log_model_mode

logger = logging.getLogger(__name__)

TRACEBACK_CHARS = 3500  # what a crash message keeps of the traceback: the end, where the error is
TRACEBACK_LINE_CHARS = 400
_GENERATIONS_IN_DISCORD = 3
# Discord's evaluation message: the metrics shown, with their labels.
_DISCORD_METRICS = (
    ("eval_loss", "Eval loss"),
    ("eval_rougeL", "ROUGE-L"),
    ("eval_bleu", "BLEU"),
    ("eval_ingredient_coverage", "Ingredient coverage"),
    ("eval_invented_ingredients", "Invented ingredients"),
    ("eval_structure", "Structure ok"),
)


def _never_raise(method):
    """Reporting must never take a training run down: log the first error of each method and carry on."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            if method.__name__ not in self._errors_logged:
                self._errors_logged.add(method.__name__)
                logger.warning(
                    "reporting: %s failed: %s: %s", method.__name__, type(e).__name__, redact(str(e))
                )
            return None

    return wrapper


def _num(value: float | None, fmt: str = ".4f") -> str:
    if value is None:
        return "n/a"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def _best(best: dict[str, Any]) -> str:
    """RunState.best in words: `rougeL 23.41 at step 1,500`."""
    return f"{best['metric'].removeprefix('eval_')} {_num(best['value'], '.4g')} at step {best['step']:,}"


def _rate(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"


class Reporter:
    """W&B + Discord for one training run. See the module docstring; all methods are safe to call always.

    cfg.report_to turns W&B and TensorBoard on (`start_step`: the step a resumed run starts from, where
    TensorBoard drops what an earlier attempt wrote after it); DISCORD_WEBHOOK_URL (or DISCORD_WEBHOOK) in the
    environment turns Discord on. cfg.discord_progress_minutes: a progress message at most this often (the
    first progress call sends one); 0 sends every call, a negative value turns progress messages off.
    """

    def __init__(
        self, cfg: TrainConfig, *, is_main: bool = True, run_id: str | None = None, start_step: int = 0
    ):
        self._errors_logged: set[str] = set()
        self.cfg = cfg
        self.is_main = is_main
        self._given_run_id = run_id
        self._wandb = None
        self._tensorboard: TensorBoardLogger | None = None
        self._discord: DiscordNotifier | None = None
        self._last_progress_at: float | None = None
        self._oom_backoffs = 0
        self._exit_code = 0
        self._closed = False
        self._name = cfg.run_name or os.path.basename(os.path.normpath(cfg.output_dir or "run"))
        self._host = socket.gethostname()
        self._last_metrics: dict[str, float] = {}  # of the last evaluation, for artifact metadata
        self._log_model = "false"
        # Idempotent; here too so that no entry point can forget it (log handlers added later need their own
        # call, which the CLI makes after configuring logging).
        install_log_redaction()
        if not is_main:
            return
        self._setup_wandb(cfg, run_id)
        if self._wandb is not None:
            self._log_model = log_model_mode()
        if "tensorboard" in cfg.report_to:
            directory = cfg.logging_dir or os.path.join(cfg.output_dir, "runs")
            self._tensorboard = TensorBoardLogger(
                directory=directory, config=cfg.to_dict(), start_step=start_step
            )
        self._setup_discord()
        atexit.register(self._close_at_exit)

    def _setup_wandb(self, cfg: TrainConfig, run_id: str | None) -> None:
        if "wandb" not in cfg.report_to:
            return
        try:
            self._wandb = WandbLogger(
                config=cfg.to_dict(),
                project=cfg.wandb_project,
                entity=cfg.wandb_entity,
                name=cfg.run_name,
                run_id=run_id,
                # W&B files live with the run they describe (output_dir/wandb) unless WANDB_DIR says else.
                directory=None if os.environ.get("WANDB_DIR") else cfg.output_dir,
            )
            # Remembered, so run_id still answers after W&B is finished or has failed.
            self._given_run_id = self._wandb.run_id or run_id
        except Exception as e:
            logger.warning("W&B could not start, training goes on: %s: %s", type(e).__name__, redact(str(e)))
            self._wandb = None

    def _setup_discord(self) -> None:
        try:
            self._start_discord()
        except Exception as e:
            logger.warning("Discord notifications off: %s: %s", type(e).__name__, redact(str(e)))
            self._discord = None

    def _start_discord(self) -> None:
        url = webhook_url_from_env()
        if not url:
            logger.info("Discord notifications off (DISCORD_WEBHOOK_URL is not set)")
            return
        if not url.startswith(("https://", "http://")):
            logger.warning("Discord notifications off: the webhook URL is not an http(s) URL")
            return
        self._discord = DiscordNotifier(url)

    # -- helpers -----------------------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The W&B run id to store with checkpoints (the given one when W&B is off)."""
        if self._wandb is not None and self._wandb.run_id:
            return self._wandb.run_id
        return self._given_run_id

    def _footer(self) -> str:
        parts = [self._name, self._host]
        if self._wandb is not None and self._wandb.run_id:
            parts.append(f"W&B {self._wandb.run_id}")
        return " · ".join(parts)

    def _notify(self, kind: str, title: str, description: str = "", fields=None, *, priority, keep="head"):
        if self._discord is None:
            return
        embed = make_embed(kind, title, description, fields, footer=self._footer(), keep=keep)
        self._discord.send({"embeds": [embed]}, kind=kind, priority=priority)

    def _log_scalars(self, metrics: dict[str, Any], step: int) -> None:
        if self._wandb is not None:
            self._wandb.log(metrics, step)
        if self._tensorboard is not None:
            self._tensorboard.log(metrics, step)

    # -- events ------------------------------------------------------------------------------------

    @_never_raise
    def started(
        self,
        *,
        model: str,
        data: str,
        effective_batch: str,
        planned_steps: int,
        data_counts: dict[str, int] | None = None,
        attempt: int = 1,
    ) -> None:
        """The run starts; `attempt` k > 1: it is the (k-1)-th restart of the run (a restarted container)."""
        forget_start_failure()
        fields = [
            ("Model", model, True),
            ("Effective batch", effective_batch, True),
            (
                "Planned steps",
                f"{planned_steps:,}" if planned_steps and planned_steps > 0 else "unknown",
                True,
            ),
            ("Data", data, False),
        ]
        url = self._wandb.url if self._wandb is not None else None
        if url:
            fields.append(("W&B", url, False))
        title = f"Training started: {self._name}"
        if attempt > 1:
            title = f"Training restarted (attempt {attempt}): {self._name}"
        self._notify("started", title, "", fields, priority=Priority.CRITICAL)
        if self._wandb is not None:
            counts = {f"data/{k}": v for k, v in (data_counts or {}).items()}
            self._wandb.set_summary({"planned_steps": planned_steps, "attempt": attempt, **counts})

    @_never_raise
    def log_step(self, logged: LoggedStep) -> None:
        """A logged training step: its metrics to W&B, and a Discord progress message when one is due."""
        self.log_metrics(logged.metrics(), logged.step)
        self.progress(
            step=logged.step,
            total=logged.total_steps,
            loss=logged.loss,
            tokens_per_s=logged.tokens_per_s,
            eta_s=logged.eta_s,
            memory_gib=logged.memory.peak_gib if logged.memory is not None else None,
        )

    @_never_raise
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._log_scalars(dict(metrics), step)

    @_never_raise
    def progress(
        self,
        *,
        step: int,
        total: int,
        loss: float,
        tokens_per_s: float,
        eta_s: float | None,
        memory_gib: float | None,
    ) -> None:
        minutes = self.cfg.discord_progress_minutes
        if self._discord is None or minutes < 0:
            return
        now = time.monotonic()
        if self._last_progress_at is not None and now - self._last_progress_at < minutes * 60:
            return
        self._last_progress_at = now
        share = f" ({100 * step / total:.1f}%)" if total and total > 0 else ""
        fields = [
            ("Step", f"{step:,} / {total:,}{share}" if total and total > 0 else f"{step:,}", True),
            ("Loss", _num(loss), True),
            ("Tokens/s", _rate(tokens_per_s), True),
            ("ETA", format_duration(eta_s), True),
            ("GPU memory", f"{memory_gib:.1f} GiB" if memory_gib is not None else "n/a", True),
        ]
        self._notify("progress", "Progress", "", fields, priority=Priority.PROGRESS)

    @_never_raise
    def evaluated(
        self,
        *,
        step: int,
        metrics: dict[str, float],
        samples: list[dict[str, Any]],
        best: dict[str, Any] | None = None,
        early_stopping: tuple[int, int] | None = None,
    ) -> None:
        """An evaluation: its metrics (HF names, eval_loss, eval_rougeL, ...) to W&B as eval/<name> with the
        samples' table, and Discord's evaluation message. `best`: the best evaluation so far (RunState.best);
        `early_stopping`: (evaluations without improvement, patience) when early stopping is on."""
        self._last_metrics = dict(metrics)
        self._log_scalars({"eval/" + k.removeprefix("eval_"): v for k, v in metrics.items()}, step)
        if self._wandb is not None:
            self._wandb.log_samples(step, samples)
        if self._tensorboard is not None:
            self._tensorboard.log_samples(step, samples)
        fields: list[tuple[str, Any, bool]] = [("Step", f"{step:,}", True)]
        fields += [(label, _num(metrics[k], ".4g"), True) for k, label in _DISCORD_METRICS if k in metrics]
        if best is not None:
            new = " (new)" if best["step"] == step else ""
            fields.append(("Best", _best(best) + new, False))
        if early_stopping is not None:
            count, patience = early_stopping
            fields.append(("Early stopping", f"{count} of {patience} evaluations without improvement", False))
        for i, sample in enumerate(samples[:_GENERATIONS_IN_DISCORD], 1):
            rouge = sample.get("rougeL")
            score = f" (ROUGE-L {rouge:.1f})" if isinstance(rouge, (int, float)) else ""
            fields.append((f"Sample {i}: prompt", sample.get("prompt", "") or "-", False))
            fields.append((f"Sample {i}: generated{score}", sample.get("generated", "") or "-", False))
        self._notify("evaluated", "Evaluation", "", fields, priority=Priority.NORMAL)

    @_never_raise
    def checkpoint_saved(self, *, step: int, path: str, best: bool = False) -> None:
        """A checkpoint was written; with WANDB_LOG_MODEL=checkpoint its model files go to W&B as a version of
        the run's model artifact (aliases latest, checkpoint_global_step_<step>, and best when `best`)."""
        self._notify(
            "checkpoint",
            "Checkpoint saved",
            "",
            [("Step", f"{step:,}", True), ("Path", path, False)],
            priority=Priority.NORMAL,
        )
        if self._log_model == "checkpoint":
            aliases = ["latest", f"checkpoint_global_step_{step}"] + (["best"] if best else [])
            self._log_model_artifact(path, aliases, {"step": step, "best": best})

    @_never_raise
    def model_saved(self, *, step: int, path: str, best: dict[str, Any] | None = None) -> None:
        """final/ was written; with WANDB_LOG_MODEL=end or checkpoint its files go to W&B (alias final_model,
        and best when `best`, the best evaluation, is what final/ holds)."""
        if self._log_model not in ("end", "checkpoint"):
            return
        aliases = ["latest", "final_model"] + (["best"] if best is not None else [])
        metadata: dict[str, Any] = {"step": step, "final_model": True}
        if best is not None:
            metadata.update(best_global_step=best["step"], best_metric=best["value"], metric=best["metric"])
        self._log_model_artifact(path, aliases, metadata)

    def _log_model_artifact(self, path: str, aliases: list[str], metadata: dict[str, Any]) -> None:
        if self._wandb is None or not self._wandb.run_id:
            return
        name = artifact_name(self.cfg.run_name, self._wandb.run_id)
        metadata = {"base_model": self.cfg.model_name_or_path, **metadata, **self._last_metrics}
        if self._wandb.log_model(path, name, aliases, metadata):
            logger.info("W&B: logged %s as model artifact %s (%s)", path, name, ", ".join(aliases))

    @_never_raise
    def hub_pushed(self, *, url: str, step: int) -> None:
        """final/ is on the Hugging Face Hub (push_to_hub; called from the upload thread)."""
        fields = [("Repository", url, False), ("Step", f"{step:,}", True)]
        self._notify("hub", "Model pushed to the Hugging Face Hub", "", fields, priority=Priority.NORMAL)
        if self._wandb is not None:
            self._wandb.set_summary({"hub_url": url})

    @_never_raise
    def hub_push_failed(self, *, what: str, error: str, pending: str) -> None:
        """An upload to the Hub failed (said once per run; called from the upload thread)."""
        fields = [("Upload", what, True), ("Error", error, False), ("Waiting in", pending, False)]
        text = (
            "Training goes on. The upload is tried again with the next save and at the end; a later run of "
            "the same command uploads what is still waiting."
        )
        self._notify("hub_failed", "Hub upload failed", text, fields, priority=Priority.NORMAL)

    @_never_raise
    def oom_backoff(self, *, step: int, micro_batch: str, accumulation: int) -> None:
        self._oom_backoffs += 1
        self._log_scalars({"train/oom_backoffs": self._oom_backoffs}, step)
        fields = [
            ("Step", f"{step:,}", True),
            ("New micro-batch", micro_batch, True),
            ("Accumulation", str(accumulation), True),
            ("Back-offs so far", str(self._oom_backoffs), True),
        ]
        self._notify(
            "oom",
            "Out of memory: micro-batch halved",
            "The effective batch is unchanged.",
            fields,
            priority=Priority.NORMAL,
        )

    @_never_raise
    def nan_skipped(self, *, step: int, skipped_total: int) -> None:
        self._log_scalars({"train/skipped_nan_steps": skipped_total}, step)
        fields = [("Step", f"{step:,}", True), ("Skipped so far", str(skipped_total), True)]
        self._notify("nan", "Non-finite loss: step skipped", "", fields, priority=Priority.NORMAL)

    @_never_raise
    def crashed(self, exc: BaseException) -> None:
        self._exit_code = 1
        kind = type(exc).__name__
        # Each line is capped so a huge exception message cannot push the frames out; then the end is kept,
        # where the failing frame and the error are.
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        lines = [
            line if len(line) <= TRACEBACK_LINE_CHARS else line[:TRACEBACK_LINE_CHARS] + "…\n"
            for line in lines
        ]
        # A ``` inside the text would end the code block early.
        tb = redact("".join(lines).rstrip()).replace("```", "`\u200b``")
        if len(tb) > TRACEBACK_CHARS:
            tb = "…" + tb[-TRACEBACK_CHARS:]
        message = redact(str(exc))
        fields = [("Exception", kind, True)]
        if message:
            fields.append(("Message", message, False))
        self._notify(
            "crashed", f"Training crashed: {kind}", f"```\n{tb}\n```", fields, priority=Priority.CRITICAL
        )
        if self._wandb is not None:
            self._wandb.set_summary({"crashed": kind})

    @_never_raise
    def interrupted(self) -> None:
        """A second Ctrl-C: the run stopped at once, without a checkpoint."""
        self._exit_code = 130
        self._notify(
            "signal",
            f"Training interrupted: {self._name}",
            "A second Ctrl-C stopped the run at once, without a checkpoint; the last saved one resumes it.",
            priority=Priority.CRITICAL,
        )
        if self._wandb is not None:
            self._wandb.set_summary({"stopped_by": "SIGINT (twice, no checkpoint)"})

    @_never_raise
    def stopped_by_signal(self, *, signal_name: str, step: int, checkpoint: str | None) -> None:
        fields = [
            ("Signal", signal_name, True),
            ("Step", f"{step:,}", True),
            ("Checkpoint", checkpoint or "none written", False),
        ]
        text = "The run can resume from the checkpoint." if checkpoint else ""
        self._notify("signal", f"Training stopped by {signal_name}", text, fields, priority=Priority.CRITICAL)
        if self._wandb is not None:
            # Tells W&B the run was interrupted on purpose (it shows as preempted, not crashed).
            self._wandb.mark_preempting()
            self._wandb.set_summary({"stopped_by": signal_name, "stopped_at_step": step})

    @_never_raise
    def stopped_before_training(self, *, signal_name: str) -> None:
        """A signal while the model loaded or the data was indexed: the run ended with nothing to save."""
        self._exit_code = signal_exit_code(signal_name)
        self._notify(
            "signal",
            f"Training stopped by {signal_name} before training started: {self._name}",
            "Nothing was trained or saved; the same command starts the run again.",
            priority=Priority.CRITICAL,
        )
        if self._wandb is not None:
            self._wandb.mark_preempting()
            self._wandb.set_summary({"stopped_by": signal_name, "stopped_at_step": None})

    @_never_raise
    def finished(
        self,
        *,
        final_loss: float | None,
        duration_s: float,
        model_dir: str,
        stopped_by: str | None = None,
        steps: str | None = None,
        best: dict[str, Any] | None = None,
        goodput: dict[str, float] | None = None,
    ) -> None:
        """The run finished at its last step, or `stopped_by` "early_stopping", or "max_time": at its time
        budget, before its last step (`steps`: how far it got, in words); `best`: the best evaluation;
        `goodput`: trainer.report.step_meter.StepMeter.goodput's values."""
        fields = [
            ("Final loss", _num(final_loss), True),
            ("Duration", format_duration(duration_s), True),
        ]
        if goodput is not None:
            fields.append(("Goodput", f"{100 * goodput['goodput']:.1f}% of the wall clock in steps", True))
        title = f"Training finished: {self._name}"
        if stopped_by == "max_time":
            title = f"Training finished, time budget reached: {self._name}"
            fields.insert(0, ("Steps", steps or "n/a", True))
        if stopped_by == "early_stopping":
            fields.append(("Stopped by", "early stopping", True))
        if best is not None:
            fields.append(("Best", _best(best), True))
        fields.append(("Model", model_dir, False))
        self._notify("finished", title, "", fields, priority=Priority.CRITICAL)
        if self._wandb is not None:
            summary: dict[str, Any] = {"final_loss": final_loss, "duration_s": duration_s}
            if stopped_by:
                summary["stopped_by"] = stopped_by
            if best is not None:
                summary.update(best_metric=best["value"], best_global_step=best["step"])
            if goodput is not None:
                summary["goodput"] = goodput["goodput"]
                summary.update({f"goodput/{k}": v for k, v in goodput.items() if k != "goodput"})
            self._wandb.set_summary(summary)

    @_never_raise
    def close(self, timeout: float = 10.0) -> None:
        """Give queued Discord messages up to `timeout` seconds to go out, and finish the W&B run."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self._close_at_exit)
        start = time.monotonic()
        closer = None
        if self._discord is not None:
            # Discord drains in its own thread while W&B finishes here.
            closer = threading.Thread(target=self._discord.close, args=(timeout,), daemon=True)
            closer.start()
        if self._wandb is not None:
            self._wandb.finish(exit_code=self._exit_code)
        if self._tensorboard is not None:
            self._tensorboard.close()
        if closer is not None:
            closer.join(max(0.0, timeout - (time.monotonic() - start)) + 0.2)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Report how the block ended, if by an exception (a second Ctrl-C, or a crash), then close."""
        if isinstance(exc, KeyboardInterrupt):
            self.interrupted()
        elif isinstance(exc, StopBeforeTraining):
            self.stopped_before_training(signal_name=exc.signal_name)
        elif exc is not None:
            self.crashed(exc)
        if exc is not None:  # the CLI then does not report it again as a failed start
            exc.run_reported = True
        self.close()

    def _close_at_exit(self) -> None:
        # The loop forgot close() (or exited through an uncaught path): still flush, briefly.
        self.close(timeout=5.0)

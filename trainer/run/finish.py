"""The run's finish, step 3 of trainer.run.train: a checkpoint to resume from when a signal stopped it; else
the final checkpoint, final/ (the best checkpoint's model where there is one), its model card, the Hub
upload, the summary and the last reports."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import store as ckpt
from trainer.checkpoint.export import save_final_model
from trainer.checkpoint.model_card import LoraSettings, ModelCardInfo
from trainer.config import TrainConfig
from trainer.eval.in_training import (
    EvalResult,
)
from trainer.infra import distributed, memory
from trainer.infra.stopping import signal_exit_code
from trainer.model.load import LAST_LOAD
from trainer.plan.memory_plan import planned_peak_bytes
from trainer.report.step_meter import (
    goodput_line,
)
from trainer.run.checkpoints import save, wait_for_checkpoints
from trainer.run.run_state import RunState
from trainer.run.setup import Run

log = logging.getLogger(__name__)


def finish(run: Run, state: RunState, last_eval: EvalResult | None) -> int:
    """Stopped by a signal: a checkpoint of the last completed step, and exit code 128 + the signal.
    Else (the last step, or early stopping) the final checkpoint and final/ (when save_final: the best
    checkpoint's weights with load_best_model_at_end, the prompt template, the model card), the run summary,
    and exit code 0."""
    cfg, output_dir = run.cfg, run.output_dir
    duration = run.meter.elapsed_s  # the training, without the final saves
    if run.stop:
        path = output_dir / f"checkpoint-{state.step}"
        if state.saved_step != state.step:
            path = save(run, state)
        wait_for_checkpoints(run, state)
        run.reporter.stopped_by_signal(
            signal_name=run.stop.signal_name, step=state.step, checkpoint=str(path)
        )
        log.info(
            "stopped by %s at step %d; the same command resumes the run", run.stop.signal_name, state.step
        )
        return signal_exit_code(run.stop.signal_name)
    stopped_by = None  # the last step
    if state.early_stopping_due(cfg.early_stopping_patience):
        stopped_by = "early_stopping"
    elif state.step < run.data.total_steps:  # the loop ended early without a signal: the time budget is spent
        stopped_by = "max_time"
    final = output_dir / "final"  # written whole, then renamed into place: it exists only when complete
    if cfg.save_final and state.saved_step != state.step:
        save(run, state)
    wait_for_checkpoints(run, state)  # before final/ takes the best one's weights, and before the end
    best_weights = best_checkpoint_for_final(cfg, state)
    final_step = state.best["step"] if best_weights is not None else state.step
    if cfg.save_final:
        state.count_progress(run.meter.run.tokens, run.meter.train_seconds)
        card = model_card_info(run, state, final, last_eval, final_step)
        export_started = time.monotonic()
        save_final_model(
            run.model,
            cfg.model_name_or_path,
            run.data.tokenizer_file,
            final,
            prompt_config=run.trained,
            card=card,
            weights_from=best_weights,
        )
        run.meter.paused("save", time.monotonic() - export_started)
        if run.hub is not None:
            run.hub.final_saved(final, final_step, card)
        final_is_best = state.best is not None and state.best["step"] == final_step
        run.reporter.model_saved(step=final_step, path=str(final), best=state.best if final_is_best else None)
    summary: dict[str, Any] = {
        "final_loss": state.last_loss,
        "nan_skipped": state.nan_skipped,
        "oom_split": state.oom.split,
        "load_weight_gib": LAST_LOAD.get("weight_bytes", 0) / memory.GIB,
        "load_peak_gib": LAST_LOAD["peak_bytes"] / memory.GIB if LAST_LOAD.get("peak_bytes") else None,
        "train_seconds": run.meter.train_seconds,  # over all restarts, as max_time counts it
        "stopped_by": stopped_by,
        # Hugging Face's TrainerState names; final_model_step: whose weights final/ holds.
        "metric_for_best_model": cfg.best_metric_key,
        "best_metric": state.best["value"] if state.best else None,
        "best_global_step": state.best["step"] if state.best else None,
        "best_model_checkpoint": state.best["path"] if state.best else None,
        "final_model_step": final_step if cfg.save_final else None,
        "adapter": cfg.adapter,
    }
    if run.device.type == "cuda":
        summary["peak_allocated_gib"] = torch.cuda.max_memory_allocated(run.device) / memory.GIB
        summary["peak_reserved_gib"] = torch.cuda.max_memory_reserved(run.device) / memory.GIB
        # The memory plan's prediction for the planned micro-batch, and what it chose, beside the measurement.
        summary["planned_peak_gib"] = planned_peak_bytes(cfg, run.plan) / memory.GIB
        summary["decoder_blocks_without_checkpointing"] = run.plan.decoder_blocks_without_checkpointing
        summary["encoder_blocks_without_checkpointing"] = run.plan.encoder_blocks_without_checkpointing
        summary["packed_rows"] = run.plan.packed_rows
    if run.graph is not None:
        run.meter.paused("capture", run.graph.capture_seconds, count=run.graph.captures)
    goodput = run.meter.goodput()
    summary["goodput"] = goodput
    run.meter.write_summary(state.step, duration, summary)
    log.info("%s", goodput_line(goodput))
    for sample in (last_eval.samples if last_eval is not None else [])[:1]:
        log.info(
            "generated for a held-out record:\n  input: %s\n  generated: %s",
            sample["prompt"],
            sample["generated"],
        )
    loss = f"{state.last_loss:.4f}" if state.last_loss is not None else "n/a"
    if not cfg.save_final:
        model = "no model saved (save_final: false)"
    elif best_weights is not None:
        model = f"the model is in {final}, with the weights of the best checkpoint ({best_weights.name})"
    else:
        model = f"the model is in {final}"
    steps = f"{state.step} steps"
    if stopped_by == "max_time":
        steps = f"time budget reached (max_time {cfg.max_time}): {state.step} of {run.data.total_steps} steps"
    elif stopped_by == "early_stopping":
        steps = f"early stopping: {state.step} of {run.data.total_steps} steps"
    log.info("finished: %s in %.0f s, final loss %s; %s", steps, duration, loss, model)
    run.reporter.finished(
        final_loss=state.last_loss,
        duration_s=duration,
        model_dir=str(final),
        stopped_by=stopped_by,
        steps=f"{state.step:,} of {run.data.total_steps:,}",
        best=state.best,
        goodput=goodput,
    )
    if run.hub is not None:  # the last upload, for at most hub_upload_timeout; what is left waits on disk
        run.hub.wait(cfg.hub_upload_timeout_s)
    return 0


def best_checkpoint_for_final(cfg: TrainConfig, state: RunState) -> Path | None:
    """With load_best_model_at_end: the best checkpoint, whose weights final/ takes, when it is not the last
    step's (None: final/ takes the model as it is). A best checkpoint that is gone is said, and the last
    step's weights are used."""
    if not cfg.load_best_model_at_end or state.best is None or state.best["step"] == state.step:
        return None
    path = Path(state.best["path"])
    if not ckpt.is_complete(path):
        log.warning(
            "load_best_model_at_end: the best checkpoint %s is gone; final/ holds the last step's", path
        )
        return None
    return path


def model_card_info(run: Run, state: RunState, final: Path, last_eval: EvalResult | None, final_step: int):
    """What final/'s model card says about this run (trainer.checkpoint.model_card)."""
    cfg = run.cfg
    if run.device.type == "cuda":
        hardware = f"{distributed.world_size()}x {torch.cuda.get_device_name(run.device)}"
    else:
        hardware = f"{distributed.world_size()}x CPU" if distributed.world_size() > 1 else "CPU"

    def named(metrics: dict[str, float]) -> dict[str, float]:
        return {"eval/" + k.removeprefix("eval_"): v for k, v in metrics.items()}

    last = named(last_eval.metrics) if last_eval is not None else {}
    if state.last_loss is not None:
        last["train/loss"] = state.last_loss
    best = state.best
    lora = None
    if cfg.adapter is not None:
        trained = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        lora = LoraSettings(
            cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, list(cfg.lora_target_modules), trained
        )
    return ModelCardInfo(
        model_path=str(final),
        base_model=cfg.model_name_or_path,
        template=run.data.template,
        train_files=[str(f) for f in cfg.train_files + cfg.eval_files],
        train_records=run.data.records - run.data.eval_records,
        eval_records=run.data.eval_records,
        skipped_records=run.data.skipped,
        steps=state.step,
        tokens=state.num_input_tokens_seen,
        wall_time_s=state.train_seconds,
        hardware=hardware,
        metrics=last,
        last_eval_step=state.step if last_eval is not None else None,
        best_metrics=named(best.get("metrics", {best["metric"]: best["value"]})) if best else {},
        best_step=best["step"] if best else None,
        metric_for_best_model=cfg.best_metric_key,
        weights_step=final_step,
        lora=lora,
    )

"""The run's setup, step 1 of trainer.run.train: the paths, the data and its step plan, the device and
the process group, the reporting, the model with its optimizer and scheduler (resumed from a checkpoint where
there is one), the CUDA graph of the micro-steps; and `Run`, the parts they make, which the loop and finish
work with."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import resume
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.hub import HubUploader
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import ConfigError, TrainConfig, source_path
from trainer.data.loader import (
    mixture_summary,
    skipped_summary,
    stream_for,
)
from trainer.data.prompt import PromptTemplate
from trainer.eval.in_training import (
    load_generation_records,
)
from trainer.infra import disk, distributed, memory
from trainer.infra.healthcheck import Heartbeat
from trainer.infra.stopping import StopRequested
from trainer.kernels.projections import accumulate_weight_grads_in_place
from trainer.model.load import load_model
from trainer.model.loss import token_loss_sum
from trainer.model.model_files import ModelFiles, resolve_tokenizer_file
from trainer.model.model_shape import LoraShape, load_shape
from trainer.optim import build_optimizer, checkpoint_bytes_per_param
from trainer.plan.memory_plan import RunPlan, gpu_bytes_for
from trainer.plan.plan_report import memory_plan_line
from trainer.report.profiling import StepProfiler
from trainer.report.reporter import Reporter
from trainer.report.step_meter import (
    TRAIN_LOG,
    ConsoleProgress,
    StepMeter,
    continue_train_log,
    format_duration,
)
from trainer.run import parallel
from trainer.run.cuda_graphs import WARMUP, MicroStepGraph
from trainer.run.run_state import RunState, count_start, read_wandb_run_id, write_wandb_run_id
from trainer.run.schedule import build_scheduler, warmup_steps
from trainer.run.step import probe_memory

log = logging.getLogger(__name__)


class ModelIntact:
    """Whether the model and optimizer are still as the last completed step left them, so that a checkpoint
    of that step can be written before the run ends on an error. They are not while the optimizer updates the
    weights (an error there may leave them half-updated), and a save that failed is not tried again."""

    def __init__(self) -> None:
        self.now = True

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Around an optimizer update or a checkpoint write: an error inside leaves `now` False."""
        self.now = False
        yield
        self.now = True


@dataclass
class Data:
    """The run's data: tokenizer, prompt template, train and held-out streams, the held-out records each
    evaluation generates for, and the step plan derived from them."""

    tokenizer_file: str
    template: PromptTemplate
    train_stream: Any
    eval_stream: Any | None
    generation_records: list[dict]  # empty on ranks that do not generate (ddp: all but rank 0)
    total_steps: int
    steps_per_epoch: float  # optimizer steps in one epoch of the training data
    records: int  # usable records, held-out ones included
    eval_records: int  # of them, held out (from eval_files, or train_files' eval_fraction)
    skipped: int
    effective_batch: str  # in words, e.g. "16 rows x 2 accumulation"


@dataclass
class Run:
    """The parts of a run, built once by setup; the loop and finish work with them. What changes as the run
    trains is in RunState, passed beside it."""

    cfg: TrainConfig
    plan: RunPlan
    # cfg with the plan's choices filled in (RunPlan.applied_to): the config the run trains with, as its
    # checkpoints store it and the loader and the prompt template read it
    trained: TrainConfig
    data: Data
    device: torch.device
    output_dir: Path
    is_main: bool
    # the HF model (checkpoints, generation); with LoRA PEFT's model around it (trainer.model.lora)
    model: Any
    train_module: Any  # what the loss is computed through: the model, or FSDP2 around it
    grad_buffer: Any  # trainer.infra.distributed.GradientBuffer, or None under FSDP2
    optimizer: Any
    scheduler: Any
    reporter: Reporter
    heartbeat: Heartbeat
    stop: StopRequested
    profiler: StepProfiler
    progress: ConsoleProgress
    meter: StepMeter
    intact: ModelIntact
    graph: Any  # trainer.run.cuda_graphs.MicroStepGraph running the micro-steps (cuda_graphs), or None
    hub: HubUploader | None  # push_to_hub's uploads (rank 0), or None
    writer: CheckpointWriter  # checkpoints written in the background


def check_paths(cfg: TrainConfig) -> None:
    """Raise ConfigError for no train_files, or an `output_dir` that cannot be a writable directory (a file,
    or under a file or a read-only directory), before any work; creates nothing."""
    if not cfg.train_files:
        raise ConfigError("train_files is empty: name at least one recipe file or glob")
    path = Path(cfg.output_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"output_dir {cfg.output_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir {cfg.output_dir}: {existing} is not writable")


def open_data(cfg: TrainConfig, plan: RunPlan, rank: int, world_size: int) -> Data:
    """The tokenizer and the train and held-out streams (data indexed, skipped records counted and reported),
    and the number of optimizer steps."""
    tokenizer_file = str(resolve_tokenizer_file(cfg.model_name_or_path))
    # The loader takes the batching from a config: the plan's budget applied (and eval_fraction 0 with
    # eval_files). The prompt template reads the same.
    planned = plan.applied_to(cfg)
    train_stream = stream_for(planned, tokenizer_file, "train", rank=rank, world_size=world_size)
    eval_stream = None
    if cfg.eval_files:
        eval_stream = stream_for(
            planned, tokenizer_file, "eval", paths=cfg.eval_files, rank=rank, world_size=world_size
        )
    elif cfg.eval_fraction > 0:
        eval_stream = stream_for(planned, tokenizer_file, "eval", rank=rank, world_size=world_size)
    stats = train_stream.stats()
    eval_stats = eval_stream.stats() if eval_stream is not None else None
    held_out = eval_stats["records"] if eval_stats is not None else 0
    if cfg.eval_files:
        log.info(
            "data: %d records for training from %s (eval_files given: nothing of them is held out, "
            "eval_fraction is not used), %d for evaluation from %s",
            stats["records"],
            ", ".join(map(str, cfg.train_files)),
            held_out,
            ", ".join(map(str, cfg.eval_files)),
        )
    else:
        log.info(
            "data: %d records for training, %d held out for evaluation, from %s",
            stats["records"],
            held_out,
            ", ".join(map(str, cfg.train_files)),
        )
    if mixture := mixture_summary(stats, [source_path(f) for f in cfg.train_files]):
        log.info("data: %s", mixture)
    skips = skipped_summary(stats, stats["records"] + (0 if cfg.eval_files else held_out))
    if skips:
        log.warning("data: %s", skips)
    if cfg.eval_files and (eval_skips := skipped_summary(eval_stats, held_out)):
        log.warning("eval data: %s", eval_skips)
    skipped = sum(stats["skipped"].values()) + (sum(eval_stats["skipped"].values()) if cfg.eval_files else 0)
    template = PromptTemplate.from_config(planned)
    # Rank 0 scores the generations; under FSDP every rank runs them (trainer.eval.in_training).
    generates = rank == 0 or cfg.distributed_strategy == "fsdp"
    records = load_generation_records(cfg, eval_stream, needed=generates)
    accum = cfg.gradient_accumulation_steps
    batches_per_epoch = len(train_stream)
    if cfg.max_steps > 0:
        total_steps = cfg.max_steps
    else:
        total_steps = max(1, math.ceil(batches_per_epoch * cfg.num_train_epochs / accum))
    if warmup_steps(cfg, total_steps) >= total_steps:
        log.warning(
            "warmup_steps %g >= the run's %d optimizer steps: the learning rate never reaches %g",
            cfg.warmup_steps,
            total_steps,
            cfg.learning_rate,
        )
    effective = f"{plan.micro_batch()} x {accum} accumulation"
    if world_size > 1:
        effective += f" x {world_size} processes ({cfg.distributed_strategy})"
    log.info(
        "plan: %d optimizer steps of %s (%.2f epochs of %d loader batches, %d records each); tokenizer %s",
        total_steps,
        effective,
        total_steps * accum / max(batches_per_epoch, 1),
        batches_per_epoch,
        stats["epoch_records"],
        tokenizer_file,
    )
    return Data(
        tokenizer_file=tokenizer_file,
        template=template,
        train_stream=train_stream,
        eval_stream=eval_stream,
        generation_records=records,
        total_steps=total_steps,
        steps_per_epoch=batches_per_epoch / accum,
        records=stats["records"] + held_out,
        eval_records=held_out,
        skipped=skipped,
        effective_batch=effective,
    )


def finished_reason(cfg: TrainConfig, data: Data, state: RunState) -> tuple[str, str] | None:
    """(why, how to train on) when the resumed run has nothing left to do: it is at its last step, stopped
    early, or its time budget is spent, and final/ is written (or not wanted); None otherwise."""
    if not ((Path(cfg.output_dir) / "final").is_dir() or not cfg.save_final):
        return None  # final/ is missing: the rerun writes it
    budget = cfg.max_time_s
    if state.step >= data.total_steps:
        return f"is at step {state.step} of {data.total_steps}", "raise max_steps to train on"
    if state.early_stopping_due(cfg.early_stopping_patience):
        why = f"stopped early at step {state.step} of {data.total_steps} (early_stopping_patience)"
        return why, "raise early_stopping_patience to train on"
    if (
        budget is not None
        and time_budget_end(state.step, budget - state.train_seconds, state.seconds_per_step) <= state.step
    ):
        why = (
            f"is at step {state.step} of {data.total_steps}, its time budget (max_time {cfg.max_time}) spent"
        )
        return why, "raise max_time to train on"
    return None


def start_train_log(cfg: TrainConfig, output_dir: Path, resume_from: Path | None, state: RunState) -> None:
    """The train log continues at the resumed step; a run that starts over keeps the rows an earlier attempt
    logged in a file beside it."""
    kept = continue_train_log(output_dir / TRAIN_LOG, state.step if resume_from else None)
    if kept is not None:
        why = "resume: never" if cfg.resume == "never" else f"no checkpoint to resume from in {output_dir}"
        log.warning("%s: training starts over from step 0; the rows logged before are kept in %s", why, kept)


def warn_if_the_disk_is_small(
    cfg: TrainConfig,
    output_dir: Path,
    model_files: ModelFiles | None,
    total_steps: int,
    steps_per_epoch: float,
) -> None:
    """Warn at start when output_dir's disk cannot hold the checkpoints the run keeps: the newest
    checkpoint's size, else an estimate from the parameter count."""
    one = ckpt.checkpoint_bytes(output_dir)
    if one is None:
        n_params = model_files.n_params if model_files is not None else None
        dtype, lora = cfg.dtype, LoraShape.of(cfg)
        try:
            if lora is not None:  # the checkpoints hold the fp32 adapters and their states
                n_params, dtype = load_shape(cfg.model_name_or_path).lora_num_params(lora), "float32"
            elif n_params is None:  # pytorch_model.bin weights, random_init, a Hub model not downloaded yet
                n_params = load_shape(cfg.model_name_or_path).num_params()
        except (ValueError, OSError):
            return
        weight_bytes = 2 if dtype == "bfloat16" else 4
        per_param = checkpoint_bytes_per_param(cfg.optimizer, weight_bytes, cfg.bf16_update)
        one = disk.estimate_checkpoint_bytes(n_params, weight_bytes, per_param)
    planned_saves = math.ceil(total_steps / cfg.every("save_steps", total_steps, steps_per_epoch))
    warning = ckpt.free_space_warning(output_dir, one, cfg.save_total_limit, planned_saves)
    if warning:
        log.warning("%s", warning)


def log_memory_plan(cfg: TrainConfig, plan: RunPlan, world_size: int) -> None:
    """The dry run's memory plan: one GPU's predicted peak by component for this run's processes; without a
    GPU, the command that predicts it."""
    gpu_bytes = gpu_bytes_for(cfg)
    if gpu_bytes is None:
        log.info(
            "memory plan: no GPU here; `trainer plan --config CONFIG --processes %d --gpu-memory 32GiB` "
            "predicts one GPU's peak",
            world_size,
        )
        return
    log.info("%s", memory_plan_line(cfg, plan, gpu_bytes))


def log_time_budget(cfg: TrainConfig, state: RunState) -> None:
    budget = cfg.max_time_s
    if budget is None:
        return
    log.info(
        "max_time %s: %s of training used so far, %s left; when it is spent the run stops at the next step "
        "boundary, saves, evaluates and writes final/; the learning-rate schedule ends there too",
        cfg.max_time,
        format_duration(state.train_seconds),
        format_duration(max(budget - state.train_seconds, 0.0)),
    )
    if state.schedule_horizon is not None:
        log.info(
            "max_time: the learning-rate schedule ends at step %d, where the time budget does at the %.3g s "
            "per step measured before",
            state.schedule_horizon,
            state.seconds_per_step or float("nan"),
        )


def time_budget_end(step: int, seconds_left: float, seconds_per_step: float | None) -> int:
    """The step a time budget with `seconds_left` ends after, at `seconds_per_step` from `step` on (`step`
    when spent; with no measured time per step, `step` + 1 while time is left)."""
    if seconds_left <= 0:
        return step
    if seconds_per_step is None or seconds_per_step <= 0:
        return step + 1
    return step + int(seconds_left // seconds_per_step)


def resumed_schedule_horizon(cfg: TrainConfig, total_steps: int, state: RunState) -> int | None:
    """With max_time, where a resumed run's learning-rate schedule ends: where the time left ends at the
    checkpoint's measured time per step (the checkpoint's horizon when it has none); None without max_time
    (the planned total steps)."""
    budget = cfg.max_time_s
    if budget is None:
        return None
    if state.seconds_per_step is None:
        return None if state.schedule_horizon is None else min(state.schedule_horizon, total_steps)
    end = time_budget_end(state.step, budget - state.train_seconds, state.seconds_per_step)
    return min(total_steps, max(end, state.step + 1))


def setup_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    """This process's device (its GPU, else the CPU), the process group, and the memory cap if one is set."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    distributed.init(device, cfg.ddp_timeout)
    if device.type == "cuda":
        log.info("CUDA allocator: %s", memory.alloc_conf_in_force())
        if cfg.gpu_memory_limit_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, cfg.gpu_memory_limit_gib * memory.GIB / total)
            )
        if cfg.empty_cache_steps:
            log.info(
                "empty_cache_steps: torch.cuda.empty_cache() every %d optimizer steps and after each "
                "evaluation",
                cfg.empty_cache_steps,
            )
    return device


def start_reporting(
    cfg: TrainConfig, data: Data, state: RunState, output_dir: Path, is_main: bool
) -> Reporter:
    """The Reporter, continuing the run's W&B run (its id from the checkpoint, else from output_dir, where
    it is kept from the start), with the start announced: "started", or "restarted (attempt k)"."""
    fresh = cfg.resume == "never"
    run_id = state.wandb_run_id or (None if fresh else read_wandb_run_id(output_dir))
    reporter = Reporter(cfg, is_main=is_main, run_id=run_id, start_step=state.step)
    files = [str(f) for f in cfg.train_files + cfg.eval_files]
    state.wandb_run_id = reporter.run_id
    attempt = 1
    if is_main:
        if reporter.run_id:
            write_wandb_run_id(output_dir, reporter.run_id)
        attempt = count_start(output_dir, fresh=fresh)
        if attempt > 1:
            log.info("restart %d of the run in %s", attempt - 1, output_dir)
    reporter.started(
        model=cfg.model_name_or_path,
        data=f"{', '.join(files)} ({data.records:,} records, {data.skipped:,} skipped)",
        effective_batch=data.effective_batch,
        planned_steps=data.total_steps,
        data_counts={"records": data.records, "skipped_records": data.skipped},
        attempt=attempt,
    )
    return reporter


def build_model(
    cfg: TrainConfig,
    plan: RunPlan,
    trained: TrainConfig,
    data: Data,
    device,
    state: RunState,
    resume_from: Path | None,
):
    """Model (loaded once: from the checkpoint when resuming), what the loss runs through (the model, or FSDP2
    around it), the all-reduced gradients of ddp over several ranks (or None), optimizer and schedule, with
    the checkpoint's training state and loader position restored into them and `state`."""
    import numpy as np

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    # A LoRA checkpoint holds the adapters: the base is loaded again, and the adapters from the checkpoint.
    from_checkpoint = resume_from if cfg.adapter is None else None
    model = load_model(
        cfg,
        device,
        path=from_checkpoint,
        random_init=False if from_checkpoint else None,
        blocks_without_checkpointing=plan.blocks_without_checkpointing,
    )
    if cfg.adapter is not None:
        # peft takes seconds to import: only LoRA runs import it (through trainer.model.lora)
        from trainer.model.lora import add_adapters

        model = add_adapters(model, cfg)
    model.train()
    train_module = parallel.wrap(model, cfg, device)
    grad_buffer = distributed.gradient_buffer(train_module)
    if not distributed.is_sharded(train_module):  # FSDP acts on autograd's own gradient accumulation
        accumulate_weight_grads_in_place(model)
    optimizer = build_optimizer(model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg, state.schedule_horizon or data.total_steps)
    if resume_from:
        ckpt.load_training_state(resume_from, model, optimizer, scheduler)
        log.info("resumed from step %d (%s)", state.step, resume_from)
    if cfg.oom_probe and device.type == "cuda" and not resume_from:
        probe_memory(train_module, cfg, plan, state.oom, device, grad_buffer)
    if state.loader is not None:
        state.loader = resume.resume_position(
            resume_from,
            state.loader,
            state.world_size,
            data.train_stream,
            trained,
            data.tokenizer_file,
        )
    state.world_size = distributed.world_size()
    state.rng = ckpt.rng_state()  # the RNG states at the step boundary, which a checkpoint stores
    return model, train_module, grad_buffer, optimizer, scheduler


def micro_step_graph(cfg: TrainConfig, device: torch.device, model, train_module):
    """With cuda_graphs on a CUDA device, the MicroStepGraph that runs the loop's micro-steps; else None."""
    if not cfg.cuda_graphs:
        return None
    if device.type != "cuda":
        log.warning("cuda_graphs: no CUDA GPU here; the micro-steps run eagerly")
        return None
    log.info("cuda_graphs: each micro-step runs as a CUDA graph, captured after %d eager ones", WARMUP)
    params = [p for p in model.parameters() if p.requires_grad]
    # FSDP2's update all-reduces through the process group: eager, once per optimizer step.
    capture_update = not distributed.is_sharded(train_module)
    return MicroStepGraph(lambda **batch: token_loss_sum(train_module, batch), params, capture_update)

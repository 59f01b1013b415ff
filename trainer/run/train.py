"""The training run, top to bottom: `train` = setup (data, plan, model, optimizer, resume point), the loop
(optimizer steps, logging, evaluation, checkpoints), finish (the final checkpoint and model, the summary).

The run's changing state is one object (trainer.run.run_state.RunState), saved with every checkpoint; what one
optimizer step computes is trainer.run.step; the numbers the loop reports go through one step meter
(trainer.report.step_meter) to the console, the train log, W&B and Discord (trainer.report.reporter).

Under torchrun (`torchrun --nproc_per_node=N -m trainer train --config ...`) every process runs this loop on
its own shard of the data (the loader's rank/world_size; equal batch counts), with the whole model (`ddp`,
its gradients summed over ranks once per step) or FSDP2 (`fsdp`) (trainer/run/parallel.py,
trainer/infra/distributed.py). The loss is still the global one: the target-token count and the loss sum are
summed over ranks, so the gradients equal those of one process over the same global batch. Rank 0 alone writes
the train log, the console progress, W&B and Discord; checkpoints are collective
(trainer/checkpoint/store.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from trainer.checkpoint import resume
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.export import save_final_model
from trainer.checkpoint.hub import HubUploader, check_hub_config, upload_pending
from trainer.checkpoint.model_card import LoraSettings, ModelCardInfo
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import ConfigError, TrainConfig, source_path
from trainer.data.loader import (
    RecipeDataError,
    RecipeFileError,
    mixture_summary,
    records_in,
    skipped_summary,
    stream_for,
    to_device,
)
from trainer.data.prompt import PromptTemplate
from trainer.data.sample import ensure_demo_data
from trainer.eval.in_training import (
    EvalResult,
    eval_batch_tokens,
    evaluate,
    load_generation_records,
    metrics_line,
)
from trainer.infra import disk, distributed, memory
from trainer.infra.healthcheck import Heartbeat
from trainer.infra.jsonl import fsync_file
from trainer.infra.library_logs import route_library_output
from trainer.infra.run_lock import describe_holder, lock_holder, lock_output_dir
from trainer.infra.stopping import StopBeforeTraining, StopRequested, signal_exit_code
from trainer.kernels.projections import accumulate_weight_grads_in_place
from trainer.model.load import LAST_LOAD, load_model
from trainer.model.loss import token_loss_sum
from trainer.model.model_files import ModelFiles, check_model_dir, resolve_tokenizer_file
from trainer.model.model_shape import LoraShape, load_shape
from trainer.optim import build_optimizer, checkpoint_bytes_per_param
from trainer.plan.memory_plan import RunPlan, gpu_bytes_for, plan_packed_rows, plan_run, planned_peak_bytes
from trainer.plan.plan_report import memory_plan_line
from trainer.report.profiling import StepProfiler
from trainer.report.reporter import Reporter
from trainer.report.step_meter import (
    TRAIN_LOG,
    ConsoleProgress,
    StepCounts,
    StepMeter,
    continue_train_log,
    format_duration,
    goodput_line,
)
from trainer.run import parallel
from trainer.run.cuda_graphs import WARMUP, MicroStepGraph
from trainer.run.run_state import RunState, count_start, read_wandb_run_id, write_wandb_run_id
from trainer.run.schedule import build_scheduler, check_scheduler, set_horizon, warmup_steps
from trainer.run.step import accumulate_with_oom_backoff, optimizer_step, probe_memory

log = logging.getLogger(__name__)

# What the loader raises for a bad record or a file that went away or changed under a running job.
DATA_ERRORS = (RecipeDataError, RecipeFileError)


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


def train(cfg: TrainConfig, dry_run: bool = False, *, clock: Callable[[], float] = time.monotonic) -> int:
    """Train as `cfg` says; returns the process exit code (0, or 128 + the signal that stopped the run).
    dry_run: check the config, the model files, the data and the plan, without loading the model or writing
    anything. `clock`: the monotonic clock the training time is measured with (max_time, tokens/s, the ETA).
    Under torchrun every process calls this; the process group lives for the call."""
    try:
        try:
            code = _train(cfg, dry_run, clock)
        except StopBeforeTraining as stopped:  # no barrier: the other ranks may be anywhere in their setup
            log.warning("stopped by %s before training started; nothing to save", stopped.signal_name)
            return stopped.exit_code
        # Ranks tear the process group down together: one rank destroying it while another is still finishing
        # (rank 0 writes the summary and the final model) aborted a CPU run at exit ("terminate called").
        distributed.barrier()
        return code
    finally:
        distributed.destroy()


def _train(cfg: TrainConfig, dry_run: bool, clock: Callable[[], float]) -> int:
    # 1. Setup. Allocator settings before anything can initialise CUDA; then everything that can fail on a
    # bad config, model directory, output_dir or data file, before the model is loaded.
    memory.set_alloc_conf(cfg.cuda_alloc_conf)
    rank, world_size, local_rank = distributed.env()
    if cfg.cuda_graphs and world_size > 1 and cfg.distributed_strategy == "fsdp":
        raise ConfigError(
            "cuda_graphs with distributed_strategy fsdp: FSDP2 gathers and reduces inside every micro-step, "
            "which a CUDA graph cannot replay; use distributed_strategy ddp, or cuda_graphs false with "
            "micro-batches as large as memory allows (eager small ones leave the GPU waiting: FLAN-T5-XL "
            "on 2 GPUs ran at 78% of ddp's speed per GPU with max_tokens 32768 x 2, 36% with 8192 x 8)",
            key=("cuda_graphs", "distributed_strategy"),
        )
    distributed.quiet_other_ranks()
    route_library_output()
    # One way out: leaving this block (finished, stopped by a signal, or by an error) closes, in this order,
    # the console progress, the profiler, the heartbeat, the reporter (which reports an error or a stop),
    # the signal handlers and, last, the output_dir lock.
    with contextlib.ExitStack() as exits:
        # Until the loop starts, SIGTERM or Ctrl-C stop the setup at once (StopBeforeTraining).
        stop = exits.enter_context(StopRequested())
        check_paths(cfg)
        check_hub_config(cfg)
        if cfg.make_demo_data:
            ensure_demo_data(
                [source_path(f) for f in cfg.train_files],
                cfg.model_name_or_path,
                n=cfg.demo_records,
                fmt=cfg.data_format,
                dry_run=dry_run,
            )
        model_files = check_model_dir(cfg.model_name_or_path, weights=not cfg.random_init)
        output_dir = Path(cfg.output_dir)
        if dry_run:
            holder = lock_holder(output_dir)
            if holder is not None:
                log.warning("dry run: %s", describe_holder(output_dir, holder))
        else:
            device = setup_device(cfg, local_rank)  # the process group too: the lock is taken collectively
            exits.callback(lock_output_dir(output_dir).release)  # a second trainer here stops now, exit 2
            if rank == 0:
                for path in ckpt.remove_stale_temporaries(output_dir):
                    what = "deleting" if ckpt.DELETING in path.name else "saving"
                    log.info("removed %s, left half-done by an earlier run stopped while %s", path, what)
        resume_from = resume.find_resume_checkpoint(cfg.resume, output_dir)
        plan = plan_run(cfg)
        data = open_data(cfg, plan, rank, world_size)
        if cfg.packing:  # the loader chose the rows' lengths from the data: the plan's blocks fit those
            plan = plan_packed_rows(plan, cfg, data.train_stream.stats()["packed_shape"])
        check_scheduler(cfg, data.total_steps)
        trained = plan.applied_to(cfg)
        if dry_run:
            log_memory_plan(cfg, plan, world_size)
            log.info("dry run: the config, the model files and the data are fine; the model is not loaded")
            return 0
        state = RunState(world_size=world_size)
        if resume_from:
            saved = ckpt.load_trainer_state(resume_from)
            now = resume.saved_config(trained)
            resume.check_resume_config(resume_from, saved.get("config", {}), now)
            resume.warn_config_changes(saved.get("config", {}), now)
            state = RunState.from_trainer_state(saved)
            if already_finished(cfg, data, state, resume_from):
                if rank == 0:  # what an earlier run of it did not get onto the Hub
                    upload_pending(cfg, output_dir)
                return 0
            state.schedule_horizon = resumed_schedule_horizon(cfg, data.total_steps, state)
        if rank == 0:
            start_train_log(cfg, output_dir, resume_from, state)
            warn_if_the_disk_is_small(cfg, output_dir, model_files, data.total_steps)
        log_time_budget(cfg, state)

        reporter = exits.enter_context(start_reporting(cfg, data, state, output_dir, is_main=rank == 0))
        heartbeat = exits.enter_context(Heartbeat(output_dir, state.step, enabled=rank == 0))
        hub = None
        if cfg.push_to_hub and rank == 0:  # closed before the reporter: its last message can still go out
            hub = HubUploader(cfg, output_dir, reporter)
            exits.callback(hub.close)
        model, train_module, grad_buffer, optimizer, scheduler = build_model(
            cfg, plan, trained, data, device, state, resume_from
        )
        # Closed before the Hub's uploader and the lock: a write in flight ends first.
        writer = CheckpointWriter(group=distributed.background_group())
        exits.callback(close_writer, writer)
        run = Run(
            cfg=cfg,
            plan=plan,
            trained=trained,
            data=data,
            device=device,
            output_dir=output_dir,
            is_main=rank == 0,
            model=model,
            train_module=train_module,
            grad_buffer=grad_buffer,
            optimizer=optimizer,
            scheduler=scheduler,
            reporter=reporter,
            heartbeat=heartbeat,
            stop=stop,
            profiler=exits.enter_context(
                StepProfiler(cfg.profile_start_step, cfg.profile_steps, output_dir, enabled=rank == 0)
            ),
            progress=exits.enter_context(
                ConsoleProgress(data.total_steps, state.step, enabled=rank == 0, bar=cfg.progress_bar)
            ),
            meter=StepMeter(
                data.total_steps,
                state.step,
                output_dir if rank == 0 else None,
                clock,
                seconds_before=state.train_seconds,
                max_time_s=cfg.max_time_s,
                steps_per_epoch=data.steps_per_epoch,
            ),
            intact=ModelIntact(),
            graph=micro_step_graph(cfg, device, model, train_module),
            hub=hub,
            writer=writer,
        )
        # 2. The loop. From here a signal asks for a checkpoint at the next micro-batch boundary.
        stop.training_started()
        last_eval = loop(run, state)
        run.progress.close()
        # 3. Finish: a checkpoint and final/, or, stopped by a signal, a checkpoint to resume from.
        return finish(run, state, last_eval)


# -- 1. setup ---------------------------------------------------------------------------------------------


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


def already_finished(cfg: TrainConfig, data: Data, state: RunState, resume_from: Path) -> bool:
    """Whether the run resumed from `resume_from` has nothing left to do: it is at its last step, stopped
    early, or its time budget is spent, and final/ is written (or not wanted). Says so in the log."""
    if not ((Path(cfg.output_dir) / "final").is_dir() or not cfg.save_final):
        return False  # final/ is missing: the rerun writes it
    budget = cfg.max_time_s
    if state.step >= data.total_steps:
        why = f"is at step {state.step} of {data.total_steps}"
        how = "raise max_steps to train on"
    elif state.early_stopping_due(cfg.early_stopping_patience):
        why = f"stopped early at step {state.step} of {data.total_steps} (early_stopping_patience)"
        how = "raise early_stopping_patience to train on"
    elif (
        budget is not None
        and time_budget_end(state.step, budget - state.train_seconds, state.seconds_per_step) <= state.step
    ):
        why = (
            f"is at step {state.step} of {data.total_steps}, its time budget (max_time {cfg.max_time}) spent"
        )
        how = "raise max_time to train on"
    else:
        return False
    log.info(
        "%s %s: this run is already finished (%s, or set another output_dir or resume: never to start over)",
        resume_from,
        why,
        how,
    )
    return True


def start_train_log(cfg: TrainConfig, output_dir: Path, resume_from: Path | None, state: RunState) -> None:
    """The train log continues at the resumed step; a run that starts over keeps the rows an earlier attempt
    logged in a file beside it."""
    kept = continue_train_log(output_dir / TRAIN_LOG, state.step if resume_from else None)
    if kept is not None:
        why = "resume: never" if cfg.resume == "never" else f"no checkpoint in {output_dir}"
        log.warning("%s: training starts over from step 0; the rows logged before are kept in %s", why, kept)


def warn_if_the_disk_is_small(
    cfg: TrainConfig, output_dir: Path, model_files: ModelFiles | None, total_steps: int
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
    planned_saves = math.ceil(total_steps / cfg.every("save_steps", total_steps))
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
    return MicroStepGraph(lambda **batch: token_loss_sum(train_module, batch), params)


# -- 2. the loop ------------------------------------------------------------------------------------------


def loader_batches(stream, resume_state: dict | None = None):
    """Yield numpy batches forever, epoch after epoch; `resume_state` (a stream state_dict) continues
    exactly where a checkpoint left off, mid-epoch included."""
    if resume_state is not None:
        stream.load_state_dict(resume_state)
    else:
        stream.set_epoch(0)
    epoch, fresh = stream.state_dict()["epoch"], resume_state is None
    while True:
        yielded = False
        for batch in stream:
            yielded = True
            yield batch
        if fresh and not yielded:
            raise RuntimeError("the training data yields no batches (all records skipped or held out?)")
        epoch, fresh = epoch + 1, True
        stream.set_epoch(epoch)


def loop(run: Run, state: RunState) -> EvalResult | None:
    """Optimizer steps until the planned total, a stop signal, or the end of the time budget; returns the last
    evaluation. An error that leaves the model as the last completed step left it (a data file that went
    away, a failed evaluation, running out of memory even after the halvings) ends the run with a checkpoint
    of that step first."""
    try:
        return train_steps(run, state)
    except Exception as error:
        save_after_error(run, state, error)
        raise


def train_steps(run: Run, state: RunState) -> EvalResult | None:
    cfg, data = run.cfg, run.data
    empty_cache = memory.EmptyCacheSchedule(cfg.empty_cache_steps)
    batches = loader_batches(data.train_stream, state.loader)
    upcoming: StepBatches | None = None  # the next step's, read while the GPU finishes this one
    last_eval, evaluated_at = None, None
    while state.step < data.total_steps:
        run.profiler.before_step(state.step)
        with record_function("data"):
            if upcoming is None:  # not read during the last step's backward: the GPU waits for it
                fetch_started = time.monotonic()
                current = next_step_batches(batches, run)
                run.meter.paused("data", time.monotonic() - fetch_started)
            else:
                current, upcoming = upcoming, None
        # Collective, once per step: all ranks stop, save after a data error on one of them, or end at the
        # time budget at the same step, never inside a step; with max_time, rank 0's estimate of the step the
        # budget ends at (its clock decides for every rank).
        *flags, budget_end = distributed.all_sum(
            [
                bool(run.stop),
                current.error is not None,
                run.meter.out_of_time(),
                time_budget_estimate(run, state),
            ]
        )
        stop, failed, out_of_time = (n > 0 for n in flags)
        if failed:
            save_after_error(run, state, current.error, collective=True)
            raise current.error or RecipeDataError(
                f"another rank stopped on a data error at step {state.step}; its message names the file"
            )
        if stop:
            run.stop.signal_name = run.stop.signal_name or "SIGTERM"  # the signal reached another rank first
            break
        if out_of_time:
            if cfg.save_final and state.saved_step != state.step:
                save(run, state)  # first: an evaluation that fails leaves the step saved
            if data.eval_stream is not None and evaluated_at != state.step:
                last_eval = evaluate_and_track(run, state)
                empty_cache.after_evaluation()
            break
        if budget_end > 0:
            follow_time_budget(run, state, int(budget_end) - 1)
        with record_function("forward_backward"):
            # Several ranks stop together at a step boundary (above), never inside a step.
            stop = run.stop if distributed.world_size() == 1 else None
            result = accumulate_with_oom_backoff(
                run.train_module,
                current.group,
                state.oom,
                cfg,
                run.plan,
                run.reporter,
                state.step,
                stop,
                n_target=current.counts.target_tokens,
                graph=run.graph,
                grad_buffer=run.grad_buffer,
            )
        run.heartbeat.beat(state.step)
        if result is None:  # stop requested mid-step: the partial gradients are dropped
            run.model.zero_grad(set_to_none=True)
            break
        if state.step + 1 < data.total_steps:
            # The GPU is still on this step's backward: the loader's work and the copies for the next step
            # cost it nothing now, where after the update it would wait for them. This step's checkpoint keeps
            # the loader state from before them (current.loader_after), so a resume reads that group again.
            with record_function("data"):
                upcoming = next_step_batches(batches, run)
        with record_function("optimizer"), run.intact.changing():
            loss, grad_norm = optimizer_step(
                run.model,
                run.optimizer,
                run.scheduler,
                *result,
                max_grad_norm=cfg.max_grad_norm,
                graph=run.graph,
                grad_buffer=run.grad_buffer,
            )
        state.loader = current.loader_after
        state.step += 1
        after_checkpoints(run, state)  # a background write that finished: its follow-up, or its error
        run.profiler.after_step(state.step)
        state.rng = ckpt.rng_state()
        empty_cache.after_step(state.step)
        count_nan_step(run, state, loss, grad_norm)
        lr = run.scheduler.get_last_lr()[0]
        # Summed over ranks: the train log and tokens/s count the whole job.
        counts = StepCounts(*(int(c) for c in distributed.all_sum(list(current.counts.row().values()))))
        run.meter.step_done(state.step, loss, lr, counts, grad_norm)
        run.heartbeat.beat(state.step)
        if state.consecutive_nan >= cfg.max_consecutive_nan_steps:
            stop_for_nan(run, state)
        run.progress.advance()
        if run.meter.should_log(state.step, cfg.every("logging_steps", data.total_steps)):
            logged = run.meter.log_window(
                state.step, loss=loss, lr=lr, grad_norm=grad_norm, memory=memory.gpu_memory(run.device)
            )
            run.progress.show(logged)
            run.reporter.log_step(logged)
        # The last step is saved before its evaluation, so an evaluation that fails leaves it saved. Other
        # evaluations come first, as in Seq2SeqTrainer: the checkpoint of their step holds their result (the
        # best so far, the early-stopping count); an evaluation that fails saves the step on its way out.
        last_step = state.step == data.total_steps
        at_eval = data.eval_stream is not None and (
            state.step % cfg.every("eval_steps", data.total_steps) == 0 or last_step
        )
        if last_step and at_eval and cfg.save_final and state.saved_step != state.step:
            save(run, state)
        if at_eval:
            last_eval, evaluated_at = evaluate_and_track(run, state), state.step
            empty_cache.after_evaluation()
        if state.step % cfg.every("save_steps", data.total_steps) == 0 and state.saved_step != state.step:
            save(run, state)
        if state.early_stopping_due(cfg.early_stopping_patience):  # the same on every rank
            break
    return last_eval


@dataclass
class StepBatches:
    """One optimizer step's loader batches on the device, this rank's counts of them, and the loader state
    after them (what a checkpoint of the step saves); or, instead, the data error the loader raised."""

    group: list[dict] | None = None
    counts: StepCounts | None = None
    loader_after: dict | None = None
    error: Exception | None = None


def next_step_batches(batches: Iterator[dict], run: Run) -> StepBatches:
    """The next `gradient_accumulation_steps` loader batches, copied to the device (queued: no wait)."""
    try:
        group = [next(batches) for _ in range(run.cfg.gradient_accumulation_steps)]
    except DATA_ERRORS as e:
        return StepBatches(error=e)
    loader_after = run.data.train_stream.state_dict()
    return StepBatches([to_device(b, run.device) for b in group], step_counts(group), loader_after)


def save_after_error(run: Run, state: RunState, error: BaseException, collective: bool = False) -> None:
    """Before the run ends on `error`: a checkpoint of the last completed step, unless it is saved already,
    nothing was trained, or the model may not be intact (the error came from the optimizer update, or was a
    failed save). Several ranks save only after an error they all know of (`collective`: a data error, agreed
    at the step boundary); any other error on one rank leaves the others inside a collective. Never raises
    for a failed save: `error` is what the run ends with."""
    if state.saved_step == state.step or state.step == 0 or not run.intact.now:
        return
    if distributed.world_size() > 1 and not collective:
        return
    log.warning(
        "step %d: %s: %s; saving the last completed step first", state.step, type(error).__name__, error
    )
    try:
        path = save(run, state)
        wait_for_checkpoints(run, state)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # torch.distributed.checkpoint's errors are BaseExceptions
        log.error("could not save step %d: %s: %s", state.step, type(e).__name__, e)
        return
    log.warning("saved %s; the same command resumes from it once the error is fixed", path)


def step_counts(group: list[dict]) -> StepCounts:
    """Records, real source and target tokens and padded positions of one step's loader batches (host
    copies)."""
    return StepCounts(
        samples=sum(records_in(b) for b in group),
        source_tokens=sum(int(b["attention_mask"].sum()) for b in group),
        target_tokens=sum(int((b["labels"] != -100).sum()) for b in group),
        padded_tokens=sum(b["input_ids"].size + b["labels"].size for b in group),
    )


def time_budget_estimate(run: Run, state: RunState) -> int:
    """Rank 0's estimate, plus 1, of the step the max_time budget ends at, from the time per step it measured
    (0: no estimate: the other ranks, no max_time, too few steps measured)."""
    seconds_per_step, seconds_left = run.meter.seconds_per_step(), run.meter.time_left_s()
    if not run.is_main or seconds_per_step is None or seconds_left is None:
        return 0
    return time_budget_end(state.step, seconds_left, seconds_per_step) + 1


def follow_time_budget(run: Run, state: RunState, budget_end: int) -> None:
    """Before a step: end the learning-rate schedule at `budget_end`, where the time budget will end (at least
    the step about to run, at most the planned total steps), so that a run stopped by max_time decays to the
    schedule's end. The first estimate is applied, later ones when they move the end by more than 2% of the
    steps left (a step's time varies). Every change is logged."""
    state.seconds_per_step = run.meter.seconds_per_step()
    horizon = min(run.data.total_steps, max(budget_end, state.step + 1))
    current = state.schedule_horizon
    if current is not None and abs(horizon - current) <= 0.02 * (current - state.step):
        return
    set_horizon(run.scheduler, run.cfg, horizon)
    state.schedule_horizon = horizon
    per_step = f"{state.seconds_per_step:.3g} s" if state.seconds_per_step else "n/a"
    log.info(
        "max_time: the learning-rate schedule ends at step %d (%s), where the time budget does at %s per "
        "step",
        horizon,
        "first estimate" if current is None else f"was {current}",
        per_step,
    )


def count_nan_step(run: Run, state: RunState, loss: float, grad_norm: float) -> None:
    """Count a step whose update was skipped for a NaN/inf loss or gradient; keep the last finite loss."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        state.consecutive_nan = 0
        state.last_loss = loss
        return
    state.nan_skipped += 1
    state.consecutive_nan += 1
    step = state.step - 1  # the step that was skipped, counted from 0 as in the OOM messages
    log.warning("step %d: loss %s / grad norm %s is not finite; update skipped", step, loss, grad_norm)
    run.reporter.nan_skipped(step=step, skipped_total=state.nan_skipped)


def stop_for_nan(run: Run, state: RunState) -> None:
    """max_consecutive_nan_steps in a row were skipped: save, and stop the run with an error."""
    path = save(run, state)
    raise RuntimeError(
        f"{state.consecutive_nan} optimizer steps in a row had a NaN/inf loss or gradient (at {state.step}); "
        f"saved {path}. Lower the learning rate or check the data."
    )


def evaluate_and_track(run: Run, state: RunState) -> EvalResult:
    """Evaluate, log the metrics (train log, W&B, Discord), keep the best checkpoint by metric_for_best_model
    (a new best is saved at once, so that the best checkpoint exists) and count evaluations without
    improvement for early stopping."""
    cfg = run.cfg
    if run.graph is not None:  # its memory pool holds a micro-step's activations: the evaluation's now
        run.graph.reset()
    result = evaluate(
        run.model,
        run.data.eval_stream,
        run.data.generation_records,
        run.device,
        cfg,
        run.data.template,
        run.data.tokenizer_file,
        run.train_module,
        max_batch_tokens=eval_batch_tokens(run.trained, state.oom.split),
    )
    run.meter.paused("evaluation", result.metrics["eval_runtime"])
    log.info(
        "step %d: %s (evaluation %.1f s, generation %.1f s of it; training paused)",
        state.step,
        metrics_line(result.metrics),
        result.metrics["eval_runtime"],
        result.metrics["eval_generation_runtime"],
    )
    run.meter.evaluated(state.step, result.metrics)
    key = cfg.best_metric_key
    if key not in result.metrics:
        log.warning(
            "step %d: metric_for_best_model %s is not among this evaluation's metrics (%s): no best is kept",
            state.step,
            key,
            ", ".join(result.metrics),
        )
    path = str(run.output_dir / f"checkpoint-{state.step}")
    new_best = state.track_evaluation(
        result.metrics, key, cfg.best_is_greater, cfg.early_stopping_threshold, path
    )
    patience = cfg.early_stopping_patience
    run.reporter.evaluated(
        step=state.step,
        metrics=result.metrics,
        samples=result.samples,
        best=state.best,
        early_stopping=(state.early_stopping_patience_counter, patience) if patience else None,
    )
    if new_best and state.saved_step != state.step:
        save(run, state)
    if state.early_stopping_due(patience):
        log.info(
            "early stopping: %d evaluations in a row without %s improving by more than %g on the best "
            "(%.4g at step %d)",
            state.early_stopping_patience_counter,
            key,
            cfg.early_stopping_threshold,
            state.best["value"] if state.best else float("nan"),
            state.best["step"] if state.best else 0,
        )
    return result


def save(run: Run, state: RunState) -> Path:
    """Checkpoint-<step> of `state` (collective): staged off the GPU and written in the background
    (trainer.checkpoint.writer), or written here when host memory is short; returns its path, which exists
    once it is written. What follows a write runs in `after_checkpoints`. The previous write is waited for
    first."""
    state.count_progress(run.meter.run.tokens, run.meter.train_seconds)
    if run.is_main:
        fsync_file(run.output_dir / TRAIN_LOG)  # on the disk up to the checkpoint, whatever happens next
    started = time.monotonic()
    in_flight = run.writer.in_flight
    with run.intact.changing():  # a write that failed is not tried again after the error
        run.writer.wait()  # one write at a time: the staged copy is reused
    waited = time.monotonic() - started
    after_checkpoints(run, state)
    with run.intact.changing():  # a save that failed is not tried again after the error
        contents = ckpt.gather_checkpoint(
            run.output_dir,
            state.step,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            tokenizer_file=run.data.tokenizer_file,
            rng=state.rng,
            trainer_state=state.trainer_state(
                resume.saved_config(run.trained), run.plan.micro_batch(state.oom.split)
            ),
            prompt_config=run.trained,
        )
        background = run.writer.save(contents)
    paused = time.monotonic() - started
    run.meter.paused("save", paused)
    state.saved_step = state.step
    how = "staged, written in the background" if background else "saved"
    # A write still going on when the next save comes (saves closer together than a write takes) is waited
    # for: said apart from the copy, which is what save_steps cannot change.
    wait = (
        f", {waited:.1f} s of it waiting for checkpoint-{in_flight}'s write"
        if waited >= 0.1 and in_flight
        else ""
    )
    log.info(
        "step %d: checkpoint-%d %s (training paused %.1f s%s)", state.step, state.step, how, paused, wait
    )
    if not background:
        after_checkpoints(run, state)
    return contents.final


def after_checkpoints(run: Run, state: RunState) -> None:
    """For each checkpoint written since the last call: its Hub upload staged, the checkpoints past
    save_total_limit removed (never the best), the reports. Raises the error of a write that failed."""
    with run.intact.changing():  # a write that failed is not tried again after the error
        written = run.writer.written()
    for done in written:
        if run.writer.background:
            log.info("checkpoint-%d written in %.1f s, while training went on", done.step, done.seconds)
        if run.hub is not None:  # staged before the rotation below may remove the checkpoint
            run.hub.checkpoint_saved(done.path, done.step)
        if run.is_main:
            best = Path(state.best["path"]) if state.best else None
            removed = ckpt.rotate_checkpoints(run.output_dir, run.cfg.save_total_limit, best)
            if removed:
                names = ", ".join(p.name for p in removed)
                log.info("removed %s (save_total_limit %d)", names, run.cfg.save_total_limit)
        is_best = state.best is not None and state.best["step"] == done.step
        run.reporter.checkpoint_saved(step=done.step, path=str(done.path), best=is_best)


def wait_for_checkpoints(run: Run, state: RunState) -> None:
    """Until the checkpoint in flight is written, and what follows it done (the wait counts as a save's
    pause)."""
    started = time.monotonic()
    with run.intact.changing():
        run.writer.wait()
    run.meter.paused("save", time.monotonic() - started, count=0)
    after_checkpoints(run, state)


def close_writer(writer: CheckpointWriter) -> None:
    """On the way out: the write in flight finishes; one that fails now is logged (the run already ends on
    its own error, or was interrupted)."""
    try:
        writer.close()
    except BaseException as e:
        log.error("the checkpoint being written failed: %s: %s", type(e).__name__, e)


# -- 3. finish --------------------------------------------------------------------------------------------


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
            "a recipe generated for held-out ingredients:\n  input: %s\n  generated: %s",
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

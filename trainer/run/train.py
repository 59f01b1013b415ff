"""The training run, top to bottom: `train` = setup (data, plan, model, optimizer, resume point:
trainer.run.setup), the loop (optimizer steps, logging, evaluation; checkpoints: trainer.run.checkpoints),
finish (the final checkpoint and model, the summary: trainer.run.finish).

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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torch.profiler import record_function

from trainer.checkpoint import resume
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.hub import HubUploader, check_hub_config, upload_pending
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import ConfigError, TrainConfig, source_path
from trainer.data import hf_datasets
from trainer.data.loader import (
    RecipeDataError,
    RecipeFileError,
    records_in,
    to_device,
)
from trainer.data.sample import demo_data
from trainer.eval.in_training import (
    EvalResult,
    eval_batch_tokens,
    evaluate,
    metrics_line,
)
from trainer.infra import distributed, memory
from trainer.infra.healthcheck import Heartbeat
from trainer.infra.library_logs import route_library_output
from trainer.infra.run_lock import describe_holder, lock_holder, lock_output_dir
from trainer.infra.stopping import StopBeforeTraining, StopRequested
from trainer.model.model_files import check_model_dir
from trainer.plan.memory_plan import plan_packed_rows, plan_run
from trainer.plan.plan_report import unmatched_files
from trainer.report.profiling import StepProfiler
from trainer.report.step_meter import (
    ConsoleProgress,
    StepCounts,
    StepMeter,
)
from trainer.run.checkpoints import (
    after_checkpoints,
    close_writer,
    prepare_background_saves,
    save,
    save_after_error,
)
from trainer.run.finish import finish
from trainer.run.run_state import RunState
from trainer.run.schedule import check_scheduler, set_horizon
from trainer.run.setup import (
    ModelIntact,
    Run,
    build_model,
    check_paths,
    finished_reason,
    log_memory_plan,
    log_time_budget,
    micro_step_graph,
    open_data,
    resumed_schedule_horizon,
    setup_device,
    start_reporting,
    start_train_log,
    time_budget_end,
    warn_if_the_disk_is_small,
)
from trainer.run.step import accumulate_with_oom_backoff, optimizer_step

log = logging.getLogger(__name__)

# What the loader raises for a bad record or a file that went away or changed under a running job.
DATA_ERRORS = (RecipeDataError, RecipeFileError)


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
    if (
        cfg.cuda_graphs
        and world_size > 1
        and cfg.distributed_strategy == "fsdp"
        and not cfg.fsdp_sync_each_micro_batch
    ):
        raise ConfigError(
            "cuda_graphs with fsdp_sync_each_micro_batch false: a replayed micro-step reduce-scatters its "
            "gradients as the captured one did, and with this setting only the step's last micro-step does; "
            "set fsdp_sync_each_micro_batch true (the default), or cuda_graphs false",
            key=("cuda_graphs", "fsdp_sync_each_micro_batch"),
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
            missing, made = demo_data(cfg, dry_run=dry_run)
            if dry_run and missing and made == missing:  # what is missing, the run writes when it starts
                # Data the run does not write must be there now: the dry run's promise is the data too.
                written = {str(path) for path in made}
                theirs = [f for f in cfg.train_files if source_path(f) not in written]
                unmatched = unmatched_files([f for f in theirs if not hf_datasets.is_dataset(f)])
                if unmatched:
                    raise ConfigError(f"train_files: {unmatched}")
                log.info("dry run: the config is fine; the run makes the model and data, then checks them")
                return 0
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
            state = RunState.from_trainer_state(saved)
            finished = finished_reason(cfg, data, state)
            if finished is not None:
                why, how = finished
                resume.refuse_changes_to_a_finished_run(resume_from, why, how, saved.get("config", {}), now)
                log.info(
                    "%s %s: this run is already finished (%s, or set another output_dir or resume: never to "
                    "start over)",
                    resume_from,
                    why,
                    how,
                )
                if rank == 0:  # what an earlier run of it did not get onto the Hub
                    upload_pending(cfg, output_dir)
                return 0
            resume.warn_config_changes(saved.get("config", {}), now)
            state.schedule_horizon = resumed_schedule_horizon(cfg, data.total_steps, state)
        if rank == 0:
            start_train_log(cfg, output_dir, resume_from, state)
            warn_if_the_disk_is_small(cfg, output_dir, model_files, data.total_steps, data.steps_per_epoch)
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
        exits.push(lambda kind, *_: close_writer(writer, interrupted=kind is KeyboardInterrupt))
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
                StepProfiler(
                    cfg.profile_start_step,
                    cfg.profile_steps,
                    output_dir,
                    enabled=rank == 0,
                    memory=cfg.profile_memory,
                )
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
    log_every, eval_every, save_every = (
        cfg.every(key, data.total_steps, data.steps_per_epoch)
        for key in ("logging_steps", "eval_steps", "save_steps")
    )
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
        prepare_background_saves(run)  # after the first step: the saves' host buffers, in a thread
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
        if run.meter.should_log(state.step, log_every):
            logged = run.meter.log_window(
                state.step, loss=loss, lr=lr, grad_norm=grad_norm, memory=memory.gpu_memory(run.device)
            )
            run.progress.show(logged)
            run.reporter.log_step(logged)
        # The last step is saved before its evaluation, so an evaluation that fails leaves it saved. Other
        # evaluations come first, as in Seq2SeqTrainer: the checkpoint of their step holds their result (the
        # best so far, the early-stopping count); an evaluation that fails saves the step on its way out.
        last_step = state.step == data.total_steps
        at_eval = data.eval_stream is not None and (state.step % eval_every == 0 or last_step)
        if last_step and at_eval and cfg.save_final and state.saved_step != state.step:
            save(run, state)
        if at_eval:
            last_eval, evaluated_at = evaluate_and_track(run, state), state.step
            empty_cache.after_evaluation()
        if state.step % save_every == 0 and state.saved_step != state.step:
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
    # A write beside an evaluation shares the host with it: said, to explain a slower one.
    writing = run.writer.in_flight
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
        "step %d: %s (evaluation %.1f s: generating %.1f s, scoring %.1f s; training paused%s)",
        state.step,
        metrics_line(result.metrics),
        result.metrics["eval_runtime"],
        result.metrics.get("eval_generation_runtime", 0.0),
        result.metrics.get("eval_scoring_runtime", 0.0),
        f"; checkpoint-{writing} was being written beside it" if writing is not None else "",
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

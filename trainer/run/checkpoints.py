"""The loop's checkpoints: a save (staged off the GPU, written in the background by
trainer.checkpoint.writer), what follows each write (the Hub upload, keep-N, the reports), the wait for a
write in flight, and the checkpoint of the last completed step before a run ends on an error."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trainer.checkpoint import resume
from trainer.checkpoint import store as ckpt
from trainer.checkpoint.writer import CheckpointWriter
from trainer.infra import distributed
from trainer.infra.jsonl import fsync_file
from trainer.report.step_meter import TRAIN_LOG
from trainer.run.run_state import RunState
from trainer.run.setup import Run

log = logging.getLogger(__name__)


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
                resume.saved_config(run.trained),
                run.plan.micro_batch(state.oom.split),
                list(run.meter.log_history),  # a copy: the log goes on while the writer writes it
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


def prepare_background_saves(run: Run) -> None:
    """Once the optimizer's states exist (after the run's first step): the host buffers background saves copy
    into, allocated beside the next steps rather than in the first save's pause."""
    if run.writer.wants_buffers:
        run.writer.reserve(ckpt.state_dicts(run.model, run.optimizer))


def wait_for_checkpoints(run: Run, state: RunState) -> None:
    """Until the checkpoint in flight is written, and what follows it done (the wait counts as a save's
    pause)."""
    started = time.monotonic()
    with run.intact.changing():
        run.writer.wait()
    run.meter.paused("save", time.monotonic() - started, count=0)
    after_checkpoints(run, state)


def close_writer(writer: CheckpointWriter, interrupted: bool = False) -> None:
    """On the way out: the write in flight finishes; one that fails now is logged (the run already ends on
    its own error, or was interrupted). After a second Ctrl-C (`interrupted`) the write is abandoned instead,
    wherever the interrupt landed: the run stops at once."""
    if interrupted:
        writer.abandon()
        return
    try:
        writer.close()
    except BaseException as e:
        log.error("the checkpoint being written failed: %s: %s", type(e).__name__, e)

"""The training loop: config -> data -> model -> optimizer -> steps -> checkpoints. Read `train` top down.

One optimizer step = `gradient_accumulation_steps` loader batches. The loss is the sum of token
cross-entropies over the whole accumulated batch divided by its number of target tokens, so k micro-batches
give the same gradient as one batch of all of them. On CUDA out-of-memory the loader batches are split into
halves (then quarters, ...) on the Python side: the same data in the same order, the same effective batch,
more micro-steps.

Under torchrun (`torchrun --nproc_per_node=N -m trainer train --config ...`) every process runs this loop on
its own shard of the data (the loader's rank/world_size; equal batch counts), with the model in DDP or FSDP2
(trainer/distributed.py). The loss is still the global one: the target-token count and the loss sum are
summed over ranks, so the gradients equal those of one process over the same global batch. Rank 0 alone
writes the train log, the progress bar, W&B and Discord; checkpoints are collective (trainer/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from trainer import distributed, memory
from trainer.config import ConfigError, TrainConfig
from trainer.data import skipped_summary, stream_for, to_device
from trainer.redact import redact_obj

log = logging.getLogger(__name__)

TRAIN_LOG = "train_log.jsonl"  # one line per optimizer step: loss, lr, time, real tokens (rank 0)
SUMMARY = "run_summary.json"  # written at the end: steps, wall time, throughput, memory
HEARTBEAT_EVERY_S = 10.0
GIB = 1024**3


class StopRequested:
    """SIGTERM/SIGINT set a flag; the loop checks it at micro-batch boundaries, saves, and exits."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops without waiting for the checkpoint
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: saving a checkpoint at the next micro-batch boundary", self.signal_name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __bool__(self) -> bool:
        return self.signal_name is not None


def write_heartbeat(output_dir: str | Path, step: int) -> None:
    """`<output_dir>/heartbeat`, replaced atomically (the container HEALTHCHECK reads it)."""
    path = Path(output_dir) / "heartbeat"
    tmp = path.with_name(f"heartbeat.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"step": step, "time": time.time()}), encoding="utf-8")
    os.replace(tmp, path)


class Heartbeat:
    def __init__(self, output_dir: str | Path, every_s: float = HEARTBEAT_EVERY_S, enabled: bool = True):
        self.output_dir, self.every_s, self._last, self.enabled = output_dir, every_s, 0.0, enabled

    def beat(self, step: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.enabled and (force or now - self._last >= self.every_s):
            write_heartbeat(self.output_dir, step)
            self._last = now


# -- data -------------------------------------------------------------------------------------------------


def ensure_demo_data(cfg: TrainConfig) -> None:
    """make_demo_data: create missing sample recipe files and the tiny model (quickstart, first use)."""
    from trainer.sample import write_sample

    for f in cfg.train_files:
        if any(ch in f for ch in "*?[") or Path(f).exists():
            continue
        log.info("make_demo_data: writing %d sample recipes to %s", cfg.demo_records, f)
        write_sample(f, cfg.demo_records, seed=0, fmt=cfg.data_format or "recipenlg-csv")
    model_dir = Path(cfg.model_name_or_path)
    if not (model_dir / "config.json").exists():
        from trainer.tiny_model import build_tiny_model

        log.info("make_demo_data: building the tiny FLAN-T5 in %s", model_dir)
        build_tiny_model(model_dir, seed=0)


def tokenizer_file_for(cfg: TrainConfig) -> str:
    from trainer.data import resolve_tokenizer_file

    return str(resolve_tokenizer_file(cfg.model_name_or_path))


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


def resume_position(
    saved: dict, saved_world_size: int, stream, cfg: TrainConfig, tokenizer_file: str
) -> dict:
    """This rank's train-stream state for resuming from `saved`, rank 0's state in a checkpoint written by
    `saved_world_size` ranks.

    Rank r of W reads the epoch's global batches r, r+W, r+2W, ... (rust_loader/core/src/plan.rs), so after
    k batches per rank the first k*W global batches are consumed, whatever the rank. With the same W every
    rank continues at k. With another W' every rank continues at floor(k*W / W'): when W' does not divide
    k*W, up to W'-1 global batches are read a second time, none is skipped. (The epoch's order is the same for
    every W; only its last few batches, cut so that every rank has as many, differ.)

    The loader's fingerprint covers the data, the loader settings and the rank/world size; rank 0 checks the
    saved one (against a stream built like the saving run's rank 0 when W changed: its index is cached) and
    refuses other data or settings. The other ranks read the same files with the same config."""
    world_size = distributed.world_size()
    if distributed.rank() == 0:
        reference = stream
        if saved_world_size != world_size:
            reference = stream_for(cfg, tokenizer_file, "train", rank=0, world_size=saved_world_size)
        reference.load_state_dict(saved)  # raises on other data or settings
    consumed = int(saved["batches_consumed"]) * saved_world_size // world_size
    if saved_world_size != world_size:
        log.info(
            "resuming on %d ranks from a checkpoint of %d: %d batches per rank consumed in epoch %d -> %d",
            world_size,
            saved_world_size,
            saved["batches_consumed"],
            saved["epoch"],
            consumed,
        )
    return dict(stream.state_dict(), epoch=int(saved["epoch"]), batches_consumed=consumed)


# -- the step ---------------------------------------------------------------------------------------------


def token_loss_sum(model, batch: dict):
    """Sum of target-token cross-entropies of `batch` (fp32), without HF's per-batch mean.

    `model` is the HF model, or a `Seq2SeqLMLoss` possibly wrapped by DDP (`.module`) or FSDP: what
    distributed training wraps, so that its hooks see the whole step."""
    from trainer.loss import Seq2SeqLMLoss

    if not isinstance(model, Seq2SeqLMLoss) and not isinstance(getattr(model, "module", None), Seq2SeqLMLoss):
        model = Seq2SeqLMLoss(model)
    return model(batch["input_ids"], batch["attention_mask"], batch["labels"])


def accumulate_gradients(
    model, group: list[dict], split: int, stop: StopRequested | None = None, n_target: int | None = None
):
    """Forward+backward over the loader batches of one optimizer step, each split into `split` micro-batches.

    Gradients are of (sum of token losses) / (target tokens in the whole group). Returns (loss sum tensor,
    number of target tokens), or None when a stop was requested at a micro-batch boundary. `n_target`: this
    rank's target-token count when the caller has it from the host copy of the batches (counting the GPU
    copy would wait for the GPU to finish the previous step).

    Several ranks: the group is this rank's part of the global one. The target-token count is summed over
    ranks before any backward, and each rank's loss is scaled by world_size because DDP and FSDP average
    gradients over ranks: the result is (sum of all ranks' token losses) / (global target tokens), as one
    process would compute over the global batch. DDP all-reduces after the last micro-batch only. The
    returned count is the global one, the loss sum this rank's.
    """

    if n_target is None:
        n_target = sum(int((b["labels"] != -100).sum()) for b in group)
    n_target = int(distributed.all_sum([n_target])[0])
    per_rank_tokens = max(n_target, 1) / distributed.world_size()
    micro_batches = [micro for batch in group for micro in memory.split_batch(batch, split)]
    total = 0.0
    for i, micro in enumerate(micro_batches):
        if stop:
            return None
        with distributed.gradient_sync(model, sync=i == len(micro_batches) - 1):
            loss_sum = token_loss_sum(model, micro)
            (loss_sum / per_rank_tokens).backward()
        total = total + loss_sum.detach()  # no sync with the GPU here
    return total, n_target


def accumulate_with_oom_backoff(
    model, group, state: dict, cfg: TrainConfig, reporter=None, step: int = 0, stop=None, n_target=None
):
    """accumulate_gradients, halving the micro-batch (doubling state["split"]) on out-of-memory and
    retrying the same data, at most cfg.max_oom_halvings times in the run."""
    import torch

    while True:
        oom = False
        try:
            return accumulate_gradients(model, group, state["split"], stop, n_target)
        except torch.OutOfMemoryError:
            if distributed.is_distributed():
                # The other ranks are waiting in a collective of this step: no retry, torchrun stops them all.
                raise RuntimeError(
                    f"out of GPU memory on rank {distributed.rank()} at step {step}; with several processes "
                    "the micro-batch is not halved automatically: lower max_tokens or "
                    "per_device_train_batch_size, or use distributed_strategy: fsdp"
                ) from None
            oom = True  # handled outside the except block, so the traceback's tensors can be freed
        if oom:
            model.zero_grad(set_to_none=True)
            memory.free_memory()
            state["halvings"] += 1
            if state["halvings"] > cfg.max_oom_halvings:
                raise RuntimeError(
                    f"out of GPU memory at step {step} even after {cfg.max_oom_halvings} halvings of the "
                    f"micro-batch (now 1/{state['split']} of a loader batch); lower max_tokens or "
                    f"per_device_train_batch_size.\n{memory.memory_summary()}"
                )
            state["split"] *= 2
            accumulation = cfg.gradient_accumulation_steps * state["split"]
            micro = describe_micro_batch(cfg, state["split"])
            log.warning(
                "out of memory at step %d: micro-batch halved to %s, accumulation %d (same effective batch)",
                step,
                micro,
                accumulation,
            )
            if reporter is not None:
                reporter.oom_backoff(step=step, micro_batch=micro, accumulation=accumulation)


def probe_memory(train_module, cfg: TrainConfig, oom: dict, device) -> None:
    """oom_probe: before training, one forward+backward on each of the largest micro-batch shapes the loader
    can yield (random ids), through the OOM back-off, so a budget that does not fit is halved now rather than
    hours into the run. The gradients are dropped."""
    import torch

    from trainer.memory_plan import probe_shapes

    shapes = probe_shapes(cfg)
    g = torch.Generator().manual_seed(0)
    for rows, src, tgt in shapes:
        batch = {
            "input_ids": torch.randint(3, 100, (rows, src), generator=g),  # any vocabulary has these ids
            "attention_mask": torch.ones(rows, src, dtype=torch.long),
            "labels": torch.randint(3, 100, (rows, tgt), generator=g),
        }
        accumulate_with_oom_backoff(train_module, [to_device(batch, device)], oom, cfg, step=0)
        train_module.zero_grad(set_to_none=True)
    memory.free_memory()
    log.info("oom_probe: %s fit with micro-batch %s", shapes, describe_micro_batch(cfg, oom["split"]))


def describe_micro_batch(cfg: TrainConfig, split: int = 1) -> str:
    if cfg.max_tokens:
        return f"{cfg.max_tokens // split} tokens"
    if cfg.per_device_train_batch_size:
        return f"{max(1, cfg.per_device_train_batch_size // split)} rows"
    return "loader default"


# -- evaluation -------------------------------------------------------------------------------------------


def evaluate(
    model, stream, device, cfg: TrainConfig, tokenizer_file: str, loss_module=None
) -> tuple[float, list[dict[str, str]]]:
    """Eval loss (token mean) over at most cfg.eval_max_batches held-out batches, and a few generations.

    Several ranks: each evaluates its shard of the held-out data (as many batches on every rank) through
    `loss_module` (the FSDP module; DDP's inner module), and the loss is the global token mean. Under FSDP the
    ranks generate together (`synced_gpus`), from their first batch only so that all run `generate` equally
    often."""
    import torch
    from tokenizers import Tokenizer

    loss_module = model if loss_module is None else loss_module
    sharded = distributed.is_sharded(loss_module)
    tok = Tokenizer.from_file(tokenizer_file)
    loss_module.eval()
    loss_sum, n_tokens, generations = 0.0, 0, []
    try:
        with torch.no_grad():
            stream.set_epoch(0)
            for i, batch in enumerate(stream):
                if i >= cfg.eval_max_batches:
                    break
                batch = to_device(batch, device)
                loss_sum += float(token_loss_sum(loss_module, batch))
                n_tokens += int((batch["labels"] != -100).sum())
                if len(generations) < cfg.num_eval_generations and (i == 0 or not sharded):
                    with distributed.full_weights(loss_module):
                        generations += generate(
                            model, tok, batch, cfg, cfg.num_eval_generations - len(generations), sharded
                        )
    finally:
        loss_module.train()
    loss_sum, n_tokens = distributed.all_sum([loss_sum, n_tokens])
    return (loss_sum / n_tokens if n_tokens else float("nan")), generations


def generate(model, tok, batch: dict, cfg: TrainConfig, n: int, synced: bool = False) -> list[dict[str, str]]:
    """Greedy generations for the first `n` rows of a batch: {"ingredients", "generated", "reference"}.
    `synced`: the ranks generate in lockstep until all are done (FSDP gathers weights for every step)."""
    input_ids, mask = batch["input_ids"][:n], batch["attention_mask"][:n]
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=cfg.generation_max_new_tokens,
        do_sample=False,
        use_cache=True,
        synced_gpus=synced,
    )
    rows = []
    for i in range(len(input_ids)):
        src = input_ids[i][mask[i].bool()].tolist()
        ref = [t for t in batch["labels"][i].tolist() if t != -100]
        rows.append(
            {
                "ingredients": tok.decode(src, skip_special_tokens=True),
                "generated": tok.decode(out[i].tolist(), skip_special_tokens=True),
                "reference": tok.decode(ref, skip_special_tokens=True),
            }
        )
    return rows


# -- the run ----------------------------------------------------------------------------------------------


def report_exit(reporter, e: BaseException) -> None:
    """Tell Discord and W&B how the run ended with `e`: a second Ctrl-C, or a crash."""
    if isinstance(e, KeyboardInterrupt):
        reporter.interrupted()
    else:
        reporter.crashed(e)
    reporter.close()


@contextlib.contextmanager
def reported_exit(reporter):
    """Report an exception raised inside (then re-raise it): model loading, the last saves."""
    try:
        yield
    except BaseException as e:
        report_exit(reporter, e)
        raise


def save_final_model(model, cfg: TrainConfig, tokenizer_file: str, final: Path, is_main: bool) -> None:
    """`final/`: the whole model and its tokenizer, written beside it and renamed into place, so that a run
    stopped or failing half-way leaves no partial final/ (the next run writes it). Collective under FSDP."""
    import shutil

    from trainer import checkpoint as ckpt

    tmp = final.with_name(final.name + ".tmp")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    distributed.barrier()
    ckpt.save_pretrained(model, tmp)  # rank 0 writes the whole model (FSDP: gathered)
    if is_main:
        _copy_tokenizer(cfg.model_name_or_path, tokenizer_file, tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)


def check_output_dir(output_dir: str) -> None:
    """Raise ConfigError when `output_dir` cannot be a writable directory (a file, or under a file or a
    read-only directory), before any work; creates nothing."""
    path = Path(output_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"output_dir {output_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir {output_dir}: {existing} is not writable")


# Keys whose change on resume changes nothing about what was already trained, or is expected.
_RESUME_FREE_KEYS = {"max_steps", "num_train_epochs", "resume", "output_dir", "progress_bar", "run_name"}


def warn_config_changes(saved: dict[str, Any], cfg: TrainConfig) -> None:
    """Warn, naming the keys, where the config differs from the one the checkpoint was written with. The
    optimizer and scheduler states come from the checkpoint, so a changed learning_rate does not apply."""
    now = redact_obj(cfg.to_dict())  # the checkpoint's copy is masked
    changed = sorted(
        k for k in saved.keys() & now.keys() if k not in _RESUME_FREE_KEYS and saved[k] != now[k]
    )
    if changed:
        log.warning(
            "resuming with a config that differs from the checkpoint's: %s; the optimizer and learning-rate "
            "schedule continue from the checkpoint's state (start over in another output_dir to apply them)",
            ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in changed),
        )


def drop_log_rows_after(train_log: Path, step: int) -> None:
    """Keep the train log's rows up to `step`: a run killed after its last checkpoint logged steps that the
    resumed run repeats."""
    if not train_log.exists():
        return
    lines = train_log.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if _log_step(line) <= step]
    if len(kept) != len(lines):
        log.info(
            "train log: dropping %d rows after step %d (the resumed run logs them again)",
            len(lines) - len(kept),
            step,
        )
        train_log.write_text("".join(kept), encoding="utf-8")


def _log_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0  # a partial last line of a killed run is dropped only if it parses to a later step


def _device(local_rank: int):
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def train(cfg: TrainConfig, dry_run: bool = False) -> int:
    """Train as `cfg` says; returns the process exit code. dry_run: check config, data and plan only.
    Under torchrun every process calls this; the process group lives for the call."""
    try:
        code = _train(cfg, dry_run)
        # Ranks tear the process group down together: one rank destroying it while another is still finishing
        # (rank 0 writes the summary and the final model) aborted a CPU run at exit ("terminate called").
        distributed.barrier()
        return code
    finally:
        distributed.destroy()


def _train(cfg: TrainConfig, dry_run: bool) -> int:
    # 1. Allocator settings, before anything can initialise CUDA.
    memory.set_alloc_conf(cfg.cuda_alloc_conf)
    rank, world_size, local_rank = distributed.env()
    is_main = rank == 0
    distributed.quiet_other_ranks()

    # 2. Data: sample data on first use (quickstart), tokenizer, train and held-out eval streams.
    if cfg.make_demo_data:
        ensure_demo_data(cfg)
    if not cfg.train_files:
        raise ConfigError("train_files is empty: name at least one recipe file or glob")
    check_output_dir(cfg.output_dir)
    from trainer import checkpoint as ckpt

    # Before the data is indexed: a damaged or missing resume point is reported at once.
    resume_from = ckpt.find_resume_checkpoint(cfg.resume, cfg.output_dir)
    from trainer.memory_plan import with_planned_batch

    cfg = with_planned_batch(cfg)
    tokenizer_file = tokenizer_file_for(cfg)
    train_stream = stream_for(cfg, tokenizer_file, "train", rank=rank, world_size=world_size)
    eval_stream = None
    if cfg.eval_fraction > 0:
        eval_stream = stream_for(cfg, tokenizer_file, "eval", rank=rank, world_size=world_size)
    train_stats = train_stream.stats()
    usable = train_stats["records"] + (eval_stream.stats()["records"] if eval_stream is not None else 0)
    skipped = sum(train_stats["skipped"].values())
    log.info(
        "data: %d records for training, %d held out for eval, from %d file(s)",
        train_stats["records"],
        usable - train_stats["records"],
        len(train_stats["files"]),
    )
    skips = skipped_summary(train_stats, usable)
    if skips:
        log.warning("data: %s", skips)
    accum = cfg.gradient_accumulation_steps
    batches_per_epoch = len(train_stream)
    if cfg.max_steps > 0:
        total_steps = cfg.max_steps
    else:
        total_steps = max(1, math.ceil(batches_per_epoch * cfg.num_train_epochs / accum))
    if cfg.warmup_steps >= total_steps:
        log.warning(
            "warmup_steps %d >= the run's %d optimizer steps: the learning rate never reaches %g",
            cfg.warmup_steps,
            total_steps,
            cfg.learning_rate,
        )
    effective = f"{describe_micro_batch(cfg)} x {accum} accumulation x {world_size} process(es)"
    if world_size > 1:
        effective += f" ({cfg.distributed_strategy})"
    log.info(
        "plan: %d optimizer steps (%d batches per epoch), effective batch %s, tokenizer %s, data %s",
        total_steps,
        batches_per_epoch,
        effective,
        tokenizer_file,
        ", ".join(cfg.train_files),
    )
    if dry_run:
        log.info("dry run: config, data and tokenizer are fine; not loading the model")
        return 0

    import numpy as np
    import torch
    from torch.profiler import record_function
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from trainer.model import load_model
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.profiling import StepProfiler
    from trainer.report import Reporter

    # transformers' own stderr handler would bypass the root handler's secret masking (a token in a path).
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()

    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    heartbeat = Heartbeat(output_dir, enabled=is_main)
    heartbeat.beat(0, force=True)
    device = _device(local_rank)
    distributed.init(device)
    log.info("allocator: %s", memory.alloc_conf_in_force() if device.type == "cuda" else "n/a (CPU)")
    if cfg.gpu_memory_limit_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cfg.gpu_memory_limit_gib * 1024**3 / total), device
        )

    # 3. Resume point, model (loaded once, from the checkpoint when resuming), optimizer, schedule.
    state: dict[str, Any] = ckpt.load_trainer_state(resume_from) if resume_from else {}
    final = output_dir / "final"  # written whole, then renamed into place: it exists only when complete
    if resume_from:
        warn_config_changes(state.get("config", {}), cfg)
        if int(state["step"]) >= total_steps and (final.is_dir() or not cfg.save_final):
            log.info(
                "%s is at step %d of %d: this run is already finished (raise max_steps to train on, or set "
                "another output_dir or resume: never to start over)",
                resume_from,
                state["step"],
                total_steps,
            )
            return 0
    # Reported from here on: a crash while loading the model reaches Discord and W&B too.
    reporter = Reporter(cfg, is_main=is_main, run_id=state.get("wandb_run_id"))
    reporter.started(
        model=cfg.model_name_or_path,
        data=f"{', '.join(cfg.train_files)} ({usable:,} records, {skipped:,} skipped)",
        effective_batch=effective,
        planned_steps=total_steps,
        data_counts={"records": usable, "skipped_records": skipped},
    )
    with reported_exit(reporter):
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        model = load_model(cfg, device, path=resume_from, random_init=False if resume_from else None)
        model.train()
        # What the loop calls for the loss: the model itself, or DDP/FSDP2 around it (several processes).
        train_module = distributed.wrap(model, cfg.distributed_strategy, device)
        optimizer = build_optimizer(model, cfg, device)
        scheduler = build_scheduler(optimizer, cfg, total_steps)
        step = int(state.get("step", 0))
        if resume_from:
            ckpt.load_training_state(resume_from, model, optimizer, scheduler)
            log.info("resumed from step %d (%s)", step, resume_from)
        oom = {"split": int(state.get("oom_split", 1)), "halvings": int(state.get("oom_halvings", 0))}
        if cfg.oom_probe and device.type == "cuda" and not resume_from:
            probe_memory(train_module, cfg, oom, device)
        # The train stream's position after the last completed step (rank 0).
        loader_state = state.get("loader")
        if loader_state is not None:
            from trainer.data import RecipeDataError

            try:
                loader_state = resume_position(
                    loader_state, int(state.get("world_size", 1)), train_stream, cfg, tokenizer_file
                )
            except RecipeDataError as e:
                raise ConfigError(
                    f"resume from {resume_from}: {e}. Train on the same data with the same batching, or "
                    "start over with resume: never or another output_dir"
                ) from None
        best = state.get("best")  # {"eval_loss", "path"}
    empty_cache = memory.EmptyCacheSchedule(cfg.empty_cache_steps)
    profiler = StepProfiler(cfg.profile_start_step, cfg.profile_steps, output_dir, enabled=is_main)
    log.info(
        "empty_cache: %s",
        f"every {cfg.empty_cache_steps} optimizer steps" if cfg.empty_cache_steps else "never",
    )

    def save(at_step: int) -> Path:
        nonlocal best
        path = ckpt.save_checkpoint(
            output_dir,
            at_step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            tokenizer_file=tokenizer_file,
            rng=boundary_rng,
            trainer_state={
                "loader": loader_state,
                "world_size": world_size,
                "config": redact_obj(cfg.to_dict()),
                "wandb_run_id": reporter.run_id,
                "oom_split": oom["split"],
                "oom_halvings": oom["halvings"],
                "micro_batch": describe_micro_batch(cfg, oom["split"]),
                "best": best,
                "nan_skipped": nan_skipped,
            },
        )
        if is_main:
            removed = ckpt.rotate_checkpoints(
                output_dir, cfg.save_total_limit, Path(best["path"]) if best else None
            )
            if removed:
                log.info(
                    "removed %s (save_total_limit %d)",
                    ", ".join(p.name for p in removed),
                    cfg.save_total_limit,
                )
        reporter.checkpoint_saved(step=at_step, path=str(path))
        return path

    # 4. The loop.
    stop = StopRequested()
    stop.install()
    batches = loader_batches(train_stream, loader_state)
    nan_skipped = int(state.get("nan_skipped", 0))
    consecutive_nan = 0
    last_loss: float | None = None
    last_generations: list[dict[str, str]] = []
    saved_at = step if resume_from else -1
    boundary_rng = ckpt.rng_state()  # RNG states at the last step boundary: what a checkpoint stores
    started = time.monotonic()
    window = {"t": time.monotonic(), "tokens": 0, "padded": 0, "samples": 0}
    run_tokens = 0
    train_log = output_dir / TRAIN_LOG if is_main else None
    if train_log is not None:
        drop_log_rows_after(train_log, step)  # steps a killed run logged after its last checkpoint
    bar = tqdm(
        total=total_steps,
        initial=step,
        desc="train",
        disable=not (is_main and cfg.progress_bar),
        dynamic_ncols=True,
    )
    exit_code = 0
    try:
        while step < total_steps:
            profiler.before_step(step)
            with record_function("data"):
                group_np = [next(batches) for _ in range(accum)]
                pending_loader_state = train_stream.state_dict()
                group = [to_device(b, device) for b in group_np]
                local_targets = sum(int((b["labels"] != -100).sum()) for b in group_np)
            # Several ranks stop together at a step boundary (below), never inside a step.
            with record_function("forward_backward"):
                step_stop = stop if world_size == 1 else None
                result = accumulate_with_oom_backoff(
                    train_module, group, oom, cfg, reporter, step, step_stop, n_target=local_targets
                )
            heartbeat.beat(step)
            if result is None:  # stop requested mid-step: the partial gradients are dropped
                model.zero_grad(set_to_none=True)
                break
            loader_state = pending_loader_state
            loss_sum, n_target = result
            with record_function("optimizer"):
                grad_norm = distributed.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                # One wait for the GPU per step, for both numbers the update depends on.
                loss_sum, grad_norm = torch.stack([loss_sum.float(), grad_norm.float()]).tolist()
                loss = distributed.all_sum([loss_sum])[0] / max(n_target, 1)  # the same on every rank
                finite = math.isfinite(loss) and math.isfinite(grad_norm)
                if finite:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if finite:
                consecutive_nan = 0
                last_loss = loss
            else:
                nan_skipped += 1
                consecutive_nan += 1
                log.warning(
                    "step %d: loss %s / grad norm %s is not finite; update skipped", step, loss, grad_norm
                )
                reporter.nan_skipped(step=step, skipped_total=nan_skipped)
            scheduler.step()
            step += 1
            profiler.after_step(step)
            boundary_rng = ckpt.rng_state()
            lr = scheduler.get_last_lr()[0]
            empty_cache.after_step(step)

            source_tokens = sum(int(b["attention_mask"].sum()) for b in group_np)
            target_tokens = local_targets
            tokens = source_tokens + target_tokens  # real (non-pad) tokens
            padded_tokens = sum(b["input_ids"].size + b["labels"].size for b in group_np)
            samples = sum(len(b["input_ids"]) for b in group_np)
            # Summed over ranks: the train log and tokens/s count the whole job.
            source_tokens, target_tokens, padded_tokens, samples = (
                int(c) for c in distributed.all_sum([source_tokens, target_tokens, padded_tokens, samples])
            )
            tokens = source_tokens + target_tokens
            window["tokens"] += tokens
            window["padded"] += padded_tokens
            window["samples"] += samples
            run_tokens += tokens
            if train_log is not None:
                with open(train_log, "a", encoding="utf-8") as f:
                    row = {"step": step, "loss": loss, "lr": lr, "time": time.time()}
                    row.update(samples=samples, source_tokens=source_tokens, target_tokens=target_tokens)
                    row.update(padded_tokens=padded_tokens)
                    f.write(json.dumps(row) + "\n")
            heartbeat.beat(step)
            if consecutive_nan >= cfg.max_consecutive_nan_steps:
                path = save(step)
                raise RuntimeError(
                    f"{consecutive_nan} optimizer steps in a row had a NaN/inf loss or gradient (at {step}); "
                    f"saved {path}. Lower the learning rate or check the data."
                )
            mem_gib = torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else None
            bar.update(1)
            if step % cfg.logging_steps == 0 or step == total_steps:
                elapsed = max(time.monotonic() - window["t"], 1e-9)
                tok_s, smp_s = window["tokens"] / elapsed, window["samples"] / elapsed
                bar.set_postfix(
                    loss=f"{loss:.4f}",
                    lr=f"{lr:.2e}",
                    tok_s=f"{tok_s:,.0f}",
                    smp_s=f"{smp_s:.1f}",
                    mem=f"{mem_gib:.1f}G" if mem_gib is not None else "cpu",
                    refresh=False,
                )
                metrics = {
                    "train/loss": loss,
                    "train/lr": lr,
                    "train/grad_norm": float(grad_norm),
                    "train/tokens_per_s": tok_s,
                    "train/samples_per_s": smp_s,
                    "train/real_token_share": window["tokens"] / max(window["padded"], 1),
                }
                if mem_gib is not None:
                    metrics["gpu/memory_peak_gib"] = mem_gib
                    metrics["gpu/memory_allocated_gib"] = torch.cuda.memory_allocated(device) / 1024**3
                    metrics["gpu/memory_reserved_gib"] = torch.cuda.memory_reserved(device) / 1024**3
                reporter.log_metrics(metrics, step)
                rate = (time.monotonic() - started) / max(step - (saved_at if saved_at > 0 else 0), 1)
                reporter.progress(
                    step=step,
                    total=total_steps,
                    loss=loss,
                    tokens_per_s=tok_s,
                    eta_s=rate * (total_steps - step),
                    memory_gib=mem_gib,
                )
                if bar.disable:
                    log.info("step %d/%d loss %.4f lr %.2e %.0f tok/s", step, total_steps, loss, lr, tok_s)
                window = {"t": time.monotonic(), "tokens": 0, "padded": 0, "samples": 0}
            if eval_stream is not None and (step % cfg.eval_steps == 0 or step == total_steps):
                eval_loss, generations = evaluate(
                    model, eval_stream, device, cfg, tokenizer_file, distributed.unwrap(train_module)
                )
                log.info("step %d: eval loss %.4f", step, eval_loss)
                reporter.evaluated(step=step, eval_loss=eval_loss, generations=generations)
                last_generations = generations
                if math.isfinite(eval_loss) and (best is None or eval_loss < best["eval_loss"]):
                    best = {
                        "eval_loss": eval_loss,
                        "path": str(output_dir / f"checkpoint-{step}"),
                        "step": step,
                    }
                    # the best checkpoint must exist: save it now unless this step saves anyway
                    if step % cfg.save_steps and step != total_steps:
                        saved_at = step
                        save(step)
            if step % cfg.save_steps == 0 and saved_at != step:
                saved_at = step
                save(step)
            if distributed.any_rank(bool(stop)):  # collective: all ranks leave the loop at the same step
                stop.signal_name = stop.signal_name or "SIGTERM"  # the signal reached another rank first
                break
    except BaseException as e:
        bar.close()
        stop.restore()
        report_exit(reporter, e)
        raise
    bar.close()
    duration = time.monotonic() - started

    # 5. Stopped by a signal: checkpoint and exit. Else: the final checkpoint and model.
    # The signal handlers stay until the end: a signal while a checkpoint or final/ is written is noted, the
    # write completes (a second Ctrl-C still stops at once).
    if stop:
        with reported_exit(reporter):
            path = save(step) if saved_at != step else output_dir / f"checkpoint-{step}"
        stop.restore()
        reporter.stopped_by_signal(signal_name=stop.signal_name, step=step, checkpoint=str(path))
        reporter.close()
        log.info("stopped by %s at step %d; resume with the same command", stop.signal_name, step)
        return 128 + getattr(signal, stop.signal_name)
    with reported_exit(reporter):
        if cfg.save_final:
            if saved_at != step:
                save(step)
            save_final_model(model, cfg, tokenizer_file, final, is_main)
    from trainer.model import LAST_LOAD

    summary = {
        "steps": step,
        "duration_s": duration,
        "tokens_per_s": run_tokens / max(duration, 1e-9),
        "final_loss": last_loss,
        "nan_skipped": nan_skipped,
        "oom_split": oom["split"],
        "load_weight_gib": LAST_LOAD.get("weight_bytes", 0) / GIB,
        "load_peak_gib": LAST_LOAD["peak_bytes"] / GIB if LAST_LOAD.get("peak_bytes") else None,
    }
    if device.type == "cuda":
        summary["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        summary["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    # A rerun that trained nothing (it only wrote a missing final/) keeps the summary of the run.
    if is_main and (run_tokens or not (output_dir / SUMMARY).exists()):
        (output_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    for g in last_generations[:1]:
        log.info("a recipe for held-out ingredients %r:\n%s", g["ingredients"], g["generated"])
    log.info("finished: %d steps in %.0f s, final loss %s, model in %s", step, duration, last_loss, final)
    stop.restore()
    reporter.finished(final_loss=last_loss, duration_s=duration, model_dir=str(final))
    reporter.close()
    heartbeat.beat(step, force=True)
    return exit_code


def _copy_tokenizer(model_name_or_path: str, tokenizer_file: str, out: Path) -> None:
    import shutil

    src = Path(model_name_or_path)
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model"]
    copied = False
    if src.is_dir():
        for name in names:
            if (src / name).exists():
                shutil.copy(src / name, out / name)
                copied = True
    if not copied:
        shutil.copy(tokenizer_file, out / "tokenizer.json")

"""`trainer plan`: the memory plan for a config on a given card, printed by component, and the time the
training takes on named GPUs (the CLI's output).

The time is predicted from a measured MFU (model FLOPs utilisation: `MEASURED_MFU`, or `MEASURED_FSDP_MFU` for
several GPUs under FSDP2) and each card's dense
bf16 tensor rate (trainer.plan.gpu_specs): real tokens/s = MFU x rate / FLOPs per real token, with the FLOPs
per token of the model and the mean record lengths of the data (the loader's token lengths when `train_files`
can be read; otherwise typical recipes, and the output says so).
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys
from dataclasses import dataclass

from trainer.config import source_path
from trainer.data import hf_datasets
from trainer.data.loader import RecipeDataError, RecipeFileError, stream_for
from trainer.infra.memory import GIB
from trainer.model.model_files import ModelFilesError, resolve_tokenizer_file
from trainer.model.model_shape import LoraShape, ModelShape, load_shape
from trainer.optim import OPTIMIZERS
from trainer.plan.gpu_specs import (
    GPUS,
    flops_per_real_token,
    predicted_epoch_seconds,
    predicted_tokens_per_s,
)
from trainer.plan.memory_plan import (
    SAFETY_MARGIN,
    TYPICAL_SOURCE,
    TYPICAL_TARGET,
    RunPlan,
    largest_batch_size,
    largest_token_budget,
    micro_batch_peak,
    plan_kwargs,
    plan_packed_rows,
    plan_run,
    planned_peak,
    row_lengths,
)
from trainer.report.step_meter import format_duration


@dataclass(frozen=True)
class MfuMeasurement:
    mfu: float  # a fraction of the card's dense bf16 rate
    how: str  # the command that measured it, where and when


# The MFU behind every time prediction: the rtx5090 preset (FLAN-T5-XL, packed rows in 8k-token micro-batches
# x 8 replayed as CUDA graphs, Adafactor + Kahan bf16) on an H100 capped at 32 GiB, 49,566 real tokens/s =
# 42.3% of 989 TFLOP/s. Update both fields together after a new measurement.
MEASURED_MFU = MfuMeasurement(
    mfu=0.423,
    how="`python3 bench/train_throughput.py --variants preset` on an H100 at 32 GiB, 2026-11-26",
)
# Several GPUs under FSDP2 (weights, gradients and optimizer states split): FLAN-T5-XXL with every weight
# trained (the 2 x 48 GB preset: 8-bit Kahan buffer, 8k-token micro-batches x 8 per GPU, eager, gradients
# reduced in bf16), on 2 H200s capped at 48 GiB: 23,316 real tokens/s.
MEASURED_FSDP_MFU = MfuMeasurement(
    mfu=0.391,
    how="`python3 bench/multi_gpu.py --shape xxl --cap 48 --runs fsdp2 --preset "
    "configs/flan-t5-xxl-fsdp-2x-rtx6000ada.yaml --steps 13 --warmup 3` on 2 H200s at 48 GiB, 2026-11-30",
)
ASSUMED_RECORDS = 1_000_000  # the epoch the prediction describes when the data cannot be read


def measured_mfu(strategy: str, processes: int) -> MfuMeasurement:
    """The measurement a prediction rests on: FSDP2's over several GPUs, one GPU's otherwise (ddp's GPUs
    each run as one does)."""
    return MEASURED_FSDP_MFU if strategy == "fsdp" and processes > 1 else MEASURED_MFU


@dataclass(frozen=True)
class EpochData:
    """One epoch of the training split: records, real token totals, optimizer steps, and where the numbers
    come from (`source`, in words)."""

    records: int
    source_tokens: int
    target_tokens: int
    steps: float  # optimizer steps per epoch
    total_steps: int  # the run's optimizer steps (max_steps, or num_train_epochs of epochs)
    source: str
    packed_shape: dict | None = None  # packing: the loader's rows (rows, source_len, target_len)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'32GiB' -> 32*2**30, '24GB' -> 24e9, '80G' -> 80*2**30 (a bare G means GiB, as nvidia-smi shows)."""
    m = _SIZE.match(text)
    if not m or not m.group(2):
        raise ValueError(f"cannot read memory size {text!r}: use e.g. 32GiB, 24GB or 80G")
    num, unit, binary, b = float(m.group(1)), m.group(2).upper(), m.group(3), m.group(4)
    power = "KMGT".index(unit) + 1
    base = 1000 if (b and not binary) else 1024
    size = int(num * base**power)
    if size <= 0:
        raise ValueError(f"memory size {text!r} must be more than 0")
    return size


def print_plan(cfg, gpu_memory: str, hours: float | None = None, processes: int = 1) -> int:
    """Print the predicted peak by component for `cfg` on a card of `gpu_memory` (e.g. "32GiB"), one of the
    `processes` GPUs a torchrun run starts, then the predicted time for an epoch and for the run on each named
    GPU (and what `hours` hours cover, if given).

    Returns the exit code: 0 if the configured micro-batch fits, 1 if not (with a suggestion), 2 if the card
    size, the process count or the model's config cannot be read."""
    if hours is not None and not (math.isfinite(hours) and hours > 0):
        print(f"trainer plan: --hours must be a positive number, got {hours}", file=sys.stderr)
        return 2
    if processes < 1:
        print(f"trainer plan: --processes must be at least 1, got {processes}", file=sys.stderr)
        return 2
    try:
        gpu_bytes = parse_size(gpu_memory)
        shape = load_shape(cfg.model_name_or_path)
    except ValueError as e:
        print(f"trainer plan: {e}", file=sys.stderr)
        return 2
    src_cap, tgt_cap = row_lengths(cfg)
    source = "max_tokens" if cfg.max_tokens else "chosen by the plan"
    plan = plan_run(cfg, gpu_bytes, processes)  # what the trainer would choose on this card
    epoch = epoch_data(cfg, plan)
    if epoch.packed_shape:  # the trainer plans again on the rows the loader chose from the data
        plan = plan_packed_rows(plan, cfg, epoch.packed_shape, gpu_bytes)
    blocks = plan.blocks_without_checkpointing
    # The trainer picks the budget with every block checkpointed, then skips checkpointing where room is left.
    kw_all = plan_kwargs(cfg, (0, 0), processes)
    peak = micro_batch_peak(shape, cfg, plan.max_tokens, blocks, plan.packed_rows, processes)
    if plan.packed_rows is not None:
        rows, src, tgt = plan.packed_rows
        batch = f"{rows} rows x ({src} + {tgt}) tokens (packed rows, as the loader chose them from the data)"
    elif cfg.per_device_train_batch_size is not None:
        padded = "packed rows" if cfg.packing else "padded to the maximum"
        batch = f"{cfg.per_device_train_batch_size} rows x ({src_cap} + {tgt_cap}) tokens ({padded})"
    else:
        shapes = "worst case over typical and maximal-length rows"
        if cfg.packing:
            rows = max(1, plan.max_tokens // (src_cap + tgt_cap))
            shapes = f"packed: {rows} rows x ({src_cap} + {tgt_cap}), the data not read"
        batch = f"token budget {plan.max_tokens} ({source}; {shapes})"
    print(f"model: {cfg.model_name_or_path} ({shape.num_params() / 1e9:.2f}B parameters)")
    print(f"processes: {processes_line(cfg, processes)}")
    lora = kw_all["lora"]
    if lora is not None:
        print(
            f"adapter: LoRA r {lora.r}, alpha {cfg.lora_alpha:g}, dropout {lora.dropout:g} on "
            f"{', '.join(lora.targets)}: {shape.lora_num_params(lora) / 1e6:.1f}M fp32 parameters trained "
            f"(their gradients and optimizer states alone), the base frozen in {cfg.dtype}"
        )
    bf16_update = {"kahan": OPTIMIZERS[cfg.optimizer].compensation, "kahan_8bit": "8-bit kahan"}.get(
        cfg.bf16_update, cfg.bf16_update
    )
    update = "fp32 adapters" if lora is not None else f"{bf16_update} bf16 update"
    print(
        f"optimizer: {cfg.optimizer} ({update}), "
        f"checkpointing: {cfg.gradient_checkpointing}, attention: {kw_all['attn_implementation']}"
    )
    if cfg.gradient_checkpointing:
        print(
            f"blocks without checkpointing (the last ones; no recompute): {blocks[0]} decoder, "
            f"{blocks[1]} encoder"
        )
    print(f"micro-batch: {batch}")
    print(f"peak at: {peak.peak_moment}")
    print(f"{'component':<24}{'GiB':>8}")
    for name, value in peak.components().items():
        print(f"{name:<24}{value / GIB:>8.2f}")
    print(f"{'total (predicted peak)':<24}{peak.peak / GIB:>8.2f}")
    print(f"{'card':<24}{gpu_bytes / GIB:>8.2f}")
    print(f"{'headroom':<24}{(gpu_bytes - peak.peak) / GIB:>8.2f}")
    print(checkpoint_memory_line(peak.gradients + peak.optimizer_states, processes))
    best = largest_token_budget(shape, gpu_bytes, src_cap=src_cap, tgt_cap=tgt_cap, **kw_all)
    typical = largest_token_budget(
        shape, gpu_bytes, src_cap=src_cap, tgt_cap=tgt_cap, worst_case=False, **kw_all
    )
    rows = largest_batch_size(shape, gpu_bytes, src_len=src_cap, tgt_len=tgt_cap, **kw_all)
    print(
        f"largest max_tokens that fits ({SAFETY_MARGIN:.0%} of the card): {best} "
        f"(typical lengths only: {typical})"
    )
    print(f"largest per_device_train_batch_size at {src_cap}+{tgt_cap} tokens: {rows}")
    print()
    for line in time_report(cfg, plan, shape, peak.peak, epoch, hours):
        print(line)
    print()
    if peak.peak > gpu_bytes * SAFETY_MARGIN:
        if best > 0:
            advice = f"set max_tokens: {best} (or per_device_train_batch_size: {rows})"
        else:
            advice = (
                "no micro-batch fits, not even one row: use a bigger card, optimizer: adafactor, shorter "
                "max_source_length/max_target_length, or FSDP over several GPUs (`--processes N --set "
                "distributed_strategy=fsdp`, docs/distributed.md)"
            )
        print(f"does not fit: the predicted peak exceeds {SAFETY_MARGIN:.0%} of the card; {advice}")
        return 1
    return 0


def processes_line(cfg, processes: int) -> str:
    """What one GPU holds in a run of `processes`, in words (the plan below is that GPU's)."""
    if processes == 1:
        return "1 (one GPU; under torchrun give --processes, its nnodes x nproc_per_node)"
    if cfg.distributed_strategy == "ddp":
        return f"{processes}, ddp: every GPU holds what one process does (the plan below is each GPU's)"
    how = [
        "each block's gathered weights freed after its forward"
        if cfg.fsdp_reshard_after_forward
        else "every block's gathered weights kept from forward to backward",
        "gradients reduce-scattered after every micro-batch"
        if cfg.fsdp_sync_each_micro_batch
        else "the whole model's gradients kept until the step's last micro-batch",
    ]
    split = f"{processes}, fsdp: weights, gradients and optimizer states split {processes} ways"
    return "; ".join([split, *how])


def checkpoint_memory_line(staged_bytes: int, processes: int) -> str:
    """What a checkpoint needs in host memory: the trained weights (as large as their gradients) and the
    optimizer's states, copied off the GPU so that the write goes on in the background
    (trainer.checkpoint.writer)."""
    per = " per process" if processes > 1 else ""
    extra = "; rank 0 also gathers the whole model for model.safetensors" if processes > 1 else ""
    return (
        f"checkpoints: {staged_bytes / GIB:.2f} GiB of host memory{per} (the trained weights and the "
        f"optimizer's states{extra}), copied there so that the write goes on in the background; with less "
        "free, saves stop training while they write"
    )


def memory_plan_line(cfg, plan: RunPlan, gpu_bytes: int) -> str:
    """One line: the micro-batch, the predicted peak of one GPU and its components (what the dry run logs)."""
    peak = planned_peak(cfg, plan)
    parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in peak.components().items() if value)
    return (
        f"memory plan per GPU ({processes_line(cfg, plan.processes)}): micro-batch {plan.micro_batch()}, "
        f"peak at {peak.peak_moment}, predicted {peak.peak / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} "
        f"({parts} GiB)"
    )


def epoch_data(cfg, plan: RunPlan) -> EpochData:
    """The training split of `cfg`'s data, read through the loader (its per-record token lengths, after
    truncation, and its batches); typical recipes of ASSUMED_RECORDS when the data or the model's tokenizer
    cannot be had (files that match nothing are said so; the tokenizer comes from the local Hugging Face
    cache, else one try at the Hub), with the reason in `source`."""
    accum = cfg.gradient_accumulation_steps * plan.processes  # loader batches per optimizer step, all GPUs
    named = ", ".join(map(str, cfg.train_files))
    files = [source_path(e) for e in cfg.train_files if not hf_datasets.is_dataset(source_path(e))]
    why = unmatched_files(files) if cfg.train_files else "train_files is empty"
    if not why:
        try:
            tokenizer = resolve_tokenizer_file(cfg.model_name_or_path)
            print(f"reading the token lengths of {named} ...", file=sys.stderr, flush=True)
            stream = stream_for(plan.applied_to(cfg), tokenizer, "train")
            sources, targets = stream.lengths()
        except (ModelFilesError, RecipeDataError, RecipeFileError) as e:
            why = str(e)
    if why:
        src, tgt = min(cfg.max_source_length, TYPICAL_SOURCE), min(cfg.max_target_length, TYPICAL_TARGET)
        rows = cfg.per_device_train_batch_size or max(1, (plan.max_tokens or 0) // (src + tgt))
        steps = ASSUMED_RECORDS / (rows * accum)
        total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(steps * cfg.num_train_epochs)
        return EpochData(
            ASSUMED_RECORDS,
            ASSUMED_RECORDS * src,
            ASSUMED_RECORDS * tgt,
            steps,
            total,
            f"no data read ({why}): assuming {ASSUMED_RECORDS:,} records of {src} + {tgt} tokens (typical "
            f"recipes) in about {rows} rows per micro-batch; times scale with the number of records",
        )
    records = len(sources)
    steps = len(stream) / accum
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(len(stream) * cfg.num_train_epochs / accum)
    return EpochData(
        records,
        int(sources.sum()),
        int(targets.sum()),
        steps,
        total,
        f"{records:,} training records per epoch, {int(sources.sum()):,} source + "
        f"{int(targets.sum()):,} target tokens (the loader's token lengths of "
        f"{', '.join(map(str, cfg.train_files))})",
        stream.stats()["packed_shape"],
    )


def unmatched_files(patterns: list[str]) -> str | None:
    """Which of `patterns` (train_files' paths and globs) name no file, in words: `/data/*.csv matches no
    file (/data does not exist)`; None when each names one. The loader says the same when it opens them; the
    plan says it without the tokenizer the loader needs first."""
    said = []
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if os.path.exists(path) or glob.glob(path, recursive=True):
            continue
        # The deepest directory before the first wildcard: where the files were looked for.
        literal = re.split(r"[*?[]", path, maxsplit=1)[0]
        directory = os.path.dirname(literal) or "."
        where = "" if os.path.isabs(path) else f", resolved against {os.getcwd()}"
        if not os.path.isdir(directory):
            said.append(f"{pattern} matches no file ({directory} does not exist{where})")
        else:
            said.append(f"{pattern} matches no file{f' ({where[2:]})' if where else ''}")
    return "; ".join(said) or None


def time_report(
    cfg, plan: RunPlan, shape: ModelShape, peak_bytes: float, epoch: EpochData, hours: float | None
) -> list[str]:
    """Lines: real tokens/s, one epoch, the run and (with `hours`) what those hours cover, on each named GPU
    at the measured MFU (`measured_mfu`); a card with less memory than the micro-batch's predicted peak says
    so instead."""
    records = max(epoch.records, 1)
    mean_src, mean_tgt = epoch.source_tokens / records, epoch.target_tokens / records
    lora = LoraShape.of(cfg)
    per_token = flops_per_real_token(shape, mean_src, mean_tgt, lora)
    measured = measured_mfu(cfg.distributed_strategy, plan.processes)
    mfu = measured.mfu
    run_epochs = epoch.total_steps / max(epoch.steps, 1e-9)
    gpus = plan.processes
    where = "one GPU"
    per_step = f"{plan.micro_batch()} x {cfg.gradient_accumulation_steps}"
    if gpus > 1 and measured is MEASURED_FSDP_MFU:
        where = f"{gpus} GPUs under fsdp, each at FSDP2's measured MFU (docs/distributed.md)"
    elif gpus > 1:
        where = f"{gpus} GPUs, each as fast as one alone (docs/distributed.md: how close each strategy comes)"
        per_step += f" x {gpus} GPUs"
    lines = [
        f"time on {where}, at {mfu:.1%} MFU (measured with {measured.how}; assumed the same on every "
        "card, closer between cards of one design than across designs):",
        f"  data: {epoch.source}",
        f"  one epoch: {epoch.records:,} records, {epoch.steps:,.0f} optimizer steps of {per_step}; mean "
        f"record {mean_src:.0f} + {mean_tgt:.0f} tokens, {per_token / 1e9:.3g} GFLOP per real token",
        f"  this run: {epoch.total_steps:,} optimizer steps ({run_epochs:.2f} epochs)",
    ]
    if lora is not None:
        lines.append(
            "  LoRA: no weight gradients for the frozen base, 4 FLOPs per parameter and token instead of 6 "
            "(the MFU is full fine-tuning's)"
        )
    for spec in GPUS.values():
        rate = f"{spec.bf16_tflops:g} TFLOP/s dense bf16"
        if spec.spec_sheet_tflops != spec.bf16_tflops:  # GeForce: training's fp32 accumulation runs at half
            rate += f" with fp32 accumulation, {spec.spec_sheet_tflops:g} with fp16 on the spec sheet"
        card_bytes = spec.memory_gb * GIB  # GeForce and data-centre cards hold binary gigabytes
        if peak_bytes > card_bytes * SAFETY_MARGIN:
            lines.append(
                f"  {spec.name} ({rate}, {spec.memory_gb:g} GB): does not fit: this micro-batch's predicted "
                f"peak {peak_bytes / GIB:.1f} GiB is over {SAFETY_MARGIN:.0%} of the card (set max_tokens "
                "lower, see `trainer plan --gpu-memory`)"
            )
            continue
        tokens_per_s = gpus * predicted_tokens_per_s(spec, mfu, per_token)
        epoch_s = (
            predicted_epoch_seconds(spec, mfu, shape, epoch.source_tokens, epoch.target_tokens, lora) / gpus
        )
        line = (
            f"  {spec.name} ({rate}): {tokens_per_s:,.0f} real tokens/s; "
            f"one epoch {format_duration(epoch_s)}; this run {format_duration(epoch_s * run_epochs)}"
        )
        if hours is not None:
            share = hours * 3600 / epoch_s if epoch_s > 0 else math.inf
            line += (
                f"; {hours:g} h cover {share * epoch.records:,.0f} records ({share:.3g} epochs, "
                f"{share * epoch.steps:,.0f} optimizer steps)"
            )
        lines.append(line)
    return lines

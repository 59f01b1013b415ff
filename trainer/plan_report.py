"""`trainer plan`: the memory plan for a config on a given card, printed by component (the CLI's output)."""

from __future__ import annotations

import re
import sys

from trainer.memory import GIB
from trainer.memory_plan import (
    SAFETY_MARGIN,
    _plan_kwargs,
    budget_peak,
    largest_batch_size,
    largest_token_budget,
    plan_memory,
    plan_run,
    row_lengths,
)
from trainer.model_shape import load_shape

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


def print_plan(cfg, gpu_memory: str) -> int:
    """Print the predicted peak by component for `cfg` on a card of `gpu_memory` (e.g. "32GiB").

    Returns the exit code: 0 if the configured micro-batch fits, 1 if not (with a suggestion), 2 if the card
    size or the model's config cannot be read."""
    try:
        gpu_bytes = parse_size(gpu_memory)
        shape = load_shape(cfg.model_name_or_path)
    except ValueError as e:
        print(f"trainer plan: {e}", file=sys.stderr)
        return 2
    src_cap, tgt_cap = row_lengths(cfg)
    source = "max_tokens" if cfg.max_tokens else "chosen by the plan"
    plan = plan_run(cfg, gpu_bytes)  # what the trainer would choose on this card
    kw = _plan_kwargs(cfg, plan.decoder_blocks_without_checkpointing)
    # The trainer picks the budget with every block checkpointed, then skips checkpointing where room is left.
    kw_all = dict(kw, decoder_blocks_without_checkpointing=0)
    if cfg.per_device_train_batch_size is not None:
        padded = "packed rows" if cfg.packing else "padded to the maximum"
        batch = f"{cfg.per_device_train_batch_size} rows x ({src_cap} + {tgt_cap}) tokens ({padded})"
        peak = plan_memory(
            shape, rows=cfg.per_device_train_batch_size, src_len=src_cap, tgt_len=tgt_cap, **kw
        )
    else:
        shapes = "worst case over typical and maximal-length rows"
        if cfg.packing:
            rows = max(1, plan.max_tokens // (src_cap + tgt_cap))
            shapes = f"packed: {rows} rows x ({src_cap} + {tgt_cap})"
        batch = f"token budget {plan.max_tokens} ({source}; {shapes})"
        peak = budget_peak(shape, plan.max_tokens, src_cap=src_cap, tgt_cap=tgt_cap, **kw)
    print(f"model: {cfg.model_name_or_path} ({shape.num_params() / 1e9:.2f}B parameters)")
    print(
        f"optimizer: {cfg.optimizer} ({cfg.bf16_update} bf16 update), "
        f"checkpointing: {cfg.gradient_checkpointing}, attention: {kw['attn_implementation']}"
    )
    if cfg.gradient_checkpointing:
        blocks = plan.decoder_blocks_without_checkpointing
        print(f"decoder blocks without checkpointing (the last ones; no recompute): {blocks}")
    print(f"micro-batch: {batch}")
    print(f"peak at: {peak.peak_moment}")
    print(f"{'component':<24}{'GiB':>8}")
    for name, value in peak.components().items():
        print(f"{name:<24}{value / GIB:>8.2f}")
    print(f"{'total (predicted peak)':<24}{peak.peak / GIB:>8.2f}")
    print(f"{'card':<24}{gpu_bytes / GIB:>8.2f}")
    print(f"{'headroom':<24}{(gpu_bytes - peak.peak) / GIB:>8.2f}")
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
    if peak.peak > gpu_bytes * SAFETY_MARGIN:
        if best > 0:
            advice = f"set max_tokens: {best} (or per_device_train_batch_size: {rows})"
        else:
            advice = (
                "no micro-batch fits, not even one row: use a bigger card, optimizer: adafactor, shorter "
                "max_source_length/max_target_length, or FSDP over several GPUs (docs/distributed.md)"
            )
        print(f"does not fit: the predicted peak exceeds {SAFETY_MARGIN:.0%} of the card; {advice}")
        return 1
    return 0

"""Where a training micro-step's GPU time goes: torch.profiler over forward+backward of FLAN-T5-XL's shape.

    python3 bench/profile_step.py                 # GPU: kernel table, top 30 by CUDA time, and a coarse split
    python3 bench/profile_step.py --attn eager    # the same with another attention implementation

Random-init bf16 model with the trainer's own loss path (trainer.model.swaps.use_fused_t5_ops, gradient
checkpointing, trainer.run.train.token_loss_sum) on one micro-batch of the benchmark's recipe-like lengths
(about 16k real tokens: 48 rows, source 96, target 256).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import AutoModelForSeq2SeqLM  # noqa: E402

from trainer.model.load import compile_blocks
from trainer.model.loss import token_loss_sum  # noqa: E402
from trainer.model.swaps import use_fused_t5_ops  # noqa: E402
from trainer.model.tiny_model import flan_t5_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attn", default="eager", help="eager or sdpa")
    parser.add_argument("--compile", action="store_true", help="compile each block (torch_compile)")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--source", type=int, default=96)
    parser.add_argument("--target", type=int, default=256)
    args = parser.parse_args()
    config = flan_t5_config("xl")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.bfloat16, attn_implementation=args.attn)
    use_fused_t5_ops(model)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        compile_blocks(model)
    model.train()
    g = torch.Generator().manual_seed(0)
    b, s, t = args.rows, args.source, args.target
    ids = torch.randint(3, 32000, (b, s), generator=g)
    labels = torch.randint(3, 32000, (b, t), generator=g)
    mask = torch.ones_like(ids)
    for r in range(b):  # some padding, as in a bucketed batch
        ids[r, s - r % 8 :], mask[r, s - r % 8 :] = 0, 0
        labels[r, t - r % 8 :] = -100
    batch = {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "labels": labels.cuda()}

    def step():
        token_loss_sum(model, batch).backward()

    for _ in range(3 if args.compile else 2):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 3
    tokens = int(mask.sum() + (labels != -100).sum())
    what = f"{args.attn}{' + compile' if args.compile else ''}"
    print(f"attention {what}: {ms:.1f} ms per micro-step of {tokens} real tokens, {tokens / ms * 1e3:,.0f}/s")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events)
    print(f"profiled CUDA time {total / 1e3:.1f} ms")
    groups = {"gemm": 0.0, "attention": 0.0, "elementwise/other": 0.0}
    for e in events:
        name = e.key.lower()
        if any(k in name for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul")):
            groups["gemm"] += e.device_time_total
        elif any(k in name for k in ("fmha", "attention", "flash", "efficient")):
            groups["attention"] += e.device_time_total
        else:
            groups["elementwise/other"] += e.device_time_total
    for k, v in groups.items():
        print(f"  {k:<18} {v / 1e3:8.1f} ms  {100 * v / total:5.1f}%")
    print(f"  {'kernel':<72} {'ms':>8} {'calls':>6} {'us/call':>8}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]:
        ms = e.self_device_time_total / 1e3
        print(f"  {e.key[:72]:<72} {ms:8.1f} {e.count:6d} {1e3 * ms / max(e.count, 1):8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

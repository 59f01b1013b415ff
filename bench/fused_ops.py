"""Time T5's gated-GELU product with dropout, eager torch ops vs trainer.fused_ops, forward and backward.

    python3 bench/fused_ops.py [--tokens 28672] [--d-ff 5120] [--dropout 0.1] [--sweep]

Shapes are FLAN-T5-XL's feed-forward on a 32k-token micro-batch (~28k tokens after padding is counted out).
Prints milliseconds per call (CUDA events, median of 20) and the ratio; --sweep also times the fused kernels
at other block sizes and warp counts (trainer.fused_ops.BLOCK, NUM_WARPS). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import fused_ops  # noqa: E402
from trainer.fused_ops import gated_gelu  # noqa: E402


def eager(a, b, p):
    return torch.nn.functional.dropout(torch.nn.functional.gelu(a, approximate="tanh") * b, p)


def time_ms(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=28672)
    parser.add_argument("--d-ff", type=int, default=5120)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    a, b = (torch.randn(args.tokens, args.d_ff, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a.requires_grad_()
    b.requires_grad_()
    grad = torch.randn_like(a)
    print(f"gated GELU x {args.tokens} tokens x d_ff {args.d_ff}, dropout {args.dropout}, bf16")
    rows = {}
    for name, fn in (("eager", eager), ("fused", gated_gelu)):
        fwd = time_ms(lambda fn=fn: fn(a, b, args.dropout))
        both = time_ms(lambda fn=fn: torch.autograd.grad(fn(a, b, args.dropout), (a, b), grad))
        rows[name] = (fwd, both)
        print(f"  {name:6s} forward {fwd:6.2f} ms   forward+backward {both:6.2f} ms")
    print(
        f"  fused/eager: forward {rows['fused'][0] / rows['eager'][0]:.2f}x, "
        f"forward+backward {rows['fused'][1] / rows['eager'][1]:.2f}x"
    )
    if args.sweep:
        default = fused_ops.BLOCK, fused_ops.NUM_WARPS
        for block in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                fused_ops.BLOCK, fused_ops.NUM_WARPS = block, warps
                fwd = time_ms(lambda: gated_gelu(a, b, args.dropout))
                both = time_ms(lambda: torch.autograd.grad(gated_gelu(a, b, args.dropout), (a, b), grad))
                mark = " (default)" if (block, warps) == default else ""
                print(
                    f"  BLOCK {block:5d} warps {warps:2d}: forward {fwd:6.2f} ms   "
                    f"forward+backward {both:6.2f} ms{mark}"
                )
        fused_ops.BLOCK, fused_ops.NUM_WARPS = default


if __name__ == "__main__":
    main()

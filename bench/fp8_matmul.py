"""What FP8 matmuls give FLAN-T5-XL's linear layers on this GPU (`fp8: true`, trainer.fp8): forward + backward
of one projection at the training step's shapes, bf16 against FP8, and a check of the GPU's cast kernel.

    python3 bench/fp8_matmul.py [--tokens 8192,24576] [--steps 20]
    python3 bench/fp8_matmul.py --sweep     # the cast kernel's tile and warps, on a 24576 x 5120 gradient

Per shape (tokens M, in K, out N), ms for the three matmuls of a projection's forward and backward
(y = x W^T, dx = dy W, dW = dy^T x): bf16; the FP8 matmuls alone (torch._scaled_mm, operands cast
beforehand); FP8 as trainer.fp8.Fp8Linear runs it, the casts included (trainer.fp8.cast: one reduction and
one Triton kernel per tensor, both layouts). The last column is that over bf16: below 1 is a gain.
Before timing, every shape's casts are compared with the torch reference (trainer.fp8.cast_reference): the
FP8 bytes must match but for rare ties (the kernel's and torch's division may differ in the last bit of the
scale), and the inverse scale to fp32 rounding.

Quality per token is the convergence benchmark's (`bench/convergence.py --runs ...,ours_fp8`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.fp8 import E4M3, E5M2, cast, cast_reference  # noqa: E402


def check_cast(x: torch.Tensor, dtype: torch.dtype) -> str:
    """Kernel against reference for one tensor; raises on a real difference, returns a summary."""
    got, want = cast(x, dtype), cast_reference(x, dtype)
    differ = (got.rows.view(torch.uint8) != want.rows.view(torch.uint8)).float().mean().item()
    values = (got.rows.float() - want.rows.float()).abs().max().item()
    scale = (got.inverse_scale / want.inverse_scale - 1).abs().item()
    ok = differ < 1e-4 and torch.equal(got.cols, got.rows.t().contiguous()) and scale < 1e-6
    if not ok:
        raise SystemExit(
            f"cast kernel differs from the reference: {differ:.2e} of bytes, {values}, scale {scale}"
        )
    return f"{differ:.0e}"


def timed(fn, steps: int) -> float:
    """GPU ms per call of `fn`, after 3 untimed calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def measure(m: int, k: int, n: int, steps: int) -> str:
    """One table row: a projection of K to N features over M tokens."""
    bf = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=bf)
    w = torch.randn(n, k, device="cuda", dtype=bf) * 0.02
    g = torch.randn(m, n, device="cuda", dtype=bf) * 1e-3
    checks = " ".join(check_cast(t, d) for t, d in ((x, E4M3), (w, E4M3), (g, E5M2)))

    def bf16():
        x @ w.t()
        g @ w
        g.t() @ x

    xc, wc, gc = cast(x, E4M3), cast(w, E4M3), cast(g, E5M2)

    def fp8_mm():
        sx, sw, sg = xc.inverse_scale, wc.inverse_scale, gc.inverse_scale
        torch._scaled_mm(xc.rows, wc.rows.t(), scale_a=sx, scale_b=sw, out_dtype=bf)
        torch._scaled_mm(gc.rows, wc.cols.t(), scale_a=sg, scale_b=sw, out_dtype=bf)
        torch._scaled_mm(gc.cols, xc.cols.t(), scale_a=sg, scale_b=sx, out_dtype=bf)

    def fp8_cast():  # as Fp8Linear: input and weight cast in the forward, the gradient in the backward
        xc, wc = cast(x, E4M3), cast(w, E4M3)
        sx, sw = xc.inverse_scale, wc.inverse_scale
        torch._scaled_mm(xc.rows, wc.rows.t(), scale_a=sx, scale_b=sw, out_dtype=bf)
        gc = cast(g, E5M2)
        torch._scaled_mm(gc.rows, wc.cols.t(), scale_a=gc.inverse_scale, scale_b=sw, out_dtype=bf)
        torch._scaled_mm(gc.cols, xc.cols.t(), scale_a=gc.inverse_scale, scale_b=sx, out_dtype=bf)

    b, f, fc = timed(bf16, steps), timed(fp8_mm, steps), timed(fp8_cast, steps)
    return f"{m:>6} {k:>6} {n:>6} | {b:7.3f} {f:7.3f} {fc:8.3f} | {fc / b:6.2f} | {checks}"


def sweep(steps: int) -> None:
    """The cast of one 24576 x 5120 bf16 tensor under each kernel setting: ms and effective GB/s (the
    reduction's read, the cast's read and its two writes: 5 bytes per element)."""
    x = torch.randn(24576, 5120, device="cuda", dtype=torch.bfloat16)
    amax_ms = timed(lambda: torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32), steps)
    print(f"absolute maximum alone: {amax_ms:.3f} ms ({x.numel() * 2 / amax_ms / 1e6:.0f} GB/s)")
    for block_r, block_c, warps in [
        (64, 128, 8),
        (64, 128, 4),
        (128, 128, 8),
        (64, 64, 4),
        (128, 64, 4),
        (32, 128, 4),
        (128, 256, 8),
        (256, 128, 8),
    ]:
        block = dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
        ms = timed(lambda block=block: cast(x, E5M2, block), steps)
        print(
            f"BLOCK_R {block_r:>3} BLOCK_C {block_c:>3} warps {warps}: {ms:.3f} ms, "
            f"{x.numel() * 5 / ms / 1e6:.0f} GB/s"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--tokens", default="8192,24576", help="rows of the activations (tokens per micro-batch)"
    )
    parser.add_argument(
        "--shapes",
        default="2048x2048,2048x5120,5120x2048",
        help="in x out features: attention projections, wi_0/wi_1, wo",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="the cast kernel's settings instead")
    args = parser.parse_args()
    if args.sweep:
        sweep(args.steps)
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = f"{'M':>6} {'K':>6} {'N':>6} | {'bf16':>7} {'fp8 mm':>7} {'fp8+cast':>8} | {'ratio':>6}"
    print(f"{header} | cast bytes differing (x, w, dy)")
    for m in (int(t) for t in args.tokens.split(",")):
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            print(measure(m, k, n, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

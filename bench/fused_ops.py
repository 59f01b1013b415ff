"""Time trainer.kernels.fused_ops against eager torch ops, forward and backward: the feed-forward's gated GELU
with dropout and its output projection (gated_gelu_linear), and a sublayer's RMSNorm with its residual
(norm_and_residual).

    python3 bench/fused_ops.py [--tokens 28672] [--d-ff 5120] [--dropout 0.1] [--sweep]
    python3 bench/fused_ops.py --host        # what the host spends per call, fused and eager

Shapes are FLAN-T5-XL's (d_model 2048, d_ff 5120) on a 32k-token micro-batch (~28k tokens after padding is
counted out). Prints milliseconds per call (CUDA events, median of 20) and the ratio; --sweep also times the
gated GELU's kernels at other block sizes and warp counts (trainer.kernels.fused_ops.BLOCK, NUM_WARPS) and the
norm's backward at other rows at a time and programs per SM (NORM_BWD_ROWS, NORM_BWD_PROGRAMS_PER_SM).

--host: the host's time per forward + backward of each op, fused and eager, with the attention kernels and the
grouped projections (trainer.kernels.projections) beside SDPA and separate linears: 64 tokens of width 64, so
small that each kernel takes the GPU a few microseconds and a loop of calls runs at the speed of the Python
and C++ that launches them (what bounds an eager micro-step whose kernels are short: FSDP2's). Median of 5
loops of 200 calls, each loop's spread printed. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.kernels import fused_ops  # noqa: E402
from trainer.kernels.fused_ops import gated_gelu_linear, norm_and_residual, residual_dropout  # noqa: E402
from trainer.kernels.packed_attention import PackedAttentionLayout, RelativeBias, packed_attention  # noqa: E402
from trainer.kernels.projections import GroupedLinear, ProjectionGroup  # noqa: E402

D_MODEL = 2048


def eager_gated(a, b, weight, p):
    product = torch.nn.functional.dropout(torch.nn.functional.gelu(a, approximate="tanh") * b, p)
    return torch.nn.functional.linear(product, weight)


def eager_norm(x, norm):
    return norm(x), x


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


def compare(title: str, variants: dict, inputs: tuple, grads: tuple) -> None:
    """Forward, and forward + backward, of each variant (a function of `inputs`), and fused / eager."""
    print(title)
    rows = {}
    for name, fn in variants.items():
        fwd = time_ms(lambda fn=fn: fn(*inputs))
        both = time_ms(lambda fn=fn: torch.autograd.grad(fn(*inputs), inputs, grads, allow_unused=True))
        rows[name] = (fwd, both)
        print(f"  {name:6s} forward {fwd:6.2f} ms   forward+backward {both:6.2f} ms")
    print(
        f"  fused/eager: forward {rows['fused'][0] / rows['eager'][0]:.2f}x, "
        f"forward+backward {rows['fused'][1] / rows['eager'][1]:.2f}x"
    )


def host_us(fn, inputs: tuple, grads: tuple, calls: int = 200, loops: int = 5) -> tuple[float, float]:
    """Microseconds per forward + backward of fn(*inputs) in a loop of `calls` (median over `loops`) and the
    loops' spread (max - min over the median)."""

    def once():
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads[: len(outs)])

    for _ in range(20):
        once()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            once()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    median = statistics.median(per_call)
    return median, (max(per_call) - min(per_call)) / median


def host_costs(p: float) -> None:
    """--host: each op's host time per forward + backward, fused against eager."""
    tokens, width = 64, 64

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()

    x, r, a, b = bf16(tokens, width), bf16(tokens, width), bf16(tokens, width), bf16(tokens, width)
    grad = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    weight = bf16(width, width)
    norm = torch.nn.RMSNorm(width, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    linears = [
        torch.nn.Linear(width, width, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    ]
    group = ProjectionGroup()
    grouped = [GroupedLinear(linear, group) for linear in linears]
    heads, head_dim = 1, 64
    q, k, v = (bf16(1, heads, tokens, head_dim) for _ in range(3))
    segments = torch.ones(1, tokens, device="cuda", dtype=torch.int32)
    bias = RelativeBias(bidirectional=True)
    table = torch.randn(bias.num_buckets, heads, device="cuda", requires_grad=True)
    attention_grad = torch.randn(1, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)

    # One layout per micro-batch and stack, shared by its blocks: built once here, as in training
    layout = PackedAttentionLayout.build(segments, segments, causal=False, position_bias=bias)
    layout.use_bias_table(table)

    def fused_attention(q, k, v):
        return packed_attention(q, k, v, layout, p)

    def eager_attention(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=1.0)
        return out.transpose(1, 2)

    ops = {
        "residual dropout": (
            lambda r, x: residual_dropout(r, x, p),
            lambda r, x: r + torch.nn.functional.dropout(x, p),
            (r, x),
            (grad,),
        ),
        "norm and residual": (
            lambda x: norm_and_residual(x, norm),
            lambda x: eager_norm(x, norm),
            (x,),
            (grad, grad),
        ),
        "gated GELU + wo": (
            lambda a, b, w: gated_gelu_linear(a, b, w, p),
            lambda a, b, w: eager_gated(a, b, w, p),
            (a, b, weight),
            (grad,),
        ),
        "attention (1 head)": (fused_attention, eager_attention, (q, k, v), (attention_grad,)),
        "3 projections": (
            lambda x: tuple(m(x) for m in grouped),
            lambda x: tuple(torch.nn.functional.linear(x, m.weight) for m in linears),
            (x,),
            (grad, grad, grad),
        ),
    }
    print(f"host time per forward + backward, {tokens} x {width}, bf16, dropout {p} (us per call, spread)")
    for name, (fused, eager, inputs, grads) in ops.items():
        f, f_spread = host_us(fused, inputs, grads)
        e, e_spread = host_us(eager, inputs, grads)
        print(
            f"  {name:20s} fused {f:7.1f} ({100 * f_spread:.0f}%)   eager {e:7.1f} ({100 * e_spread:.0f}%)"
            f"   fused/eager {f / e:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=28672)
    parser.add_argument("--d-ff", type=int, default=5120)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--host", action="store_true", help="the host's time per call instead")
    args = parser.parse_args()
    if args.host:
        host_costs(args.dropout)
        return

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()

    a, b, weight = bf16(args.tokens, args.d_ff), bf16(args.tokens, args.d_ff), bf16(D_MODEL, args.d_ff)
    grad = torch.randn(args.tokens, D_MODEL, device="cuda", dtype=torch.bfloat16)
    p = args.dropout
    gated = (a, b, weight)
    compare(
        f"gated GELU x {args.tokens} tokens x d_ff {args.d_ff}, dropout {p}, then wo to {D_MODEL}, bf16",
        {"eager": lambda *t: eager_gated(*t, p), "fused": lambda *t: gated_gelu_linear(*t, p)},
        gated,
        (grad,),
    )
    norm = torch.nn.RMSNorm(D_MODEL, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    x = bf16(args.tokens, D_MODEL)
    norm_grads = (grad, torch.randn_like(grad))
    compare(
        f"RMSNorm and residual x {args.tokens} tokens x {D_MODEL}, bf16",
        {"eager": lambda x: eager_norm(x, norm), "fused": lambda x: norm_and_residual(x, norm)},
        (x,),
        norm_grads,
    )
    if args.sweep:
        default = fused_ops.BLOCK, fused_ops.NUM_WARPS
        for block in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                fused_ops.BLOCK, fused_ops.NUM_WARPS = block, warps
                both = time_ms(
                    lambda: torch.autograd.grad(gated_gelu_linear(*gated, p), gated, grad, allow_unused=True)
                )
                mark = " (default)" if (block, warps) == default else ""
                print(
                    f"  gated GELU BLOCK {block:5d} warps {warps:2d}: forward+backward {both:6.2f} ms{mark}"
                )
        fused_ops.BLOCK, fused_ops.NUM_WARPS = default
        default = fused_ops.NORM_BWD_ROWS, fused_ops.NORM_BWD_PROGRAMS_PER_SM
        for rows in (1, 2, 4):
            for programs in (1, 2, 4, 8):
                fused_ops.NORM_BWD_ROWS, fused_ops.NORM_BWD_PROGRAMS_PER_SM = rows, programs
                both = time_ms(lambda: torch.autograd.grad(norm_and_residual(x, norm), (x,), norm_grads))
                mark = " (default)" if (rows, programs) == default else ""
                print(
                    f"  norm backward: {rows} rows at a time, {programs} programs per SM: forward+backward "
                    f"{both:6.2f} ms{mark}"
                )
        fused_ops.NORM_BWD_ROWS, fused_ops.NORM_BWD_PROGRAMS_PER_SM = default


if __name__ == "__main__":
    main()

"""T5 attention alone, forward + backward, at FLAN-T5-XL head shapes on recipe lengths (GPU).

    python3 bench/attention_kernels.py [--rows 48 --query 256 --key 256] [--variants eager,triton]

Compares the eager math T5 uses (q k^T + position bias + padding mask, softmax, p v), the trainer's Triton
kernels (trainer.kernels.attention), SDPA with the float bias as its mask, and FlexAttention with the bias
read in a score_mod, with and without a gradient for the
bias (T5 trains it), compiled with static and with dynamic shapes. Prints ms per call and the bias-gradient
agreement with eager.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.kernels import attention  # noqa: E402
from trainer.kernels.attention import t5_attention  # noqa: E402

SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages), forward and backward tried separately
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 8, 2),
    (128, 32, 4, 2),
    (64, 32, 4, 2),
    (64, 128, 4, 2),
    (128, 128, 8, 2),
    (32, 64, 4, 2),
    (64, 64, 8, 3),
]


def timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--query", type=int, default=256)
    parser.add_argument("--key", type=int, default=256)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--variants", default="", help="comma-separated name prefixes (default: all)")
    parser.add_argument("--sweep", action="store_true", help="time the Triton kernels' tile settings (SWEEP)")
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="attention dropout (Triton only; skips the eager check)"
    )
    parser.add_argument("--no-bias", action="store_true", help="no position bias (as T5's cross-attention)")
    parser.add_argument("--kernels", action="store_true", help="time each Triton kernel (torch.profiler)")
    args = parser.parse_args()
    b, h, t, s, d = args.rows, args.heads, args.query, args.key, 64
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt, requires_grad=True) for n in (t, s, s))
    bias = (torch.randn(h, t, s, device=dev, dtype=dt) * 0.5).requires_grad_()
    lengths = torch.tensor([s - (i % 8) * 4 for i in range(b)], device=dev)
    keep = torch.arange(s, device=dev)[None, :] < lengths[:, None]  # (b, s) key padding
    if args.causal:
        keep_full = (
            keep[:, None, :] & (torch.arange(t, device=dev)[:, None] >= torch.arange(s, device=dev))[None]
        )
    else:
        keep_full = keep[:, None, :].expand(b, t, s)
    float_mask = torch.zeros(b, 1, t, s, device=dev, dtype=dt).masked_fill(~keep_full[:, None], -1e9)
    grad_out = torch.randn(b, h, t, d, device=dev, dtype=dt)

    def eager():
        scores = q @ k.transpose(-1, -2) + bias + float_mask
        return F.softmax(scores.float(), dim=-1).to(dt) @ v

    def triton_kernels():
        return t5_attention(
            q, k, v, None if args.no_bias else bias, keep, causal=args.causal, dropout_p=args.dropout
        ).transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias + float_mask, scale=1.0)

    def mask_mod(bi, hi, qi, ki):
        return keep_full[bi, qi, ki]

    block_mask = create_block_mask(mask_mod, b, None, t, s, device=dev)

    def flex_fn(compiled, with_bias: bool, bias_grad: bool):
        bias_used = bias if bias_grad else bias.detach()

        def score_mod(score, bi, hi, qi, ki):
            return score + bias_used[hi, qi, ki]

        return lambda: compiled(
            q, k, v, score_mod=score_mod if with_bias else None, block_mask=block_mask, scale=1.0
        )

    static = torch.compile(flex_attention, dynamic=False)
    dynamic = torch.compile(flex_attention, dynamic=True)
    rows_dynamic = torch.compile(flex_attention, dynamic=False)

    def flex_rows_dynamic():
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 0)
        return flex_fn(rows_dynamic, True, True)()

    def flex_padded(multiple: int = 128):
        """Query and key lengths padded to `multiple` around the kernel (bounded static shapes)."""
        tp, sp = -(-t // multiple) * multiple, -(-s // multiple) * multiple
        keep_p = F.pad(keep_full, (0, sp - s, 0, tp - t))
        mask_p = create_block_mask(lambda bi, hi, qi, ki: keep_p[bi, qi, ki], b, None, tp, sp, device=dev)

        def run():
            qp, kp, vp = F.pad(q, (0, 0, 0, tp - t)), F.pad(k, (0, 0, 0, sp - s)), F.pad(v, (0, 0, 0, sp - s))
            bp = F.pad(bias, (0, sp - s, 0, tp - t))

            def score_mod(score, bi, hi, qi, ki):
                return score + bp[hi, qi, ki]

            return static(qp, kp, vp, score_mod=score_mod, block_mask=mask_p, scale=1.0)[:, :, :t]

        return run

    variants = {
        "eager math (T5)": eager,
        "triton (trainer.kernels.attention)": triton_kernels,
        "sdpa, float bias mask": sdpa,
        "flex static, no bias": flex_fn(static, False, False),
        "flex static, bias (no grad)": flex_fn(static, True, False),
        "flex static, bias + grad": flex_fn(static, True, True),
        "flex dynamic, bias + grad": flex_fn(dynamic, True, True),
        "flex rows dynamic, bias + grad": flex_rows_dynamic,
        "flex static, padded to 128": flex_padded(),
    }
    print(f"rows {b}, heads {h}, query {t}, key {s}, causal {args.causal}")
    if args.sweep:
        sweep(triton_kernels, grad_out, (q, k, v, bias))
        return 0
    if args.kernels:
        kernel_times(triton_kernels, grad_out, (q, k, v, bias))
        return 0
    wanted = [w for w in args.variants.split(",") if w]
    reference = None
    for name, fn in variants.items():
        if reference is not None and wanted and not any(name.startswith(w) for w in wanted):
            continue

        def step(fn=fn):
            for x in (q, k, v, bias):
                x.grad = None
            fn().backward(grad_out)

        fwd_ms = timed(lambda fn=fn: fn())
        total_ms = timed(step)
        step()
        grads = [x.grad.float().clone() if x.grad is not None else None for x in (q, k, v, bias)]
        if reference is None:
            reference = grads
        # With --dropout the Triton kernels compute another function than eager: nothing to compare.
        dropped = args.dropout > 0 and name.startswith("triton")
        errs = [
            "-" if g is None or dropped else f"{float((g - r).norm() / r.norm()):.1e}"
            for g, r in zip(grads, reference, strict=True)
        ]
        print(
            f"  {name:<30} fwd {fwd_ms:7.3f} ms  fwd+bwd {total_ms:7.3f} ms  "
            f"grad vs eager (q, k, v, bias) {' '.join(errs)}"
        )
    return 0


def kernel_times(fn, grad_out, inputs, reps: int = 10) -> None:
    """Milliseconds per forward + backward call of each CUDA kernel, from torch.profiler."""

    def step():
        for x in inputs:
            x.grad = None
        fn().backward(grad_out)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    for e in sorted(events, key=lambda e: -e.self_device_time_total):
        print(f"  {e.key[:70]:<70} {e.self_device_time_total / 1e3 / reps:7.3f} ms  x{e.count // reps}")


def sweep(fn, grad_out, inputs) -> None:
    """Forward time per FWD_CONFIG and forward+backward time per BWD_CONFIG (forward at the default)."""
    defaults = dict(attention.FWD_CONFIG), dict(attention.BWD_CONFIG)

    def step():
        for x in inputs:
            x.grad = None
        fn().backward(grad_out)

    for bm, bn, warps, stages in SWEEP:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        try:
            attention.FWD_CONFIG = cfg
            fwd = f"{timed(fn):7.3f}"
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot run (shared memory)
            fwd = f"failed ({type(e).__name__})"
        attention.FWD_CONFIG, attention.BWD_CONFIG = defaults[0], cfg
        try:
            total = f"{timed(step):7.3f}"
        except Exception as e:  # noqa: BLE001
            total = f"failed ({type(e).__name__})"
        attention.BWD_CONFIG = defaults[1]
        print(f"  {bm:>3} x {bn:>3}, {warps} warps, {stages} stages: fwd {fwd} ms, fwd+bwd {total} ms")
    programs = attention.BWD_PROGRAMS
    for n in (528, 1056, 2112, 4224):
        attention.BWD_PROGRAMS = n
        print(f"  BWD_PROGRAMS {n}: fwd+bwd {timed(step):7.3f} ms")
    attention.BWD_PROGRAMS = programs


if __name__ == "__main__":
    raise SystemExit(main())

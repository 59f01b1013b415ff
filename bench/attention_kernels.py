"""T5 attention alone, forward + backward, at FLAN-T5-XL head shapes on recipe lengths (GPU).

    python3 bench/attention_kernels.py [--rows 48 --query 256 --key 256]

Compares the eager math T5 uses (q k^T + position bias + padding mask, softmax, p v), SDPA with the float
bias as its mask, and FlexAttention with the bias read in a score_mod, with and without a gradient for the
bias (T5 trains it), compiled with static and with dynamic shapes. Prints ms per call and the bias-gradient
agreement with eager.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


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
        "sdpa, float bias mask": sdpa,
        "flex static, no bias": flex_fn(static, False, False),
        "flex static, bias (no grad)": flex_fn(static, True, False),
        "flex static, bias + grad": flex_fn(static, True, True),
        "flex dynamic, bias + grad": flex_fn(dynamic, True, True),
        "flex rows dynamic, bias + grad": flex_rows_dynamic,
        "flex static, padded to 128": flex_padded(),
    }
    print(f"rows {b}, heads {h}, query {t}, key {s}, causal {args.causal}")
    reference = None
    for name, fn in variants.items():

        def step(fn=fn):
            for x in (q, k, v, bias):
                x.grad = None
            fn().backward(grad_out)

        fwd_ms = timed(lambda fn=fn: fn())
        total_ms = timed(step)
        step()
        if reference is None:
            reference = bias.grad.float().clone()
        err = (
            "-"
            if bias.grad is None
            else f"{float((bias.grad.float() - reference).norm() / reference.norm()):.1e}"
        )
        print(f"  {name:<30} fwd {fwd_ms:7.3f} ms  fwd+bwd {total_ms:7.3f} ms  bias grad vs eager {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a decoding step's time goes: the attention kernel's launch settings, and one engine step of
FLAN-T5-XL's shape kernel by kernel.

    python3 bench/decode_kernels.py --sweep      # trainer.kernels.decode_attention: BLOCK x num_warps
    python3 bench/decode_kernels.py --profile    # one step of 72 rows: replayed time, then kernels (eager)

--sweep times the kernel (triton.testing.do_bench, median) on the self- and cross-attention of a step of
72 rows at XL's 32 heads of 64 (self: 128 cached positions each, cross: prompts of 80-195 tokens) and gives
the bandwidth it reaches (keys and values read once) beside the copy bandwidth measured here.
--profile fills an engine (trainer.eval.decoding) with 72 prompts, times its replayed step with CUDA events,
says the step's floor (decoder weights, head and the caches' valid part, read once), then profiles eager steps
with torch.profiler and prints the kernels by GPU time.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from trainer.kernels.decode_attention import CROSS_CONFIG, SELF_CONFIG, decode_attention
from trainer.model.t5_decoding import decode_attention_reference

HEADS, HEAD_DIM, ROWS = 32, 64, 72


def copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms / 1e3)


def sweep() -> None:
    bandwidth = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {
        # the self-attention's step: 128 cached positions and the new one, which the kernel writes
        "self (128 + 1 positions, bias)": (257, torch.full((ROWS,), 129, device="cuda"), True),
        "cross (prompts of 80-195)": (
            195,
            torch.randint(80, 196, (ROWS,), device="cuda", generator=g),
            False,
        ),
    }
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); {ROWS} rows x {HEADS} heads x {HEAD_DIM}"
    )
    print(f"{'case':<28} {'BLOCK':>5} {'warps':>5} {'us':>8} {'TB/s':>6} {'of copy':>8}")
    for name, (length, lengths, with_bias) in cases.items():
        lengths = lengths.to(torch.int32)
        q = torch.randn(ROWS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(ROWS, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        bias = (
            torch.randn(HEADS, length, device="cuda", dtype=torch.bfloat16, generator=g)
            if with_bias
            else None
        )
        new = (torch.randn_like(q), torch.randn_like(q)) if with_bias else None
        ref = decode_attention_reference(q.float(), k.float(), v.float(), lengths, bias, new)
        read = int(lengths.sum()) * HEADS * HEAD_DIM * 2 * 2
        for block in (32, 64, 128):
            for warps in (1, 2, 4, 8):
                config = dict(BLOCK=block, num_warps=warps)
                out = decode_attention(q, k, v, lengths, bias, new, config)
                err = float((out.float() - ref).norm() / ref.norm())
                assert err < 1e-2, (config, err)
                args = (q, k, v, lengths, bias, new, config)
                us = 1e3 * triton.testing.do_bench(lambda a=args: decode_attention(*a), return_mode="median")
                mark = " (default)" if config == (SELF_CONFIG if with_bias else CROSS_CONFIG) else ""
                print(
                    f"{name:<28} {block:>5} {warps:>5} {us:>8.1f} {read / us / 1e6:>6.2f} "
                    f"{read / (us / 1e6) / bandwidth:>7.0%}{mark}"
                )


def profile() -> None:
    from transformers import AutoModelForSeq2SeqLM

    from trainer.eval.decoding import Decoding, DecodingEngine
    from trainer.eval.generate import prepare_for_generation
    from trainer.model.swaps import use_fused_t5_ops
    from trainer.model.tiny_model import flan_t5_config

    bandwidth = copy_bandwidth()
    config = flan_t5_config("xl")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.bfloat16)
    use_fused_t5_ops(model)
    model = prepare_for_generation(model)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(2, 32000, (int(n),), generator=g).tolist() for n in torch.randint(80, 196, (ROWS,))
    ]
    decoding = Decoding(max_new_tokens=256, min_new_tokens=256)

    def filled(graphs: bool) -> DecodingEngine:
        engine = DecodingEngine(model, slots=ROWS, max_source_tokens=195, max_new_tokens=256, graphs=graphs)
        engine.start(range(ROWS), prompts, [decoding] * ROWS)
        engine.step(120)  # 120 positions cached, as mid-way through 256 new tokens
        return engine

    with torch.no_grad():
        engine = filled(graphs=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.step(16)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 16
        d, inner, ff = config.d_model, config.num_heads * config.d_kv, config.d_ff * 3
        weights = 2 * (config.num_decoder_layers * (6 * d * inner + d * ff) + config.vocab_size * d)
        kv = engine.parts.kv_bytes_per_token // 2 * (sum(map(len, prompts)) + ROWS * 137)
        floor_ms = (weights + kv) / bandwidth * 1e3
        print(
            f"replayed step, {ROWS} rows at ~136 positions: {ms:.2f} ms; floor {floor_ms:.2f} ms "
            f"({weights / 2**30:.2f} GiB weights + {kv / 2**30:.2f} GiB caches at {bandwidth / 1e12:.2f} "
            "TB/s): "
            f"{floor_ms / ms:.0%} of the bound"
        )
        eager = filled(graphs=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            eager.step(3)
            torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 3
    print(f"eager step, GPU time of its kernels: {total / 1e3:.2f} ms")
    rows = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:20]
    for e in rows:
        print(f"  {e.device_time_total / 3 / 1e3:7.3f} ms  {e.count // 3:5d}x  {e.key[:90]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.sweep:
        sweep()
    if args.profile:
        profile()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

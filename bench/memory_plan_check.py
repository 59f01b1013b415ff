"""Calibrate `trainer.memory_plan` against real peaks: predicted vs measured, one JSON line per config.

On a GPU (one invocation, a few minutes on an H100):

    python bench/memory_plan_check.py

builds a FLAN-T5-XL-shaped model from T5Config in bf16 directly on CUDA (random init, no hub), then for each
config runs real micro-steps (forward + backward with non-reentrant gradient checkpointing on every block,
2 micro-batches accumulated per optimizer step, 2 optimizer steps) on random tokens at fixed rows x lengths,
and compares `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` with the plan.

Without a GPU, `python bench/memory_plan_check.py --device cpu --tiny` runs the same code on a tiny shape and
measures the peak of live tensor bytes through the dispatcher instead (dropout masks are then in the compute
dtype, which the plan is told).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Before CUDA initialises: the allocator setting the trainer uses by default.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
# Runs from a checkout without an install (the package needs no compiled part for this).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402

from trainer.memory_plan import GIB, LiveTensorBytes, ModelShape, plan_memory  # noqa: E402

XL = dict(
    d_model=2048, d_ff=5120, d_kv=64, num_heads=32, num_layers=24, num_decoder_layers=24, vocab_size=32128
)
TINY = dict(d_model=64, d_ff=160, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=512)

# (name, optimizer, bf16_update, rows, source length, target length, attention)
XL_CONFIGS = [
    ("adamw-kahan 8k", "adamw", "kahan", 16, 128, 384, "eager"),
    ("adamw-kahan 16k", "adamw", "kahan", 32, 128, 384, "eager"),
    ("adafactor 16k long rows", "adafactor", "naive", 16, 512, 512, "eager"),
    ("adafactor 32k", "adafactor", "naive", 64, 128, 384, "eager"),
    ("adamw-kahan 16k sdpa", "adamw", "kahan", 32, 128, 384, "sdpa"),
]
TINY_CONFIGS = [
    ("adamw-kahan", "adamw", "kahan", 8, 32, 96, "eager"),
    ("adamw-kahan long", "adamw", "kahan", 4, 128, 128, "eager"),
    ("adafactor", "adafactor", "naive", 16, 24, 64, "eager"),
]


def build_model(shape_kwargs: dict, device: str) -> T5ForConditionalGeneration:
    config = T5Config(
        **shape_kwargs,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = T5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(torch.float32)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()), "model was not built in bf16"
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def make_optimizer(model, optimizer: str, bf16_update: str):
    if optimizer == "adamw":
        import optimi

        return optimi.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, kahan_sum=bf16_update == "kahan")
    from transformers.optimization import Adafactor

    return Adafactor(
        model.parameters(), lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False
    )


def run_config(model, name, optimizer, bf16_update, rows, src, tgt, attn, device, steps=2, accumulation=2):
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    opt = make_optimizer(model, optimizer, bf16_update)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    cuda = device == "cuda"
    tracker = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        tracker = LiveTensorBytes(list(model.parameters())).__enter__()
    start = time.perf_counter()
    try:
        for _ in range(steps):
            for _ in range(accumulation):
                ids = torch.randint(2, vocab, (rows, src), generator=gen).to(device)
                # Padding in one row, as longest-padding batches have: the masks then take their real shapes.
                mask = torch.ones_like(ids)
                mask[0, -max(1, src // 10) :] = 0
                labels = torch.randint(2, vocab, (rows, tgt), generator=gen).to(device)
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
                (out.loss / accumulation).backward()
                del out
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    if cuda:
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    else:
        allocated = reserved = tracker.peak
    seconds = time.perf_counter() - start
    del opt
    model.zero_grad(set_to_none=True)

    plan = plan_memory(
        ModelShape.from_config(model.config),
        optimizer=optimizer,
        bf16_update=bf16_update,
        rows=rows,
        src_len=src,
        tgt_len=tgt,
        device="cuda" if cuda else "cpu",
        attn_implementation=attn,
    )
    return {
        "config": name,
        "optimizer": optimizer,
        "bf16_update": bf16_update,
        "rows": rows,
        "src_len": src,
        "tgt_len": tgt,
        "tokens": rows * (src + tgt),
        "attn": attn,
        "device": device,
        "peak_moment": plan.peak_moment,
        "predicted_allocated_bytes": plan.allocated,
        "measured_allocated_bytes": allocated,
        "predicted_allocated_gib": round(plan.allocated / GIB, 3),
        "measured_allocated_gib": round(allocated / GIB, 3),
        "ratio_allocated": round(plan.allocated / allocated, 3),
        "predicted_reserved_gib": round(plan.peak / GIB, 3),
        "measured_reserved_gib": round(reserved / GIB, 3),
        "ratio_reserved": round(plan.peak / reserved, 3),
        "components_gib": {k: round(v / GIB, 3) for k, v in plan.components().items()},
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny T5 shape (for the CPU path)")
    parser.add_argument("--only", nargs="*", help="run only configs whose name contains one of these")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny", file=sys.stderr)
        return 2
    shape, configs = (TINY, TINY_CONFIGS) if args.tiny else (XL, XL_CONFIGS)
    if args.only:
        configs = [c for c in configs if any(o in c[0] for o in args.only)]
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny bf16 models: one thread is fastest, most of all on shared cores
    torch.manual_seed(0)
    model = build_model(shape, args.device)
    if args.device == "cuda":
        print(
            f"# {torch.cuda.get_device_name()}, alloc conf {os.environ['PYTORCH_CUDA_ALLOC_CONF']}",
            flush=True,
        )
    results = []
    for name, optimizer, update, rows, src, tgt, attn in configs:
        try:
            result = run_config(model, name, optimizer, update, rows, src, tgt, attn, args.device)
        except torch.OutOfMemoryError as e:
            result = {"config": name, "error": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
        print(json.dumps(result), flush=True)
        results.append(result)

    print()
    columns = [
        "config",
        "tokens",
        "peak at",
        "pred alloc GiB",
        "meas alloc GiB",
        "ratio",
        "pred reserved GiB",
    ]
    columns += ["meas reserved GiB", "ratio"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | {r['error']} |")
            continue
        cells = [r["config"], r["tokens"], r["peak_moment"], r["predicted_allocated_gib"]]
        cells += [r["measured_allocated_gib"], r["ratio_allocated"], r["predicted_reserved_gib"]]
        cells += [r["measured_reserved_gib"], r["ratio_reserved"]]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    ok = [r for r in results if "error" not in r and abs(r["ratio_allocated"] - 1) <= 0.10]
    print(f"\n{len(ok)}/{len(results)} configs within 10% of the measured peak allocated")
    return 0


if __name__ == "__main__":
    sys.exit(main())

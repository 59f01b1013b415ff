"""Training throughput: Hugging Face Seq2SeqTrainer (the peer, bench/hf_peer.py) against our trainer, same
GPU and data, in one call.

    python3 bench/train_throughput.py                 # GPU: the tuned peer, the rtx5090 preset, loss check
    python3 bench/train_throughput.py --peers tuned --variants preset,ours_32k   # the preset and padded rows
    python3 bench/train_throughput.py --peers '' --variants ours_32k,ours_packed   # packing against padding
    python3 bench/train_throughput.py --tiny          # CPU: a tiny shape through the same code

Data: synthetic recipe-length token sequences (bench_run.make_records: 4096 records, source ~
lognormal(median 96, sigma 0.35), target ~ lognormal(median 256, sigma 0.45), random ids). The peer trains
on them as token lists; ours reads them through the real Rust loader: the records are written as JSONL
`source`/`target` pairs of words `t<id>` with a WordLevel tokenizer.json that maps each word back to its id
and appends `</s>`: the loader's token-budget batching runs on exactly the peer's tokens.

Model: FLAN-T5-XL's shape (d_model 2048, d_ff 5120, 24+24 layers, 32 heads x 64, vocab 32128, gated-GELU),
random init in bf16, gradient checkpointing, both sides capped at 32 GiB with set_per_process_memory_fraction.
Effective batch: the peer's 128 samples per optimizer step, matched in real tokens by ours (the accumulation
is set to match; `preset` takes every other batching and optimizer key from configs/flan-t5-xl-rtx5090.yaml,
so it follows the file). Each peer preset
and each of our variants runs in its own process (clean memory counters).

Reported per config: real (non-pad) tokens/s, samples/s, MFU and peak allocated memory, and the ratio to the
first peer named in --peers (default: `tuned`, the best Hugging Face setup known: Adafactor, bs 32, GA 4,
group_by_length, SDPA). MFU counts 6 x [(encoder + cross-attention K/V params) x source tokens + (rest of the
decoder + LM head) x target tokens] per sample (trainer.plan.gpu_specs.flops_per_token), real tokens only,
checkpoint recompute not counted, against the GPU's dense bf16 rate (989 TFLOP/s on an H100 or H200). The
loss check runs one batch through the eager HF reference
(`model(..., labels=...).loss`) and through our step's loss (Triton attention, fused ops, chunked
cross-entropy), same
weights, dropout off: they must agree within bf16 tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_run import (
    QUIET_RUN,
    VOCAB,
    make_records,
    mean_lengths,
    read_preset,
    run_one_in_subprocess,
    train_rows,
    write_data,
)

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

PEER_SCRIPT = Path(__file__).resolve().parent / "hf_peer.py"
# The preset's keys that decide the step's speed and memory (the data, model and run length are the bench's).
PRESET_KEYS = (
    "dtype",
    "gradient_checkpointing",
    "optimizer",
    "bf16_update",
    "learning_rate",
    "lr_scheduler_type",
    "pad_to_multiple_of",
    "max_tokens",
    "packing",
    "cuda_graphs",
    "attn_implementation",
    "decoder_blocks_without_checkpointing",
    "encoder_blocks_without_checkpointing",
)
PEER_SAMPLES_PER_STEP = 128  # every hf_peer preset: bs 32 x GA 4, bs 16 x GA 8, bs 8 x GA 16
# Our variants: trainer config overrides on top of BASE.
BASE = dict(
    dtype="bfloat16",
    gradient_checkpointing=True,
    optimizer="adafactor",
    bf16_update="kahan",
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    pad_to_multiple_of=8,
    max_tokens=16384,
)


def preset_values() -> dict:
    """The rtx5090 preset's speed and memory keys, as the file sets them."""
    values = read_preset()
    return {k: values[k] for k in PRESET_KEYS if k in values}


PRESET_VALUES = preset_values()
VARIANTS = {
    "preset": PRESET_VALUES,  # what `docker compose up` runs
    # The preset with AdamW (Kahan bf16 weights) at the quality benchmark's rate: 10 GiB of moments more, so
    # the memory plan recomputes most blocks at 32 GiB (docs/quality.md).
    "preset_adamw": PRESET_VALUES | {"optimizer": "adamw", "learning_rate": 3e-4},
    # The same with 8-bit moments (stochastically rounded bf16 weights, no Kahan buffer): Adafactor's memory.
    "preset_adamw8bit": PRESET_VALUES | {"optimizer": "adamw8bit", "learning_rate": 3e-4},
    "ours": {},
    "ours_compile": {"torch_compile": True},
    "ours_empty_cache_every_step": {"empty_cache_steps": 1},
    "ours_8k": {"max_tokens": 8192},
    "ours_32k": {"max_tokens": 32768},
    "ours_packed": {"max_tokens": 32768, "packing": True},  # ours_32k with packed rows (docs/loader.md)
    "ours_packed_16k": {"max_tokens": 16384, "packing": True},  # half the rows: more blocks un-checkpointed
    # 8k-token packed micro-batches replayed as CUDA graphs (host launches no longer the limit); the memory
    # plan keeps 22 of the 24 decoder blocks un-checkpointed at this size (recipes packed by the loader).
    "ours_packed_graphs": {"max_tokens": 8192, "packing": True, "cuda_graphs": True},
    "ours_32k_all_checkpointed": {"max_tokens": 32768, "decoder_blocks_without_checkpointing": 0},
    "ours_32k_compile": {"max_tokens": 32768, "torch_compile": True},
    "ours_64k": {"max_tokens": 65536},
    "ours_eager": {"attn_implementation": "eager"},
    "ours_eager_32k": {"attn_implementation": "eager", "max_tokens": 32768},
    "ours_sdpa": {"attn_implementation": "sdpa"},
    "ours_sdpa_compile": {"attn_implementation": "sdpa", "torch_compile": True},
    "ours_adamw": {"optimizer": "adamw", "bf16_update": "naive", "learning_rate": 1e-4, "max_tokens": 8192},
}


def peak_flops() -> float:
    """This GPU's dense bf16 rate (trainer.plan.gpu_specs); an H100's 989 TFLOP/s for a GPU it does not
    know."""
    import torch

    from trainer.plan.gpu_specs import gpu_spec

    try:
        return gpu_spec(torch.cuda.get_device_name()).bf16_flops if torch.cuda.is_available() else 989e12
    except ValueError:
        return 989e12


def flops_per_token_pair(shape: str) -> tuple[float, float]:
    """Training FLOPs per real source token and per real target token of the benchmark's model."""
    from trainer.model.tiny_model import flan_t5_config
    from trainer.plan.gpu_specs import flops_per_token

    return flops_per_token(flan_t5_config(shape, vocab_size=VOCAB))


# -------------------------------------------------------------------------------------------- subprocesses


def run_ours(
    variant: str, work: Path, steps: int, warmup: int, tiny: bool, profile_dir: str | None = None
) -> dict:
    """One of our variants through trainer.run.train.train; steady-state numbers from its train log.
    profile_dir: also profile two steps after the timed ones (trainer.report.profiling), report copied
    there."""
    import torch

    from trainer.config import TrainConfig
    from trainer.model.model_shape import load_shape
    from trainer.plan.memory_plan import budget_peak, plan_kwargs, row_lengths
    from trainer.report.step_meter import SUMMARY
    from trainer.run.train import train

    shape = "tiny" if tiny else "xl"
    records = make_records(n=512 if tiny else 4096)
    data, model_dir = write_data(work, records, shape)
    values = dict(BASE) | VARIANTS[variant]
    mean_tokens = sum(mean_lengths(records))
    # The peer's effective batch in real tokens; our batches are >= 95% real tokens.
    accumulation = max(1, round(PEER_SAMPLES_PER_STEP * mean_tokens / (values["max_tokens"] * 0.96)))
    if tiny:  # checks the code path only
        accumulation = 2
        values.update(max_tokens=2048, dtype="float32" if not torch.cuda.is_available() else "bfloat16")
    values.update(
        model_name_or_path=str(model_dir),
        random_init=True,
        train_files=[str(data)],
        max_source_length=512,
        max_target_length=512,
        gradient_accumulation_steps=accumulation,
        output_dir=str(work / "out"),
        max_steps=steps + (2 if profile_dir else 0),  # profiled steps come after the timed ones
        progress_bar=False,
        **QUIET_RUN,
        gpu_memory_limit_gib=32.0 if torch.cuda.is_available() else None,
        profile_steps=2 if profile_dir else 0,
        profile_start_step=steps,
    )
    # The trainer plans what the config leaves open (decoder blocks without checkpointing, on the packed rows
    # the loader chooses) and writes its prediction into the run summary.
    cfg = TrainConfig.from_dict(values, source=variant)
    rc = train(cfg)
    if profile_dir and (work / "out" / "profile" / "kernels.txt").exists():
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "out" / "profile" / "kernels.txt", Path(profile_dir) / f"{variant}.txt")
    rows = train_rows(work / "out")[:steps]
    summary = json.loads((work / "out" / SUMMARY).read_text())
    blocks = tuple(summary.get(f"{stack}_blocks_without_checkpointing") for stack in ("decoder", "encoder"))
    planned = summary.get("planned_peak_gib")  # the worst case the trainer planned for
    typical = planned
    if planned is not None and not cfg.packing:  # padded batches: typical recipe rows as well
        src_cap, tgt_cap = row_lengths(cfg)
        kw = plan_kwargs(cfg, blocks)
        typical = (
            budget_peak(
                load_shape(str(model_dir)),
                cfg.max_tokens,
                src_cap=src_cap,
                tgt_cap=tgt_cap,
                worst_case=False,
                **kw,
            ).peak
            / 2**30
        )
    timed = rows[warmup:]
    seconds = timed[-1]["time"] - rows[warmup - 1]["time"]
    src = sum(r["source_tokens"] for r in timed)
    tgt = sum(r["target_tokens"] for r in timed)
    samples = sum(r["samples"] for r in timed)
    padded = sum(r["padded_tokens"] for r in timed)
    per_src, per_tgt = flops_per_token_pair(shape)
    return dict(
        config=variant,
        ok=rc == 0,
        real_tok_s=(src + tgt) / seconds,
        samples_s=samples / seconds,
        mfu=(per_src * src + per_tgt * tgt) / seconds / peak_flops(),
        pad_frac=1 - (src + tgt) / padded,
        peak_alloc_gib=summary.get("peak_allocated_gib"),
        peak_reserved_gib=summary.get("peak_reserved_gib"),
        tokens_per_step=(src + tgt) / len(timed),
        accumulation=accumulation,
        max_tokens=cfg.max_tokens,
        blocks_without_checkpointing=blocks,
        packed_rows=summary.get("packed_rows"),
        optimizer=f"{cfg.optimizer} ({cfg.bf16_update})",
        final_loss=rows[-1]["loss"],
        oom_split=summary.get("oom_split"),
        plan_typical_gib=typical,
        plan_worst_gib=planned,
    )


def loss_check(tiny: bool) -> dict:
    """One batch, same weights, dropout off: the eager HF loss vs our step's loss."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.fused_t5 import use_triton_attention
    from trainer.model.loss import token_loss_sum
    from trainer.model.swaps import use_fused_t5_ops
    from trainer.model.tiny_model import flan_t5_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = "tiny" if tiny else "xl"
    config = flan_t5_config(shape, vocab_size=VOCAB)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForSeq2SeqLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    records = make_records(n=8, seed=1)
    src_len, tgt_len = max(len(s) for s, _ in records), max(len(t) for _, t in records)
    ids = torch.zeros(len(records), src_len, dtype=torch.long)
    labels = torch.full((len(records), tgt_len), -100, dtype=torch.long)
    for i, (s, t) in enumerate(records):
        ids[i, : len(s)], labels[i, : len(t)] = torch.tensor(s), torch.tensor(t)
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        reference = float(model(**batch).loss)
        if device == "cuda":  # the trainer's attention kernels (eager attention stays on CPU)
            use_triton_attention(model)
        use_fused_t5_ops(model)
        ours = float(token_loss_sum(model, batch)) / int((labels != -100).sum())
    rel = abs(ours - reference) / abs(reference)
    return dict(config="loss check", reference=reference, ours=ours, rel_diff=rel, ok=rel < 1e-2)


def run_peer(preset: str, tiny: bool, timeout: float) -> dict:
    """bench/hf_peer.py --preset `preset` in its own process; its RESULT line."""
    cmd = [sys.executable, str(PEER_SCRIPT), "--preset", preset]
    if tiny:
        cmd += ["--tiny", "--steps", "3", "--warmup", "1"]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    except subprocess.TimeoutExpired:
        return {"config": f"hf_{preset}", "ok": False, "error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"config": f"hf_{preset}", "ok": False, "error": (proc.stdout + proc.stderr)[-1500:]}


# ------------------------------------------------------------------------------------------------ report


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shape (CPU check of the script)")
    parser.add_argument(
        "--variants",
        default="preset",
        help=f"ours: of {', '.join(VARIANTS)} (preset: configs/flan-t5-xl-rtx5090.yaml's keys)",
    )
    parser.add_argument(
        "--peers",
        default="tuned",
        help="bench/hf_peer.py presets, the first one the reference of the ratios ('' for none)",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    parser.add_argument("--out", help="directory for the full results (train_throughput.json)")
    parser.add_argument("--profile-dir", help="profile two steps of each of our variants, kernel tables here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant or "loss-check"
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
            if args.one == "loss-check":
                result = loss_check(args.tiny)
            else:
                result = run_ours(args.one, Path(tmp), args.steps, args.warmup, args.tiny, args.profile_dir)
        Path(args.result).write_text(json.dumps(result))
        return 0

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}; torch {torch.__version__}", flush=True)
    results = []
    peers = [p for p in args.peers.split(",") if p]
    for peer in peers:
        t0 = time.time()
        results.append(run_peer(peer, args.tiny, timeout=300) | {"side": "peer"})
        print(f"{peer}: {time.time() - t0:.0f} s {json.dumps(results[-1])}", flush=True)
    extra = ["--tiny"] if args.tiny else []
    steps = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.profile_dir:
        steps += ["--profile-dir", args.profile_dir]
    for variant in [v for v in args.variants.split(",") if v]:
        t0 = time.time()
        results.append(
            run_one_in_subprocess(__file__, ["--one", variant, *steps, *extra], timeout=480)
            | {"side": "ours"}
        )
        print(f"{variant}: {time.time() - t0:.0f} s {json.dumps(results[-1])}", flush=True)
    check = run_one_in_subprocess(__file__, ["--one", "loss-check", *extra], timeout=240)
    print(f"loss check: {json.dumps(check)}", flush=True)

    from trainer.model.tiny_model import flan_t5_config
    from trainer.plan.gpu_specs import flops_per_real_token

    model_config = flan_t5_config("tiny" if args.tiny else "xl", vocab_size=VOCAB)
    real_token_flops = flops_per_real_token(model_config, *mean_lengths(make_records()))
    reference = next((r for r in results if r["side"] == "peer"), None)
    best = reference["real_tok_s"] if reference and reference.get("ok") else None
    print()
    columns = ["config", "real tok/s", "samples/s", "MFU", "padding", "peak alloc / reserved", "vs peer"]
    print("| " + " | ".join([*columns, "plan: typical / worst"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if not r.get("ok"):
            print(f"| {r['config']} | failed: {str(r.get('error', ''))[-200:]!r} | | | | | |")
            continue
        mfu = r.get("mfu", r["real_tok_s"] * real_token_flops / peak_flops())
        padding = f"{100 * r['pad_frac']:.1f}%" if "pad_frac" in r else "-"
        ratio = f"{r['real_tok_s'] / best:.2f}x" if best else "-"
        print(
            f"| {r.get('label', r['config'])} | {r['real_tok_s']:,.0f} | {r['samples_s']:.1f} "
            f"| {100 * mfu:.1f}% | {padding} | {_peak(r)} | {ratio} | {_plan(r)} |"
        )
    if reference is not None:
        print(f"\nvs peer: ratios to {reference.get('label', reference['config'])} (bench/hf_peer.py)")
    if check.get("ok") is not None and "reference" in check:
        print(
            f"\nloss check (one batch, dropout off): HF eager {check['reference']:.5f}, "
            f"ours {check['ours']:.5f}, "
            f"relative difference {check['rel_diff']:.2e} -> {'ok' if check['ok'] else 'MISMATCH'}"
        )
    else:
        print(f"\nloss check failed: {check.get('error', '')[-500:]}")
    if args.out:
        everything = {"device": device, "results": results, "loss_check": check}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "train_throughput.json").write_text(json.dumps(everything, indent=2) + "\n")
    return 0 if check.get("ok") else 1


def _plan(r: dict) -> str:
    """The memory plan's typical and worst-case prediction, the typical one relative to the measured peak
    (reserved: what the card must hold, a CUDA graph's memory pool included)."""
    if r.get("plan_typical_gib") is None:
        return "-"
    measured = r.get("peak_reserved_gib")
    err = f" ({100 * (r['plan_typical_gib'] / measured - 1):+.0f}%)" if measured else ""
    return f"{r['plan_typical_gib']:.1f}{err} / {r['plan_worst_gib']:.1f} GiB"


def _peak(r: dict) -> str:
    if r.get("peak_alloc_gib") is None:
        return "n/a (CPU)"
    return f"{r['peak_alloc_gib']:.1f} / {r['peak_reserved_gib']:.1f} GiB"


if __name__ == "__main__":
    raise SystemExit(main())

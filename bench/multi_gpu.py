"""Several GPUs through torchrun: DDP scaling on packed rows; FSDP2 with the preset's Adafactor + Kahan.

    python3 bench/multi_gpu.py                            # 2 GPUs: ddp1, ddp2, fsdp2, then the table
    python3 bench/multi_gpu.py --tiny --device cpu        # tiny shape, gloo, CPU: checks the script itself

Runs, each `torchrun --standalone --nproc_per_node=N` over the trainer's own loop (`trainer.train.train`, as
`torchrun -m trainer train` does), on bench_run's recipe-length records (the data of
bench/train_throughput.py) read by the Rust loader, rank-sharded, every process capped at 32 GiB:

- `ddp1`, `ddp2`: FLAN-T5-XL's shape (random init, bf16 weights) with the rtx5090 preset's settings
  (Adafactor with Kahan-compensated bf16 updates, gradient checkpointing, 32k-token micro-batches x 2) on
  packed rows (`packing: true`), the same per-GPU micro-batch on 1 and on 2 GPUs. DDP scaling efficiency =
  real tokens/s on 2 GPUs / (2 x real tokens/s on 1 GPU).
- `fsdp2`: the same on 2 GPUs under FSDP2 (`distributed_strategy: fsdp`). It sees the same global batches
  as `ddp2` from the same initial weights, so its per-step losses are compared with ddp2's (DDP equals one
  process over the same global batch: tests/test_distributed.py).
- `fsdp2_adamw` (not run by default): FLAN-T5-XL with fp32 weights and torch AdamW (fp32 states) under FSDP2.

tokens/s are real (non-pad) source + target tokens of all ranks over the steps after `--warmup`, from the
train log's per-step times. NCCL's NVLink multicast is off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1): some multi-GPU hosts cannot use it. Needs this package (or its wheel),
torch and transformers; no network, no W&B, no torch-optimi.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_run import QUIET_RUN, train_rows

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

PRESET = dict(  # configs/flan-t5-xl-rtx5090.yaml's training settings, on packed rows
    dtype="bfloat16",
    optimizer="adafactor",
    bf16_update="kahan",
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    gradient_checkpointing=True,
    max_source_length=512,
    max_target_length=512,
    packing=True,
    random_init=True,
    progress_bar=False,
    **QUIET_RUN,
)
RUNS = {
    # name: (processes, config overrides)
    "ddp1": (1, {}),
    "ddp2": (2, {}),
    "fsdp2": (2, dict(distributed_strategy="fsdp")),
    "fsdp2_adamw": (
        2,
        dict(distributed_strategy="fsdp", dtype="float32", optimizer="adamw", learning_rate=1e-4),
    ),
}
DEFAULT_RUNS = ["ddp1", "ddp2", "fsdp2"]


def worker(config: Path) -> int:
    """One rank (under torchrun): train, then record this rank's peak GPU memory."""
    import logging

    import torch
    import yaml

    from trainer.config import TrainConfig
    from trainer.train import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = TrainConfig.from_dict(yaml.safe_load(config.read_text()), source=str(config))
    rc = train(cfg)
    mem = {"rank": int(os.environ.get("RANK", 0)), "exit_code": rc}
    if torch.cuda.is_available():
        mem["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 1024**3
        mem["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 1024**3
    (Path(cfg.output_dir) / f"rank-{mem['rank']}.json").write_text(json.dumps(mem))
    return rc


def steady_tokens_per_s(rows: list[dict], warmup: int) -> float:
    """Real tokens of all ranks per second over the steps after `warmup` (train log, rank 0's clock)."""
    timed = rows[warmup:]  # warmup >= 1: the first timed step starts at the end of the one before
    tokens = sum(r["source_tokens"] + r["target_tokens"] for r in timed)
    return tokens / (timed[-1]["time"] - rows[warmup - 1]["time"])


def launch(name: str, nproc: int, values: dict, tmp: Path, device: str, warmup: int) -> dict:
    import yaml

    out = tmp / name
    values = dict(values, output_dir=str(out))
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(values))
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [__file__, "--worker", str(config)]
    t0 = time.time()
    print(f"--- {name}: {nproc} process(es): {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0:
        raise SystemExit(f"{name} failed with exit code {rc}")
    summary = json.loads((out / "run_summary.json").read_text())
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]
    rows = train_rows(out)
    return {
        "run": name,
        "processes": nproc,
        "strategy": values.get("distributed_strategy", "ddp"),
        "optimizer": f"{values['optimizer']}, {values['dtype']} weights",
        "wall_s": time.time() - t0,
        "steps": summary["steps"],
        "tokens_per_s": steady_tokens_per_s(rows, max(1, min(warmup, len(rows) - 1))),
        "real_token_share": sum(r["source_tokens"] + r["target_tokens"] for r in rows)
        / sum(r["padded_tokens"] for r in rows),
        "losses": [r["loss"] for r in rows],
        "peak_allocated_gib": [r.get("peak_allocated_gib") for r in ranks],
        "peak_reserved_gib": [r.get("peak_reserved_gib") for r in ranks],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one rank, under torchrun
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--max-tokens", type=int, default=32768, help="per-GPU micro-batch token budget")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--records", type=int, default=8192)
    parser.add_argument("--tiny", action="store_true", help="tiny shape (checks the script)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)

    from bench_run import make_records, write_data

    shape = "tiny" if args.tiny else "xl"
    results = []
    with tempfile.TemporaryDirectory(prefix="multi-gpu-") as tmp:
        tmp = Path(tmp)
        data, model_dir = write_data(tmp, make_records(args.records), shape)
        base = dict(
            PRESET,
            model_name_or_path=str(model_dir),
            train_files=[str(data)],
            max_steps=args.steps,
            max_tokens=args.max_tokens,
            gradient_accumulation_steps=args.accumulation,
            gpu_memory_limit_gib=32.0 if args.device == "cuda" else None,
        )
        for name in args.runs:
            nproc, overrides = RUNS[name]
            values = dict(base, **overrides)
            if args.device == "cpu":
                values.update(dtype="float32", optimizer="adamw")  # CPU check: plain fp32 AdamW everywhere
            result = launch(name, nproc, values, tmp, args.device, args.warmup)
            results.append(result)
            print(json.dumps(result), flush=True)
            if args.json:  # after every run, so a run cut short keeps the ones before
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")

    by_name = {r["run"]: r for r in results}
    print(
        f"\nFLAN-T5-{shape} shape, {args.device}, packed rows, per-GPU micro-batch {args.max_tokens} "
        f"tokens x {args.accumulation} accumulation, {args.steps} steps ({args.warmup} warm-up)\n"
    )
    print("| run | GPUs | strategy | optimizer | real tokens/s | real tokens | peak per GPU (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        peaks = ", ".join(f"{p:.1f}" if p is not None else "n/a" for p in r["peak_allocated_gib"])
        print(
            f"| {r['run']} | {r['processes']} | {r['strategy']} | {r['optimizer']} | "
            f"{r['tokens_per_s']:,.0f} | {100 * r['real_token_share']:.1f}% | {peaks} |"
        )
    summary = {}
    if "ddp1" in by_name and "ddp2" in by_name:
        eff = by_name["ddp2"]["tokens_per_s"] / (2 * by_name["ddp1"]["tokens_per_s"])
        print(f"\nDDP scaling efficiency (2 GPUs / 2 x 1 GPU): {100 * eff:.1f}%")
        summary["ddp_scaling_efficiency"] = eff
    if "ddp2" in by_name and "fsdp2" in by_name:
        pairs = list(zip(by_name["ddp2"]["losses"], by_name["fsdp2"]["losses"], strict=True))
        worst = max(abs(f - d) / d for d, f in pairs)
        print(
            f"FSDP2 vs DDP on the same global batches: loss {pairs[0][1]:.4f} -> {pairs[-1][1]:.4f} "
            f"(DDP {pairs[0][0]:.4f} -> {pairs[-1][0]:.4f}), largest per-step difference {100 * worst:.2f}%"
        )
        summary["fsdp2_vs_ddp2_max_rel_loss_diff"] = worst
    if args.json:
        Path(args.json).write_text(json.dumps(results + [summary], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Several GPUs through torchrun: DDP scaling efficiency; FSDP2 training FLAN-T5-XL with fp32 AdamW states.

    python3 bench/multi_gpu.py                            # 2 GPUs: all three runs below, then the table
    python3 bench/multi_gpu.py --tiny --device cpu        # tiny shape, gloo, CPU: checks the script itself

Runs, each `torchrun --standalone --nproc_per_node=N` over the trainer's own loop (`trainer.train.train`, as
`torchrun -m trainer train` does), on generated recipes read by the Rust loader, rank-sharded:

- `ddp1`, `ddp2`: FLAN-T5-XL's shape (random init, bf16 weights), the rtx5090 preset's optimizer (Adafactor
  with Kahan-compensated bf16 updates) and gradient checkpointing, the same per-GPU micro-batch
  (`--max-tokens` x `--accumulation`) on 1 and on 2 GPUs. DDP scaling efficiency = real tokens/s on 2 GPUs /
  (2 x real tokens/s on 1 GPU).
- `fsdp2`: FLAN-T5-XL with fp32 weights and torch AdamW (fp32 states: 4 x 11.4 GB before sharding) under
  FSDP2 on 2 GPUs, bf16 compute; peak memory per rank.

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

from bench_run import QUIET_RUN

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

COMMON = dict(
    gradient_checkpointing=True,
    max_source_length=512,
    max_target_length=512,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    progress_bar=False,
    random_init=True,
    **QUIET_RUN,
)
RUNS = {
    # name: (processes, config overrides)
    "ddp1": (1, dict(dtype="bfloat16", optimizer="adafactor", bf16_update="kahan", learning_rate=1e-3)),
    "ddp2": (2, dict(dtype="bfloat16", optimizer="adafactor", bf16_update="kahan", learning_rate=1e-3)),
    "fsdp2": (2, dict(dtype="float32", optimizer="adamw", distributed_strategy="fsdp")),
}


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


def steady_tokens_per_s(out: Path, warmup: int) -> float:
    """Real tokens of all ranks per second over the steps after `warmup` (train log, rank 0's clock)."""
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    if len(rows) <= warmup or "time" not in rows[0]:
        return json.loads((out / "run_summary.json").read_text())[
            "tokens_per_s"
        ]  # whole run, warmup included
    timed = rows[warmup:]  # warmup >= 1: the first timed step starts at the end of the one before
    tokens = sum(r["source_tokens"] + r["target_tokens"] for r in timed)
    return tokens / (timed[-1]["time"] - rows[warmup - 1]["time"])


def launch(name: str, nproc: int, values: dict, tmp: Path, device: str) -> dict:
    out = tmp / name
    values = dict(values, output_dir=str(out))
    config = tmp / f"{name}.yaml"
    import yaml

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
    return {
        "run": name,
        "processes": nproc,
        "wall_s": time.time() - t0,
        "steps": summary["steps"],
        "final_loss": summary["final_loss"],
        "load_weight_gib": summary["load_weight_gib"],
        "peak_allocated_gib": [r.get("peak_allocated_gib") for r in ranks],
        "peak_reserved_gib": [r.get("peak_reserved_gib") for r in ranks],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one rank, under torchrun
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--max-tokens", type=int, default=8192, help="per-GPU micro-batch token budget")
    parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--records", type=int, default=8000)
    parser.add_argument("--tiny", action="store_true", help="tiny shape (checks the script)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)

    from trainer.sample import write_sample
    from trainer.tiny_model import build_tiny_model

    sys.path.insert(0, str(Path(__file__).parent))
    from xl_smoke import write_model_dir

    results = []
    with tempfile.TemporaryDirectory(prefix="multi-gpu-") as tmp:
        tmp = Path(tmp)
        data = tmp / "recipes.csv"
        write_sample(data, args.records, seed=0, fmt="recipenlg-csv")
        tok_dir = build_tiny_model(tmp / "tok", seed=0)  # only its tokenizer is used
        model_dir = write_model_dir(tmp / "model", "tiny" if args.tiny else "xl", tok_dir)
        base = dict(
            COMMON,
            model_name_or_path=str(model_dir),
            train_files=[str(data)],
            max_steps=args.steps,
            max_tokens=args.max_tokens,
            gradient_accumulation_steps=args.accumulation,
        )
        for name in args.runs:
            nproc, overrides = RUNS[name]
            values = dict(base, **overrides)
            if args.device == "cpu":
                values.update(dtype="float32", optimizer="adamw")  # CPU check: plain fp32 AdamW everywhere
            result = launch(name, nproc, values, tmp, args.device)
            result["tokens_per_s"] = steady_tokens_per_s(tmp / name, max(1, min(args.warmup, args.steps - 1)))
            result["optimizer"] = f"{values['optimizer']}, {values['dtype']} weights"
            results.append(result)
            print(json.dumps(result), flush=True)

    by_name = {r["run"]: r for r in results}
    print(
        f"\nFLAN-T5-{'tiny' if args.tiny else 'XL'} shape, {args.device}, per-GPU micro-batch "
        f"{args.max_tokens} tokens x {args.accumulation} accumulation, {args.steps} steps "
        f"({args.warmup} warm-up)\n"
    )
    print("| run | GPUs | optimizer | real tokens/s | peak allocated per rank (GiB) | final loss |")
    print("|---|---|---|---|---|---|")
    for r in results:
        peaks = ", ".join(f"{p:.1f}" if p is not None else "n/a" for p in r["peak_allocated_gib"])
        print(
            f"| {r['run']} | {r['processes']} | {r['optimizer']} | {r['tokens_per_s']:,.0f} | {peaks} | "
            f"{r['final_loss']:.4f} |"
        )
    if "ddp1" in by_name and "ddp2" in by_name:
        eff = by_name["ddp2"]["tokens_per_s"] / (2 * by_name["ddp1"]["tokens_per_s"])
        print(f"\nDDP scaling efficiency (2 GPUs / 2 x 1 GPU): {100 * eff:.1f}%")
        results.append({"ddp_scaling_efficiency": eff})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

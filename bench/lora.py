"""The presets for smaller cards, measured in one call on one GPU, each in its own process capped at its
card's memory: FLAN-T5-XL + LoRA at 16 GiB, XL full fine-tuning at 24 GiB, FLAN-T5-XXL + LoRA at 32 GiB.

    python3 bench/lora.py                             # GPU: the three presets (about 5 minutes on an H100)
    python3 bench/lora.py --configs xxl_lora_32gib --steps 4
    python3 bench/lora.py --configs xl_full_24gib --set bf16_update=stochastic   # a preset's key changed
    python3 bench/lora.py --tiny                      # CPU: the tiny shape through the same code

Each config is a preset as shipped (configs/*.yaml: packed rows, CUDA graphs, 8k-token micro-batches x 8
accumulated, the plan choosing the blocks without checkpointing on the loader's rows), trained on the
synthetic recipe-length records of the other benchmarks (bench_run.make_records: 4096 records, source ~
lognormal(median 96), target ~ lognormal(median 256), random ids) with random weights of the model's shape
(`random_init`: nothing downloads; XXL's 20.5 GiB of bf16 weights are made on the GPU in bf16), in a process
capped with set_per_process_memory_fraction (`gpu_memory_limit_gib`) at the card's memory.

Reported per config, from the run's train log and run_summary.json:
- peak allocated / reserved over the whole run (torch's counters), the memory plan's prediction for the run
  (the plan the trainer made on the loader's packed rows, `planned_peak_gib`) and its error against the
  reserved peak, and the plan by component;
- real (non-pad) tokens/s over the timed steps (the warm-up steps, which capture the CUDA graphs, left out)
  and MFU: model FLOPs of trainer.plan.gpu_specs.flops_per_token (LoRA: 4 per frozen-base parameter and token,
  no weight gradients; 6 per adapter parameter) against the GPU's dense bf16 rate (989 TFLOP/s on an H100);
- `trainer plan`'s time for an epoch of 1M typical recipes (96 + 256 tokens, what it assumes without data)
  on the card the preset is for, at trainer.plan.plan_report.MEASURED_MFU and at this run's MFU.
Noise: a few timed steps; the throughput benchmarks' repeated calls moved by 1-3% (bench/NOTES.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_run import QUIET_RUN, make_records, run_one_in_subprocess, train_rows, write_data

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

PRESETS = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class Bench:
    preset: str  # configs/<preset>
    shape: str  # trainer.model.tiny_model.flan_t5_config's: "xl" or "xxl"
    card_gib: int  # the process's memory cap: the card's memory
    card: str  # trainer.plan.gpu_specs.GPUS key of the card the preset is for


CONFIGS = {
    "xl_lora_16gib": Bench("flan-t5-xl-lora-rtx4080.yaml", "xl", 16, "rtx4080"),
    "xl_full_24gib": Bench("flan-t5-xl-rtx4090.yaml", "xl", 24, "rtx4090"),
    "xxl_lora_32gib": Bench("flan-t5-xxl-lora-rtx5090.yaml", "xxl", 32, "rtx5090"),
}


def run_one(name: str, work: Path, steps: int, warmup: int, tiny: bool, overrides: list[str]) -> dict:
    """One preset through trainer.run.train.train, capped at its card, with `overrides` (KEY=VALUE, the value
    as YAML) applied; its numbers."""
    import torch
    import yaml

    from trainer.config import TrainConfig
    from trainer.model.model_shape import LoraShape, load_shape
    from trainer.plan.gpu_specs import GPUS, flops_per_token, predicted_epoch_seconds
    from trainer.plan.memory_plan import TYPICAL_SOURCE, TYPICAL_TARGET, micro_batch_peak
    from trainer.plan.plan_report import ASSUMED_RECORDS, MEASURED_MFU
    from trainer.report.step_meter import SUMMARY
    from trainer.run.train import train

    bench = CONFIGS[name]
    cuda = torch.cuda.is_available()
    shape = "tiny" if tiny else bench.shape
    records = make_records(n=512 if tiny else 4096)
    data, model_dir = write_data(work, records, shape)
    values = yaml.safe_load((PRESETS / bench.preset).read_text(encoding="utf-8"))
    for item in overrides:
        key, _, raw = item.partition("=")
        values[key.strip()] = yaml.safe_load(raw)
    values.update(
        model_name_or_path=str(model_dir),
        random_init=True,
        train_files=[str(data)],
        output_dir=str(work / "out"),
        max_steps=warmup + steps,
        progress_bar=False,
        gpu_memory_limit_gib=bench.card_gib if cuda else None,
        **QUIET_RUN,
    )
    if tiny:  # the code path only
        values.update(max_tokens=2048, gradient_accumulation_steps=2)
        if not cuda:
            values.update(dtype="float32")
    cfg = TrainConfig.from_dict(values, source=bench.preset)
    rc = train(cfg)
    rows = train_rows(work / "out")
    summary = json.loads((work / "out" / SUMMARY).read_text())
    timed = rows[warmup:]
    seconds = timed[-1]["time"] - rows[warmup - 1]["time"]
    src, tgt = sum(r["source_tokens"] for r in timed), sum(r["target_tokens"] for r in timed)
    lora = LoraShape.of(cfg)
    model_shape = load_shape(str(model_dir))
    per_src, per_tgt = flops_per_token(model_shape, lora)
    peak_flops = GPUS["h100"].bf16_flops
    if cuda:
        from trainer.plan.gpu_specs import gpu_spec

        with contextlib.suppress(ValueError):  # a GPU trainer.plan.gpu_specs does not know: an H100's rate
            peak_flops = gpu_spec(torch.cuda.get_device_name()).bf16_flops
    mfu = (per_src * src + per_tgt * tgt) / seconds / peak_flops
    blocks = (
        summary.get("decoder_blocks_without_checkpointing"),
        summary.get("encoder_blocks_without_checkpointing"),
    )
    plan = None
    if summary.get("packed_rows") is not None:  # on CUDA: the plan the trainer made, by component
        plan = micro_batch_peak(model_shape, cfg, cfg.max_tokens, blocks, tuple(summary["packed_rows"]))
    card = GPUS[bench.card]
    epoch = dict(
        source_tokens=ASSUMED_RECORDS * TYPICAL_SOURCE,
        target_tokens=ASSUMED_RECORDS * TYPICAL_TARGET,
        lora=lora,
    )
    return dict(
        config=name,
        ok=rc == 0,
        preset=bench.preset + "".join(f", {item}" for item in overrides),
        cap_gib=bench.card_gib if cuda else None,
        adapter=cfg.adapter,
        real_tok_s=(src + tgt) / seconds,
        mfu=mfu,
        peak_alloc_gib=summary.get("peak_allocated_gib"),
        peak_reserved_gib=summary.get("peak_reserved_gib"),
        plan_gib=summary.get("planned_peak_gib"),
        plan_components_gib={k: v / 2**30 for k, v in plan.components().items()} if plan else None,
        plan_moment=plan.peak_moment if plan else None,
        blocks_without_checkpointing=blocks,
        packed_rows=summary.get("packed_rows"),
        oom_split=summary.get("oom_split"),
        final_loss=rows[-1]["loss"],
        card=card.name,
        epoch_s_plan_mfu=predicted_epoch_seconds(card, MEASURED_MFU.mfu, model_shape, **epoch),
        epoch_s_this_mfu=predicted_epoch_seconds(card, min(mfu, 1.0), model_shape, **epoch),
        plan_mfu=MEASURED_MFU.mfu,
    )


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per config")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timing (>= 1)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per config")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="change every preset's key (a YAML value)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shape (CPU check of the script)")
    parser.add_argument("--out", help="directory for the full results (lora.json)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one config in this process
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the timing starts at the end of a step")
    if any("=" not in item for item in args.set):
        parser.error("--set takes KEY=VALUE items")

    if args.one:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
            result = run_one(args.one, Path(tmp), args.steps, args.warmup, args.tiny, args.set)
        Path(args.result).write_text(json.dumps(result))
        return 0

    import torch

    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}; torch {torch.__version__}", flush=True)
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
    extra += ["--set", *args.set] if args.set else []
    results = []
    for name in args.configs.split(","):
        t0 = time.time()
        results.append(run_one_in_subprocess(__file__, ["--one", name, *extra], timeout=args.timeout))
        print(f"{name}: {time.time() - t0:.0f} s {json.dumps(results[-1])}", flush=True)

    print()
    print(
        "| config | cap | peak alloc / reserved | plan (vs reserved) | real tok/s | MFU "
        "| blocks kept (dec, enc) | trainer plan: 1M recipes on the card (its MFU / this run's) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if not r.get("ok"):
            print(f"| {r['config']} | failed: {str(r.get('error', ''))[-300:]!r} | | | | | | |")
            continue
        print(
            f"| {r['config']} ({r['preset']}) | {_gib(r['cap_gib'])} | {_peak(r)} | {_plan(r)} "
            f"| {r['real_tok_s']:,.0f} | {100 * r['mfu']:.1f}% | {tuple(r['blocks_without_checkpointing'])} "
            f"| {r['card']}: {_duration(r['epoch_s_plan_mfu'])} at {100 * r['plan_mfu']:.1f}% / "
            f"{_duration(r['epoch_s_this_mfu'])} at {100 * r['mfu']:.1f}% |"
        )
    for r in results:
        if r.get("plan_components_gib"):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["plan_components_gib"].items())
            print(
                f"\n{r['config']}: plan at {r['plan_moment']}, GiB: {parts}; packed rows {r['packed_rows']}"
            )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        everything = {"device": device, "results": results}
        (Path(args.out) / "lora.json").write_text(json.dumps(everything, indent=2) + "\n")
    return 0 if all(r.get("ok") for r in results) else 1


def _gib(value) -> str:
    return f"{value} GiB" if value else "none (CPU)"


def _peak(r: dict) -> str:
    if r.get("peak_alloc_gib") is None:
        return "n/a (CPU)"
    return f"{r['peak_alloc_gib']:.1f} / {r['peak_reserved_gib']:.1f} GiB"


def _plan(r: dict) -> str:
    if r.get("plan_gib") is None:
        return "-"
    measured = r.get("peak_reserved_gib")
    return f"{r['plan_gib']:.1f} GiB ({100 * (r['plan_gib'] / measured - 1):+.1f}%)" if measured else "-"


def _duration(seconds: float) -> str:
    from trainer.report.step_meter import format_duration

    return format_duration(seconds)


if __name__ == "__main__":
    raise SystemExit(main())

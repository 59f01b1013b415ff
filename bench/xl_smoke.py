"""FLAN-T5-XL smoke run on one GPU under a 32 GiB cap, through the trainer's own loop.

    python bench/xl_smoke.py --steps 10            # on the GPU machine (random init, no Hub)
    python bench/xl_smoke.py --tiny --steps 3      # tiny shape on the CPU: checks the script itself

The architecture is FLAN-T5-XL's (d_model 2048, d_ff 5120, 24+24 layers, 32 heads x 64, vocab 32128,
gated-GELU) with random weights saved as safetensors and loaded like the real checkpoint (from_pretrained
straight onto the GPU in bf16, under the load-once check), trained
with the rtx5090 preset's optimizer and batching on generated recipes. It goes through
`trainer.run.train.train`, so the load-once assertion, the OOM back-off and the optimizer are the ones a user
gets. Needs only this package (its wheel), torch and transformers; no network.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import yaml
from bench_run import QUIET_RUN

# The rtx5090 preset's optimizer and batching (configs/ is not in the wheel; kept in step with
# configs/flan-t5-xl-rtx5090.yaml, which is used instead when it is found).
PRESET = dict(
    dtype="bfloat16",
    gradient_checkpointing=True,
    max_source_length=512,
    max_target_length=512,
    max_tokens=32768,
    pad_to_multiple_of=8,
    gradient_accumulation_steps=2,
    optimizer="adafactor",
    bf16_update="kahan",
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    cuda_alloc_conf="expandable_segments:True",
)


def write_model_dir(out: Path, shape: str, tokenizer_dir: Path) -> Path:
    """config.json of the architecture ("xl" or "tiny", no weights) plus the tokenizer."""
    import shutil

    from trainer.model.tiny_model import flan_t5_config

    out.mkdir(parents=True, exist_ok=True)
    flan_t5_config(shape).save_pretrained(out)
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return out


def write_random_weights(model_dir: Path) -> None:
    """Random weights saved as safetensors, so the run loads them the way it loads google/flan-t5-xl
    (from_pretrained straight onto the GPU in bf16, with the load-once check)."""
    import gc

    import torch
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--tiny", action="store_true", help="tiny shape (CPU check of the script)")
    parser.add_argument("--gpu-memory-gib", type=float, default=32.0)
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--preset", default="configs/flan-t5-xl-rtx5090.yaml")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from trainer.infra import memory

    memory.set_alloc_conf(PRESET["cuda_alloc_conf"])  # before torch touches CUDA
    import torch

    from trainer.config import TrainConfig
    from trainer.data.sample import write_sample
    from trainer.model.tiny_model import build_tiny_model
    from trainer.report.step_meter import SUMMARY
    from trainer.run.train import train

    values = dict(PRESET)
    preset = Path(args.preset)
    if preset.is_file():
        loaded = yaml.safe_load(preset.read_text())
        values.update({k: loaded[k] for k in PRESET if k in loaded})
    with tempfile.TemporaryDirectory(prefix="xl-smoke-") as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        data = tmp / "recipes.csv"
        write_sample(data, args.records, seed=0, fmt="recipenlg-csv")
        tok_dir = build_tiny_model(tmp / "tok", seed=0)  # only its tokenizer is used
        model_dir = write_model_dir(tmp / "model", "tiny" if args.tiny else "xl", tok_dir)
        write_random_weights(model_dir)
        values.update(
            model_name_or_path=str(model_dir),
            train_files=[str(data)],
            output_dir=str(tmp / "out"),
            max_steps=args.steps,
            **QUIET_RUN,
            gpu_memory_limit_gib=args.gpu_memory_gib if torch.cuda.is_available() else None,
        )
        if args.tiny:
            values.update(max_tokens=1024, gradient_accumulation_steps=2)
            if not torch.cuda.is_available():
                values["dtype"] = "float32"
        for item in args.set:
            key, _, raw = item.partition("=")
            values[key] = yaml.safe_load(raw)
        cfg = TrainConfig.from_dict(values, source="xl_smoke")
        setup_s = time.time() - t0
        rc = train(cfg)
        summary = json.loads((tmp / "out" / SUMMARY).read_text())
    summary.update(setup_s=setup_s, exit_code=rc, shape="tiny" if args.tiny else "flan-t5-xl")
    summary["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary["optimizer"] = f"{cfg.optimizer} ({cfg.bf16_update}), {cfg.dtype}"
    summary["micro_batch"] = f"max_tokens {cfg.max_tokens} x GA {cfg.gradient_accumulation_steps}"
    rows = [
        ("device", summary["device"]),
        ("model", summary["shape"]),
        ("optimizer", summary["optimizer"]),
        ("batching", summary["micro_batch"]),
        ("memory cap", f"{args.gpu_memory_gib} GiB" if torch.cuda.is_available() else "n/a (CPU)"),
        ("optimizer steps", summary["steps"]),
        ("weights", f"{summary['load_weight_gib']:.2f} GiB"),
        ("load peak", _gib(summary.get("load_peak_gib"))),
        ("peak allocated", _gib(summary.get("peak_allocated_gib"))),
        ("peak reserved", _gib(summary.get("peak_reserved_gib"))),
        ("real tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        ("final loss", f"{summary['final_loss']:.4f}" if summary["final_loss"] is not None else "n/a"),
        ("OOM split", summary["oom_split"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("| " + "metric".ljust(width) + " | value |")
    print("|" + "-" * (width + 2) + "|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return rc


def _gib(v) -> str:
    return f"{v:.2f} GiB" if v is not None else "n/a"


if __name__ == "__main__":
    raise SystemExit(main())

"""Packed rows and CUDA graphs train as padded rows do, step by step, in bf16 on a GPU.

    python3 bench/packing_exact.py --model DIR --data FILE --out DIR [--steps 50]
    python3 bench/packing_exact.py --tiny --out /tmp/packing_exact     # CPU: the tiny model, fp32, no graphs

The same records in each optimizer step, trained from the same weights with dropout off through the
trainer's own model, accumulation and update (the rtx5090 preset's optimization: configs/), four ways:

- padded_a: one record per row, the step's records sorted by length and cut into 2 micro-batches;
- padded_b: the same records shuffled and cut into 3 micro-batches: the control, which differs from padded_a
  only in how the records are split (so only in bf16 rounding);
- packed: the loader's packed rows, several records per row, 2 micro-batches;
- packed_graphs: the same packed micro-batches replayed as CUDA graphs (trainer.run.cuda_graphs), the update
  too.

Per step the loss of each; the verdict: packed's relative distance to padded_a, and packed_graphs' to packed,
is within the control's (mean over the steps at most twice the control's). bench/quality.py runs this on its
pretrained model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_run import preset_optimization, without_dropout

MICRO_BATCHES = {"padded_a": 2, "padded_b": 3}
WITHIN = 2.0  # a run's mean distance at most this many times the control's


def config(model_dir: Path, data: Path, tiny: bool, rows: int):
    """The trainer config of these runs: the preset's optimization, packed rows of `rows` per micro-batch."""
    from trainer.config import TrainConfig

    values = preset_optimization() | dict(
        model_name_or_path=str(model_dir),
        train_files=[str(data)],
        dtype="float32" if tiny else "bfloat16",
        max_source_length=128 if tiny else 512,
        max_target_length=160 if tiny else 512,
        packing=True,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=2,
        gradient_checkpointing=False,
        eval_fraction=0.0,
        report_to="none",
    )
    return TrainConfig.from_dict(values, source="packing_exact")


def step_batches(cfg, steps: int, seed: int = 0) -> dict[str, list[list[dict]]]:
    """For each way, `steps` groups of micro-batches (numpy) holding the same records per step."""
    from trainer.data.loader import packed_records, padded_batch, stream_for
    from trainer.model.model_files import resolve_tokenizer_file

    stream = stream_for(cfg, resolve_tokenizer_file(cfg.model_name_or_path), "train")
    stream.set_epoch(0)
    batches = iter(stream)
    rng = np.random.default_rng(seed)
    ways: dict[str, list[list[dict]]] = {"packed": [], "padded_a": [], "padded_b": []}
    for _ in range(steps):
        packed = [next(batches) for _ in range(cfg.gradient_accumulation_steps)]
        records = [r for b in packed for r in packed_records(b)]
        by_length = sorted(records, key=lambda r: (len(r[1]), len(r[0])))
        shuffled = [records[i] for i in rng.permutation(len(records))]
        ways["packed"].append(packed)
        for name, ordered in (("padded_a", by_length), ("padded_b", shuffled)):
            parts = np.array_split(np.arange(len(ordered)), MICRO_BATCHES[name])
            ways[name].append(
                [padded_batch([ordered[i] for i in p], cfg.pad_to_multiple_of or 1) for p in parts]
            )
    return ways


def train(cfg, groups: list[list[dict]], device, graphs: bool) -> list[float]:
    """The per-step losses of training on `groups` from the model's weights, as the trainer's loop does."""
    import torch

    from trainer.data.loader import to_device
    from trainer.kernels.projections import accumulate_weight_grads_in_place
    from trainer.model.load import load_model
    from trainer.model.loss import token_loss_sum
    from trainer.optim import build_optimizer
    from trainer.run.cuda_graphs import MicroStepGraph
    from trainer.run.schedule import build_scheduler
    from trainer.run.step import accumulate_gradients, optimizer_step

    torch.manual_seed(0)
    model = load_model(cfg, device)
    model.train()
    accumulate_weight_grads_in_place(model)
    optimizer = build_optimizer(model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg, total_steps=len(groups))
    graph = None
    if graphs:
        params = [p for p in model.parameters() if p.requires_grad]
        graph = MicroStepGraph(lambda **batch: token_loss_sum(model, batch), params)
    losses = []
    for group in groups:
        on_device = [to_device(b, device) for b in group]
        n_target = sum(int((b["labels"] != -100).sum()) for b in group)
        loss_sum, n_target = accumulate_gradients(model, on_device, split=1, n_target=n_target, graph=graph)
        loss, _ = optimizer_step(
            model, optimizer, scheduler, loss_sum, n_target, max_grad_norm=cfg.max_grad_norm, graph=graph
        )
        losses.append(loss)
    return losses


def distances(a: list[float], b: list[float]) -> dict:
    """Relative per-step distances |a - b| / b: their mean and largest."""
    d = [abs(x - y) / y for x, y in zip(a, b, strict=True)]
    return {"mean": statistics.fmean(d), "max": max(d)}


def tiny_inputs(work: Path) -> tuple[Path, Path]:
    from trainer.data.sample import write_sample
    from trainer.model.tiny_model import build_tiny_model

    data = work / "recipes.jsonl"
    write_sample(data, 600, seed=3, fmt="jsonl")
    return build_tiny_model(work / "model"), data


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="model directory (a T5 saved with save_pretrained, with tokenizer.json)"
    )
    parser.add_argument("--data", help="recipe file to draw the steps' records from")
    parser.add_argument("--out", required=True, help="directory for packing_exact.json")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per way")
    parser.add_argument("--rows", type=int, default=8, help="packed rows per micro-batch")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (checks the script)")
    args = parser.parse_args()
    import torch

    from trainer.data.loader import packed_records

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="packing-exact-") as tmp:
        if args.tiny:
            model_dir, data = tiny_inputs(Path(tmp))
            args.steps, args.rows = min(args.steps, 6), 2
        elif not (args.model and args.data):
            parser.error("--model and --data are needed (or --tiny)")
        else:
            model_dir, data = Path(args.model), Path(args.data)
        no_dropout = without_dropout(Path(model_dir), Path(tmp) / "no-dropout")
        cfg = config(no_dropout, data, args.tiny, args.rows)
        device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
        ways = step_batches(cfg, args.steps)
        losses = {name: train(cfg, groups, device, graphs=False) for name, groups in ways.items()}
        if device.type == "cuda":
            losses["packed_graphs"] = train(
                dataclasses.replace(cfg, cuda_graphs=True), ways["packed"], device, True
            )
    control = distances(losses["padded_b"], losses["padded_a"])
    compared = {"packed vs padded_a": distances(losses["packed"], losses["padded_a"])}
    if "packed_graphs" in losses:
        compared["packed_graphs vs packed"] = distances(losses["packed_graphs"], losses["packed"])
    verdicts = {
        name: d["mean"] <= WITHIN * control["mean"] or (control["mean"] == 0 and d["mean"] == 0)
        for name, d in compared.items()
    }
    records = [sum(len(packed_records(b)) for b in group) for group in ways["packed"]]
    report = dict(
        model=str(model_dir),
        dtype=cfg.dtype,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        steps=args.steps,
        records_per_step=statistics.fmean(records),
        losses=losses,
        control=control,
        compared=compared,
        verdicts=verdicts,
    )
    (out / "packing_exact.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"{args.steps} steps of {report['records_per_step']:.0f} records, {cfg.dtype}, {report['device']}")
    print("| comparison | mean relative loss distance per step | largest |")
    print("|---|---|---|")
    print(f"| padded_b vs padded_a (control: another split) | {control['mean']:.2e} | {control['max']:.2e} |")
    for name, d in compared.items():
        print(f"| {name} | {d['mean']:.2e} | {d['max']:.2e} |")
    for name, ok in verdicts.items():
        ratio = compared[name]["mean"] / control["mean"] if control["mean"] else math.nan
        verdict = "PASS" if ok else "FAIL"
        print(f"{name}: {verdict} ({ratio:.2f}x the control's mean distance; goal <= {WITHIN:g}x)")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

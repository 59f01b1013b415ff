"""Goodput of the rtx5090 preset through the CLI: the share of the wall clock in optimizer steps, with its
evaluations and checkpoints, and each kind of pause.

    python3 bench/goodput.py                  # GPU: FLAN-T5-XL's shape, random weights, 32 GiB cap
    python3 bench/goodput.py --tiny           # CPU check of the script: the tiny model

`trainer train --config configs/flan-t5-xl-rtx5090.yaml` as a user runs it (a subprocess), on generated
RecipeNLG records and FLAN-T5-XL's shape with random bf16 weights saved as safetensors (bench/xl_smoke.py's),
`gpu_memory_limit_gib` 32, evaluating and saving every `--every` steps (the preset: 500; a short run uses
fewer so that it sees several of each). The trainer's own accounting (`run_summary.json`'s `goodput`, the
log's `goodput ...` line) gives the steps' time and each pause: checkpoints (staging, or the whole write
when it is in the loop; final/), evaluations, CUDA graph captures, data. Each save's pause is split into
the wait for the previous write (a short run's saves come closer together than a write takes) and the copy.
From those the table also gives the goodput at the preset's cadence: steps of the measured mean time, one
evaluation and one copy per 500 steps (the first save, which may wait for the host buffers' allocation,
captures and data once per run: they do not recur). At the preset's cadence no checkpoint write runs beside
an evaluation (the save of the evaluation's step comes after it, and the previous write began ~700 s before),
and one that does may take longer (the trainer's log line says so). So the evaluation's time is the mean of
those with no write beside them after the first, or the first's where no other ran alone: it also carries
the decoding engine's compilation, so the projection errs low. So does the step time, measured with writes
running beside most steps of a short run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from bench_run import PRESET

PRESET_CADENCE = 500


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (a check of the script)")
    ap.add_argument("--every", type=int, help="eval_steps = save_steps (default 60; 4 with --tiny)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default 3 x --every; 4 x with --tiny)")
    ap.add_argument("--records", type=int, default=12_000)
    args = ap.parse_args()
    every = args.every or (4 if args.tiny else 60)
    steps = args.steps or (4 if args.tiny else 3) * every

    from xl_smoke import write_model_dir, write_random_weights

    from trainer.data.sample import write_sample
    from trainer.model.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        tmp = Path(tmp)
        data = tmp / "recipes.csv"
        write_sample(data, args.records, seed=0, fmt="recipenlg-csv")
        tokenizer_dir = build_tiny_model(tmp / "tokenizer", seed=0)
        if args.tiny:
            model = tokenizer_dir
        else:
            model = write_model_dir(tmp / "model", "xl", tokenizer_dir)
            write_random_weights(model)
        values = yaml.safe_load(PRESET.read_text(encoding="utf-8"))
        values.update(
            model_name_or_path=str(model),
            train_files=[str(data)],
            output_dir=str(tmp / "out"),
            max_steps=steps,
            eval_steps=every,
            save_steps=every,
            eval_fraction=0.01,
            report_to="none",
            progress_bar=False,
            discord_progress_minutes=-1,
            logging_steps=10,
        )
        if args.tiny:
            values.update(dtype="float32", cuda_graphs=False, max_tokens=1024, gradient_accumulation_steps=2)
            values.update(max_source_length=64, max_target_length=96, gradient_checkpointing=False)
        else:
            values["gpu_memory_limit_gib"] = 32
        config = tmp / "goodput.yaml"
        config.write_text(yaml.safe_dump(values))
        done = subprocess.run(
            [sys.executable, "-m", "trainer", "train", "--config", str(config)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        goodput = json.loads((tmp / "out" / "run_summary.json").read_text())["goodput"]
        log = done.stderr
        rows = [json.loads(line) for line in (tmp / "out" / "train_log.jsonl").open(encoding="utf-8")]

    # Each save's pause and the part of it spent waiting for the previous write (saves closer together than
    # a write takes: a short run's cadence, not the preset's).
    saves = [
        (float(paused), float(waited or 0.0))
        for paused, waited in re.findall(
            r"checkpoint-\d+ (?:staged|saved).*training paused ([\d.]+) s(?:, ([\d.]+) s of it waiting)?", log
        )
    ]
    copies = [paused - waited for paused, waited in saves]
    writes = [float(s) for s in re.findall(r"checkpoint-\d+ written in ([\d.]+) s", log)]
    for line in sorted(set(re.findall(r"decoding with Hugging Face's generate.*", log))):
        print(f"evaluation: {line}")
    eval_rows = [r for r in rows if "eval_runtime" in r]
    beside_write = {
        int(s) for s in re.findall(r"step (\d+): .*; checkpoint-\d+ was being written beside it", log)
    }
    alone = [r["eval_runtime"] for r in eval_rows if r["step"] not in beside_write]
    step_s = goodput["steps_s"] / steps
    # The first save may wait for the pinned host buffers the later ones reuse (allocated beside the first
    # steps): once per run.
    save_s = sum(copies[1:] or copies) / max(len(copies[1:] or copies), 1)
    alone = alone[1:] or alone  # see the module doc
    eval_s = sum(alone) / max(len(alone), 1)
    at_cadence = PRESET_CADENCE * step_s / (PRESET_CADENCE * step_s + save_s + eval_s)
    shape = "tiny model, CPU" if args.tiny else "FLAN-T5-XL shape, 32 GiB cap"
    print(
        f"the rtx5090 preset through `trainer train`, {shape}: {steps} steps, eval_steps = save_steps = "
        f"{every}"
    )
    print(f"{'wall clock':<34}{goodput['wall_s']:>10.1f} s")
    print(f"{'in optimizer steps':<34}{goodput['steps_s']:>10.1f} s   ({step_s:.3f} s a step)")
    for kind, label in (("save", "checkpoints"), ("evaluation", "evaluations"), ("capture", "captures")):
        print(
            f"{'paused: ' + label:<34}{goodput[f'{kind}_s']:>10.1f} s   ({goodput[f'{kind}_count']} of them)"
        )
    print(f"{'paused: data':<34}{goodput['data_s']:>10.1f} s")
    print(f"goodput of this run: {100 * goodput['goodput']:.1f}%")
    for i, ((paused, waited), copy) in enumerate(zip(saves, copies, strict=True), start=1):
        print(
            f"save {i}: training paused {paused:.2f} s: {waited:.2f} waiting for the write before, "
            f"{copy:.2f} copying"
        )
    for r in eval_rows:
        print(
            f"evaluation at step {r['step']}: {r['eval_runtime']:.1f} s: generating "
            f"{r.get('eval_generation_runtime', 0):.1f} s ({r.get('eval_gen_len', 0):.0f} new tokens a "
            f"record), scoring {r.get('eval_scoring_runtime', 0):.1f} s"
            + ("; a checkpoint write beside it" if r["step"] in beside_write else "")
        )
    print(
        f"each save after the first paused training {save_s:.2f} s to copy the state (the writes took "
        f"{sum(writes) / max(len(writes), 1):.1f} s in the background); each evaluation with no write beside "
        f"it {eval_s:.1f} s"
    )
    print(
        f"goodput at the preset's cadence ({PRESET_CADENCE} steps between evaluations and saves): "
        f"{100 * at_cadence:.1f}%"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

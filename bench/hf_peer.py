"""The Hugging Face peer: `Seq2SeqTrainer` training a FLAN-T5-XL-shaped model, timed like our trainer.

    python3 bench/hf_peer.py                         # GPU: the tuned preset, ~1.5 min on an H100
    python3 bench/hf_peer.py --preset adamw_bs16_ga8 # another preset (--list-presets)
    python3 bench/hf_peer.py --preset tuned --optim adamw_torch_fused --batch-size 16 --grad-accum 8
    python3 bench/hf_peer.py --tiny                  # CPU: a tiny shape through the same code (checks it)

What a Hugging Face user runs: `Seq2SeqTrainer` with FLAN-T5-XL's architecture (d_model 2048, d_ff 5120,
24+24 layers, 32 heads x 64, vocab 32128, gated-GELU), random init in bf16 (no Hub here), gradient
checkpointing, longest padding per batch, the process capped at 32 GiB with
`torch.cuda.set_per_process_memory_fraction` to stand in for an RTX 5090. Data: bench_run.make_records, 4096
recipe-length sequences of random ids, the same ones our trainer reads in bench/train_throughput.py.

It times `--steps` optimizer steps after `--warmup` (a CUDA sync at each step's end) and counts the real
(non-pad) tokens of exactly the batches those steps trained on (the collator tallies each batch on the CPU).
Prints a one-row table, then one line `RESULT {json}`: real tokens/s, samples/s, padding share, peak
allocated and reserved memory (bench/train_throughput.py reads that line).

Presets (each 128 samples per optimizer step): `tuned` is the best Hugging Face setup known on this data
(Adafactor, bs 32, GA 4, group_by_length, SDPA: 8,300 real tok/s, 37.7% padding, 18.1 GiB on an H100 at 32
GiB); the others are the earlier peer configurations. Flags override a preset's settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_run import VOCAB, make_records

# (settings, what it is). attn "sdpa" is also what transformers 5 picks for T5 when none is named.
PRESETS = {
    "tuned": dict(optim="adafactor", batch_size=32, grad_accum=4, group_by_length=True, attn="sdpa"),
    "adamw_bs16_ga8": dict(
        optim="adamw_torch_fused", batch_size=16, grad_accum=8, group_by_length=False, attn="sdpa"
    ),
    "adamw_bs8_ga16": dict(
        optim="adamw_torch_fused", batch_size=8, grad_accum=16, group_by_length=False, attn="sdpa"
    ),
    "adafactor_bs8_ga16": dict(
        optim="adafactor", batch_size=8, grad_accum=16, group_by_length=False, attn="sdpa"
    ),
    "adamw_bs16_ga8_grp_sdpa": dict(
        optim="adamw_torch_fused", batch_size=16, grad_accum=8, group_by_length=True, attn="sdpa"
    ),
    "adamw_bs16_ga8_eager": dict(
        optim="adamw_torch_fused", batch_size=16, grad_accum=8, group_by_length=False, attn="eager"
    ),
}
DEFAULT_PRESET = "tuned"
OPTIMS = ("adamw_torch_fused", "adafactor")


def describe(settings: dict) -> str:
    """'HF, Adafactor, bs 32, GA 4, group_by_length, SDPA' for tables."""
    optim = {"adafactor": "Adafactor", "adamw_torch_fused": "AdamW fused"}[settings["optim"]]
    parts = ["HF", optim, f"bs {settings['batch_size']}", f"GA {settings['grad_accum']}"]
    if settings["group_by_length"]:
        parts.append("group_by_length")
    parts.append(settings["attn"].upper() if settings["attn"] == "sdpa" else settings["attn"])
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------- HF machinery
# Shared with bench/quality.py, whose reference run is this trainer on real recipes.


def collate(features: list[dict]) -> dict:
    """Longest padding (ids 0, labels -100), and `counts`: (real source, real target, padded tokens, rows)
    of the batch as Python ints, computed here on the CPU so that counting costs the GPU nothing;
    `CountingSeq2SeqTrainer` takes them out before the model sees the batch."""
    import torch

    src_len = max(len(f["input_ids"]) for f in features)
    tgt_len = max(len(f["labels"]) for f in features)
    ids = torch.zeros(len(features), src_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full((len(features), tgt_len), -100, dtype=torch.long)
    for i, f in enumerate(features):
        s, t = torch.as_tensor(f["input_ids"]), torch.as_tensor(f["labels"])
        ids[i, : len(s)], mask[i, : len(s)], labels[i, : len(t)] = s, 1, t
    real_src = sum(len(f["input_ids"]) for f in features)
    real_tgt = sum(len(f["labels"]) for f in features)
    counts = (real_src, real_tgt, ids.numel() + labels.numel(), len(features))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "counts": counts}


def sampling_kwargs(group_by_length: bool) -> dict:
    """transformers 5 names the sampler `train_sampling_strategy="group_by_length"`; 4.x had
    `group_by_length=True`. Whichever this version's TrainingArguments has."""
    from transformers import Seq2SeqTrainingArguments

    fields = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    if "train_sampling_strategy" in fields:
        return {"train_sampling_strategy": "group_by_length" if group_by_length else "random"}
    return {"group_by_length": group_by_length}


def counting_trainer_class():
    """Seq2SeqTrainer that records each optimizer step's token counts (from `collate`) in `step_counts`:
    {step index: [real source, real target, padded, rows]}."""
    from transformers import Seq2SeqTrainer

    class CountingSeq2SeqTrainer(Seq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_counts: dict[int, list[int]] = {}

        def get_batch_samples(self, *args, **kwargs):
            batches, num_items = super().get_batch_samples(*args, **kwargs)
            totals = self.step_counts.setdefault(self.state.global_step, [0, 0, 0, 0])
            for batch in batches:
                for i, c in enumerate(batch.pop("counts")):
                    totals[i] += c
            return batches, num_items

    return CountingSeq2SeqTrainer


def step_timer_class():
    """A TrainerCallback recording each optimizer step's end (after a CUDA sync) in `ends`."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    return StepTimer


def cap_gpu_memory(gib: float) -> None:
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))


# ----------------------------------------------------------------------------------------------- the run


def run(settings: dict, steps: int, warmup: int, tiny: bool, gpu_memory_gib: float) -> dict:
    # The peer measured so far ran with expandable segments; set before CUDA starts.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainingArguments

    from trainer.model.tiny_model import flan_t5_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    records = make_records(n=256 if tiny else 4096)
    data = [{"input_ids": s, "labels": t} for s, t in records]
    cap_gpu_memory(gpu_memory_gib)
    torch.manual_seed(0)
    config = flan_t5_config("tiny" if tiny else "xl", vocab_size=VOCAB)
    with torch.device(device):
        model = AutoModelForSeq2SeqLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=settings["attn"]
        )
    timer = step_timer_class()()
    with tempfile.TemporaryDirectory(prefix="hf-peer-") as out:
        args = Seq2SeqTrainingArguments(
            output_dir=out,
            per_device_train_batch_size=settings["batch_size"],
            gradient_accumulation_steps=settings["grad_accum"],
            max_steps=steps,
            learning_rate=1e-4,
            optim=settings["optim"],
            gradient_checkpointing=True,
            bf16=False,  # the weights are bf16 already, as our trainer's
            report_to="none",
            logging_steps=10**9,
            save_strategy="no",
            dataloader_num_workers=2,
            remove_unused_columns=False,
            disable_tqdm=True,
            seed=0,
            **sampling_kwargs(settings["group_by_length"]),
        )
        trainer = counting_trainer_class()(
            model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[timer]
        )
        result = {"config": settings["name"], "label": describe(settings), "side": "peer", **settings}
        result["attn_used"] = model.config._attn_implementation
        result["params"] = sum(p.numel() for p in model.parameters())
        try:
            trainer.train()
        except torch.OutOfMemoryError:
            return result | {"ok": False, "error": "CUDA out of memory", **_peaks(torch)}
    seconds = timer.ends[steps - 1] - timer.ends[warmup - 1]
    timed = [trainer.step_counts[s] for s in range(warmup, steps)]
    src, tgt, padded, rows = (sum(c[i] for c in timed) for i in range(4))
    return result | {
        "ok": True,
        "steps": steps,
        "warmup": warmup,
        "real_tok_s": (src + tgt) / seconds,
        "samples_s": rows / seconds,
        "pad_frac": 1 - (src + tgt) / padded,
        "seconds_per_step": seconds / (steps - warmup),
        "source_tokens": src,
        "target_tokens": tgt,
        **_peaks(torch),
    }


def _peaks(torch) -> dict:
    if not torch.cuda.is_available():
        return {"peak_alloc_gib": None, "peak_reserved_gib": None}
    return {
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    parser.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    parser.add_argument("--batch-size", type=int, help="per_device_train_batch_size")
    parser.add_argument("--grad-accum", type=int, help="gradient_accumulation_steps")
    parser.add_argument("--optim", choices=OPTIMS)
    parser.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--attn", choices=("eager", "sdpa"))
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps in all")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--gpu-memory-gib", type=float, default=32.0, help="cap of this process")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (checks the script)")
    parser.add_argument("--out", help="write the result here as JSON (a directory: hf_peer_<config>.json)")
    args = parser.parse_args()
    if args.list_presets:
        for name, settings in PRESETS.items():
            print(f"{name}: {describe(settings)}")
        return 0
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")

    settings = dict(PRESETS[args.preset])
    overrides = {
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "optim": args.optim,
        "group_by_length": args.group_by_length,
        "attn": args.attn,
    }
    changed = {k: v for k, v in overrides.items() if v is not None and v != settings[k]}
    settings.update(changed)
    settings["name"] = f"hf_{args.preset}" + ("_custom" if changed else "")
    if args.tiny:  # few rows per step: the CPU checks the code path, not the speed
        settings.update(batch_size=min(settings["batch_size"], 4), grad_accum=min(settings["grad_accum"], 2))

    result = run(settings, args.steps, args.warmup, args.tiny, args.gpu_memory_gib)
    if result["ok"]:
        gib = lambda v: "n/a (CPU)" if v is None else f"{v:.1f} GiB"  # noqa: E731
        print("| config | real tok/s | samples/s | padding | peak alloc | peak reserved |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {result['label']} | {result['real_tok_s']:,.0f} | {result['samples_s']:.1f} "
            f"| {100 * result['pad_frac']:.1f}% | {gib(result['peak_alloc_gib'])} "
            f"| {gib(result['peak_reserved_gib'])} |"
        )
    if args.out:
        out = Path(args.out)
        if out.suffix != ".json":
            out.mkdir(parents=True, exist_ok=True)
            out = out / f"hf_peer_{settings['name']}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

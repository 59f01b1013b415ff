"""Equal quality per token: our trainer against Hugging Face Seq2SeqTrainer, T5-base from scratch on recipes.

    python3 bench/convergence.py --out results/convergence      # GPU: the five default runs, ~11 min (H100)
    python3 bench/convergence.py --out results/convergence --max-reference-s 100 \
        --runs reference,reference_adafactor,ours,ours_adamw    # the README's table, ~8 min
    python3 bench/convergence.py --tiny --out /tmp/convergence  # CPU: tiny shapes through the same code

Every speed lever must leave the loss per trained token where it was. The runs, each in its own process, on
the same data, tokenizer and initial weights:

- reference: Hugging Face `Seq2SeqTrainer`, AdamW (torch fused), fp32 weights with bf16 autocast
  (`bf16=True`), lr --adamw-lr with a linear warmup over the first 10% of the steps then constant,
  gradient checkpointing, group_by_length, SDPA, batches of 32 rows x the accumulation that matches ours in
  real tokens per optimizer step;
- reference_adafactor: the same with the preset's optimizer instead: Hugging Face's Adafactor (T5 settings:
  no relative step, no parameter scaling), lr 1e-3 constant, no warmup;
- ours: `python -m trainer train` with the rtx5090 preset's settings (configs/flan-t5-xl-rtx5090.yaml:
  Adafactor, Kahan-compensated bf16 weights, lr 1e-3 constant, 32k-token micro-batches x 2);
- ours_adamw: the same command with AdamW on bf16 weights with Kahan-compensated updates (torch-optimi),
  the reference's learning rate and warmup;
- ours_packed: the preset with packed rows (`packing: true`: several records per row, no padding);
- ours_packed_graphs: ours_packed in micro-batches of a quarter the tokens x 4 accumulation (the same
  optimizer steps), each micro-step a replayed CUDA graph (`cuda_graphs: true`).

Model: FLAN-T5-base's shape (d_model 768, d_ff 2048 gated-GELU, 12+12 layers, 12 heads x 64, vocab 32128),
random init (seed 0, saved once in bf16 and loaded by all four, the LM head untied and scaled so the first
logits are ~N(0, 1)). Data: `--records` generated recipes (trainer.sample.write_sample), a Unigram tokenizer
trained on the first `--tokenizer-records` of them with T5's special tokens (asked for 32k pieces; the
generator's vocabulary stops the trainer earlier, the count is printed), rendered and tokenized by the
trainer's Rust loader for all four runs; `--eval-fraction` of the records (by content hash) held out.

The reference trains until it has seen `--target-tokens` target tokens (or `--max-reference-s` seconds);
ours then train on that many target tokens plus `--ours-margin`, so that they can show whether they reach
the reference's final loss. Eval loss: the token-weighted mean cross-entropy over every held-out record, at
about `--evals` regular points of each run. Training time: the steps' own time, measured the same way on
both sides: evaluation and checkpoints are left out, and the first step (compilation, warm-up) is counted at
the median step's duration.

Verdicts (the goal every speed lever is held to): at the reference's final token count, our eval loss is
within 1% of the reference's; and we reach the reference's final eval loss in at most a quarter of its
training time. Writes convergence.png (eval loss against target tokens and against training time) and
convergence.json (every point) to --out, and prints a table and both verdicts for each of our runs. Each of
our runs is also compared with the Hugging Face run of its own optimizer (the preset's with
reference_adafactor, ours_adamw with the reference) at that run's final token count: the gap that the
trainer's speed levers alone make.

Needs `train_log.jsonl` rows with an `eval_loss` key ({"step", "eval_loss", "time"}) from the trainer.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "configs" / "flan-t5-xl-rtx5090.yaml"
MODEL_VOCAB = 32128  # FLAN-T5-base's embedding rows; the trained tokenizer uses the first few thousand
TOKENIZER_PIECES = 32000
HF_BATCH_SIZE = 32
WARMUP_FRACTION = 0.1
QUALITY_TOLERANCE = 0.01  # our eval loss at equal tokens: at most 1% above the reference's
TIME_SHARE = 0.25  # ... and the reference's final loss reached in at most a quarter of its training time
RUNS = {
    "reference": "HF Seq2SeqTrainer, AdamW, fp32 + bf16 autocast",
    "reference_adafactor": "HF Seq2SeqTrainer, Adafactor (lr 1e-3), fp32 + bf16 autocast",
    "ours": "ours, rtx5090 preset (Adafactor, Kahan bf16, lr 1e-3)",
    "ours_adamw": "ours, AdamW, Kahan bf16",
    "ours_packed": "ours, rtx5090 preset, packed rows",
    "ours_packed_graphs": "ours, rtx5090 preset, packed rows, micro-batches of 1/4 as CUDA graphs",
}
# Each of our runs against the Hugging Face run of its optimizer and schedule: what remains between them is
# the trainer's own doing (kernels, bf16 weights with Kahan updates, batching), not the optimizer's.
SAME_OPTIMIZER = {
    "ours": "reference_adafactor",
    "ours_packed": "reference_adafactor",
    "ours_packed_graphs": "reference_adafactor",
    "ours_adamw": "reference",
}


# -------------------------------------------------------------------------------------------- preparation


def write_initial_weights(config, model_dir: Path) -> int:
    """Random weights (seed 0) saved in bf16 for every run; returns the parameter count. The LM head gets
    its own weight scaled by d_model**-0.5 (initial logits ~N(0, 1), as trainer/tiny_model.py explains),
    and config.json says it is untied, as FLAN-T5's does."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config)
    model.lm_head.weight = torch.nn.Parameter(
        torch.randn(config.vocab_size, config.d_model) * config.d_model**-0.5
    )
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    model_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model_config["tie_word_embeddings"] = False
    model_config.pop("scale_decoder_outputs", None)
    (model_dir / "config.json").write_text(json.dumps(model_config, indent=2) + "\n", encoding="utf-8")
    return sum(p.numel() for p in model.parameters())


def prepare(work: Path, args) -> dict:
    """Recipes, tokenizer and initial weights under `work`; what was made and how long each part took."""
    from trainer.config import TASKS
    from trainer.sample import write_sample
    from trainer.tiny_model import flan_t5_config, recipe_texts, save_tokenizer, train_tokenizer

    times = {}
    t0 = time.perf_counter()
    data = work / "recipes.jsonl"
    write_sample(data, args.records, seed=0, fmt="jsonl")
    times["recipes_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    texts = recipe_texts(data, tasks=TASKS[:1], limit=args.tokenizer_records)  # the preset's prompt
    tok = train_tokenizer(texts, vocab_size=args.tokenizer_pieces)
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(tok, model_dir)
    times["tokenizer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model_vocab = MODEL_VOCAB if not args.tiny else 128 * math.ceil(vocab / 128)
    config = flan_t5_config("tiny" if args.tiny else "base", vocab_size=model_vocab)
    params = write_initial_weights(config, model_dir)
    times["weights_s"] = time.perf_counter() - t0
    return (
        dict(data=data, model_dir=model_dir, tokenizer_vocab=vocab, model_vocab=model_vocab, params=params)
        | times
    )


def preset_values() -> dict:
    """configs/flan-t5-xl-rtx5090.yaml's values."""
    import yaml

    return yaml.safe_load(PRESET.read_text(encoding="utf-8"))


def ours_config(prep: dict, args, work: Path, name: str) -> dict:
    """Our run's config: the rtx5090 preset's settings with this benchmark's data, model, evaluation and
    output; `name` "ours_adamw" swaps in AdamW with the reference's learning rate and warmup (set later)."""
    values = preset_values()
    values.update(
        model_name_or_path=str(prep["model_dir"]),
        train_files=[str(prep["data"])],
        output_dir=str(work / name),
        eval_fraction=args.eval_fraction,
        eval_max_batches=10**6,  # every held-out record
        eval_generation_records=0,  # eval loss only: the reference generates nothing either
        num_eval_generations=0,
        save_steps=10**9,
        save_total_limit=1,
        save_final=False,
        logging_steps=1,
        report_to="none",
        resume="never",
        progress_bar=False,
        discord_progress_minutes=-1.0,
        gpu_memory_limit_gib=None if args.tiny else args.gpu_memory_gib,
    )
    if args.tiny:  # CPU: fp32 (Kahan has nothing to compensate), small batches
        values.update(dtype="float32", max_tokens=1024, gradient_accumulation_steps=2)
    if name in ("ours_packed", "ours_packed_graphs"):
        values.update(packing=True)
    if name == "ours_packed_graphs" and not args.tiny:  # the same effective batch in 4x the micro-steps
        accumulation = values["gradient_accumulation_steps"] * 4
        values.update(
            cuda_graphs=True, max_tokens=values["max_tokens"] // 4, gradient_accumulation_steps=accumulation
        )
    if args.seed is not None:
        values.update(seed=args.seed)
    if name == "ours_adamw":
        values.update(
            optimizer="adamw",
            bf16_update="kahan",
            learning_rate=args.adamw_lr,
            lr_scheduler_type="constant_with_warmup",
        )
    return values


def loader_config(values: dict):
    from trainer.config import TrainConfig
    from trainer.memory_plan import with_planned_batch

    return with_planned_batch(TrainConfig.from_dict(values, source="convergence"), gpu_bytes=None)


def token_rows(cfg, tokenizer_file: str, split: str) -> dict[str, np.ndarray]:
    """Every record of `split` as the trainer's loader tokenizes it: flat source/target ids and offsets."""
    from trainer.data import stream_for

    rows_cfg = dataclasses.replace(cfg, max_tokens=None, per_device_train_batch_size=1024, shuffle=False)
    src, tgt, src_len, tgt_len = [], [], [], []
    for batch in stream_for(rows_cfg, tokenizer_file, split):
        n_src = batch["attention_mask"].sum(1)
        n_tgt = (batch["labels"] != -100).sum(1)
        for i in range(len(n_src)):
            src.append(batch["input_ids"][i, : n_src[i]])
            tgt.append(batch["labels"][i, : n_tgt[i]])
        src_len.append(n_src)
        tgt_len.append(n_tgt)
    offsets = lambda lens: np.concatenate([[0], np.cumsum(np.concatenate(lens))])  # noqa: E731
    return {
        "src": np.concatenate(src).astype(np.int32),
        "src_off": offsets(src_len),
        "tgt": np.concatenate(tgt).astype(np.int32),
        "tgt_off": offsets(tgt_len),
    }


@dataclasses.dataclass
class StepPlan:
    """Our trainer's optimizer steps on this data (same config and seed as the run, so the same batches in the
    same order): the target tokens trained after each step, and the real tokens per step."""

    cumulative_target: list[int]
    real_tokens_per_step: float

    def steps_for(self, target_tokens: float) -> int:
        """The steps after which at least `target_tokens` target tokens are trained."""
        i = bisect.bisect_left(self.cumulative_target, target_tokens)
        if i == len(self.cumulative_target):
            raise ValueError(
                f"the plan covers {self.cumulative_target[-1]:,} target tokens, not {target_tokens:,.0f}"
            )
        return i + 1


def plan_steps(cfg, tokenizer_file: str, target_tokens: float) -> StepPlan:
    """Our steps up to `target_tokens` target tokens, read from the loader as the trainer reads it."""
    from trainer.data import stream_for

    stream = stream_for(cfg, tokenizer_file, "train")
    cumulative, batches, target, real, epoch = [], 0, 0, 0, 0
    while target < target_tokens:
        stream.set_epoch(epoch)
        for batch in stream:
            n_tgt = int((batch["labels"] != -100).sum())
            target += n_tgt
            real += n_tgt + int(batch["attention_mask"].sum())
            batches += 1
            if batches % cfg.gradient_accumulation_steps == 0:
                cumulative.append(target)
                if target >= target_tokens:
                    break
        epoch += 1
    return StepPlan(cumulative, real / max(len(cumulative), 1))


# ---------------------------------------------------------------------------------------- the reference


class RowsDataset:
    """Records as {"input_ids", "labels"} lists of ids, from token_rows' flat arrays."""

    def __init__(self, rows: dict[str, np.ndarray]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["src_off"]) - 1

    def __getitem__(self, i: int) -> dict:
        r = self.rows
        return {
            "input_ids": r["src"][r["src_off"][i] : r["src_off"][i + 1]].tolist(),
            "labels": r["tgt"][r["tgt_off"][i] : r["tgt_off"][i + 1]].tolist(),
        }


def eval_batches(rows: dict[str, np.ndarray], rows_per_batch: int, device) -> list[dict]:
    """The held-out records in batches of similar length, padded, on `device`."""
    from hf_peer import collate

    data = RowsDataset(rows)
    order = sorted(range(len(data)), key=lambda i: (len(data[i]["labels"]), len(data[i]["input_ids"])))
    batches = []
    for start in range(0, len(order), rows_per_batch):
        batch = collate([data[i] for i in order[start : start + rows_per_batch]])
        batch.pop("counts")
        batches.append({k: v.to(device) for k, v in batch.items()})
    return batches


def eval_loss(model, batches: list[dict], autocast: bool) -> float:
    """Token-weighted mean cross-entropy over `batches` (fp32 loss on the model's logits)."""
    import torch
    import torch.nn.functional as F

    device_type = next(model.parameters()).device.type
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        for b in batches:
            logits = model(
                input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]
            ).logits
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum"
            )
            total += float(loss)
            count += int((b["labels"] != -100).sum())
    model.train()
    return total / count


def reference_run(spec: dict) -> dict:
    """The Hugging Face side, in its own process (`--reference SPEC`)."""
    import torch
    from hf_peer import cap_gpu_memory, collate, counting_trainer_class, sampling_kwargs
    from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainingArguments, TrainerCallback

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    cap_gpu_memory(spec["gpu_memory_gib"])
    model = AutoModelForSeq2SeqLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.to(device)
    rows = np.load(spec["rows"])
    train_rows = {k.removeprefix("train_"): rows[k] for k in rows.files if k.startswith("train_")}
    held_out = eval_batches(
        {k.removeprefix("eval_"): rows[k] for k in rows.files if k.startswith("eval_")},
        rows_per_batch=32 if on_cuda else 8,
        device=device,
    )
    step_counts: dict[int, list[int]] = {}

    class Progress(TrainerCallback):
        """Step ends (after a CUDA sync), evaluations every `eval_every` steps, and the stop at the token
        budget or the time limit (with a last evaluation)."""

        def __init__(self):
            self.t0 = 0.0
            self.ends: list[float] = []
            self.evals: list[dict] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if on_cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.ends.append(now - self.t0)
            step = state.global_step
            target = sum(step_counts[s][1] for s in range(step))
            done = target >= spec["target_tokens"] or now - self.t0 > spec["max_train_seconds"]
            if step % spec["eval_every"] == 0 or done:
                loss = eval_loss(model, held_out, autocast=True)
                self.evals.append({"step": step, "target_tokens": target, "eval_loss": loss})
                print(f"step {step}, {target:,} target tokens, eval loss {loss:.4f}", flush=True)
            control.should_training_stop = done

    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="convergence-hf-") as out:
        adafactor = spec["optimizer"] == "adafactor"  # HF's Adafactor with T5's settings, as the preset
        args = Seq2SeqTrainingArguments(
            output_dir=out,
            per_device_train_batch_size=spec["batch_size"],
            gradient_accumulation_steps=spec["grad_accum"],
            max_steps=10**6,  # stopped by the token budget
            learning_rate=spec["learning_rate"],
            lr_scheduler_type="constant" if adafactor else "constant_with_warmup",
            warmup_steps=0 if adafactor else spec["warmup_steps"],
            optim="adafactor" if adafactor else "adamw_torch_fused",
            weight_decay=0.0,
            max_grad_norm=1.0,
            bf16=True,  # fp32 master weights, bf16 autocast
            use_cpu=not on_cuda,  # (the CPU check: autocast on the CPU)
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            report_to="none",
            logging_steps=10**9,
            save_strategy="no",
            dataloader_num_workers=2,
            remove_unused_columns=False,
            disable_tqdm=True,
            seed=0,
            **sampling_kwargs(True),
        )
        trainer = counting_trainer_class()(
            model=model,
            args=args,
            train_dataset=RowsDataset(train_rows),
            data_collator=collate,
            callbacks=[progress],
        )
        trainer.step_counts = step_counts
        trainer.train()
    steps = [
        {
            "step": s + 1,
            "end_s": progress.ends[s],
            "source_tokens": c[0],
            "target_tokens": c[1],
            "padded": c[2],
        }
        for s, c in sorted(step_counts.items())
        if s < len(progress.ends)
    ]
    result = {"steps": steps, "evals": progress.evals}
    if on_cuda:
        result["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


# ------------------------------------------------------------------------------------------------- ours


def read_train_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a train_log.jsonl: train rows have `loss`, eval rows `eval_loss`."""
    train, evals = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if "eval_loss" in row:
            evals.append(row)
        elif "loss" in row:
            train.append(row)
    return train, evals


def ours_curve(train_rows: list[dict], eval_rows: list[dict]) -> dict:
    """Our run's steps and eval points in the reference's form (step ends relative to the first row)."""
    t_first = train_rows[0]["time"]
    steps = [
        {
            "step": r["step"],
            "end_s": r["time"] - t_first,
            "source_tokens": r["source_tokens"],
            "target_tokens": r["target_tokens"],
            "padded": r.get("padded_tokens"),
        }
        for r in train_rows
    ]
    tokens = np.cumsum([r["target_tokens"] for r in train_rows])
    by_step = {r["step"]: int(t) for r, t in zip(train_rows, tokens, strict=True)}
    evals = [
        {"step": e["step"], "target_tokens": by_step[e["step"]], "eval_loss": e["eval_loss"]}
        for e in eval_rows
        if e["step"] in by_step
    ]
    return {"steps": steps, "evals": evals}


# --------------------------------------------------------------------------------------------- analysis


def training_seconds(steps: list[dict], disturbed: set[int]) -> dict[int, float]:
    """Cumulative training seconds at each step's end, measured alike on both sides: a step's duration is
    the time since the previous step's end, except for the first step (compilation, warm-up) and the steps
    right after an evaluation (which include it, and our best-so-far checkpoint): those count as the median
    of the others."""
    durations = {}
    for prev, cur in zip(steps, steps[1:], strict=False):
        if prev["step"] not in disturbed:
            durations[cur["step"]] = cur["end_s"] - prev["end_s"]
    median = statistics.median(durations.values()) if durations else 0.0
    total, out = 0.0, {}
    for s in steps:
        total += durations.get(s["step"], median)
        out[s["step"]] = total
    return out


def curve(run: dict) -> list[dict]:
    """Eval points with their training seconds: [{"step", "target_tokens", "eval_loss", "seconds"}]."""
    seconds = training_seconds(run["steps"], {e["step"] for e in run["evals"]})
    return [e | {"seconds": seconds[e["step"]]} for e in run["evals"] if e["step"] in seconds]


def interpolate(points: list[dict], x_key: str, x: float, y_key: str) -> float | None:
    """y at x by linear interpolation between the points around x; None outside their range."""
    for a, b in zip(points, points[1:], strict=False):
        if a[x_key] <= x <= b[x_key]:
            share = 0.0 if b[x_key] == a[x_key] else (x - a[x_key]) / (b[x_key] - a[x_key])
            return a[y_key] + share * (b[y_key] - a[y_key])
    if points and points[-1][x_key] == x:
        return points[-1][y_key]
    return None


def seconds_to_reach(points: list[dict], loss: float) -> float | None:
    """Training seconds at which the eval loss first falls to `loss` (linear between eval points)."""
    for i, p in enumerate(points):
        if p["eval_loss"] <= loss:
            if i == 0:
                return p["seconds"]
            a = points[i - 1]
            share = (a["eval_loss"] - loss) / (a["eval_loss"] - p["eval_loss"])
            return a["seconds"] + share * (p["seconds"] - a["seconds"])
    return None


def verdicts(reference: list[dict], ours: list[dict]) -> dict:
    final = reference[-1]
    at_tokens = interpolate(ours, "target_tokens", final["target_tokens"], "eval_loss")
    gap = None if at_tokens is None else at_tokens / final["eval_loss"] - 1
    gaps = [
        interpolate(ours, "target_tokens", p["target_tokens"], "eval_loss")
        for p in reference[len(reference) // 2 :]
    ]
    gaps = [
        g / p["eval_loss"] - 1
        for g, p in zip(gaps, reference[len(reference) // 2 :], strict=True)
        if g is not None
    ]
    reach = seconds_to_reach(ours, final["eval_loss"])
    share = None if reach is None else reach / final["seconds"]
    return {
        "reference_final_tokens": final["target_tokens"],
        "reference_final_loss": final["eval_loss"],
        "reference_seconds": final["seconds"],
        "loss_at_reference_tokens": at_tokens,
        "gap": gap,
        "worst_gap_second_half": max(gaps) if gaps else None,
        "quality_ok": gap is not None and gap <= QUALITY_TOLERANCE,
        "seconds_to_reference_loss": reach,
        "time_share": share,
        "time_ok": share is not None and share <= TIME_SHARE,
    }


def verdict_line(name: str, v: dict) -> str:
    gap = "not measured" if v["gap"] is None else f"{100 * v['gap']:+.2f}%"
    share = "never" if v["time_share"] is None else f"{100 * v['time_share']:.0f}%"
    return (
        f"{name}: equal tokens {'PASS' if v['quality_ok'] else 'FAIL'}: eval loss {gap} vs the reference's "
        f"at {v['reference_final_tokens'] / 1e6:.2f}M target tokens "
        f"(goal <= +{100 * QUALITY_TOLERANCE:.0f}%); "
        f"time {'PASS' if v['time_ok'] else 'FAIL'}: the reference's final loss "
        f"{v['reference_final_loss']:.4f} reached in {share} of its {v['reference_seconds']:.0f} s "
        f"(goal <= {100 * TIME_SHARE:.0f}%)"
    )


def plot(curves: dict[str, list[dict]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, points in curves.items():
        if not points:
            continue
        dashed = name.startswith("reference")
        style = dict(marker="o", markersize=3, label=RUNS[name], linestyle="--" if dashed else "-")
        losses = [p["eval_loss"] for p in points]
        by_tokens.plot([p["target_tokens"] / 1e6 for p in points], losses, **style)
        by_time.plot([p["seconds"] for p in points], losses, **style)
    if curves.get("reference"):
        final = curves["reference"][-1]["eval_loss"]
        for ax in (by_tokens, by_time):
            ax.axhline(final, color="gray", linewidth=0.8, linestyle=":")
    by_tokens.set_xlabel("target tokens trained (millions)")
    by_time.set_xlabel("training time (s; evaluation and checkpoints left out)")
    for ax in (by_tokens, by_time):
        ax.set_ylabel("eval loss (held-out recipes, per token)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / "convergence.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------- main


def run_child(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run `cmd` in the log's directory with its output in `log`; (exit code, seconds). 124 on timeout.
    (Not in the checkout: `python -m trainer` there would import its source tree, which may lack the
    built loader, instead of the installed package.)"""
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=os.environ, cwd=log.parent
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])


@dataclasses.dataclass
class Setup:
    """What the runs share: data, model, tokenizer, the loader's view of it, the batch plans."""

    prep: dict
    cfg: object  # our TrainConfig (the preset's batching), for the loader
    tokenizer_file: str
    rows_file: Path
    plan: StepPlan  # ours
    batch_size: int  # the reference's rows per micro-batch ...
    grad_accum: int  # ... and accumulation, matching ours in real tokens per optimizer step
    reference_steps: float  # the reference's optimizer steps for --target-tokens (estimated)


def set_up(args, work: Path) -> Setup:
    """Recipes, tokenizer, initial weights; the held-out and training records as the loader tokenizes them;
    the reference's batch matched to ours."""
    prep = prepare(work, args)
    print(
        f"prepared {args.records:,} recipes in {prep['recipes_s']:.0f} s; tokenizer "
        f"({prep['tokenizer_vocab']:,} pieces from {args.tokenizer_records:,} recipes) in "
        f"{prep['tokenizer_s']:.0f} s; initial weights ({prep['params'] / 1e6:.0f}M parameters) in "
        f"{prep['weights_s']:.0f} s",
        flush=True,
    )
    t0 = time.perf_counter()
    cfg = loader_config(ours_config(prep, args, work, "ours"))
    tokenizer_file = str(prep["model_dir"] / "tokenizer.json")
    train_rows = token_rows(cfg, tokenizer_file, "train")
    held_out = token_rows(cfg, tokenizer_file, "eval")
    rows_file = work / "rows.npz"
    np.savez(
        rows_file,
        **{f"train_{k}": v for k, v in train_rows.items()},
        **{f"eval_{k}": v for k, v in held_out.items()},
    )
    n_train, n_eval = len(train_rows["src_off"]) - 1, len(held_out["src_off"]) - 1
    mean_src, mean_tgt = len(train_rows["src"]) / n_train, len(train_rows["tgt"]) / n_train
    # Enough steps for ours on anything the reference can reach (it stops at the step passing the budget).
    plan = plan_steps(cfg, tokenizer_file, 1.1 * args.target_tokens * (1 + args.ours_margin) + 10**5)
    batch = HF_BATCH_SIZE if not args.tiny else 4
    grad_accum = max(1, round(plan.real_tokens_per_step / (mean_src + mean_tgt) / batch))
    print(
        f"data: {n_train:,} train / {n_eval:,} held-out records, mean {mean_src:.0f} source + {mean_tgt:.0f} "
        f"target tokens; ours ~{plan.real_tokens_per_step:,.0f} real tokens per step, the reference "
        f"{batch} rows x {grad_accum} (~{batch * grad_accum * (mean_src + mean_tgt):,.0f}); "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    reference_steps = args.target_tokens / (batch * grad_accum * mean_tgt)
    return Setup(prep, cfg, tokenizer_file, rows_file, plan, batch, grad_accum, reference_steps)


def run_reference(name: str, setup: Setup, args, work: Path, timeout: float) -> dict:
    """A Hugging Face run (`reference` or `reference_adafactor`), in its own process."""
    adafactor = name == "reference_adafactor"
    spec = {
        "model_dir": str(setup.prep["model_dir"]),
        "rows": str(setup.rows_file),
        "batch_size": setup.batch_size,
        "grad_accum": setup.grad_accum,
        "optimizer": "adafactor" if adafactor else "adamw",
        "learning_rate": preset_values()["learning_rate"] if adafactor else args.adamw_lr,
        "warmup_steps": max(1, round(WARMUP_FRACTION * setup.reference_steps)),
        "target_tokens": args.target_tokens,
        "max_train_seconds": args.max_reference_s,
        "eval_every": max(1, round(setup.reference_steps / args.evals)),
        "gpu_memory_gib": args.gpu_memory_gib,
        "result": str(work / f"{name}.json"),
    }
    (work / f"{name}_spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", args.out]
    cmd += ["--reference", str(work / f"{name}_spec.json")]
    log = work / f"{name}.log"
    rc, seconds = run_child(cmd, log, timeout=timeout)
    if rc != 0:
        print(f"{name}: failed (exit {rc}):\n{tail(log)}", flush=True)
        return {"ok": False, "log": tail(log, 40)}
    run = json.loads(Path(spec["result"]).read_text())
    tokens = run["evals"][-1]["target_tokens"]
    print(f"{name}: {len(run['steps'])} steps, {tokens:,} target tokens, {seconds:.0f} s", flush=True)
    return run | {"ok": True, "process_s": seconds, "spec": spec}


def run_ours(name: str, setup: Setup, args, work: Path, target_tokens: float, timeout: float) -> dict:
    """`python -m trainer train` on `target_tokens` plus the margin, evaluating about --evals times by
    `target_tokens`; its train log's steps and evaluations (those it logged, when stopped by `timeout`)."""
    import yaml

    values = ours_config(setup.prep, args, work, name)
    plan = setup.plan
    if values.get("packing") or args.seed is not None:  # other batches (packed rows, another order): own plan
        plan = plan_steps(loader_config(values), setup.tokenizer_file, target_tokens * (1 + args.ours_margin))
    at_target = plan.steps_for(target_tokens)
    values.update(
        max_steps=plan.steps_for(target_tokens * (1 + args.ours_margin)),
        eval_steps=max(1, round(at_target / args.evals)),
    )
    if name == "ours_adamw":
        values["warmup_steps"] = max(1, round(WARMUP_FRACTION * at_target))
    config_file = work / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(values))
    cmd = [sys.executable, "-m", "trainer", "train", "--config", str(config_file)]
    rc, seconds = run_child(cmd, work / f"{name}.log", timeout=timeout)
    log_file = Path(values["output_dir"]) / "train_log.jsonl"
    train_log, eval_log = read_train_log(log_file) if log_file.exists() else ([], [])
    if rc not in (0, 124) or not train_log:
        print(f"{name}: failed (exit {rc}):\n{tail(work / f'{name}.log')}", flush=True)
        return {"ok": False, "log": tail(work / f"{name}.log", 40)}
    if rc == 124:
        print(
            f"{name}: stopped after {timeout:.0f} s (--budget-s); what it logged until then counts",
            flush=True,
        )
    run = ours_curve(train_log, eval_log)
    print(f"{name}: {len(run['steps'])} steps, {len(run['evals'])} evaluations, {seconds:.0f} s", flush=True)
    if not eval_log:
        print(
            f"{name}: {log_file} has no eval rows ({{'step', 'eval_loss', 'time'}}): this trainer does not "
            "log its evaluations there yet",
            flush=True,
        )
    return run | {"ok": True, "process_s": seconds, "config": values}


def left(started: float, args) -> float:
    """Seconds of --budget-s left (at least 30: a run gets a chance to start); the CPU check has no budget."""
    if args.tiny:
        return 3600.0
    return max(30.0, args.budget_s - (time.perf_counter() - started))


def report(results: dict, out: Path, title: str) -> Path:
    """Curves and verdicts into `results`; the table and verdict lines printed; the plot written."""
    curves = {name: curve(r) for name, r in results["runs"].items() if r.get("ok")}
    reference = curves.get("reference") or []
    for name, points in curves.items():
        results["runs"][name]["curve"] = points
        if name != "reference" and reference and points:
            results["runs"][name]["verdicts"] = verdicts(reference, points)
        same = curves.get(SAME_OPTIMIZER.get(name, ""))
        if same and points:
            results["runs"][name]["vs_same_optimizer"] = verdicts(same, points)
    print()
    print(
        "| run | eval loss at the reference's final tokens | vs reference | training time to the reference's "
        "final loss | share of the reference's time | process wall time |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results["runs"].items():
        print("| " + " | ".join([RUNS[name], *table_cells(name, r, curves.get(name))]) + " |")
    print()
    for name, r in results["runs"].items():
        if r.get("verdicts") and not name.startswith("reference"):
            print(verdict_line(name, r["verdicts"]))
    for name, r in results["runs"].items():
        v = r.get("vs_same_optimizer")
        if v and v["gap"] is not None:
            print(
                f"{name} against {SAME_OPTIMIZER[name]} (same optimizer and schedule): eval loss "
                f"{100 * v['gap']:+.2f}% at {v['reference_final_tokens'] / 1e6:.2f}M target tokens"
            )
    return plot(curves, out, title)


def table_cells(name: str, r: dict, points: list[dict] | None) -> list[str]:
    if not r.get("ok"):
        return ["failed", "", "", "", ""]
    wall = f"{r['process_s']:.0f} s"
    if name == "reference":
        if not points:
            return ["-", "-", "-", "-", wall]
        last = points[-1]
        return [
            f"{last['eval_loss']:.4f} at {last['target_tokens'] / 1e6:.2f}M",
            "1",
            f"{last['seconds']:.0f} s",
            "1",
            wall,
        ]
    v = r.get("verdicts")
    if not v:
        return ["-", "-", "-", "-", wall]
    loss = "-" if v["loss_at_reference_tokens"] is None else f"{v['loss_at_reference_tokens']:.4f}"
    gap = "-" if v["gap"] is None else f"{100 * v['gap']:+.2f}%"
    reach = v["seconds_to_reference_loss"]
    share = "-" if v["time_share"] is None else f"{100 * v['time_share']:.0f}%"
    return [loss, gap, "not reached" if reach is None else f"{reach:.0f} s", share, wall]


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", required=True, help="directory for convergence.png and convergence.json")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--records", type=int, default=200_000, help="generated recipes")
    parser.add_argument(
        "--tokenizer-records", type=int, default=50_000, help="recipes the tokenizer learns on"
    )
    parser.add_argument("--tokenizer-pieces", type=int, default=TOKENIZER_PIECES)
    parser.add_argument("--eval-fraction", type=float, default=0.005, help="records held out for eval")
    parser.add_argument("--target-tokens", type=float, default=4e6, help="the reference's training budget")
    parser.add_argument("--max-reference-s", type=float, default=120, help="...or this many seconds of it")
    parser.add_argument("--ours-margin", type=float, default=0.2, help="ours train this share longer")
    parser.add_argument("--evals", type=int, default=8, help="evaluations per run (about)")
    parser.add_argument("--adamw-lr", type=float, default=5e-4, help="AdamW's lr, the reference's and ours")
    parser.add_argument("--gpu-memory-gib", type=float, default=32.0)
    parser.add_argument(
        "--seed",
        type=int,
        help="our runs' seed (data order, dropout) instead of the preset's: how far a run moves by chance",
    )
    parser.add_argument(
        "--runs",
        default="reference,reference_adafactor,ours,ours_adamw,ours_packed",
        help=f"of {', '.join(RUNS)}",
    )
    parser.add_argument("--budget-s", type=float, default=480, help="stop any run still going after this (s)")
    parser.add_argument("--work", help="keep the data, models and logs here (default: a temporary dir)")
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # internal: the HF run's spec file
    args = parser.parse_args()

    if args.reference:
        spec = json.loads(Path(args.reference).read_text())
        Path(spec["result"]).write_text(json.dumps(reference_run(spec)))
        return 0
    if args.tiny:
        args.records = min(args.records, 3000)
        args.tokenizer_records = min(args.tokenizer_records, 3000)
        args.tokenizer_pieces = min(args.tokenizer_pieces, 2000)
        args.eval_fraction = max(args.eval_fraction, 0.02)
        args.target_tokens = min(args.target_tokens, 12_000)
        args.max_reference_s = max(args.max_reference_s, 900)  # a busy CPU: stop by tokens, as on the GPU
        args.evals = min(args.evals, 3)
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    if "ours_adamw" in runs and importlib.util.find_spec("optimi") is None:
        parser.error("ours_adamw needs torch-optimi (pip install torch-optimi), or leave it out with --runs")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="convergence-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    setup = set_up(args, work)
    results: dict = {"args": vars(args), "prep": {k: str(v) for k, v in setup.prep.items()}, "runs": {}}
    target_tokens = args.target_tokens
    for name in [r for r in runs if r.startswith("reference")]:
        timeout = min(args.max_reference_s + 180, left(started, args))
        results["runs"][name] = run_reference(name, setup, args, work, timeout)
    if results["runs"].get("reference", {}).get("ok"):  # ours train on what the reference reached
        target_tokens = results["runs"]["reference"]["evals"][-1]["target_tokens"]
    for name in [r for r in runs if not r.startswith("reference")]:
        results["runs"][name] = run_ours(
            name, setup, args, work, target_tokens, min(300, left(started, args))
        )

    title = (
        f"T5-base from scratch on {args.records:,} generated recipes, "
        f"{setup.prep['tokenizer_vocab']:,}-piece tokenizer" + (" (tiny CPU check)" if args.tiny else "")
    )
    png = report(results, out, title)
    results["total_s"] = time.perf_counter() - started
    (out / "convergence.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {png} and {out / 'convergence.json'}; {results['total_s']:.0f} s in all")
    return 0 if all(r.get("ok") for r in results["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

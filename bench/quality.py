"""Quality per token, with seeds: does a speed lever or a setting learn as well as the baseline does?

    python3 bench/quality.py --out results/quality             # every variant, 3 seeds, on all GPUs
    python3 bench/quality.py --out results/quality --variants padded,packed,packed_graphs --seeds 5
    python3 bench/quality.py --out results/quality --variants padded --extra lora_r16:adapter=lora,lora_r=16
    python3 bench/quality.py --out results/quality --variants padded,ddp2,fsdp2   # FSDP2 against ddp, 2 GPUs
    python3 bench/quality.py --tiny --out /tmp/quality         # CPU: tiny shapes through the same code

What users do with FLAN-T5, at a size that runs many times in minutes: a small T5 (FLAN-T5-small's shape) is
first pretrained with T5's span corruption and prefix LM on generated recipe text, then every run fine-tunes
that one pretrained model on other recipes and is evaluated on held-out ones:

1. Data: three disjoint sets of generated recipes (trainer.data.sample): the pretraining text, the fine-tuning
   set and --eval-records held-out records (the eval loss is the token mean over all of them). A
   SentencePiece-Unigram tokenizer is trained on the pretraining text.
2. Pretraining: random weights, T5's span corruption (15% of the words in spans of 3 on average, each span
   replaced by a sentinel; the target is the spans after their sentinels) mixed with T5's prefix-LM objective
   (the recipe cut at a random word between 10% and 50% of it: the source is its start, the target the
   rest), so that the decoder already writes long text when fine-tuning starts, as FLAN-T5's does (span
   corruption alone leaves 300 fine-tuning steps mostly learning to write, which rewards the highest learning
   rate and spreads the seeds), written as pre-rendered
   source/target pairs and trained by this trainer (`trainer train`, under torchrun on every GPU, 4
   micro-batches a step on 1, 2 or 4 GPUs alike): AdamW with Kahan-compensated bf16 weights, packed rows,
   warm-up and cosine decay, dropout off. Made once per --work: a later call reuses it.
3. Fine-tuning: each variant x each seed (data order and dropout) is one run of --steps optimizer steps from
   the pretrained weights (dropout 0.1, as FLAN-T5's config), evaluated every --eval-every steps, then scored
   by `trainer evaluate` (ROUGE-L, ingredient coverage, ...) on a fixed sample of the held-out records. The
   runs are spread over the GPUs, one run per GPU at a time (`--runs-per-gpu`); a run of several processes
   (`ddp2`, `fsdp2`, or `processes=N` in `--extra`) under torchrun on as many GPUs.

The baseline (`padded`) is the rtx5090 preset's optimization (optimizer, learning rate, schedule, Kahan
bf16, clipping: read from configs/flan-t5-xl-rtx5090.yaml) on padded rows in the eager loop, its batch scaled
to this model. Every other variant changes one thing; the table says what. Batches are matched in real
tokens per optimizer step, so the variants take the same optimizer steps; they are compared at equal
optimizer steps (the last evaluation) and at equal target tokens (the eval loss interpolated at the
baseline's mean final token count): mean +- standard error over seeds, and the difference to the baseline
with its standard error. A lever passes when its mean is no more than 1% above the baseline's; a difference
within two standard errors is noise, in either direction, and the table says so.

The Hugging Face references (`hf_adamw`: AdamW with fp32 master weights and bf16 autocast; `hf_adafactor`:
transformers' Adafactor with the preset's settings) are Seq2SeqTrainer on the same token ids, batches and
steps (group_by_length, SDPA).

Also one run of bench/packing_exact.py on the pretrained model: packed, padded and CUDA-graph steps over the
same records, bf16, dropout off, against the spread of two padded splits.

Writes quality.json (every run's curve and metrics) and quality.png to --out, after each run, and prints the
table last. --budget-s stops starting runs after that many seconds (what finished is reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_run
import numpy as np

REPO = Path(__file__).resolve().parent.parent
BASELINE = "padded"
PASS_MARGIN = 0.01  # a lever passes when its mean eval loss is at most 1% above the baseline's
SENTINELS = 100  # the tokenizer's <extra_id_N>
NOISE_DENSITY, MEAN_SPAN = 0.15, 3.0  # T5's span corruption
CORRUPTIONS = 1  # span-corruption pairs per recipe
PREFIX_LM = 1  # prefix-LM pairs per recipe, each cut elsewhere
PRETRAIN_MICRO_BATCHES = 4  # per pretraining step, across the GPUs and accumulation


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each part is: the GPU benchmark's, or the CPU check's (--tiny)."""

    shape: str  # "small": FLAN-T5-small's layers; "tiny": trainer.model.tiny_model's
    pretrain_records: int
    finetune_records: int
    eval_records: int
    tokenizer_records: int
    pretrain_tokens: int  # target + source tokens the pretraining trains on (all GPUs together)
    pretrain_micro_tokens: int
    packed_rows: int  # packed rows per optimizer step (a multiple of 8); the padded budget is matched to it
    max_source_length: int
    max_target_length: int
    steps: int
    eval_every: int
    generation_records: int
    max_new_tokens: int
    dtype: str


GPU = Sizes(
    "small", 300_000, 30_000, 2_400, 30_000, 200_000_000, 65_536, 16, 512, 512, 300, 100, 128, 320, "bfloat16"
)
TINY = Sizes("tiny", 2_000, 800, 60, 2_000, 24_000, 1_024, 8, 64, 96, 6, 3, 4, 32, "float32")
SMALL_SHAPE = dict(d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_decoder_layers=8, num_heads=6)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    title: str
    settings: dict  # config values on top of the baseline's (ours), or the reference's spec (hf)
    hf: bool = False
    processes: int = 1  # ours under torchrun on this many GPUs (each its share of the same global batch)


def preset_optimization() -> dict:
    """The rtx5090 preset's optimization settings, which the baseline keeps."""
    return bench_run.preset_optimization() | {
        "pad_to_multiple_of": bench_run.read_preset().get("pad_to_multiple_of")
    }


def variants(args, packed_rows: int) -> dict[str, Variant]:
    """Every variant this benchmark knows; `packed_rows`: the packed variants' rows per optimizer step (the
    baseline's budget is matched to their real tokens), a multiple of 8."""
    import yaml

    preset = preset_optimization()
    warmup = max(1, round(0.05 * args.steps))
    schedule = f"lr {preset['learning_rate']:g} {preset['lr_scheduler_type']}"
    preset_warmup = preset.get("warmup_steps") or 0  # below 1: a share of the steps
    if preset_warmup:
        schedule += f", warm-up {preset_warmup:.0%}" if preset_warmup < 1 else f", warm-up {preset_warmup}"
    adamw = dict(
        optimizer="adamw", learning_rate=args.adamw_lr, lr_scheduler_type="linear", warmup_steps=warmup
    )
    known = [
        Variant(BASELINE, f"ours, padded rows, eager ({preset['optimizer']}, {schedule}, Kahan bf16)", {}),
        Variant(
            "packed",
            "ours, packed rows (same real tokens per step)",
            dict(packing=True, per_device_train_batch_size=packed_rows // 2, max_tokens=None),
        ),
        Variant(
            "packed_graphs",
            "ours, packed rows, micro-batches of 1/4 as CUDA graphs",
            dict(
                packing=True,
                per_device_train_batch_size=packed_rows // 8,
                max_tokens=None,
                gradient_accumulation_steps=8,
                cuda_graphs=True,
            ),
        ),
        Variant(
            "constant",
            f"ours, padded, lr {preset['learning_rate']:g} constant, no warm-up",
            dict(lr_scheduler_type="constant", warmup_steps=0),
        ),
        Variant(
            "warmup_linear",
            f"ours, padded, lr {preset['learning_rate']:g}, warm-up {warmup} steps then linear decay to 0",
            dict(lr_scheduler_type="linear", warmup_steps=warmup),
        ),
        Variant(
            "warmup_cosine",
            f"ours, padded, lr {preset['learning_rate']:g}, warm-up {warmup} steps then cosine decay to 0",
            dict(lr_scheduler_type="cosine", warmup_steps=warmup),
        ),
        Variant(
            "kahan_8bit",
            "ours, padded, the Kahan buffer in 8-bit codes (stochastically rounded; 1 byte per weight less)",
            dict(bf16_update="kahan_8bit"),
        ),
        Variant(
            "adamw",
            f"ours, padded, AdamW lr {args.adamw_lr:g} (Kahan bf16), warm-up {warmup} then linear decay",
            adamw,
        ),
        Variant(
            "adamw8bit",
            f"ours, padded, 8-bit AdamW lr {args.adamw_lr:g} (stochastic bf16 rounding), as adamw otherwise",
            adamw | dict(optimizer="adamw8bit"),
        ),
        Variant(
            "ddp2",
            "ours, padded, ddp on 2 GPUs (one micro-batch each: the baseline's global batches)",
            dict(distributed_strategy="ddp", gradient_accumulation_steps=1),
            processes=2,
        ),
        Variant(
            "fsdp2",
            "ours, padded, FSDP2 on 2 GPUs (one micro-batch each: the baseline's global batches)",
            dict(distributed_strategy="fsdp", gradient_accumulation_steps=1),
            processes=2,
        ),
        Variant(
            "hf_adamw",
            f"HF Seq2SeqTrainer, AdamW lr {args.adamw_lr:g}, fp32 + bf16 autocast, warm-up {warmup} + linear",
            adamw | dict(optim="adamw_torch_fused"),
            hf=True,
        ),
        Variant(
            "hf_adafactor",
            f"HF Seq2SeqTrainer, transformers' Adafactor ({schedule}), fp32 + bf16 autocast",
            preset | dict(optim="adafactor"),
            hf=True,
        ),
    ]
    found = {v.name: v for v in known}
    for extra in args.extra:  # NAME:key=value,key=value on top of the baseline (processes=N: under torchrun)
        name, _, sets = extra.partition(":")
        values = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in sets.split(",") if s)}
        processes = int(values.pop("processes", 1))
        title = f"ours, padded, {', '.join(f'{k}={v}' for k, v in values.items())}"
        if processes > 1:
            title += f", {processes} GPUs"
        found[name] = Variant(name, title, values, processes=processes)
    return found


# ---------------------------------------------------------------------------------------------- the data


def span_corruption(words: list[str], rng: np.random.Generator) -> tuple[str, str]:
    """T5's span corruption over words: NOISE_DENSITY of them in spans of MEAN_SPAN on average, alternating
    with kept runs (the text starts with a kept run); each span becomes <extra_id_k> in the source, and the
    target is the spans each after its sentinel, closed by the next sentinel."""
    n = len(words)
    noise = min(max(1, round(n * NOISE_DENSITY)), n - 1)
    spans = min(max(1, round(noise / MEAN_SPAN)), noise, n - noise, SENTINELS - 1)

    def segment(items: int) -> list[int]:  # `items` split into `spans` runs of at least one
        cuts = np.sort(rng.choice(np.arange(1, items), spans - 1, replace=False)) if spans > 1 else []
        return np.diff(np.concatenate([[0], cuts, [items]])).astype(int).tolist()

    source, target, at = [], [], 0
    for k, (keep, drop) in enumerate(zip(segment(n - noise), segment(noise), strict=True)):
        source += words[at : at + keep] + [f"<extra_id_{k}>"]
        target += [f"<extra_id_{k}>"] + words[at + keep : at + keep + drop]
        at += keep + drop
    return " ".join(source), " ".join(target + [f"<extra_id_{spans}>"])


def prefix_lm(words: list[str], rng: np.random.Generator) -> tuple[str, str]:
    """T5's prefix-LM objective over words: the text cut at a random word between 10% and 50% of it; the
    source is the start, the target the rest (at least half of the text)."""
    cut = int(rng.integers(max(1, len(words) // 10), max(1, len(words) // 2) + 1))
    return " ".join(words[:cut]), " ".join(words[cut:])


def prepare(work: Path, sizes: Sizes) -> dict:
    """Recipes, tokenizer and the pretraining pairs under `work`; the paths and counts. Made once per --work:
    a later call with the same --work reuses them (work/prepared.json says they are complete, and for which
    sizes: a --work of other sizes is refused)."""
    from trainer.config import TASKS
    from trainer.data.sample import write_sample
    from trainer.model.tiny_model import recipe_texts, save_tokenizer, train_tokenizer

    done = work / "prepared.json"
    if done.exists():
        prep = json.loads(done.read_text(encoding="utf-8"))
        made_for = prep.pop("sizes", None)
        if made_for != dataclasses.asdict(sizes):
            shape = made_for["shape"] if made_for else "unknown"
            raise SystemExit(
                f"{work} holds data and a pretrained model of other sizes ({shape}; this call: {sizes.shape},"
                f" {'--tiny' if sizes is TINY else 'the GPU sizes'}): give another --work, or delete it"
            )
        print(f"data: reused from {work}", flush=True)
        return {k: Path(v) if k not in ("vocab", "records") else v for k, v in prep.items()}
    t0 = time.perf_counter()
    paths = {name: work / f"{name}.jsonl" for name in ("pretrain_recipes", "finetune", "heldout")}
    write_sample(paths["pretrain_recipes"], sizes.pretrain_records, seed=101, fmt="jsonl")
    write_sample(paths["finetune"], sizes.finetune_records, seed=102, fmt="jsonl")
    write_sample(paths["heldout"], sizes.eval_records, seed=103, fmt="jsonl")
    # Disjoint by content: no fine-tuning or held-out recipe in the pretraining text, no held-out one
    # trained on.
    seen = {_recipe_key(line) for line in paths["pretrain_recipes"].open(encoding="utf-8")}
    for name in ("finetune", "heldout"):
        kept = [line for line in paths[name].open(encoding="utf-8") if _recipe_key(line) not in seen]
        paths[name].write_text("".join(kept), encoding="utf-8")
        seen |= {_recipe_key(line) for line in kept}
    texts = recipe_texts(paths["pretrain_recipes"], tasks=TASKS[:1])  # prompts, then the recipes themselves
    recipes = texts[len(texts) // 2 :]
    tokenizer = train_tokenizer(texts[: sizes.tokenizer_records] + recipes[: sizes.tokenizer_records], 32000)
    tokenizer_dir = work / "tokenizer"
    vocab = save_tokenizer(tokenizer, tokenizer_dir)
    rng = np.random.default_rng(0)
    pairs = work / "pretrain.jsonl"
    with pairs.open("w", encoding="utf-8") as f:
        for objective, copies in ((span_corruption, CORRUPTIONS), (prefix_lm, PREFIX_LM)):
            for _ in range(copies):
                for text in recipes:
                    words = text.split()
                    if len(words) < 2:
                        continue
                    source, target = objective(words, rng)
                    f.write(json.dumps({"source": source, "target": target}) + "\n")
    counts = {name: sum(1 for _ in paths[name].open(encoding="utf-8")) for name in ("finetune", "heldout")}
    print(
        f"data: {len(recipes):,} pretraining recipes, {counts['finetune']:,} to fine-tune on, "
        f"{counts['heldout']:,} held out; tokenizer of {vocab:,} pieces; {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    prep = dict(
        pretrain=pairs,
        finetune=paths["finetune"],
        heldout=paths["heldout"],
        tokenizer_dir=tokenizer_dir,
        vocab=vocab,
        records=counts,
    )
    done.write_text(json.dumps(prep | {"sizes": dataclasses.asdict(sizes)}, default=str), encoding="utf-8")
    return prep


def _recipe_key(line: str) -> tuple:
    r = json.loads(line)
    return (r["title"], tuple(r["ingredients"]))


# ----------------------------------------------------------------------------------------- pretraining


def initial_model(prep: dict, sizes: Sizes, out: Path) -> Path:
    """Random weights (seed 0) in the model's dtype with the tokenizer: the LM head its own tensor scaled by
    d_model**-0.5 (initial logits ~N(0, 1)), untied as FLAN-T5's; dropout off for pretraining."""
    import torch
    from transformers import GenerationConfig, T5ForConditionalGeneration

    from trainer.model.tiny_model import flan_t5_config

    config = flan_t5_config("tiny", vocab_size=128 * math.ceil(prep["vocab"] / 128))
    if sizes.shape == "small":
        for key, value in SMALL_SHAPE.items():
            setattr(config, key, value)
    config.dropout_rate = 0.0
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    model.lm_head.weight = torch.nn.Parameter(
        torch.randn(config.vocab_size, config.d_model) * config.d_model**-0.5
    )
    model.generation_config = GenerationConfig(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    dtype = torch.bfloat16 if sizes.dtype == "bfloat16" else torch.float32
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    for f in prep["tokenizer_dir"].iterdir():
        shutil.copy(f, out / f.name)
    _edit_config(out, tie_word_embeddings=False)
    return out


def _edit_config(model_dir: Path, **values) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8")) | values
    config.pop("scale_decoder_outputs", None)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def common_values(sizes: Sizes) -> dict:
    """Config values every run of ours shares: no reporting, a fresh start, a train-log row per step."""
    return dict(
        dtype=sizes.dtype,
        report_to="none",
        resume="never",
        progress_bar=False,
        discord_progress_minutes=-1.0,
        logging_steps=1,
        save_steps=10**9,
        save_total_limit=1,
        max_source_length=sizes.max_source_length,
        max_target_length=sizes.max_target_length,
    )


def trainer_command(processes: int) -> list[str]:
    """The `trainer` CLI as one process, or under torchrun as `processes` (one per visible GPU)."""
    if processes <= 1:
        return [sys.executable, "-m", "trainer"]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
    ]
    return [*torchrun, "-m", "trainer"]


def pretrain(prep: dict, sizes: Sizes, work: Path, gpus: int) -> tuple[Path, dict]:
    """The pretrained model (work/pretraining/final): span corruption and prefix LM on every GPU; dropout then
    set to 0.1. Also what the pretraining did (steps, tokens, losses, seconds). Made once per --work: a
    later call reuses it, and one stopped midway (a time limit) resumes from its last checkpoint."""
    import yaml

    done = work / "pretraining" / "pretraining.json"
    if done.exists():
        info = json.loads(done.read_text(encoding="utf-8"))
        print(f"pretrained model reused from {done.parent}: {info['steps']} steps", flush=True)
        return done.parent / "final", info
    # The same global batch on 1, 2 or 4 GPUs (accumulating micro-batches on fewer), so that the pretrained
    # model, and the fine-tuning runs' losses, do not depend on the machine.
    accumulation = max(1, math.ceil(PRETRAIN_MICRO_BATCHES / max(gpus, 1)))
    micro_batches = accumulation * max(gpus, 1)
    steps = max(1, round(sizes.pretrain_tokens / (sizes.pretrain_micro_tokens * micro_batches)))
    init = initial_model(prep, sizes, work / "init")
    values = common_values(sizes) | dict(
        model_name_or_path=str(init),
        train_files=[str(prep["pretrain"])],
        output_dir=str(work / "pretraining"),
        eval_fraction=0.0,
        eval_generation_records=0,
        num_eval_generations=0,
        packing=True,
        max_tokens=sizes.pretrain_micro_tokens,
        gradient_accumulation_steps=accumulation,
        max_target_length=256,
        optimizer="adamw",
        bf16_update="kahan",
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        max_steps=steps,
        logging_steps=max(1, steps // 20),
        resume="auto",
        save_steps=max(1, steps // 10),
    )
    config = work / "pretrain.yaml"
    config.write_text(yaml.safe_dump(values), encoding="utf-8")
    t0 = time.perf_counter()
    log = work / "pretrain.log"
    rc = run_logged([*trainer_command(gpus), "train", "--config", str(config)], log, env=os.environ)
    if rc != 0:
        raise SystemExit(f"pretraining failed (exit {rc}):\n{tail(log, 30)}")
    rows = read_log(work / "pretraining" / "train_log.jsonl")[0]
    out = work / "pretraining" / "final"
    for name in ("recipe_template.json", "README.md"):  # the fine-tuning runs bring their own prompt
        (out / name).unlink(missing_ok=True)
    _edit_config(out, dropout_rate=0.1)
    info = dict(
        steps=steps,
        processes=max(gpus, 1),
        tokens=sum(r["source_tokens"] + r["target_tokens"] for r in rows),
        first_loss=rows[0]["loss"],
        last_loss=rows[-1]["loss"],
        seconds=time.perf_counter() - t0,
    )
    print(
        f"pretrained {steps} steps ({info['tokens'] / 1e6:.0f}M tokens) on {info['processes']} process(es) "
        f"in {info['seconds']:.0f} s: loss {info['first_loss']:.3f} -> {info['last_loss']:.3f}",
        flush=True,
    )
    done.write_text(json.dumps(info), encoding="utf-8")
    return out, info


# ------------------------------------------------------------------------------------ matching the batches


def real_tokens_per_step(values: dict, tokenizer_file: str, steps: int = 40) -> float:
    """Mean real (source + target) tokens per optimizer step of the first `steps` steps, as the loader makes
    them for these config values."""
    from trainer.config import TrainConfig
    from trainer.data.loader import stream_for

    cfg = TrainConfig.from_dict(values, source="quality")
    stream = stream_for(cfg, tokenizer_file, "train")
    stream.set_epoch(0)
    total, batches = 0, 0
    for batch in stream:
        total += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        batches += 1
        if batches == steps * cfg.gradient_accumulation_steps:
            break
    return total / max(batches / cfg.gradient_accumulation_steps, 1)


def matched_budget(baseline: dict, packed: dict, tokenizer_file: str) -> tuple[int, float, float]:
    """The padded baseline's token budget per micro-batch whose real tokens per optimizer step match the
    packed rows' (`packed`: the packed variant's values); and both per-step means."""
    packed_real = real_tokens_per_step(packed, tokenizer_file)
    budget = packed_real / baseline["gradient_accumulation_steps"] / 0.85  # padded rows are ~85% real
    for _ in range(2):
        budget = 64 * max(1, round(budget / 64))
        padded_real = real_tokens_per_step(baseline | dict(max_tokens=budget), tokenizer_file)
        budget *= packed_real / padded_real
    budget = 64 * max(1, round(budget / 64))
    return budget, real_tokens_per_step(baseline | dict(max_tokens=budget), tokenizer_file), packed_real


# ----------------------------------------------------------------------------------------------- the runs


@dataclasses.dataclass
class Job:
    variant: Variant
    seed: int
    out: Path
    commands: list[list[str]]
    started: float = 0.0
    seconds: float = 0.0
    rc: int | None = None


def ours_job(variant: Variant, seed: int, base: dict, setup: dict, work: Path) -> Job:
    import yaml

    out = work / f"{variant.name}-seed{seed}"
    values = base | variant.settings | dict(seed=seed, output_dir=str(out / "run"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(values), encoding="utf-8")
    train = [*trainer_command(variant.processes), "train", "--config", str(out / "config.yaml")]
    return Job(variant, seed, out, [train, evaluate_command(out / "run" / "final", setup, out)])


def evaluate_command(model_dir: Path, setup: dict, out: Path) -> list[str]:
    sizes = setup["sizes"]
    return [
        *(sys.executable, "-m", "trainer", "evaluate", "--model", str(model_dir)),
        *("--data", str(setup["prep"]["heldout"]), "--max-records", str(sizes.generation_records)),
        *("--max_new_tokens", str(sizes.max_new_tokens), "--output", str(out / "evaluate.json")),
    ]


def hf_job(variant: Variant, seed: int, setup: dict, work: Path) -> Job:
    out = work / f"{variant.name}-seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(
        variant.settings,
        seed=seed,
        model_dir=str(setup["pretrained"]),
        rows=str(setup["rows_file"]),
        batch_size=setup["hf_batch"][0],
        grad_accum=setup["hf_batch"][1],
        steps=setup["args"].steps,
        eval_every=setup["args"].eval_every,
        out=str(out),
    )
    (out / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    hf = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--hf-run",
        str(out / "spec.json"),
        "--out",
        str(out),
    ]
    return Job(variant, seed, out, [hf, evaluate_command(out / "final", setup, out)])


def run_logged(cmd: list[str], log: Path, env) -> int:
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent).returncode


def run_pool(jobs: list[Job], gpus: int, per_gpu: int, deadline: float, on_done) -> None:
    """Each job's commands in turn, in order, on as many GPUs as its variant has processes
    (CUDA_VISIBLE_DEVICES: the least busy ones), `per_gpu` jobs on each GPU at a time (one job at a time on
    the CPU); no job starts after `deadline` (time.monotonic()). `on_done(job)` after each job."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")[:gpus]
    too_wide = {j.variant.name for j in jobs if gpus and j.variant.processes > len(visible)}
    if too_wide:
        raise SystemExit(f"variants {sorted(too_wide)} need more GPUs than the {len(visible)} here")
    load = dict.fromkeys(visible, 0)  # jobs running on each GPU
    waiting, running = list(jobs), []  # running: [job, Popen, command index, log file, its GPUs]
    while waiting or running:
        while waiting and time.monotonic() < deadline:
            need = waiting[0].variant.processes
            free = sorted((g for g in visible if load[g] < per_gpu), key=lambda g: load[g])
            if (visible and len(free) < need) or (not visible and running):
                break  # the next job waits for its GPUs (the CPU: for the running job)
            job, chosen = waiting.pop(0), free[:need]
            for g in chosen:
                load[g] += 1
            job.started = time.monotonic()
            running.append([job, *_start(job, 0, chosen), chosen])
        time.sleep(0.5)
        for entry in list(running):
            job, proc, index, log, chosen = entry
            if proc.poll() is None:
                continue
            log.close()
            if proc.returncode == 0 and index + 1 < len(job.commands):
                entry[1:4] = _start(job, index + 1, chosen)
                continue
            job.rc, job.seconds = proc.returncode, time.monotonic() - job.started
            running.remove(entry)
            for g in chosen:
                load[g] -= 1
            on_done(job)
        if not running and time.monotonic() >= deadline and waiting:
            print(f"--budget-s reached: {len(waiting)} runs not started", flush=True)
            return


def _start(job: Job, index: int, gpus: list[str]):
    """Command `index` of `job` started on `gpus` (none: as this process sees the devices); its Popen, the
    index and its log file."""
    env = dict(os.environ) | ({"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {})
    log = open(job.out / "run.log", "a", encoding="utf-8")  # noqa: SIM115 (closed when the command ends)
    log.write("$ " + " ".join(job.commands[index]) + "\n")
    log.flush()
    proc = subprocess.Popen(job.commands[index], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=job.out)
    return proc, index, log


# ------------------------------------------------------------------------------------- the HF reference


def token_rows(values: dict, tokenizer_file: str, files: list[str]) -> dict[str, np.ndarray]:
    """Every record of `files` as the trainer's loader tokenizes it: flat source/target ids and offsets."""
    from trainer.config import TrainConfig
    from trainer.data.loader import stream_for

    cfg = TrainConfig.from_dict(
        values | dict(train_files=files, eval_files=[], eval_fraction=0.0, max_tokens=None, packing=False),
        source="quality",
    )
    cfg = dataclasses.replace(cfg, per_device_train_batch_size=1024, shuffle=False)
    src, tgt, src_len, tgt_len = [], [], [], []
    for batch in stream_for(cfg, tokenizer_file, "all"):
        n_src, n_tgt = batch["attention_mask"].sum(1), (batch["labels"] != -100).sum(1)
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


def hf_eval_loss(model, data: RowsDataset, device, rows_per_batch: int) -> float:
    """Token-weighted mean cross-entropy over every record of `data` (bf16 autocast, fp32 loss)."""
    import torch
    import torch.nn.functional as F
    from hf_peer import collate

    order = sorted(range(len(data)), key=lambda i: (len(data[i]["labels"]), len(data[i]["input_ids"])))
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for start in range(0, len(order), rows_per_batch):
            b = collate([data[i] for i in order[start : start + rows_per_batch]])
            b.pop("counts")
            b = {k: v.to(device) for k, v in b.items()}
            logits = model(**b).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), reduction="sum")
            total += float(loss)
            count += int((b["labels"] != -100).sum())
    model.train()
    return total / count


def hf_run(spec: dict) -> None:
    """The Hugging Face reference, in its own process (--hf-run SPEC): train_log.jsonl rows like ours, and the
    model in final/ (with the tokenizer) for `trainer evaluate`."""
    import torch
    from hf_peer import collate, counting_trainer_class, sampling_kwargs
    from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainingArguments, TrainerCallback

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    model = AutoModelForSeq2SeqLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.to(device)
    rows = np.load(spec["rows"])
    train = RowsDataset({k.removeprefix("train_"): rows[k] for k in rows.files if k.startswith("train_")})
    held_out = RowsDataset({k.removeprefix("eval_"): rows[k] for k in rows.files if k.startswith("eval_")})
    out = Path(spec["out"])
    log_rows: list[dict] = []
    step_counts: dict[int, list[int]] = {}

    class Progress(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            c = step_counts[step - 1]
            log_rows.append(
                {"step": step, "loss": float("nan"), "source_tokens": c[0], "target_tokens": c[1]}
            )
            if step % spec["eval_every"] == 0 or step == spec["steps"]:
                loss = hf_eval_loss(model, held_out, device, 64 if on_cuda else 8)
                log_rows.append({"step": step, "eval_loss": loss})
                print(f"step {step}: eval loss {loss:.4f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="quality-hf-") as tmp:
        args = Seq2SeqTrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=spec["batch_size"],
            gradient_accumulation_steps=spec["grad_accum"],
            max_steps=spec["steps"],
            learning_rate=spec["learning_rate"],
            lr_scheduler_type=spec["lr_scheduler_type"],
            warmup_steps=spec.get("warmup_steps") or 0,
            optim=spec["optim"],
            weight_decay=0.0,
            max_grad_norm=spec.get("max_grad_norm", 1.0),
            bf16=True,
            use_cpu=not on_cuda,
            report_to="none",
            logging_steps=10**9,
            save_strategy="no",
            dataloader_num_workers=2,
            remove_unused_columns=False,
            disable_tqdm=True,
            seed=spec["seed"],
            data_seed=spec["seed"],
            **sampling_kwargs(True),
        )
        trainer = counting_trainer_class()(
            model=model, args=args, train_dataset=train, data_collator=collate, callbacks=[Progress()]
        )
        trainer.step_counts = step_counts
        trainer.train()
    final = out / "final"
    model.to(torch.bfloat16).save_pretrained(final, safe_serialization=True)
    for f in Path(spec["model_dir"]).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, final / f.name)
    (out / "run").mkdir(exist_ok=True)
    with open(out / "run" / "train_log.jsonl", "w", encoding="utf-8") as f:
        for row in log_rows:
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------ the analysis


def read_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(step rows, eval rows) of a train_log.jsonl."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def curve(out: Path) -> list[dict]:
    """[{"step", "target_tokens", "eval_loss"}] of one run: target tokens trained before each evaluation."""
    steps, evals = read_log(out / "run" / "train_log.jsonl")
    tokens = dict(
        zip([r["step"] for r in steps], np.cumsum([r["target_tokens"] for r in steps]).tolist(), strict=True)
    )
    return [
        {"step": e["step"], "target_tokens": tokens[e["step"]], "eval_loss": e["eval_loss"]} for e in evals
    ]


def interpolate(points: list[dict], tokens: float) -> float | None:
    """The eval loss at `tokens` target tokens, linear between the evaluations around it."""
    for a, b in zip(points, points[1:], strict=False):
        if a["target_tokens"] <= tokens <= b["target_tokens"]:
            share = (tokens - a["target_tokens"]) / max(b["target_tokens"] - a["target_tokens"], 1)
            return a["eval_loss"] + share * (b["eval_loss"] - a["eval_loss"])
    if len(points) >= 2 and points[-1]["target_tokens"] < tokens <= 1.05 * points[-1]["target_tokens"]:
        a, b = points[-2], points[-1]  # a few percent past the last evaluation: its last segment's slope
        slope = (b["eval_loss"] - a["eval_loss"]) / max(b["target_tokens"] - a["target_tokens"], 1)
        return b["eval_loss"] + slope * (tokens - b["target_tokens"])
    return None


def mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def summarize(results: dict) -> dict:
    """Per variant: mean +- SE of the final eval loss (equal steps), of the eval loss at the baseline's mean
    final target tokens (equal tokens) and of the generation metrics; the difference to the baseline."""
    by_variant: dict[str, list[dict]] = {}
    for run in results["runs"].values():
        if run.get("ok"):
            by_variant.setdefault(run["variant"], []).append(run)
    base_runs = by_variant.get(BASELINE, [])
    tokens = statistics.fmean(r["curve"][-1]["target_tokens"] for r in base_runs) if base_runs else None
    summary = {}
    for name, runs in by_variant.items():
        at_steps = [r["curve"][-1]["eval_loss"] for r in runs]
        at_tokens = [x for r in runs if tokens and (x := interpolate(r["curve"], tokens)) is not None]
        gen = {
            k: [r["metrics"][k] for r in runs if k in r.get("metrics", {})]
            for k in ("rougeL", "ingredient_coverage")
        }
        summary[name] = dict(
            n=len(runs),
            steps=runs[0]["curve"][-1]["step"],
            target_tokens=statistics.fmean(r["curve"][-1]["target_tokens"] for r in runs),
            equal_steps=mean_se(at_steps),
            equal_tokens=mean_se(at_tokens) if len(at_tokens) == len(runs) else (math.nan, math.nan),
            rougeL=mean_se(gen["rougeL"]),
            ingredient_coverage=mean_se(gen["ingredient_coverage"]),
            seconds_per_run=statistics.fmean(r["seconds"] for r in runs),
        )
    base = summary.get(BASELINE)
    for name, s in summary.items():
        for key in ("equal_steps", "equal_tokens"):
            s[f"{key}_vs_baseline"] = _difference(s[key], base[key]) if base and name != BASELINE else None
        if base and name != BASELINE and not results["variants"][name]["hf"]:
            diffs = [s[f"{k}_vs_baseline"] for k in ("equal_steps", "equal_tokens")]
            if any(math.isnan(gap) for gap, _ in diffs):  # a run without the equal-tokens point: no verdict
                continue
            if any(math.isnan(se) for _, se in diffs):  # one seed on either side: no noise to judge against
                s["verdict"] = "none (one seed)"
            else:
                s["verdict"] = "PASS" if all(gap <= PASS_MARGIN for gap, _ in diffs) else "FAIL"
    return dict(baseline_target_tokens=tokens, variants=summary)


def _difference(x: tuple[float, float], base: tuple[float, float]) -> tuple[float, float]:
    """(x / base - 1, its standard error) from two independent means with their standard errors."""
    (m, se), (b, se_b) = x, base
    ratio = m / b - 1
    return ratio, (m / b) * math.sqrt((se / m) ** 2 + (se_b / b) ** 2)


def table(results: dict) -> str:
    summary, variants = results["summary"]["variants"], results["variants"]

    def loss(ms: tuple[float, float]) -> str:
        if math.isnan(ms[0]):
            return "-"
        if math.isnan(ms[1]):
            return f"{ms[0]:.4f} (one seed)"
        return f"{ms[0]:.4f} ± {ms[1]:.4f} ({100 * ms[1] / ms[0]:.2f}%)"

    def gap(d) -> str:
        if d is None:
            return "baseline"
        if math.isnan(d[0]):
            return "-"
        if math.isnan(d[1]):
            return f"{100 * d[0]:+.2f}% (no standard error)"
        noise = " (noise)" if abs(d[0]) < 2 * d[1] else ""
        return f"{100 * d[0]:+.2f}% ± {100 * d[1]:.2f}%{noise}"

    def score(ms: tuple[float, float], scale: float = 1.0) -> str:
        if math.isnan(ms[0]):
            return "-"
        return f"{scale * ms[0]:.2f}" + ("" if math.isnan(ms[1]) else f" ± {scale * ms[1]:.2f}")

    lines = [
        "| variant | seeds | eval loss, equal steps | vs baseline | eval loss, equal target tokens "
        "| vs baseline | ROUGE-L | ingredient coverage (%) | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(summary, key=lambda n: (n != BASELINE, variants[n]["hf"], list(variants).index(n)))
    for name in order:
        s = summary[name]
        cells = [
            variants[name]["title"] + f" (`{name}`)",
            str(s["n"]),
            loss(s["equal_steps"]),
            gap(s["equal_steps_vs_baseline"]),
            loss(s["equal_tokens"]),
            gap(s["equal_tokens_vs_baseline"]),
            score(s["rougeL"]),
            score(s["ingredient_coverage"], 100),
            s.get("verdict", "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    base = summary.get(BASELINE)
    if base:
        lines.append(
            f"\nEqual steps: step {base['steps']}; equal target tokens: "
            f"{results['summary']['baseline_target_tokens'] / 1e6:.2f}M (the baseline's mean at its last "
            "step). Mean ± standard error over seeds; 'noise': the difference is within two standard errors. "
            f"A lever passes when it is at most {100 * PASS_MARGIN:.0f}% above the baseline at both."
        )
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    by_variant: dict[str, list[list[dict]]] = {}
    for run in results["runs"].values():
        if run.get("ok"):
            by_variant.setdefault(run["variant"], []).append(run["curve"])
    for name, curves in by_variant.items():
        n = min(len(c) for c in curves)
        steps = [c["step"] for c in curves[0][:n]]
        losses = np.array([[p["eval_loss"] for p in c[:n]] for c in curves])
        se = losses.std(0, ddof=1) / math.sqrt(len(curves)) if len(curves) > 1 else np.zeros(n)
        ax.errorbar(steps, losses.mean(0), yerr=se, marker="o", markersize=3, capsize=2, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out eval loss (mean ± SE over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- main


def tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory for quality.json, quality.png and the logs")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument(
        "--variants",
        default="padded,packed,packed_graphs,warmup_linear,adamw,hf_adamw,hf_adafactor",
        help="comma-separated; the baseline (padded) is always run",
    )
    parser.add_argument(
        "--extra", action="append", default=[], help="NAME:key=value,... a variant of the baseline"
    )
    parser.add_argument("--seeds", type=int, default=3, help="runs per variant (data order and dropout)")
    parser.add_argument("--hf-seeds", type=int, help="runs per Hugging Face reference (default: --seeds)")
    parser.add_argument(
        "--runs-per-gpu",
        type=int,
        default=2,
        help="runs sharing a GPU at a time (the small model leaves room)",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: 300; --tiny 6)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations (default: 100; --tiny 3)")
    parser.add_argument("--adamw-lr", type=float, default=3e-4, help="AdamW's learning rate, ours and HF's")
    parser.add_argument("--gpus", type=int, help="GPUs to spread the runs over (default: all)")
    parser.add_argument(
        "--budget-s", type=float, help="start no run after this many seconds (default: 530; --tiny: none)"
    )
    parser.add_argument("--no-exactness", action="store_true", help="skip bench/packing_exact.py")
    parser.add_argument(
        "--work",
        help="keep data, models and logs here (default: --out/work); a later call with the same --work "
        "reuses its data and pretrained model, and resumes a pretraining that was stopped",
    )
    parser.add_argument("--hf-run", help=argparse.SUPPRESS)  # internal: one Hugging Face run's spec
    args = parser.parse_args()
    if args.hf_run:
        hf_run(json.loads(Path(args.hf_run).read_text(encoding="utf-8")))
        return 0

    started = time.monotonic()
    sizes = TINY if args.tiny else GPU
    args.steps = args.steps or sizes.steps
    args.eval_every = args.eval_every or sizes.eval_every
    gpus = 0 if args.tiny else (args.gpus if args.gpus is not None else gpu_count())
    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)

    prep = prepare(work, sizes)
    prepared_s = time.monotonic() - started
    pretrained, pretraining = pretrain(prep, sizes, work, gpus)
    tokenizer_file = str(pretrained / "tokenizer.json")
    base = (
        common_values(sizes)
        | preset_optimization()
        | dict(
            model_name_or_path=str(pretrained),
            train_files=[str(prep["finetune"])],
            eval_files=[str(prep["heldout"])],
            eval_fraction=0.0,
            eval_max_batches=10**6,  # every held-out record
            eval_generation_records=0,  # generation is scored once at the end, by `trainer evaluate`
            num_eval_generations=0,
            eval_steps=args.eval_every,
            max_steps=args.steps,
            gradient_accumulation_steps=2,
            packing=False,
            cuda_graphs=False,
        )
    )
    if args.tiny:
        base |= dict(gradient_checkpointing=False)
    known = variants(args, sizes.packed_rows)
    budget, padded_real, packed_real = matched_budget(base, base | known["packed"].settings, tokenizer_file)
    base["max_tokens"] = budget
    packed_rows = sizes.packed_rows
    names = list(dict.fromkeys([BASELINE, *args.variants.split(","), *(e.split(":")[0] for e in args.extra)]))
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(known)}")
    records = base | dict(per_device_train_batch_size=None)
    rows = (
        {"train": token_rows(records, tokenizer_file, [str(prep["finetune"])])}
        if any(known[n].hf for n in names)
        else {}
    )
    setup = dict(sizes=sizes, prep=prep, pretrained=pretrained, args=args)
    if rows:
        rows["eval"] = token_rows(records, tokenizer_file, [str(prep["heldout"])])
        setup["rows_file"] = work / "rows.npz"
        np.savez(setup["rows_file"], **{f"{s}_{k}": v for s, r in rows.items() for k, v in r.items()})
        per_record = (len(rows["train"]["src"]) + len(rows["train"]["tgt"])) / (
            len(rows["train"]["src_off"]) - 1
        )
        records_per_step = padded_real / per_record
        accumulation = max(1, math.ceil(records_per_step / 32))
        setup["hf_batch"] = (max(1, round(records_per_step / accumulation)), accumulation)
    print(
        f"batches: padded {budget:,} tokens x 2 per step, {padded_real:,.0f} real; packed {packed_rows} rows "
        "per step, "
        f"{packed_real:,.0f}"
        + (f"; HF {setup['hf_batch'][0]} rows x {setup['hf_batch'][1]}" if rows else ""),
        flush=True,
    )

    jobs = []
    hf_seeds = args.seeds if args.hf_seeds is None else args.hf_seeds
    for seed in range(max(args.seeds, hf_seeds)):  # seed by seed: a benchmark cut short has every variant
        for name in sorted(names, key=lambda n: not known[n].hf):  # the slower HF runs first in each round
            v = known[name]
            if seed < (hf_seeds if v.hf else args.seeds):
                jobs.append(hf_job(v, seed, setup, work) if v.hf else ours_job(v, seed, base, setup, work))
    results = {
        "args": vars(args),
        "sizes": dataclasses.asdict(sizes),
        "batches": dict(
            padded_max_tokens=budget,
            padded_real=padded_real,
            packed_rows=packed_rows,
            packed_real=packed_real,
        ),
        "variants": {n: dataclasses.asdict(known[n]) for n in names},
        "prepared_s": prepared_s,
        "pretraining": pretraining,
        "runs": {},
    }
    if not args.no_exactness:
        exact_out = work / "packing_exact"
        exact_out.mkdir(exist_ok=True)
        cmd = [sys.executable, str(REPO / "bench" / "packing_exact.py"), "--model", str(pretrained)]
        cmd += ["--data", str(prep["finetune"]), "--out", str(exact_out)] + (["--tiny"] if args.tiny else [])
        jobs.insert(min(len(jobs), max(gpus, 1)), Job(Variant("packing_exact", "", {}), 0, exact_out, [cmd]))
    out.mkdir(parents=True, exist_ok=True)

    def done(job: Job) -> None:
        key = f"{job.variant.name}-seed{job.seed}"
        if job.variant.name == "packing_exact":
            ok = job.rc == 0 and (job.out / "packing_exact.json").exists()
            results["packing_exact"] = (
                json.loads((job.out / "packing_exact.json").read_text()) if ok else None
            )
            print(
                f"packing_exact: {'done' if ok else f'failed (exit {job.rc})'} in {job.seconds:.0f} s",
                flush=True,
            )
            if ok:
                print(tail(job.out / "run.log", 12), flush=True)
        else:
            run = dict(variant=job.variant.name, seed=job.seed, seconds=job.seconds, rc=job.rc, ok=False)
            try:
                run["curve"] = curve(job.out)
                report = json.loads((job.out / "evaluate.json").read_text(encoding="utf-8"))
                run["metrics"] = report["metrics"]
                run["ok"] = job.rc == 0 and bool(run["curve"])
            except (OSError, KeyError, ValueError) as e:
                run["error"] = f"{type(e).__name__}: {e}"
            results["runs"][key] = run
            last = f"eval loss {run['curve'][-1]['eval_loss']:.4f}" if run.get("curve") else "no evaluation"
            status = "ok" if run["ok"] else f"FAILED (exit {job.rc}): {tail(job.out / 'run.log', 8)}"
            print(f"{key}: {last}, {job.seconds:.0f} s, {status}", flush=True)
        results["summary"] = summarize(results)
        (out / "quality.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")

    deadline = started + (args.budget_s or (math.inf if args.tiny else 530))
    run_pool(jobs, gpus, args.runs_per_gpu, deadline, done)
    results["total_s"] = time.monotonic() - started
    results["summary"] = summarize(results)
    (out / "quality.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'quality.json'}; {results['total_s']:.0f} s in all\n")
    print(table(results))
    try:
        plot(results, out)
        print(f"\nthe curves: {out / 'quality.png'}")
    except ModuleNotFoundError as e:  # the bench extra's plotting library
        print(f"\nno quality.png: {e} (pip install '.[bench]')")
    return 0 if all(r.get("ok") for r in results["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

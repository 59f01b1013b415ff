"""What the benchmarks share: the trainer settings of a timing run, and the synthetic recipe-length data that
the throughput, peer and allocator benchmarks all train on.

Importing this sets nothing in the environment (the allocator benchmark sets PYTORCH_CUDA_ALLOC_CONF itself).
"""

from __future__ import annotations

import json
from pathlib import Path

# Trainer settings every timing run shares: no evaluation, no checkpoints, no reporting, a fresh start, a
# train-log row per step (the benchmarks time steps from it).
QUIET_RUN = dict(
    eval_fraction=0.0,
    logging_steps=1,
    save_steps=10**9,
    save_final=False,
    report_to="none",
    resume="never",
)

VOCAB = 32128  # FLAN-T5's
PRESET = Path(__file__).resolve().parent.parent / "configs" / "flan-t5-xl-rtx5090.yaml"
# The preset's optimization: what the quality and exactness benchmarks keep from it.
OPTIMIZATION_KEYS = (
    "optimizer",
    "bf16_update",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "max_grad_norm",
)


def read_preset() -> dict:
    """configs/flan-t5-xl-rtx5090.yaml's keys as the file sets them: the benchmarks follow the preset."""
    import yaml

    return yaml.safe_load(PRESET.read_text(encoding="utf-8"))


def preset_optimization() -> dict:
    """The preset's optimizer, learning rate, schedule, Kahan updates and clipping."""
    preset = read_preset()
    return {k: preset[k] for k in OPTIMIZATION_KEYS if k in preset}


RECORDS = 4096


def make_records(n: int = RECORDS, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Recipe-length token sequences: (source ids, target ids), source ~ lognormal(median 96, sigma 0.35)
    clipped to [16, 512], target ~ lognormal(median 256, sigma 0.45) clipped to [32, 512], random ids in
    [3, 32000), each ending with </s> (id 1). The same draws as the original peer script, so the numbers
    measured before and after it moved here are on identical data."""
    import numpy as np

    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(np.log(96), 0.35, n), 16, 512).astype(int)
    tgt = np.clip(rng.lognormal(np.log(256), 0.45, n), 32, 512).astype(int)
    return [
        (
            [int(i) for i in rng.integers(3, 32000, s - 1)] + [1],
            [int(i) for i in rng.integers(3, 32000, t - 1)] + [1],
        )
        for s, t in zip(src, tgt, strict=True)
    ]


def write_data(out: Path, records, shape: str) -> tuple[Path, Path]:
    """`records` for our trainer: JSONL of pre-rendered `source`/`target` pairs of words `t<id>` and a model
    dir (config.json of the shape, and a WordLevel tokenizer.json mapping each word back to its id and
    appending </s>), so that the Rust loader's batching runs on exactly these token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from trainer.model.tiny_model import flan_t5_config

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    flan_t5_config(shape, vocab_size=VOCAB).save_pretrained(model_dir)
    data = out / "records.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for s, t in records:
            words = lambda ids: " ".join(f"t{i}" for i in ids[:-1])  # noqa: E731 (the post-processor adds </s>)
            f.write(json.dumps({"source": words(s), "target": words(t)}) + "\n")
    return data, model_dir


def without_dropout(model_dir: Path, out: Path) -> Path:
    """`model_dir` with dropout off, as the new directory `out`: its files linked, its config rewritten. A
    step's loss and gradients then depend on the weights and the records alone."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    (out / "config.json").write_text(json.dumps(config | {"dropout_rate": 0.0}), encoding="utf-8")
    return out


def mean_lengths(records) -> tuple[float, float]:
    """Mean source and target length of `records` (</s> included)."""
    return (
        sum(len(s) for s, _ in records) / len(records),
        sum(len(t) for _, t in records) / len(records),
    )


def train_rows(output_dir: Path) -> list[dict]:
    """The per-step rows of a run's train log (evaluation rows, which have eval_loss instead, left out)."""
    from trainer.report.step_meter import TRAIN_LOG

    rows = [json.loads(line) for line in (Path(output_dir) / TRAIN_LOG).read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def run_one_in_subprocess(script: str, args: list[str], timeout: float) -> dict:
    """`script` with `args` (`--one NAME ...`) in a fresh process (its own memory cap and counters), which
    writes its JSON result to the file `--result` names; a result with the error instead when it fails or
    times out."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, script, *args, "--result", out.name]
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"config": args[1], "ok": False, "error": f"timed out after {timeout:.0f} s"}
        text = Path(out.name).read_text()
        if proc.returncode != 0 or not text:
            return {"config": args[1], "ok": False, "error": (proc.stdout + proc.stderr)[-2000:]}
        return json.loads(text)

"""The model card: README.md in a trained model's directory, saying what it is and how to use it.

`write_model_card(model_dir, info)` writes it; `ModelCardInfo` is everything it says, gathered by the
training loop at the end of a run. The metadata header is `huggingface_hub.ModelCardData`'s (base_model,
datasets, tags, library_name, pipeline_tag, and the weights' evaluation as model-index); the text has the
`trainer generate` command and a transformers snippet with the exact prompt (rendered by the training
loader's renderer), the prompt template, the data, the run (steps, tokens, wall time, hardware; a LoRA run's
settings, with PEFT's way to load its adapter alone) and the final metrics. A card for the Hub (`repo_id`)
shows how to download the model from there.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from trainer.data.prompt import PromptTemplate, template_parts
from trainer.infra.disk import write_text_atomic
from trainer.infra.redact import redact

__all__ = ["LoraSettings", "ModelCardInfo", "card_metadata", "model_card", "write_model_card"]

CARD_FILE = "README.md"
EXAMPLE = {"title": "Lemon Pancakes", "ingredients": ["2 eggs", "1 cup flour", "1 cup milk", "1 lemon"]}


@dataclass
class ModelCardInfo:
    """What the card says about a run. `model_path` is where the model is to be used from (final/, not the
    temporary directory it is written to); `metrics` are the last logged values by name ("train/loss",
    "eval/loss", "eval/rougeL", ...), of the evaluation at `last_eval_step`; `best_metrics` those of the best
    evaluation (at `best_step`, by `metric_for_best_model`); `weights_step`: the step whose weights the
    directory holds (default: the last, `steps`); `repo_id`: the Hub repository the card is uploaded to
    (None: a card for the local directory)."""

    model_path: str
    base_model: str
    template: PromptTemplate
    train_files: list[str]
    train_records: int
    eval_records: int
    skipped_records: int
    steps: int
    tokens: int  # real (non-padding) source + target tokens trained on
    wall_time_s: float
    hardware: str  # e.g. "1x NVIDIA GeForce RTX 5090" or "CPU"
    metrics: dict[str, float] = field(default_factory=dict)
    last_eval_step: int | None = None
    best_metrics: dict[str, float] = field(default_factory=dict)
    best_step: int | None = None
    metric_for_best_model: str | None = None
    weights_step: int | None = None
    repo_id: str | None = None
    lora: LoraSettings | None = None  # a LoRA run's (trainer.model.lora); None: full fine-tuning


@dataclass
class LoraSettings:
    """A LoRA run's adapter, as the card states it: the config's settings and the parameters trained."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str]
    trained_parameters: int


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a `|` (the default target template has two) would end the cell."""
    return text.replace("|", "\\|")


def example_prompt(template: PromptTemplate) -> tuple[str, list[str]]:
    """A prompt rendered with the model's template, and the `trainer generate` options that give it."""
    rendered = template.renderer().render(**EXAMPLE)
    needs = {name for kind, name in template_parts(template.source_template) if kind == "field"}
    options = []
    if "title" in needs:
        options += ["--title", EXAMPLE["title"]]
    if "ingredients" in needs or not options:
        options += ["--ingredients", "; ".join(EXAMPLE["ingredients"])]
    return rendered["source"], options


# `namespace/name` as the Hub spells repository ids (huggingface_hub.utils.validate_repo_id's characters).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_FILE_SUFFIXES = (".csv", ".jsonl", ".json", ".gz", ".zst", ".parquet", ".arrow")


def hub_ids(names: list[str]) -> list[str]:
    """Of model or data names, those that are Hub repository ids rather than local paths or globs."""
    return [
        n
        for n in names
        if _HUB_ID.match(n) and not n.lower().endswith(_FILE_SUFFIXES) and not Path(n).exists()
    ]


def card_metadata(info: ModelCardInfo) -> ModelCardData:
    """The card's YAML header: a base model and datasets only where they are Hub ids (a local path is not
    valid there), and the evaluation of the weights this directory holds as model-index."""
    weights = info.weights_step if info.weights_step is not None else info.steps
    if info.best_step is not None and weights == info.best_step:
        scored = info.best_metrics
    else:
        scored = info.metrics if info.last_eval_step == weights else {}
    datasets = hub_ids(info.train_files)
    name = info.repo_id.split("/")[-1] if info.repo_id else "recipe-t5"
    results = [
        EvalResult(
            task_type="text2text-generation",
            task_name="Recipe generation",
            dataset_type=datasets[0] if datasets else "recipes",
            dataset_name="held-out recipes",
            dataset_split="held-out",
            metric_type=metric.removeprefix("eval/"),
            metric_name=metric.removeprefix("eval/"),
            metric_value=round(value, 4),
        )
        for metric, value in sorted(scored.items())
        if metric.startswith("eval/") and _is_a_score(metric)
    ]
    base_model = hub_ids([info.base_model])
    return ModelCardData(
        base_model=base_model[0] if base_model else None,
        datasets=datasets or None,
        library_name="transformers",
        pipeline_tag="text2text-generation",
        tags=["recipe-generation", "recipe-t5-trainer"] + (["lora"] if info.lora else []),
        model_name=name if results else None,
        eval_results=results or None,
    )


def _is_a_score(metric: str) -> bool:
    """Whether an evaluation value scores the model: not its timings (runtime, generation_runtime,
    scoring_runtime, samples_per_second ...) nor the generations' mean length (gen_len)."""
    name = metric.removeprefix("eval/")
    return not (name.endswith(("runtime", "per_second")) or name == "gen_len")


def _use_it(info: ModelCardInfo, options: list[str]) -> tuple[str, str]:
    """The shell lines of "Use it", and what from_pretrained loads (the repository, or the directory)."""
    local = info.model_path
    lines = []
    if info.repo_id is not None:
        local = info.repo_id.split("/")[-1]
        lines.append(shlex.join(["hf", "download", info.repo_id, "--local-dir", local]))
    quoted = shlex.quote(local)
    lines += [
        shlex.join(["trainer", "generate", "--model", local, *options]),
        f"trainer generate --model {quoted} --input held_out.csv --output recipes.jsonl",
        f"trainer evaluate --model {quoted} --data held_out.csv --output report.json",
        f"trainer serve --model {quoted}   # a web page and a JSON API on http://127.0.0.1:8000",
    ]
    return "\n".join(lines), info.repo_id or info.model_path


def model_card(info: ModelCardInfo) -> str:
    """The card's Markdown text, its header written by huggingface_hub (which also parses it back)."""
    t = info.template
    prompt, options = example_prompt(t)
    commands, load_from = _use_it(info, options)
    metrics_table = _metrics_table(info)
    files = ", ".join(f"`{f}`" for f in info.train_files) or "-"
    read = info.train_records + info.eval_records + info.skipped_records
    records = (
        f"{info.train_records:,} trained on, {info.eval_records:,} held out, "
        f"{info.skipped_records:,} of {read:,} skipped"
    )
    method, adapter_use = _method(info, load_from)
    body = f"""# Recipe model fine-tuned from {info.base_model}{" with LoRA" if info.lora else ""}

Task `{t.task}`: the prompt is `{t.source_template}`; the model writes
`{t.target_template}` (ingredients joined with "; ", directions numbered "1. ... 2. ...").

## Use it

```bash
{commands}
```

With transformers alone, prompt it exactly as it was trained:

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained({load_from!r})
model = AutoModelForSeq2SeqLM.from_pretrained({load_from!r})
prompt = {prompt!r}
inputs = tokenizer(prompt, return_tensors="pt", truncation=True, max_length={t.max_source_length})
out = model.generate(**inputs, max_new_tokens={t.max_target_length})
print(tokenizer.decode(out[0], skip_special_tokens=True))
```
{adapter_use}
## Prompt template (`recipe_template.json`)

| | |
|---|---|
| source | `{_cell(t.source_template)}` |
| target | `{_cell(t.target_template)}` |
| max source / target tokens | {t.max_source_length} / {t.max_target_length} |
| lists | ingredients joined with "; ", directions numbered "1. Mix. 2. Bake.", NER joined with ", " |

## Training

| | |
|---|---|
| base model | `{info.base_model}` |
| method | {method} |
| data | {files} |
| records | {records} |
| steps | {info.steps:,} |
| tokens | {info.tokens:,} (source + target, padding excluded) |
| wall time | {_duration(info.wall_time_s)} |
| hardware | {info.hardware} |

## Final metrics

{metrics_table}
"""
    return ModelCard(f"---\n{card_metadata(info).to_yaml()}\n---\n\n{body}").content


def _method(info: ModelCardInfo, load_from: str) -> tuple[str, str]:
    """The Training table's method, and for a LoRA run the lines loading its adapter alone with PEFT."""
    lora = info.lora
    if lora is None:
        return "full fine-tuning", ""
    targets = ", ".join(f"`{name}`" for name in lora.target_modules)
    method = (
        f"LoRA: r {lora.r}, alpha {lora.alpha:g}, dropout {lora.dropout:g} on {targets} "
        f"({lora.trained_parameters / 1e6:.1f}M trained parameters), merged into these weights; the adapter "
        "alone is in `adapter/` (PEFT)"
    )
    where = f"{load_from!r}, subfolder='adapter'" if info.repo_id else repr(f"{load_from}/adapter")
    return (
        method,
        f"""
The LoRA adapter alone, on its base, with PEFT:

```python
from peft import PeftModel

model = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained({info.base_model!r}), {where})
```
""",
    )


def _value(metrics: dict[str, float], name: str) -> str:
    return f"{metrics[name]:.4g}" if name in metrics else "-"


def _metrics_table(info: ModelCardInfo) -> str:
    """The weights' step, then a table of the last evaluation's metrics and, when one was kept, the best's."""
    weights = info.weights_step if info.weights_step is not None else info.steps
    if info.best_step is not None and weights == info.best_step:
        which = f"the best evaluation by `{info.metric_for_best_model}`"
        holds = f"This directory holds the weights of step {weights:,} of {info.steps:,}, {which}."
    else:
        holds = f"This directory holds the weights of step {weights:,}, the last."
    names = sorted(info.metrics.keys() | info.best_metrics.keys())
    if not names:
        return holds + "\n\n| metric | value |\n|---|---|\n| - | - |"
    last = f"last (step {info.last_eval_step:,})" if info.last_eval_step is not None else "last"
    if info.best_step is None:
        rows = [f"| `{n}` | {_value(info.metrics, n)} |" for n in names]
        return "\n".join([holds, "", f"| metric | {last} |", "|---|---|", *rows])
    rows = [f"| `{n}` | {_value(info.metrics, n)} | {_value(info.best_metrics, n)} |" for n in names]
    header = f"| metric | {last} | best (step {info.best_step:,}) |"
    return "\n".join([holds, "", header, "|---|---|---|", *rows])


def write_model_card(model_dir: str | os.PathLike[str], info: ModelCardInfo) -> Path:
    """Write README.md (the model card) into `model_dir`; returns its path. Secrets in it (a token in a data
    path) are masked, as in the log."""
    path = Path(model_dir) / CARD_FILE
    write_text_atomic(path, redact(model_card(info)))
    return path

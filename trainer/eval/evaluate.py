"""`trainer evaluate`: eval loss and generation metrics of a trained model on recipe files.

The records are read, rendered and tokenized by the training loader's code, as the model was trained
(`--split eval`: only the share that training held out). The loss is the one evaluations during training
compute (`eval_loss`): the sum of target-token cross-entropies over the target tokens, of the loader's padded
batches. Then the model generates for the same records (batched as `trainer generate` does) and
`trainer.eval.recipe_metrics.generation_metrics` scores the recipes: ROUGE, BLEU, chrF and the recipe checks.
The table goes to standard output, the report (with every generation) to `--output` as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.data.loader import Batch, padded_batch, to_device
from trainer.data.prompt import PromptTemplate
from trainer.eval.generate import (
    DEFAULT_BATCH_TOKENS,
    UsageError,
    add_model_arguments,
    batch_token_budget,
    decoding_given,
    decoding_settings,
    generate_rows,
    load_for_generation,
    open_model_dir,
    plan_batches,
    read_records,
    strict_subparser,
)
from trainer.eval.recipe_metrics import generation_metrics
from trainer.infra.disk import write_text_atomic

log = logging.getLogger(__name__)

# How the table names each metric; the report's JSON keys are the metric names themselves.
METRIC_LABELS = {
    "loss": "eval loss (token mean)",
    "rouge1": "ROUGE-1 F1 (x100)",
    "rouge2": "ROUGE-2 F1 (x100)",
    "rougeL": "ROUGE-L F1 (x100)",
    "bleu": "BLEU",
    "chrf": "chrF",
    "ingredient_coverage": "ingredient coverage",
    "invented_ingredients": "invented ingredients",
    "structure": "structure ok",
    "repetition": "repeated 4-grams",
    "length_ratio": "length ratio (words)",
}


def sample_records(records: Sequence[dict], n: int | None, seed: int) -> list[dict]:
    """At most `n` records, drawn with `seed` (the same ones every time), in their file order."""
    if n is None or len(records) <= n:
        return list(records)
    keep = sorted(random.Random(seed).sample(range(len(records)), n))
    return [records[i] for i in keep]


def record_batches(records: Sequence[dict], max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> Iterator[Batch]:
    """`records` (with `source_ids` and `target_ids`, as the loader's renderer reads them) as the loader's
    padded batches (trainer.data.loader.padded_batch), grouped by length, at most `max_batch_tokens` padded
    tokens each."""
    costs = [len(r["source_ids"]) + len(r["target_ids"]) for r in records]
    for group in plan_batches(costs, max_batch_tokens):
        yield padded_batch([(records[i]["source_ids"], records[i]["target_ids"]) for i in group])


def eval_loss(loss_module, batches: Iterable[Batch | dict], device) -> float:
    """Sum of target-token cross-entropies over the number of target tokens of `batches` (loader batches:
    the training loop's held-out ones, or `record_batches`), summed over ranks under torchrun: the eval loss
    of `trainer evaluate` and of evaluations during training. `loss_module`: the HF model, or what the loss
    runs through (`Seq2SeqLMLoss`, the FSDP module)."""
    # torch (seconds to import) loads here: the CLI imports this module for `trainer --help`'s parser
    import torch

    from trainer.infra import distributed
    from trainer.model.loss import token_loss_sum

    loss_sum, n_tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            batch = to_device(batch, device)
            loss_sum += float(token_loss_sum(loss_module, batch))
            n_tokens += int((batch["labels"] != -100).sum())
    loss_sum, n_tokens = distributed.all_sum([loss_sum, n_tokens])
    return loss_sum / n_tokens if n_tokens else math.nan


def generation_eval(
    model,
    tokenizer_file: str | os.PathLike[str],
    template: PromptTemplate,
    records: Sequence[dict],
    decoding: dict[str, Any],
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate for `records` (from `template.renderer(tokenizer_file).read(...)`) and score the recipes:
    (metric name -> value, the generated rows). What `trainer evaluate` runs after the loss, and what the
    training loop logs at each evaluation (`eval/<name>`, the rows as a table). Beside the scores:
    `gen_len` (Hugging Face's name: mean new tokens per record), `generation_runtime` and `scoring_runtime`
    (seconds generating, seconds scoring)."""
    started = time.perf_counter()
    rows = generate_rows(
        model, tokenizer_file, template, records, decoding, max_batch_tokens, what="evaluate"
    )
    generated = time.perf_counter()
    metrics = generation_metrics(
        [r["generated"] for r in rows],
        [r.get("reference") for r in rows],
        [r["source"] for r in rows],
        template,
    )
    if rows:
        metrics["gen_len"] = sum(r["new_tokens"] for r in rows) / len(rows)
    metrics["generation_runtime"] = generated - started
    metrics["scoring_runtime"] = time.perf_counter() - generated
    return metrics, rows


def format_table(metrics: dict[str, float], records: int) -> str:
    """The metrics as an aligned two-column table."""
    width = max(len(label) for label in METRIC_LABELS.values())
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -------"]
    for name, label in METRIC_LABELS.items():
        if name in metrics:
            lines.append(f"{label:<{width}}  {metrics[name]:.4f}")
    lines.append(f"{'records':<{width}}  {records}")
    return "\n".join(lines)


def add_evaluate_parser(sub) -> None:
    """`trainer evaluate` on the CLI's subparsers."""
    p = sub.add_parser(
        "evaluate",
        help="eval loss, ROUGE/BLEU/chrF and recipe metrics of a trained model",
        description="Evaluate a trained model on recipe files: eval loss (token mean, as in training), then "
        "generates for the same records and scores the recipes. Prints a table; --output writes JSON.",
    )
    add_model_arguments(p)
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        required=True,
        metavar="FILE",
        help="recipe files or globs with references (RecipeNLG/Food.com CSV, JSONL, Parquet, Arrow; "
        ".gz/.zst), save_to_disk directories or hf://datasets/OWNER/NAME",
    )
    p.add_argument(
        "--split",
        choices=["all", "eval"],
        default="all",
        help="eval: only the records training held out (needs the model's saved eval_fraction or "
        "--eval-fraction)",
    )
    p.add_argument(
        "--eval-fraction",
        "--eval_fraction",
        type=float,
        help="the training run's eval_fraction (default: the model's recipe_template.json)",
    )
    p.add_argument(
        "--max-records",
        "--max_records",
        type=int,
        help="evaluate at most N records, drawn with --seed (the same ones every time)",
    )
    p.add_argument("--output", help="write the report (metrics and every generation) as JSON")
    p.set_defaults(run=run_evaluate)
    strict_subparser(p)


def run_evaluate(args: argparse.Namespace) -> int:
    """`trainer evaluate`; a value or model directory it cannot use raises UsageError or ModelDirError, which
    the CLI prints as one line (exit 2)."""
    import torch

    given = decoding_given(args)
    if args.max_records is not None and args.max_records < 1:
        raise UsageError(f"--max-records must be >= 1, got {args.max_records}")
    model_dir = open_model_dir(args.model, args.task)
    template = model_dir.template
    split: dict[str, Any] = {}
    if args.split == "eval":
        fraction = args.eval_fraction if args.eval_fraction is not None else template.eval_fraction
        if not 0 < fraction < 1:
            raise UsageError(
                f"--split eval needs the training run's eval_fraction in (0, 1): {model_dir.path} says "
                f"{template.eval_fraction if model_dir.template_saved else 'nothing'}; pass --eval-fraction"
            )
        split = {"split": "eval", "eval_fraction": fraction}
    renderer = template.renderer(model_dir.tokenizer_file)
    records = read_records(renderer, args.data, args.data_format, template.columns, **split)
    with_reference = [r for r in records if r["target_ids"] is not None]
    if len(with_reference) < len(records):
        log.warning(
            "data: %d records have no reference and are not evaluated", len(records) - len(with_reference)
        )
    if not with_reference:
        raise UsageError(
            f"no record of {', '.join(args.data)} has a reference (title, ingredients, directions)"
        )
    chosen = sample_records(with_reference, args.max_records, args.seed)
    if len(chosen) < len(with_reference):
        log.info(
            "evaluating %d of %d records (--max-records, seed %d)",
            len(chosen),
            len(with_reference),
            args.seed,
        )
    model = load_for_generation(model_dir, args.device)
    started = time.monotonic()
    # the loss's batches hold logits (32k vocabulary x fp32 a token): the default budget unless one is given
    loss_batches = record_batches(chosen, args.max_batch_tokens or DEFAULT_BATCH_TOKENS)
    loss = eval_loss(model, loss_batches, next(model.parameters()).device)
    log.info("eval loss %.4f over %d records", loss, len(chosen))
    decoding, said = decoding_settings(model, template, given)
    log.info("%s", said)
    torch.manual_seed(args.seed)
    budget = batch_token_budget(model, args.max_batch_tokens)
    scores, rows = generation_eval(model, model_dir.tokenizer_file, template, chosen, decoding, budget)
    metrics = {"loss": loss, **scores}
    log.info("evaluated %d records in %.1f s", len(rows), time.monotonic() - started)
    print(format_table(metrics, len(rows)))
    if args.output:
        report = {
            "model": str(model_dir.path),
            "data": list(args.data),
            "split": args.split,
            "records": len(rows),
            "template": template.to_dict(),
            "decoding": decoding,
            "metrics": metrics,
            "generations": rows,
        }
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        log.info("wrote %s", out)
    return 0

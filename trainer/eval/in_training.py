"""Evaluation during training: the loss on held-out batches, and recipes generated for held-out records,
scored as `trainer evaluate` scores them.

`evaluate` returns the metrics under Hugging Face's names (`eval_loss`, `eval_rougeL`,
`eval_ingredient_coverage`, ...: trainer.eval.recipe_metrics; `eval_runtime`, its seconds) and the first few
generated recipes with their own scores; the loop logs them to the train log, W&B and Discord and keeps the
best checkpoint by one of them.

The records generated for are a fixed sample (`load_generation_records`: `eval_generation_records` of them,
drawn with the run's seed), the same at every evaluation, so that the metrics move with the model and not
with the sample. Decoding follows the config (`generation_max_new_tokens`, `generation_num_beams`), else the
model's generation_config, as in `trainer generate`.

Several ranks: the loss is each rank's shard of the held-out batches, summed over ranks. Under ddp rank 0
generates alone with its whole model (no collectives); the other ranks wait for its metrics, which
every rank receives (the best checkpoint and early stopping decide the same everywhere). Under FSDP every rank
runs the model's forward together: they all generate for the same records with `synced_gpus`, rank 0
scores.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from trainer.config import TrainConfig
from trainer.data.prompt import PromptTemplate
from trainer.eval.evaluate import eval_loss, generation_eval
from trainer.eval.generate import decoding_settings
from trainer.eval.recipe_metrics import generation_metrics
from trainer.infra import distributed

log = logging.getLogger(__name__)

# The per-sample scores shown beside each generated recipe (W&B table, Discord); the headline metrics of the
# log line and Discord's evaluation message, in this order.
SAMPLE_METRICS = ("rougeL", "ingredient_coverage", "invented_ingredients", "structure")
HEADLINE_METRICS = ("eval_loss", "eval_rougeL", "eval_bleu", "eval_ingredient_coverage", "eval_structure")


@dataclass
class EvalResult:
    metrics: dict[str, float]  # {"eval_loss": ..., "eval_rougeL": ...}: the same on every rank
    # The first num_eval_generations generated recipes (rank 0): {"prompt", "generated", "reference"} and
    # their own scores under SAMPLE_METRICS' names.
    samples: list[dict[str, Any]]


def load_generation_records(cfg: TrainConfig, eval_stream, *, needed: bool = True) -> list[dict]:
    """The held-out records each evaluation generates for: `eval_generation_records` of `eval_stream`'s
    records (eval_files, or train_files' share held out by eval_fraction), drawn with cfg.seed, read at their
    indexed offsets (`RecipeStream.sample_records`). `needed` False (a rank that does not generate): none."""
    if not needed or eval_stream is None or cfg.eval_generation_records == 0:
        return []
    chosen = eval_stream.sample_records(cfg.eval_generation_records, cfg.seed)
    log.info(
        "evaluation: generating for %d of %d held-out records at each evaluation (seed %d)",
        len(chosen),
        eval_stream.stats()["records"],
        cfg.seed,
    )
    return chosen


def evaluate(
    model,
    stream,
    records: list[dict],
    device,
    cfg: TrainConfig,
    template: PromptTemplate,
    tokenizer_file: str,
    loss_module=None,
    max_batch_tokens: int = 32768,
) -> EvalResult:
    """Eval loss (token mean) over at most cfg.eval_max_batches held-out batches of `stream`, then generation
    for `records` (`load_generation_records`) in batches of at most `max_batch_tokens` (`eval_batch_tokens`)
    and its metrics. `model` is the HF model; `loss_module` what the loss runs through (the FSDP module;
    default `model`). Collective under torchrun."""
    loss_module = model if loss_module is None else loss_module
    loss_module.eval()
    started = time.perf_counter()
    try:
        stream.set_epoch(0)  # each rank its shard of the held-out batches, the same ones every time
        held_out = itertools.islice(stream, cfg.eval_max_batches)
        metrics = {"eval_loss": eval_loss(loss_module, held_out, device)}
        scores, samples = generation_scores(
            model, loss_module, records, cfg, template, tokenizer_file, max_batch_tokens
        )
    finally:
        loss_module.train()
    metrics.update({f"eval_{name}": value for name, value in scores.items()})
    metrics["eval_runtime"] = time.perf_counter() - started  # Hugging Face's name (seconds)
    return EvalResult(metrics, samples)


def decoding(cfg: TrainConfig, model, template: PromptTemplate) -> tuple[dict[str, Any], str]:
    """`model.generate` options of the config's generation keys (the rest: the model's generation_config),
    and a line saying each value and where it came from (`trainer generate`'s rules)."""
    given = {"max_new_tokens": cfg.generation_max_new_tokens, "num_beams": cfg.generation_num_beams}
    return decoding_settings(model, template, {k: v for k, v in given.items() if v is not None})


def generation_scores(
    model,
    loss_module,
    records: list[dict],
    cfg: TrainConfig,
    template: PromptTemplate,
    tokenizer_file: str,
    max_batch_tokens: int,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate for `records` and score the recipes: (metric name -> value, the first samples with their
    own scores); the metrics on every rank, the samples on rank 0. See the module doc for who generates."""
    sharded = distributed.is_sharded(loss_module)
    metrics: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    if records and (sharded or distributed.rank() == 0):
        kwargs, _ = decoding(cfg, model, template)
        kwargs["synced_gpus"] = sharded  # FSDP: each forward gathers weights, so every rank steps together
        with distributed.full_weights(loss_module):
            metrics, rows = generation_eval(
                model, tokenizer_file, template, records, kwargs, max_batch_tokens
            )
    metrics = distributed.broadcast_object(metrics)  # every rank, every time: ranks without records too
    samples = []
    for row in rows[: cfg.num_eval_generations] if distributed.rank() == 0 else []:
        own = generation_metrics([row["generated"]], [row.get("reference")], [row["source"]], template)
        sample = {"prompt": row["source"], "generated": row["generated"], "reference": row.get("reference")}
        samples.append(sample | {name: own.get(name) for name in SAMPLE_METRICS})
    return metrics, samples


def eval_batch_tokens(cfg: TrainConfig, split: int = 1) -> int:
    """Generation's budget of rows x beams x (prompt + new tokens) per batch: the training micro-batch's
    tokens (`max_tokens`, or rows x the maximum lengths; after `split`, the OOM back-off). A decoder's KV
    cache holds about what a checkpointed training step keeps per token, so what trained fits. `cfg`: the
    config with the memory plan applied (`RunPlan.applied_to`)."""
    if cfg.max_tokens:
        return max(1, cfg.max_tokens // split)
    rows = max(1, (cfg.per_device_train_batch_size or 1) // split)
    return rows * (cfg.max_source_length + cfg.max_target_length)


def metrics_line(metrics: dict[str, float]) -> str:
    """The headline metrics in a line: `eval loss 2.0643, rougeL 20.79, bleu 9.28, ingredient_coverage 0.109,
    structure 0.111` (ROUGE, BLEU and chrF are 0-100 scores, the recipe checks shares)."""
    parts = []
    for key in HEADLINE_METRICS:
        if key in metrics:
            name = key.removeprefix("eval_")
            fmt = ".4f" if name == "loss" else ".2f" if name in ("rougeL", "bleu") else ".3f"
            parts.append(f"{'eval loss' if name == 'loss' else name} {metrics[key]:{fmt}}")
    return ", ".join(parts)

"""Evaluation during training: the loss on held-out recipes, and a few generated recipes beside the real ones.

`evaluate` returns the metrics under HF's names (`eval_loss`; further metrics join as further keys) and the
generations; the loop logs the metrics to the train log, W&B and Discord.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer import distributed
from trainer.config import TrainConfig
from trainer.data import to_device
from trainer.step import token_loss_sum


@dataclass
class EvalResult:
    metrics: dict[str, float]  # {"eval_loss": ...}
    generations: list[dict[str, str]]  # {"ingredients", "generated", "reference"}

    @property
    def loss(self) -> float:
        return self.metrics["eval_loss"]


def evaluate(model, stream, device, cfg: TrainConfig, tokenizer_file: str, loss_module=None) -> EvalResult:
    """Eval loss (token mean) over at most cfg.eval_max_batches held-out batches, and a few generations.

    Several ranks: each evaluates its shard of the held-out data (as many batches on every rank) through
    `loss_module` (the FSDP module; DDP's inner module), and the loss is the global token mean. Under FSDP the
    ranks generate together (`synced_gpus`), from their first batch only so that all run `generate` equally
    often."""
    import torch
    from tokenizers import Tokenizer

    loss_module = model if loss_module is None else loss_module
    sharded = distributed.is_sharded(loss_module)
    tok = Tokenizer.from_file(tokenizer_file)
    loss_module.eval()
    loss_sum, n_tokens, generations = 0.0, 0, []
    try:
        with torch.no_grad():
            stream.set_epoch(0)
            for i, batch in enumerate(stream):
                if i >= cfg.eval_max_batches:
                    break
                batch = to_device(batch, device)
                loss_sum += float(token_loss_sum(loss_module, batch))
                n_tokens += int((batch["labels"] != -100).sum())
                if len(generations) < cfg.num_eval_generations and (i == 0 or not sharded):
                    with distributed.full_weights(loss_module):
                        generations += generate(
                            model, tok, batch, cfg, cfg.num_eval_generations - len(generations), sharded
                        )
    finally:
        loss_module.train()
    loss_sum, n_tokens = distributed.all_sum([loss_sum, n_tokens])
    return EvalResult({"eval_loss": loss_sum / n_tokens if n_tokens else float("nan")}, generations)


def generate(model, tok, batch: dict, cfg: TrainConfig, n: int, synced: bool = False) -> list[dict[str, str]]:
    """Greedy generations for the first `n` rows of a batch: {"ingredients", "generated", "reference"}.
    `synced`: the ranks generate in lockstep until all are done (FSDP gathers weights for every step)."""
    input_ids, mask = batch["input_ids"][:n], batch["attention_mask"][:n]
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=cfg.generation_max_new_tokens,
        do_sample=False,
        use_cache=True,
        synced_gpus=synced,
    )
    rows = []
    for i in range(len(input_ids)):
        src = input_ids[i][mask[i].bool()].tolist()
        ref = [t for t in batch["labels"][i].tolist() if t != -100]
        rows.append(
            {
                "ingredients": tok.decode(src, skip_special_tokens=True),
                "generated": tok.decode(out[i].tolist(), skip_special_tokens=True),
                "reference": tok.decode(ref, skip_special_tokens=True),
            }
        )
    return rows

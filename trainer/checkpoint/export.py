"""`final/`: the finished model, written whole (weights, tokenizer, prompt template and model card), the
weights those of the best checkpoint with load_best_model_at_end; a LoRA run's merged into the base, its
adapter in `final/adapter/`."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from trainer.checkpoint.model_card import write_model_card
from trainer.checkpoint.store import delete_tree, is_adapter_model, save_pretrained, whole_model_weights
from trainer.data.prompt import save_prompt_template
from trainer.infra import disk, distributed

log = logging.getLogger(__name__)


def save_final_model(
    model,
    model_name_or_path: str,
    tokenizer_file: str,
    final: Path,
    *,
    prompt_config=None,
    card=None,
    weights_from: Path | None = None,
) -> None:
    """`final/`: the whole model and its tokenizer, written beside it and renamed into place, so that a run
    stopped or failing half-way leaves no partial final/ (the next run writes it). Collective under FSDP.

    `weights_from`: a checkpoint whose weights final/ takes instead of `model`'s (load_best_model_at_end),
    hard-linked (copied on a filesystem without links); the same on every rank. `prompt_config`: the config
    trained with, for `recipe_template.json`; `card`: a trainer.checkpoint.model_card.ModelCardInfo for
    README.md.

    A PEFT model (LoRA, trainer.model.lora): final/ holds the base with the adapter (`weights_from`'s, else
    the model's) merged into its weights, final/adapter/ the adapter; rank 0's model is merged in place."""
    is_main = distributed.rank() == 0
    tmp = final.with_name(final.name + ".tmp")
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    distributed.barrier()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # this rank's, under FSDP
    with disk.removed_on_failure(tmp, needed_bytes=weights, remove=is_main):
        if is_adapter_model(model):
            if is_main:
                # peft takes seconds to import: only LoRA runs import it (through trainer.model.lora)
                from trainer.model.lora import save_merged

                save_merged(model, tmp, adapter_from=weights_from)
        elif weights_from is None:
            whole = whole_model_weights(model)  # under torchrun: gathered to rank 0 (collective)
            if is_main:
                save_pretrained(model, tmp, whole)
        elif is_main:
            _link_weights(Path(weights_from), tmp)
        if is_main:
            _copy_tokenizer(model_name_or_path, tokenizer_file, tmp)
            if prompt_config is not None:
                save_prompt_template(tmp, prompt_config)
            if card is not None:
                write_model_card(tmp, card)
            if final.exists():
                delete_tree(final)
            os.rename(tmp, final)
            log.info("saved the final model and its tokenizer in %s", final)


def _link_weights(checkpoint: Path, out: Path) -> None:
    """The model files save_pretrained wrote into `checkpoint` (config, generation config, safetensors and
    their index), hard-linked into `out`: no second copy on disk, and rotating the checkpoint away later
    leaves them."""
    out.mkdir(parents=True, exist_ok=True)
    names = ["config.json", "generation_config.json", "model.safetensors.index.json"]
    files = [checkpoint / n for n in names if (checkpoint / n).is_file()]
    files += sorted(checkpoint.glob("*.safetensors"))
    for src in files:
        try:
            os.link(src, out / src.name)
        except OSError:
            shutil.copy2(src, out / src.name)


def _copy_tokenizer(model_name_or_path: str, tokenizer_file: str, out: Path) -> None:
    src = Path(model_name_or_path)
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model"]
    copied = False
    if src.is_dir():
        for name in names:
            if (src / name).exists():
                shutil.copy(src / name, out / name)
                copied = True
    if not copied:
        shutil.copy(tokenizer_file, out / "tokenizer.json")

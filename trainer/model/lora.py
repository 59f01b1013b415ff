"""LoRA (Hu et al., 2021): FLAN-T5 fine-tuned through small trainable adapters over a frozen base
(`adapter: lora`, docs/lora.md).

PEFT is the implementation: its `LoraConfig` (r, lora_alpha, lora_dropout, target_modules), its injection
and initialisation of the adapters (lora_A Kaiming-uniform, lora_B zeros: training starts from the base
model), fp32 adapters over the bf16 base (`autocast_adapter_dtype`, PEFT's default), its files
(`adapter_model.safetensors`, `adapter_config.json` naming the base) and its merge (`merge_and_unload`).

One part is the trainer's own: the arithmetic of an adapted projection on the fast path. PEFT's layer
(`lora.Linear.forward`) is a module around one projection, `base_layer(x) + lora_B(lora_A(dropout(x))) *
scaling`, with x cast to the adapter's fp32 and that copy kept for the backward, in every adapted projection.
The fast path runs several projections as one autograd function, q, k and v of one input, wi_0 and wi_1
(trainer.kernels.projections), and the feed-forward's output projection wo inside the fused gated GELU
(trainer.kernels.fused_ops), where no module of wo is called. So the adapted layers stay PEFT's layers in the
module tree (state-dict names, files and merge are PEFT's), and the fused functions read their adapters at
each call (`trainer.kernels.projections.LowRank`): the down-projections of a shared input as one matmul, the
products in the base's dtype (as under autocast), fp32 gradients for the fp32 adapters, and no gradient matmul
at all for a frozen weight. Elsewhere (evaluation and generation without gradients; wo off the GPU) PEFT's own
forward runs.

The base is frozen: no gradients, optimizer states or Kahan buffers for it. Checkpoints hold the adapters
and their optimizer states (trainer.checkpoint.store); at the end `final/` holds the merged model and
`final/adapter/` the adapter (`save_final`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from trainer.kernels.projections import GroupedLinear, LowRank
from trainer.model.model_files import from_pretrained, write_config

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_DIR = "adapter"  # final/adapter/


class GroupedLoraLinear(PeftLoraLinear):
    """PEFT's LoRA layer on a trainer.kernels.projections.GroupedLinear: PEFT's own (adapter parameters,
    initialisation, merge, files); under autograd its forward is the base's grouped projection, which adds
    this layer's update (`connect_fused_paths`); without gradients PEFT's forward."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if torch.is_grad_enabled() and not args and not kwargs:
            return self.base_layer(x)
        return super().forward(x, *args, **kwargs)


def lora_config(cfg) -> LoraConfig:
    """PEFT's LoraConfig for the run's `adapter: lora` keys."""
    return LoraConfig(
        task_type=TaskType.SEQ_2_SEQ_LM,
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        bias="none",
    )


def add_adapters(model, cfg) -> PeftModel:
    """`model` (the HF model, with trainer.model.load's fused ops in place) with LoRA adapters on
    cfg.lora_target_modules and everything else frozen: PEFT's model around it, which the run trains,
    checkpoints and merges. Logs what is trained."""
    config = lora_config(cfg)
    # PEFT's extension point for module types it does not know (its "dynamic dispatch" of custom modules).
    config._register_custom_module({GroupedLinear: GroupedLoraLinear})
    with _peft_warnings_ignored():
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    # The base the adapter files name: the config's (PEFT takes the model's name, empty for random_init).
    config.base_model_name_or_path = cfg.model_name_or_path
    fused = connect_fused_paths(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    n_trainable, n_frozen = sum(p.numel() for p in trainable), sum(p.numel() for p in frozen)
    log.info(
        "LoRA: r %d, alpha %g (scaling %g), dropout %g on %s: %s trained parameters (%.2f%%) in %s over a "
        "frozen %s base of %s; %d adapted projections on the fused path",
        cfg.lora_r,
        cfg.lora_alpha,
        cfg.lora_alpha / cfg.lora_r,
        cfg.lora_dropout,
        ", ".join(cfg.lora_target_modules),
        f"{n_trainable:,}",
        100 * n_trainable / (n_trainable + n_frozen),
        str(trainable[0].dtype).removeprefix("torch."),
        str(frozen[0].dtype).removeprefix("torch."),
        f"{n_frozen:,}",
        fused,
    )
    return peft_model


@contextlib.contextmanager
def _peft_warnings_ignored():
    """PEFT warns of any registered custom module type ("proceed at your own risk"), and asks transformers a
    question it has renamed: nothing for the user to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unsupported layer type", UserWarning)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def low_rank_of(layer: LoraLayer) -> LowRank | None:
    """The update a PEFT LoRA layer adds now: its active adapter's (lora_A, lora_B, scaling, dropout p); None
    while its adapters are disabled or merged into the base weight."""
    if layer.disable_adapters or layer.merged:
        return None
    (name,) = layer.active_adapters
    dropout = layer.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0
    return LowRank(layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name], p)


def connect_fused_paths(model) -> int:
    """Point the fused functions at the LoRA layers PEFT put in place: each grouped projection's group reads
    its member's adapter, the fused gated feed-forward (trainer.model.fused_t5.FusedGatedGelu, which has
    `wo_low_rank`) its wo's. Returns how many were connected."""
    connected = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and isinstance(module.base_layer, GroupedLinear):
            base = module.base_layer
            base._group.low_rank[base._index] = functools.partial(low_rank_of, module)
            connected += 1
        elif hasattr(module, "wo_low_rank") and isinstance(module.wo, LoraLayer):
            module.wo_low_rank = functools.partial(low_rank_of, module.wo)
            connected += 1
    return connected


def load_adapter_weights(peft_model: PeftModel, adapter_dir: str | Path) -> None:
    """Load the adapter PEFT saved in `adapter_dir` (a checkpoint's, or final/adapter/) into `peft_model`'s
    adapters, which must have its shapes (the same LoRA settings)."""
    from safetensors.torch import load_file

    device = next(p.device for p in peft_model.parameters() if p.requires_grad)
    state = load_file(Path(adapter_dir) / ADAPTER_WEIGHTS, device=str(device))
    result = set_peft_model_state_dict(peft_model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"{adapter_dir}: its adapter does not fit this model's ({len(missing)} adapter weights missing, "
            f"{len(result.unexpected_keys)} unexpected)"
        )


def save_adapter(peft_model: PeftModel, path: str | Path) -> None:
    """The adapter in PEFT's format in `path` (adapter_model.safetensors, adapter_config.json naming the
    base), with a short README.md saying how to load it (PEFT adds its own metadata to its header)."""
    config = peft_model.peft_config["default"]
    base = config.base_model_name_or_path
    settings = f"r {config.r}, lora_alpha {config.lora_alpha:g}, lora_dropout {config.lora_dropout:g}"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "README.md").write_text(
        f"""---
base_model: {base}
library_name: peft
---
# LoRA adapter of {base} for recipes

Trained by recipe-t5-trainer ({settings} on {", ".join(sorted(config.target_modules))}). On its base, with
PEFT:

```python
from peft import PeftModel
from transformers import AutoModelForSeq2SeqLM

model = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained({base!r}), "<this directory>")
```
""",
        encoding="utf-8",
    )
    peft_model.save_pretrained(path, safe_serialization=True)


def merge(peft_model: PeftModel):
    """The HF model inside `peft_model` with the adapter merged into its weights and PEFT's layers gone
    (PEFT's merge_and_unload: base weight += scaling * lora_B @ lora_A, computed in fp32, rounded once)."""
    with warnings.catch_warnings():
        # transformers 5 says T5's embeddings are tied although FLAN-T5's head is its own; PEFT notices and
        # writes tie_word_embeddings false, which is what FLAN-T5's config.json says: nothing to warn of.
        warnings.filterwarnings("ignore", "Input and output embeddings are no longer tied", UserWarning)
        return peft_model.merge_and_unload()


def save_merged(peft_model: PeftModel, out: Path, adapter_from: Path | None = None) -> None:
    """Write the adapter in PEFT's format to `out`/adapter/ (its base named in adapter_config.json), and the
    base with the adapter merged into its weights to `out` (save_pretrained: it loads as any model does).
    `adapter_from`: a checkpoint whose adapter is written and merged instead of the model's own
    (load_best_model_at_end). The model is merged in place (PEFT's merge_and_unload): it trains no more."""
    if adapter_from is not None:
        load_adapter_weights(peft_model, adapter_from)
    save_adapter(peft_model, out / ADAPTER_DIR)
    merged = merge(peft_model)
    merged.save_pretrained(out, safe_serialization=True)
    write_config(merged, out)
    log.info("LoRA: the adapter merged into the base's weights, and saved alone in %s/", ADAPTER_DIR)


def base_model_of(adapter_dir: str | Path) -> str:
    """The base model an adapter directory names (PEFT's base_model_name_or_path)."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return config["base_model_name_or_path"]


def load_merged(adapter_dir: str | Path, **from_pretrained_kwargs):
    """The model of an adapter directory: its base (`base_model_of`) loaded with `from_pretrained_kwargs`,
    the adapter merged into it (for generation and evaluation)."""
    base = base_model_of(adapter_dir)
    model = from_pretrained(base, **from_pretrained_kwargs)
    with _peft_warnings_ignored():
        merged = merge(PeftModel.from_pretrained(model, str(adapter_dir)))
    log.info("model: %s with the LoRA adapter of %s merged into it", base, adapter_dir)
    return merged

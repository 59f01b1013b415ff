"""The model shapes the memory plan works from: a T5 config's sizes, read from a local model directory, a
built-in table of the public FLAN-T5 / T5 v1.1 checkpoints (no download needed), or the Hugging Face cache;
and LoRA's adapters over them (`LoraShape`, `ModelShape.lora_weight_shapes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a T5 config that decide memory."""

    d_model: int
    d_ff: int
    d_kv: int
    num_heads: int
    num_layers: int
    num_decoder_layers: int
    vocab_size: int
    gated: bool = True  # feed_forward_proj "gated-gelu": wi_0, wi_1 and wo
    tie_word_embeddings: bool = False
    dropout_rate: float = 0.1
    relative_attention_num_buckets: int = 32

    @property
    def inner(self) -> int:
        return self.num_heads * self.d_kv

    def num_params(self) -> int:
        return sum(math.prod(dims) * n for dims, n in self.weight_shapes().items())

    def weight_shapes(self) -> dict[tuple[int, ...], int]:
        """How many weights of each shape the model has."""
        d, f, inner = self.d_model, self.d_ff, self.inner
        blocks = self.num_layers + self.num_decoder_layers
        attentions = self.num_layers + 2 * self.num_decoder_layers
        counts: dict[tuple[int, ...], int] = {}
        for shape, n in [
            ((inner, d), 3 * attentions),  # q, k, v
            ((d, inner), attentions),  # o
            ((f, d), (2 if self.gated else 1) * blocks),  # wi_0, wi_1 (or wi)
            ((d, f), blocks),  # wo
            ((self.vocab_size, d), 1 if self.tie_word_embeddings else 2),  # shared, lm_head
            ((d,), 2 * self.num_layers + 3 * self.num_decoder_layers + 2),  # layer norms, final norms
            ((self.relative_attention_num_buckets, self.num_heads), 2),
        ]:
            counts[shape] = counts.get(shape, 0) + n
        return counts

    def projections(self) -> dict[str, tuple[int, int, int]]:
        """T5's projections by PEFT's module name: (in features, out features, how many the model has)."""
        d, f, inner = self.d_model, self.d_ff, self.inner
        blocks = self.num_layers + self.num_decoder_layers
        attentions = self.num_layers + 2 * self.num_decoder_layers
        feed_forward = (f, blocks) if self.gated else (f, 0)
        return {
            "q": (d, inner, attentions),
            "k": (d, inner, attentions),
            "v": (d, inner, attentions),
            "o": (inner, d, attentions),
            "wi_0": (d, feed_forward[0], feed_forward[1]),
            "wi_1": (d, feed_forward[0], feed_forward[1]),
            "wi": (d, f, 0 if self.gated else blocks),
            "wo": (f, d, blocks),
        }

    def lora_weight_shapes(self, lora: LoraShape) -> dict[tuple[int, ...], int]:
        """How many adapter matrices of each shape LoRA adds: lora_A (r, in) and lora_B (out, r) per adapted
        projection (trainer.model.lora)."""
        counts: dict[tuple[int, ...], int] = {}
        for name in lora.targets:
            n_in, n_out, n = self.projections()[name]
            for dims in ((lora.r, n_in), (n_out, lora.r)):
                counts[dims] = counts.get(dims, 0) + n
        return {dims: n for dims, n in counts.items() if n}

    def lora_num_params(self, lora: LoraShape) -> int:
        return sum(math.prod(dims) * n for dims, n in self.lora_weight_shapes(lora).items())

    def block_params(self, decoder: bool) -> int:
        """Parameters of one T5 block (without the first block's relative position bias table)."""
        d, inner = self.d_model, self.inner
        feed_forward = ((2 if self.gated else 1) + 1) * d * self.d_ff
        attentions = 2 if decoder else 1
        return attentions * 4 * d * inner + feed_forward + (attentions + 1) * d

    def root_params(self) -> int:
        """Parameters outside the blocks: the embedding, the LM head (when untied) and the final norms."""
        return (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.d_model + 2 * self.d_model

    def sharded_params(self, shards: int) -> int:
        """Parameters one of `shards` ranks holds when each weight is split along its first dimension into
        `shards` parts of ceil(rows / shards) rows (FSDP2's padded shards)."""
        return sum(
            n * -(-dims[0] // shards) * math.prod(dims[1:]) for dims, n in self.weight_shapes().items()
        )

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a `transformers.T5Config` (or anything with its attribute names)."""
        proj = getattr(config, "feed_forward_proj", "relu")
        return cls(
            d_model=config.d_model,
            d_ff=config.d_ff,
            d_kv=config.d_kv,
            num_heads=config.num_heads,
            num_layers=config.num_layers,
            num_decoder_layers=getattr(config, "num_decoder_layers", None) or config.num_layers,
            vocab_size=config.vocab_size,
            gated=proj.startswith("gated-"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            dropout_rate=float(getattr(config, "dropout_rate", 0.1)),
            relative_attention_num_buckets=getattr(config, "relative_attention_num_buckets", 32),
        )


@dataclass(frozen=True)
class LoraShape:
    """The numbers of `adapter: lora` that decide memory and FLOPs (trainer.model.lora): the rank, the adapted
    projections (PEFT's module names) and the adapters' dropout."""

    r: int
    targets: tuple[str, ...]
    dropout: float = 0.0

    @classmethod
    def of(cls, cfg) -> LoraShape | None:
        """The config's adapters; None for full fine-tuning."""
        if cfg.adapter != "lora":
            return None
        return cls(cfg.lora_r, tuple(cfg.lora_target_modules), cfg.lora_dropout)


def _t5(d: int, f: int, h: int, n: int) -> dict:
    return dict(
        d_model=d, d_ff=f, d_kv=64, num_heads=h, num_layers=n, num_decoder_layers=n, vocab_size=32128,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.1,
    )  # fmt: skip


# The config.json values of the public checkpoints, so `trainer plan` needs no download (nor the slow import
# of transformers' config machinery).
KNOWN_CONFIGS: dict[str, dict] = {
    "google/flan-t5-small": _t5(512, 1024, 6, 8),
    "google/flan-t5-base": _t5(768, 2048, 12, 12),
    "google/flan-t5-large": _t5(1024, 2816, 16, 24),
    "google/flan-t5-xl": _t5(2048, 5120, 32, 24),
    "google/flan-t5-xxl": _t5(4096, 10240, 64, 24),
    "google/t5-v1_1-small": _t5(512, 1024, 6, 8),
    "google/t5-v1_1-base": _t5(768, 2048, 12, 12),
    "google/t5-v1_1-large": _t5(1024, 2816, 16, 24),
    "google/t5-v1_1-xl": _t5(2048, 5120, 32, 24),
    "google/t5-v1_1-xxl": _t5(4096, 10240, 64, 24),
}


def transformers_version() -> str:
    """The installed transformers' version, read without importing it (which takes seconds)."""
    return version("transformers")


def transformers_major() -> int:
    """The installed transformers' major version: 5 has the attention interface and the sublayer signatures
    the fused modules follow, and ties T5's LM head to the shared embedding whatever `tie_word_embeddings`
    says (the flag only decides the decoder-output scaling); 4.x keeps v1.1/FLAN's head separate."""
    return int(transformers_version().split(".")[0])


def load_shape(model_name_or_path: str) -> ModelShape:
    """A local model dir's config.json, else the built-in table, else the local Hugging Face cache."""
    path = Path(model_name_or_path)
    if (path / "config.json").is_file():
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(str(path)))
    if model_name_or_path in KNOWN_CONFIGS:
        values = dict(KNOWN_CONFIGS[model_name_or_path])
        values["tie_word_embeddings"] = transformers_major() >= 5
        return ModelShape.from_config(SimpleNamespace(**values))
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_name_or_path, local_files_only=True)
    except OSError as e:
        raise ValueError(
            f"no config for {model_name_or_path!r}: not a local model dir, not a known FLAN-T5 id "
            f"({', '.join(sorted(KNOWN_CONFIGS))}), and not in the local Hugging Face cache"
        ) from e
    return ModelShape.from_config(config)


def scales_decoder_outputs(config) -> bool:
    """Whether T5 multiplies the decoder's outputs by d_model**-0.5 before the LM head."""
    # transformers 5 names the flag scale_decoder_outputs; 4.x scaled when the head was tied.
    return bool(getattr(config, "scale_decoder_outputs", config.tie_word_embeddings))

"""Adafactor with T5's fine-tuning settings (trainer.optim.adafactor_optimizer), as Hugging Face's
`adafactor` optim (transformers' Adafactor with scale_parameter and relative_step off): a factored second
moment, no first moment, so its states are a row and a column vector per matrix. The full XL presets' choice.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from trainer.optim.spec import OptimizerSpec

log = logging.getLogger(__name__)


class AdafactorSpec(OptimizerSpec):
    name = "adafactor"
    help = "adafactor (T5's settings; the XL presets': far smaller states)"
    hf_names = ("adafactor",)

    def state_bytes(self, shape: Any, weight_bytes: int, lora: Any = None, shards: int = 1) -> int:
        if lora is not None:
            return 4 * sum((rows + cols) * n for (rows, cols), n in shape.lora_weight_shapes(lora).items())
        # A row and a column vector (fp32) per matrix, whole on every FSDP rank; a full fp32 vector for 1-D
        # weights (layer norms), sharded like them; a 0-d fp32 RMS per weight tensor.
        d, f, inner, v = shape.d_model, shape.d_ff, shape.inner, shape.vocab_size
        d_shard = -(-d // shards)
        ff_mats = (3 if shape.gated else 2) * (d + f)
        enc = shape.num_layers * (4 * (d + inner) + ff_mats + 2 * d_shard)
        dec = shape.num_decoder_layers * (8 * (d + inner) + ff_mats + 3 * d_shard)
        embeds = (1 if shape.tie_word_embeddings else 2) * (v + d)
        bias = 2 * (shape.relative_attention_num_buckets + shape.num_heads)  # relative position bias tables
        final_norms = 2 * d_shard
        ff_n = 3 if shape.gated else 2
        tensors = shape.num_layers * (4 + ff_n + 2) + shape.num_decoder_layers * (8 + ff_n + 3) + 2 + 2
        tensors += 1 if shape.tie_word_embeddings else 2
        return 4 * (enc + dec + embeds + bias + final_norms + tensors)

    def checkpoint_bytes_per_param(self, weight_bytes: int) -> float:
        return 0  # factored: vectors per matrix

    def step_scratch_bytes(self, shape: Any, lora: Any = None, shards: int = 1) -> int:
        if shards > 1:  # FSDP's shards, one weight at a time in torch ops: a few fp32 copies of the largest
            largest = max(-(-dims[0] // shards) * math.prod(dims[1:]) for dims in shape.weight_shapes())
            return 3 * 4 * largest
        # On a GPU the kernels keep fp32 partial sums per group of same-shape weights (~0.3 GB for XL).
        # Imported here: `trainer plan` runs also where the kernels cannot (no Triton).
        from trainer.kernels.adafactor_kernels import scratch_bytes

        weights = shape.weight_shapes() if lora is None else shape.lora_weight_shapes(lora)
        return max(scratch_bytes(count, dims) for dims, count in weights.items())

    def build(self, params: list, cfg: Any, device: Any, kahan: bool) -> Any:
        from trainer.optim.adafactor_optimizer import Adafactor

        log.info("optimizer: Adafactor (T5 settings, factored), %s updates", "Kahan" if kahan else "plain")
        return Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, kahan=kahan)


ADAFACTOR = AdafactorSpec()

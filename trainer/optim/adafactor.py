"""Adafactor with T5's fine-tuning settings (trainer.optim.adafactor_optimizer), as Hugging Face's
`adafactor` optim (transformers' Adafactor with scale_parameter and relative_step off): a factored second
moment, no first moment, so its states are a row and a column vector per matrix. The full XL presets' choice.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.optim.spec import OptimizerSpec

log = logging.getLogger(__name__)


class AdafactorSpec(OptimizerSpec):
    name = "adafactor"
    help = "adafactor (T5's settings; the XL presets': far smaller states)"
    hf_names = ("adafactor",)
    kahan_8bit = True

    def state_bytes(self, shape: Any, weight_bytes: int, lora: Any = None, shards: int = 1) -> int:
        if lora is not None:
            return 4 * sum((rows + cols) * n for (rows, cols), n in shape.lora_weight_shapes(lora).items())
        # A row and a column vector (fp32) per matrix (under FSDP the rows split like the weight's, the
        # columns whole on every rank); a full fp32 vector for 1-D weights (layer norms), split like them;
        # a 0-d fp32 RMS per weight tensor (transformers' Adafactor keeps one).
        numbers = 0
        for dims, count in shape.weight_shapes().items():
            rows = -(-dims[0] // shards)
            numbers += count * (1 + (rows + dims[1] if len(dims) == 2 else rows))
        return 4 * numbers

    def checkpoint_bytes_per_param(self, weight_bytes: int) -> float:
        return 0  # factored: vectors per matrix

    def step_scratch_bytes(self, shape: Any, lora: Any = None, shards: int = 1) -> int:
        # On a GPU the kernels keep fp32 partial sums per group of same-shape weights (~0.3 GB for XL), of
        # each rank's rows under FSDP, where the all-reduced sums of every weight add theirs.
        # Imported here: `trainer plan` runs also where the kernels cannot (no Triton).
        from trainer.kernels.adafactor_kernels import scratch_bytes

        weights = shape.weight_shapes() if lora is None else shape.lora_weight_shapes(lora)
        local = {(-(-dims[0] // shards), *dims[1:]): count for dims, count in weights.items()}
        partial = max(scratch_bytes(count, dims) for dims, count in local.items())
        if shards == 1:
            return partial
        return partial + sum(4 * count * (dims[-1] + 2) for dims, count in weights.items())

    def build(self, params: list, cfg: Any, device: Any, update: str) -> Any:
        from trainer.optim.adafactor_optimizer import Adafactor

        what = {"kahan": "Kahan-compensated", "kahan_8bit": "Kahan-compensated (8-bit buffer)"}
        log.info("optimizer: Adafactor (T5 settings, factored), %s updates", what.get(update, "plain"))
        return Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, bf16_update=update)


ADAFACTOR = AdafactorSpec()

"""8-bit AdamW, as Hugging Face's `adamw_torch_8bit` / `adamw_bnb_8bit`: AdamW whose two moments are kept in
8 bits, in blocks of 256 numbers with an fp32 scale each, on bitsandbytes' dynamic map
(trainer.optim.adamw8bit_optimizer, its GPU kernel trainer.kernels.adamw8bit_kernels). Its states take 2
bytes per weight where `adamw`'s take 4 (bf16). bf16 weights take stochastically rounded updates instead of a
Kahan buffer: small updates land in expectation, and the 2 bytes per weight a buffer would take back are not
spent, so it needs the memory `adafactor` + Kahan does.

FSDP2 is not taken (its kernel reads whole weights; ddp is).
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.optim.spec import OptimizerSpec

log = logging.getLogger(__name__)

BLOCK = 256  # numbers per fp32 scale (trainer.kernels.adamw8bit_kernels.BLOCK)


def _moment_bytes(numel: int) -> int:
    """Bytes of one moment of a weight of `numel` numbers: 8-bit codes and an fp32 scale per block, or fp32
    numbers for a weight not in whole blocks."""
    return numel + 4 * (numel // BLOCK) if numel % BLOCK == 0 else 4 * numel


class AdamW8bitSpec(OptimizerSpec):
    name = "adamw8bit"
    help = "adamw8bit (AdamW with 8-bit moments: adafactor's memory)"
    hf_names = ("adamw_torch_8bit", "adamw_bnb_8bit", "adamw_8bit")
    kahan = False  # stochastic rounding: a buffer would cost back what the 8-bit moments save
    compensation = "stochastically rounded"
    fsdp = False

    def state_bytes(self, shape: Any, weight_bytes: int, lora: Any = None, shards: int = 1) -> int:
        weights = shape.weight_shapes() if lora is None else shape.lora_weight_shapes(lora)
        total = 0
        for dims, count in weights.items():
            numel = -(-dims[0] // shards) * (dims[1] if len(dims) == 2 else 1)
            total += count * 2 * _moment_bytes(numel)
        return total

    def checkpoint_bytes_per_param(self, weight_bytes: int) -> float:
        return 2 * (1 + 4 / BLOCK)

    def build(self, params: list, cfg: Any, device: Any, update: str) -> Any:
        from trainer.optim.adamw8bit_optimizer import AdamW8bit

        stochastic = update == "kahan"
        what = "stochastically rounded bf16 updates" if stochastic else f"{params[0].dtype} updates"
        log.info("optimizer: 8-bit AdamW (blocks of %d), %s", BLOCK, what)
        return AdamW8bit(
            params,
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_epsilon,
            weight_decay=cfg.weight_decay,
            stochastic_rounding=stochastic,
        )


ADAMW8BIT = AdamW8bitSpec()

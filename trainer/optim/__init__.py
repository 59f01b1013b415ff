"""The optimizers, each declared in one module (trainer.optim.spec.OptimizerSpec: names, state and step
memory, Kahan and FSDP support, how it is built) and listed in OPTIMIZERS. The config takes their names, the
memory plan and `trainer plan` their memory, the loop `build_optimizer`.
"""

from __future__ import annotations

from typing import Any

from trainer.optim.adafactor import ADAFACTOR
from trainer.optim.adamw import ADAMW
from trainer.optim.adamw8bit import ADAMW8BIT
from trainer.optim.spec import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (ADAMW, ADAMW8BIT, ADAFACTOR)}


def compensated_updates(weight_bytes: int, bf16_update: str) -> bool:
    """Whether no small update may be lost: 16-bit weights, and the config asks (`bf16_update: kahan`)."""
    return weight_bytes == 2 and bf16_update == "kahan"


def kahan_updates(spec: OptimizerSpec, weight_bytes: int, bf16_update: str) -> bool:
    """Whether 16-bit weights take Kahan-compensated updates: the config asks and the optimizer can."""
    return spec.kahan and compensated_updates(weight_bytes, bf16_update)


def checkpoint_bytes_per_param(name: str, weight_bytes: int, bf16_update: str) -> float:
    """Bytes a checkpoint holds per trained parameter for the optimizer `name`: its states, and a Kahan buffer
    in the weights' dtype where it keeps one."""
    spec = OPTIMIZERS[name]
    kahan = weight_bytes if kahan_updates(spec, weight_bytes, bf16_update) else 0
    return spec.checkpoint_bytes_per_param(weight_bytes) + kahan


def build_optimizer(model: Any, cfg: Any, device: Any) -> Any:
    """The optimizer cfg.optimizer names over `model`'s trainable weights; 16-bit weights with compensated
    updates where cfg.bf16_update says kahan (a Kahan buffer, or the optimizer's own way)."""
    params = [p for p in model.parameters() if p.requires_grad]
    compensated = compensated_updates(params[0].element_size(), cfg.bf16_update)
    return OPTIMIZERS[cfg.optimizer].build(params, cfg, device, compensated)

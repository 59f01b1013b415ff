"""The optimizers, each declared in one module (trainer.optim.spec.OptimizerSpec: names, state and step
memory, the bf16 update ways and FSDP support, how it is built) and listed in OPTIMIZERS. The config takes
their names, the memory plan and `trainer plan` their memory, the loop `build_optimizer`.
"""

from __future__ import annotations

from typing import Any

from trainer.optim.adafactor import ADAFACTOR
from trainer.optim.adamw import ADAMW
from trainer.optim.adamw8bit import ADAMW8BIT
from trainer.optim.spec import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (ADAMW, ADAMW8BIT, ADAFACTOR)}


def bf16_update_mode(weight_bytes: int, bf16_update: str) -> str:
    """How the weights take updates: the config's `bf16_update` for 16-bit weights, "naive" (plain
    arithmetic) for 32-bit ones."""
    return bf16_update if weight_bytes == 2 else "naive"


def kahan_buffer_bytes(spec: OptimizerSpec, weight_bytes: int, bf16_update: str) -> int:
    """Bytes per weight of a Kahan buffer: the weight's (`kahan`) or one (`kahan_8bit`) where the config asks
    for one and the optimizer keeps one; 0 otherwise."""
    mode = bf16_update_mode(weight_bytes, bf16_update)
    if not spec.kahan or mode not in ("kahan", "kahan_8bit"):
        return 0
    return 1 if mode == "kahan_8bit" else weight_bytes


def checkpoint_bytes_per_param(name: str, weight_bytes: int, bf16_update: str) -> float:
    """Bytes a checkpoint holds per trained parameter for the optimizer `name`: its states, and a Kahan buffer
    where it keeps one."""
    spec = OPTIMIZERS[name]
    return spec.checkpoint_bytes_per_param(weight_bytes) + kahan_buffer_bytes(spec, weight_bytes, bf16_update)


def build_optimizer(model: Any, cfg: Any, device: Any) -> Any:
    """The optimizer cfg.optimizer names over `model`'s trainable weights, their 16-bit updates as
    cfg.bf16_update says."""
    params = [p for p in model.parameters() if p.requires_grad]
    update = bf16_update_mode(params[0].element_size(), cfg.bf16_update)
    return OPTIMIZERS[cfg.optimizer].build(params, cfg, device, update)

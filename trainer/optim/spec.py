"""What an optimizer declares: its name and Hugging Face's names for it, the memory its states and its step
take, which `bf16_update` ways it takes, and whether it runs on FSDP2's shards; and how it is built. One
module of trainer.optim per optimizer; the memory plan, `trainer plan`, the disk check and the loop ask it
instead of branching on a name.

A spec module imports no torch at import time (the config reads the names, and `trainer config` or a
container's health check should not load torch): `build` imports what it needs.
"""

from __future__ import annotations

from typing import Any


class OptimizerSpec:
    """One optimizer, as the config names it. Subclasses set the attributes and override the methods whose
    default does not hold."""

    name: str = ""  # the config's `optimizer` value
    help: str = ""  # a few words for `trainer config` (what it is, when to pick it)
    hf_names: tuple[str, ...] = ()  # Hugging Face `optim` values that mean the same algorithm and settings
    kahan: bool = True  # keeps a bf16 compensation buffer per weight with `bf16_update: kahan`
    compensation: str = "kahan"  # what `bf16_update: kahan` does with this optimizer, in words
    kahan_8bit: bool = False  # takes `bf16_update: kahan_8bit` (the Kahan buffer in 8-bit codes)
    fsdp: bool = True  # updates FSDP2's sharded weights (DTensors)

    def state_bytes(self, shape: Any, weight_bytes: int, lora: Any = None, shards: int = 1) -> int:
        """Bytes of this optimizer's own states (not a Kahan buffer) for a model of `shape`
        (trainer.model.model_shape.ModelShape) with `weight_bytes`-byte weights, or for `lora`'s fp32
        adapters, on one of `shards` FSDP ranks."""
        raise NotImplementedError

    def checkpoint_bytes_per_param(self, weight_bytes: int) -> float:
        """Bytes a checkpoint holds per trained parameter for these states (before the first checkpoint
        gives the real size); states that grow slower than the parameters count as nothing."""
        raise NotImplementedError

    def step_scratch_bytes(self, shape: Any, lora: Any = None, shards: int = 1) -> int:
        """GPU memory the step itself allocates beyond the states and gradients, at its peak."""
        return 0

    def build(self, params: list, cfg: Any, device: Any, update: str) -> Any:
        """The torch optimizer over `params` with the config's learning rate, weight decay and the
        optimizer's own keys; `update` (trainer.optim.bf16_update_mode): "kahan" (16-bit weights, no small
        update may be lost: a Kahan buffer where `kahan` is set, otherwise the optimizer's own way),
        "kahan_8bit" (the same with an 8-bit buffer) or "naive" (rounded to nearest; any 32-bit weights)."""
        raise NotImplementedError

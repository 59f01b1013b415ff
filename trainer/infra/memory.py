"""GPU memory environment: the caching allocator's settings, the empty_cache schedule, out-of-memory helpers.

`set_alloc_conf` must run before anything initialises CUDA: the allocator reads its settings once, at the
first CUDA allocation. `trainer.run.train.train` calls it first thing.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

GIB = 1024**3

# torch >= 2.9 reads PYTORCH_ALLOC_CONF and still honours the older CUDA-specific name.
ALLOC_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def set_alloc_conf(value: str | None) -> str | None:
    """Put `value` in PYTORCH_CUDA_ALLOC_CONF unless the user set one; return the value in force.

    Warns when CUDA is already initialised, because then the setting cannot take effect any more.
    """
    user = {name: os.environ[name] for name in ALLOC_ENV_VARS if os.environ.get(name)}
    if user:
        name, in_force = next(iter(user.items()))
        if value and in_force != value:
            log.info("allocator: keeping the user's %s=%s (config asks for %s)", name, in_force, value)
    elif value:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
        in_force = value
    else:
        in_force = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("allocator: CUDA was initialised before the allocator settings could be applied")
    return in_force


def alloc_conf_in_force() -> str:
    """The allocator settings torch runs with, for the log (read back from the environment torch saw)."""
    values = [f"{name}={os.environ[name]}" for name in ALLOC_ENV_VARS if os.environ.get(name)]
    text = ", ".join(values) if values else "allocator defaults"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        text += f" (backend {torch.cuda.memory.get_allocator_backend()})"
    return text


@dataclass(frozen=True)
class GpuMemory:
    """This process's GPU memory in GiB: the peak allocated since the start, allocated now, reserved now."""

    peak_gib: float
    allocated_gib: float
    reserved_gib: float


def gpu_memory(device) -> GpuMemory | None:
    """The GPU memory of `device` (a torch.device); None on a CPU."""
    if device.type != "cuda":
        return None
    import torch

    return GpuMemory(
        peak_gib=torch.cuda.max_memory_allocated(device) / GIB,
        allocated_gib=torch.cuda.memory_allocated(device) / GIB,
        reserved_gib=torch.cuda.memory_reserved(device) / GIB,
    )


def free_memory() -> None:
    """Drop what an out-of-memory step left behind (tracebacks hold tensors) and return cached blocks."""
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def memory_summary() -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.memory_summary(abbreviated=True)
    return "(no CUDA device: no memory summary)"


class EmptyCacheSchedule:
    """torch.cuda.empty_cache() every `every` optimizer steps and after each evaluation; `every` 0: never.

    Evaluation and generation allocate other shapes than training steps do: their cached blocks, returned to
    the driver after them, would otherwise stay reserved beside the training's. Each clearing costs a device
    sync and the re-growth of the cache in the next step: after every step it cost 3.5% of the step time
    (bench/NOTES.md); every N steps it costs that over N (`python3 bench/allocator.py` measures one clearing).
    Called only between steps. On a CPU nothing is cleared, but the decisions are the same and counted in
    `calls`.
    """

    def __init__(self, every: int):
        self.every = every
        self.calls = 0

    def after_step(self, step: int) -> bool:
        """Clear after optimizer step `step` if it is one of every `every`-th; returns whether it did."""
        if self.every <= 0 or step % self.every:
            return False
        return self._clear()

    def after_evaluation(self) -> bool:
        """Clear after an evaluation (unless `every` is 0); returns whether it did."""
        return self.every > 0 and self._clear()

    def _clear(self) -> bool:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        self.calls += 1
        return True

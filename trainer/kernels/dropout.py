"""Dropout inside the Triton kernels, without a stored mask: each element's random number is a counter-based
hash (`uniform16`) of its index, keyed by a seed drawn from torch's generator (`dropout_seed`). The backward
and gradient checkpointing's recompute (which restores that generator) draw the same seed, so they drop the
same elements. Used by the attention kernels (trainer.kernels.packed_attention)
and the fused feed-forward and residual ops (trainer.kernels.fused_ops). The optimizers' stochastic rounding
draws from the same hash (8-bit AdamW's weights, Adafactor's 8-bit Kahan codes); `uniform16_reference` gives
the same numbers in torch ops, for the CPU's path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """lowbias32 (C. Wellons, "hash prospector"): a bijective mix of a uint32, every input bit flipping each
    output bit with probability ~1/2."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def uniform16(seed, index):
    """A uniform 16-bit random number (as uint32) for each element index, keyed by `seed`: the mixed index
    plus the mixed seed, mixed again. Distinct indices below 2**32 get distinct hashes (the mix is a
    bijection). One hash per number, computed where the number is used: the kernels' tiles need no
    reshaping, which made Philox (eight 16-bit numbers per call) ~2x dearer here (bench/NOTES.md)."""
    return _mix32(index.to(tl.uint32) + _mix32(seed.to(tl.uint32))) >> 16


_U32 = 0xFFFFFFFF


def _mix32_reference(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` in torch ops on int64 tensors holding uint32 values (products wrap; the low 32 bits kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def uniform16_reference(seed: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`uniform16` in torch ops: the same 16-bit numbers (int64) for the same seed (an int or a 0-d int64
    tensor on index's device) and element indices."""
    key = _mix32_reference(torch.as_tensor(seed, dtype=torch.int64, device=index.device) & _U32)
    return _mix32_reference((index.to(torch.int64) + key) & _U32) >> 16


def dropout_resolution(dropout_p: float) -> float:
    """dropout_p rounded to a multiple of 2**-16 (0.1 -> 0.100006), the resolution of uniform16: what the
    kernels drop with, so that dropout_keep keeps each element with probability exactly 1 - p."""
    return round(dropout_p * 65536) / 65536


@triton.jit
def dropout_keep(seed, index, dropout_p):
    """Which elements survive dropout: those whose uniform16 number u has u >= p * 2**16 (p from
    dropout_resolution)."""
    return uniform16(seed, index).to(tl.float32) >= dropout_p * 65536.0


def dropout_seed(device: torch.device) -> torch.Tensor:
    """A dropout seed (for uniform16) from torch's generator on `device`, as a 1-element tensor the kernels
    read: gradient checkpointing's recompute, which restores that generator, draws the same one."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


@triton.jit
def attention_keep(seed, bh, rows, cols, T, S, dropout_p):
    """Which attention probabilities of the tile (rows x cols) of batch-head bh survive dropout: probability
    (bh, i, j) is element (bh x T + i) x S + j of dropout_keep."""
    index = (bh * T + rows[:, None]).to(tl.uint32) * S + cols[None, :]
    return dropout_keep(seed, index, dropout_p)

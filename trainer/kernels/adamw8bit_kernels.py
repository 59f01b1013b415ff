"""8-bit AdamW's update (trainer.optim.adamw8bit_optimizer.AdamW8bit): its moments in blocks of 256 numbers,
each block an fp32 scale (its largest magnitude) and 256 one-byte codes into a 256-value map, as
bitsandbytes' blockwise 8-bit optimizers (Dettmers et al., 2022, "8-bit Optimizers via Block-wise
Quantization") and torchao's AdamW8bit keep them: the first moment on the signed dynamic map, the second on
the unsigned one (`dynamic_map`, bitsandbytes' `create_dynamic_map` as torchao writes it).

`reference_update` is the update in torch ops, one weight at a time (the CPU's path, and what the kernel is
tested against). On a GPU `update_group` updates every same-size weight of a dtype in one launch: each
program reads a tile of 8 blocks of each weight through a device table of addresses, dequantizes both
moments, updates them and the weight in fp32, writes the moments back quantized (one max per block, an
8-step binary search over the map per number, then the nearer of the two neighbours) and the weight rounded
to its dtype: stochastically for bf16 (an update below half a bf16 step lands with the probability of its
size, so none is lost on average), from a counter-based hash of each number's index keyed by a seed drawn
from torch's generator each step (trainer.kernels.dropout.uniform16). ~10 bytes moved per bf16 weight: 6
read, 4 written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trainer.kernels.adafactor_kernels import _TRITON_DTYPES, WeightGroup, _table, _tensor
from trainer.kernels.dropout import uniform16

BLOCK = 256  # numbers per scale
TILE_BLOCKS = 8  # blocks per program


def quantized(numel: int) -> bool:
    """Whether a weight of `numel` numbers keeps 8-bit moments: whole blocks (every T5 weight does); other
    weights keep fp32 moments."""
    return numel > 0 and numel % BLOCK == 0


def dynamic_map(signed: bool) -> list[float]:
    """bitsandbytes' dynamic quantization map of 256 sorted values in [-1, 1] (signed) or [0, 1]: a
    dynamic exponent (powers of ten from 1e-6) and a fraction with the bits the exponent leaves, so small
    magnitudes keep their relative precision (torchao.optim.quant_utils.create_dynamic_map, BSD-3, with
    max_exponent_bits 7 and 8 bits)."""
    data: list[float] = []
    for i in range(7):  # exponents 1e-6 .. 1; a signed map gives half its fractions to the negatives
        fractions = 2**i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = torch.linspace(0.1, 1, fractions)
        means = ((boundaries[:-1] + boundaries[1:]) / 2.0).tolist()
        data += [10 ** (i - 6) * m for m in means]
        if signed:
            data += [-(10 ** (i - 6)) * m for m in means]
    data += [0.0, 1.0]
    assert len(data) == 256
    return sorted(data)


def quantize(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` (a multiple of BLOCK numbers) as codes into `qmap` (uint8, x's shape) and one scale per block
    (fp32): each block divided by its largest magnitude, each number the nearer of the two map values around
    it."""
    blocks = x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1).clamp_min(1e-12)
    y = blocks / scale[:, None]
    codes = torch.where(y >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes += torch.where(y >= qmap[codes + step], step, 0)
    up = (codes + 1).clamp_max(255)
    low = qmap[codes]
    codes = torch.where(y - low >= (qmap[up] - low) * 0.5, up, codes)
    return codes.to(torch.uint8).reshape(x.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The fp32 numbers `codes` and `scale` (from `quantize`) stand for."""
    return (qmap[codes.int()].reshape(-1, BLOCK) * scale[:, None]).reshape(codes.shape)


@dataclass(frozen=True)
class StepScalars:
    """One weight's step: the learning rate, decoupled weight decay, betas, eps and the bias corrections
    1 - beta1^t and sqrt(1 - beta2^t)."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    bias_correction1: float
    sqrt_bias_correction2: float


def stochastic_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 `x` rounded to bf16 away from zero with the probability of the 16 bits bf16 drops, else toward
    zero: unbiased."""
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator)
    bits = (x.view(torch.int32) + noise) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


def reference_update(
    p: torch.Tensor, grad: torch.Tensor, state: dict, maps: tuple[torch.Tensor, torch.Tensor], s: StepScalars,
    stochastic: bool,
) -> None:  # fmt: skip
    """One AdamW step of weight `p` in torch ops: decoupled weight decay, the moments (8-bit in `state`'s
    exp_avg_codes/scale and exp_avg_sq_codes/scale where the weight is `quantized`, else fp32 exp_avg and
    exp_avg_sq), the bias-corrected update; bf16 weights rounded stochastically when `stochastic`.
    `maps`: the signed and unsigned dynamic maps on p's device."""
    w, g = p.float(), grad.float()
    w = w - s.lr * s.weight_decay * w
    if "exp_avg_codes" in state:
        m = dequantize(state["exp_avg_codes"], state["exp_avg_scale"], maps[0])
        v = dequantize(state["exp_avg_sq_codes"], state["exp_avg_sq_scale"], maps[1])
    else:
        m, v = state["exp_avg"], state["exp_avg_sq"]
    m = m.lerp(g, 1 - s.beta1)
    v = v.lerp(g * g, 1 - s.beta2)
    if "exp_avg_codes" in state:
        for name, x, qmap in (("exp_avg", m, maps[0]), ("exp_avg_sq", v, maps[1])):
            codes, scale = quantize(x, qmap)
            state[f"{name}_codes"].copy_(codes)
            state[f"{name}_scale"].copy_(scale)
    else:
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
    w = w - s.lr * (m / s.bias_correction1) / (v.sqrt() / s.sqrt_bias_correction2 + s.eps)
    p.copy_(stochastic_bf16(w) if stochastic and p.dtype == torch.bfloat16 else w)


@triton.jit
def _quantize(x, Map):
    """Codes (int32) and per-row scales of a tile of blocks (rows) of fp32 numbers, as `quantize`."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    y = x / scale[:, None]
    codes = tl.where(y >= tl.load(Map + 128), 128, 0)
    codes += tl.where(y >= tl.load(Map + codes + 64), 64, 0)
    codes += tl.where(y >= tl.load(Map + codes + 32), 32, 0)
    codes += tl.where(y >= tl.load(Map + codes + 16), 16, 0)
    codes += tl.where(y >= tl.load(Map + codes + 8), 8, 0)
    codes += tl.where(y >= tl.load(Map + codes + 4), 4, 0)
    codes += tl.where(y >= tl.load(Map + codes + 2), 2, 0)
    codes += tl.where(y >= tl.load(Map + codes + 1), 1, 0)
    up = tl.minimum(codes + 1, 255)
    low = tl.load(Map + codes)
    codes = tl.where(y - low >= (tl.load(Map + up) - low) * 0.5, up, codes)
    return codes, scale


@triton.jit(do_not_specialize=["blocks", "lr", "lr_wd", "bias_correction1", "sqrt_bias_correction2"])
def _update(
    P,
    G,
    MCodes,
    MScale,
    VCodes,
    VScale,
    SignedMap,
    UnsignedMap,
    Seed,
    blocks,
    lr,
    lr_wd,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    bias_correction1,
    sqrt_bias_correction2,
    TY: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, n = tl.program_id(0), tl.program_id(1)  # a weight's tiles on the grid's long axis (up to 2**31 - 1)
    weight, grad = _tensor(P, n, TY), _tensor(G, n, TY)
    m_codes, v_codes = _tensor(MCodes, n, tl.uint8), _tensor(VCodes, n, tl.uint8)
    m_scale, v_scale = _tensor(MScale, n, tl.float32), _tensor(VScale, n, tl.float32)
    b = t * NB + tl.arange(0, NB)
    live = b < blocks
    inside = live[:, None] & (tl.arange(0, BLOCK) < BLOCK)[None, :]
    at = b.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    g = tl.load(grad + at, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(weight + at, mask=inside, other=0.0).to(tl.float32)
    mc = tl.load(m_codes + at, mask=inside, other=0).to(tl.int32)
    vc = tl.load(v_codes + at, mask=inside, other=0).to(tl.int32)
    m = tl.load(SignedMap + mc) * tl.load(m_scale + b, mask=live, other=0.0)[:, None]
    v = tl.load(UnsignedMap + vc) * tl.load(v_scale + b, mask=live, other=0.0)[:, None]
    w = w - lr_wd * w
    m = m + one_minus_beta1 * (g - m)
    v = v + one_minus_beta2 * (g * g - v)
    mc, ms = _quantize(m, SignedMap)
    vc, vs = _quantize(v, UnsignedMap)
    tl.store(m_codes + at, mc.to(tl.uint8), mask=inside)
    tl.store(v_codes + at, vc.to(tl.uint8), mask=inside)
    tl.store(m_scale + b, ms, mask=live)
    tl.store(v_scale + b, vs, mask=live)
    w = w - lr * (m / bias_correction1) / (tl.sqrt_rn(v) / sqrt_bias_correction2 + eps)
    if STOCHASTIC:  # the 16 bits bf16 drops, plus a uniform 16-bit number: a carry rounds away from zero
        seed = tl.load(Seed) + n
        noise = uniform16(seed, at).to(tl.int32)
        w = ((w.to(tl.int32, bitcast=True) + noise) & -65536).to(tl.float32, bitcast=True)
    tl.store(weight + at, w.to(TY, fp_downcast_rounding="rtne"), mask=inside)


def supports(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether `update_group` can update `p`: what the Adafactor kernels' tables need (a contiguous CUDA
    weight and gradient of one dtype at 16-byte aligned addresses), in whole blocks."""
    return WeightGroup.supports(p, grad) and quantized(p.numel())


def update_group(
    weights: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
    maps: tuple[torch.Tensor, torch.Tensor], s: StepScalars, stochastic: bool,
) -> None:  # fmt: skip
    """`reference_update` of same-size, same-dtype weights (`supports`) in one launch."""
    device, dtype = weights[0].device, weights[0].dtype
    tables = [
        _table(tensors, device)
        for tensors in (
            weights,
            grads,
            [st["exp_avg_codes"] for st in states],
            [st["exp_avg_scale"] for st in states],
            [st["exp_avg_sq_codes"] for st in states],
            [st["exp_avg_sq_scale"] for st in states],
        )
    ]
    blocks = weights[0].numel() // BLOCK
    seed = torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)
    _update[(triton.cdiv(blocks, TILE_BLOCKS), len(weights))](
        *tables,
        *maps,
        seed,
        blocks,
        s.lr,
        s.lr * s.weight_decay,
        1 - s.beta1,
        1 - s.beta2,
        s.eps,
        s.bias_correction1,
        s.sqrt_bias_correction2,
        TY=_TRITON_DTYPES[dtype],
        STOCHASTIC=stochastic and dtype == torch.bfloat16,
        NB=TILE_BLOCKS,
        BLOCK=BLOCK,
        num_warps=4,
    )

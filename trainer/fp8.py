"""FP8 matmuls for the T5 blocks' linear layers (`fp8: true`), as torchao's "tensorwise" float8 training.

Each projection of the encoder and decoder blocks (attention q, k, v, o; the feed-forward's wi_0, wi_1, wo)
runs its three training matmuls in FP8 on the tensor cores: y = x W^T, dx = dy W and dW = dy^T x, with
activations and weights in e4m3 and gradients in e5m2, each tensor scaled by one factor (its absolute
maximum to the format's largest value, computed on the GPU: no host wait) and the products accumulated in
fp32 and written in bf16 (torch._scaled_mm). Weights, gradients, the optimizer and checkpoints stay as
they are; the LM head, embeddings and norms stay bf16. Evaluation and generation (no gradients) run bf16.

On a GPU each cast is one Triton kernel that reads the tensor once and writes both layouts the matmuls need
(row-major and transposed); the absolute maximum is one reduction before it. A projection sharing its input
with the previous one (q, k and v; wi_0 and wi_1; every cross-attention's k and v on the encoder output)
reuses that input's cast. On CPU (tests) the casts are torch ops.

FP8 tensor cores: compute capability 8.9 and up (RTX 40xx and 50xx, L4/L40, H100/H200, B200).
`python3 bench/fp8_matmul.py` times the matmuls and casts at FLAN-T5-XL's shapes; the quality per token is
`bench/convergence.py --runs ...,ours_fp8`'s to show.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MIN_CAPABILITY = (8, 9)
ALIGN = 16  # torch._scaled_mm wants every dimension of both operands a multiple of 16
CAST_BLOCK = dict(BLOCK_R=64, BLOCK_C=128, num_warps=8)


@triton.jit(do_not_specialize=["rows", "padded_rows", "cols"])
def _cast_kernel(
    X,
    Rows,
    Cols,
    Amax,
    InverseScale,
    rows,
    padded_rows,
    cols,
    top,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One (BLOCK_R x BLOCK_C) tile of X scaled by top / amax, saturated, rounded to the FP8 type of Rows,
    written to Rows (row-major, zero rows past `rows`) and, transposed, to Cols."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    scale = tl.math.div_rn(top, tl.maximum(tl.load(Amax), 1e-12))
    x = tl.load(X + r[:, None] * cols + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < cols), other=0.0)
    y = tl.clamp(x.to(tl.float32) * scale, -top, top).to(Rows.dtype.element_ty, fp_downcast_rounding="rtne")
    inside = (r[:, None] < padded_rows) & (c[None, :] < cols)
    tl.store(Rows + r[:, None] * cols + c[None, :], y, mask=inside)
    tl.store(Cols + c[None, :] * padded_rows + r[:, None], y, mask=inside)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(InverseScale, tl.math.div_rn(1.0, scale))


def unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on `device`, or None. CPU runs them (slowly: tests and checks)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 matmuls need a CUDA GPU, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"FP8 matmuls need FP8 tensor cores (compute capability 8.9+: RTX 40xx/50xx, H100); "
            f"{name} is {capability[0]}.{capability[1]}"
        )
    return None


class Fp8Cast:
    """A 2-D tensor in FP8, both layouts: `rows` (R padded to a multiple of 16, C) and `cols` (C, R padded),
    zero rows in the padding, and `inverse_scale`, the fp32 factor that maps the FP8 values back."""

    __slots__ = ("rows", "cols", "inverse_scale", "__weakref__")

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, inverse_scale: torch.Tensor):
        self.rows, self.cols, self.inverse_scale = rows, cols, inverse_scale


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def cast_reference(x: torch.Tensor, dtype: torch.dtype) -> Fp8Cast:
    """The cast as torch ops (CPU, and the GPU kernel's check): x * (fp8 max / amax(|x|)), saturated, rounded
    to nearest even."""
    top = torch.finfo(dtype).max
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    scale = top / amax.clamp(min=1e-12)
    rows = (x.float() * scale).clamp(-top, top).to(dtype)
    pad = _padded(x.size(0)) - x.size(0)
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, x.size(1))])
    return Fp8Cast(rows, rows.t().contiguous(), scale.reciprocal())


def cast(x: torch.Tensor, dtype: torch.dtype, block: dict = CAST_BLOCK) -> Fp8Cast:
    """`x` (2-D, contiguous) in FP8 `dtype` with one scale, both layouts (Triton on a GPU; `block`: the
    kernel's tile and warps, which bench/fp8_matmul.py --sweep compares)."""
    if x.device.type != "cuda":
        return cast_reference(x, dtype)
    r, c = x.shape
    rp = _padded(r)
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    rows = torch.empty(rp, c, device=x.device, dtype=dtype)
    cols = torch.empty(c, rp, device=x.device, dtype=dtype)
    inverse_scale = torch.empty((), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(rp, block["BLOCK_R"]), triton.cdiv(c, block["BLOCK_C"]))
    _cast_kernel[grid](x, rows, cols, amax, inverse_scale, r, rp, c, torch.finfo(dtype).max, **block)
    return Fp8Cast(rows, cols, inverse_scale)


class InputCasts:
    """The last input's cast, shared by the projections of one model: q, k and v (and wi_0 and wi_1, and the
    cross-attentions' k and v) are called with the same tensor, which is then cast once."""

    def __init__(self):
        self._source: weakref.ref | None = None
        self._version = -1
        self._cast: Fp8Cast | None = None

    def get(self, x: torch.Tensor) -> Fp8Cast:
        if self._source is not None and self._source() is x and x._version == self._version:
            return self._cast
        flat = x.reshape(-1, x.size(-1))
        self._cast = cast(flat if flat.is_contiguous() else flat.contiguous(), E4M3)
        self._source, self._version = weakref.ref(x), x._version
        return self._cast


class _Fp8Matmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, x_cast: Fp8Cast):
        w = cast(weight, E4M3)
        rows = x.numel() // x.size(-1)
        y = torch._scaled_mm(
            x_cast.rows, w.rows.t(), scale_a=x_cast.inverse_scale, scale_b=w.inverse_scale, out_dtype=x.dtype
        )
        ctx.save_for_backward(x_cast.cols, x_cast.inverse_scale, w.cols, w.inverse_scale)
        ctx.rows = rows
        return y[:rows].view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad_out):
        x_cols, x_inverse, w_cols, w_inverse = ctx.saved_tensors
        flat = grad_out.reshape(-1, grad_out.size(-1))
        g = cast(flat if flat.is_contiguous() else flat.contiguous(), E5M2)
        dtype = grad_out.dtype
        grad_x = torch._scaled_mm(
            g.rows, w_cols.t(), scale_a=g.inverse_scale, scale_b=w_inverse, out_dtype=dtype
        )
        grad_w = torch._scaled_mm(
            g.cols, x_cols.t(), scale_a=g.inverse_scale, scale_b=x_inverse, out_dtype=dtype
        )
        return grad_x[: ctx.rows].view(*grad_out.shape[:-1], w_cols.size(0)), grad_w, None


class Fp8Linear(torch.nn.Module):
    """A bias-free nn.Linear whose training matmuls run in FP8; the same `weight` Parameter (state-dict keys
    unchanged). Without gradients (evaluation, generation) it is the bf16 linear."""

    def __init__(self, linear: torch.nn.Linear, casts: InputCasts):
        super().__init__()
        self.weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._casts = casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return torch.nn.functional.linear(x, self.weight)
        return _Fp8Matmuls.apply(x, self.weight, self._casts.get(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def use_fp8_linears(model: torch.nn.Module) -> int:
    """Swap the bias-free Linear layers inside the encoder and decoder blocks of a T5 `model` for Fp8Linear;
    returns the count. The LM head and the embeddings stay bf16; so does any layer whose sizes are not
    multiples of 16 (what the FP8 matmuls take)."""
    casts = InputCasts()
    swapped = 0
    for stack in (model.encoder, model.decoder):
        for parent in list(stack.block.modules()):
            for name, child in list(parent.named_children()):
                if (
                    type(child) is torch.nn.Linear
                    and child.bias is None
                    and child.in_features % ALIGN == 0
                    and child.out_features % ALIGN == 0
                ):
                    setattr(parent, name, Fp8Linear(child, casts))
                    swapped += 1
    return swapped

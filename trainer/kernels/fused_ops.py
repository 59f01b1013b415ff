"""T5's gated-GELU feed-forward product as one Triton kernel each way: gelu_tanh(a) * b, then dropout; the
sublayers' residual dropout and RMSNorm backward; the loss's cross-entropy over a chunk of logits.

Eager T5 (`T5DenseGatedActDense`) writes and reads the (tokens x d_ff) intermediate five times in the forward
(GELU, product, dropout with its byte mask) and more in the backward, all twice with gradient checkpointing:
at FLAN-T5-XL size (d_ff 5120) that is ~0.15 s of a ~1.9 s optimizer step (bench/NOTES.md). The fused
forward reads a and b once and writes the result once, which the output projection wo reads and nothing
keeps; the backward reads the gradient, a and b and writes both gradients and the result again, for wo's
weight gradient (gated_gelu_linear: the kernels and wo are one autograd function). Dropout keeps no mask:
the kept set is drawn from a hash of each element's index keyed by a seed from torch's CUDA generator
(trainer.kernels.dropout.uniform16), regenerated in the backward, and reproduced by checkpoint recompute
(which restores that generator). Arithmetic is fp32, rounded once at the end. trainer.model.fused_t5 swaps
them into T5's modules.

On CPU (tests) the kernels run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.kernels.dropout import dropout_keep, dropout_resolution, dropout_seed
from trainer.kernels.projections import (
    LowRank,
    low_rank_down_grads,
    low_rank_forward,
    low_rank_input_grad,
    mark_rms_norm_output,
    weight_gradient,
)

BLOCK = 1024  # elements per program
# 4 elements per thread: forward + backward 1.50 -> 1.13 ms at XL size (bench/fused_ops.py --sweep)
NUM_WARPS = 8


@triton.jit
def _tanh_inner(a):
    """tanh(sqrt(2/pi) (a + 0.044715 a^3)) as 2 sigmoid(2x) - 1 (no libdevice: runs in the interpreter)."""
    x = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit(do_not_specialize=["n"])
def _gated_gelu_fwd_kernel(A, B, Out, Seed, n, dropout_p, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(A + offs, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=inside, other=0.0).to(tl.float32)
    gelu = 0.5 * a * (1.0 + _tanh_inner(a))
    y = gelu * b
    if DROPOUT:
        keep = dropout_keep(tl.load(Seed), offs, dropout_p)
        y = tl.where(keep, y / (1.0 - dropout_p), 0.0)
    tl.store(Out + offs, y.to(Out.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["n"])
def _gated_gelu_bwd_kernel(
    Grad, A, B, GradA, GradB, Out, Seed, n, dropout_p, DROPOUT: tl.constexpr, BLOCK: tl.constexpr
):
    """a's and b's gradients, and the forward's output again (`Out`: wo's input, for its weight's gradient).
    GradA may be Grad itself: each element is read before it is written, by the same thread."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(Grad + offs, mask=inside, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=inside, other=0.0).to(tl.float32)
    t = _tanh_inner(a)
    gelu = 0.5 * a * (1.0 + t)
    y = gelu * b  # as the forward computes it, to the bit
    if DROPOUT:
        keep = dropout_keep(tl.load(Seed), offs, dropout_p)
        g = tl.where(keep, g / (1.0 - dropout_p), 0.0)
        y = tl.where(keep, y / (1.0 - dropout_p), 0.0)
    dgelu = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)
    tl.store(GradA + offs, (g * b * dgelu).to(GradA.dtype.element_ty), mask=inside)
    tl.store(GradB + offs, (g * gelu).to(GradB.dtype.element_ty), mask=inside)
    tl.store(Out + offs, y.to(Out.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["n"])
def _residual_dropout_fwd_kernel(Residual, X, Out, Seed, n, dropout_p, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    r = tl.load(Residual + offs, mask=inside, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    x = tl.where(dropout_keep(tl.load(Seed), offs, dropout_p), x / (1.0 - dropout_p), 0.0)
    tl.store(Out + offs, (r + x).to(Out.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["n"])
def _dropout_bwd_kernel(Grad, GradX, Seed, n, dropout_p, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(Grad + offs, mask=inside, other=0.0).to(tl.float32)
    g = tl.where(dropout_keep(tl.load(Seed), offs, dropout_p), g / (1.0 - dropout_p), 0.0)
    tl.store(GradX + offs, g.to(GradX.dtype.element_ty), mask=inside)


class _ResidualDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, x, dropout_p):
        residual, x = residual.contiguous(), x.contiguous()
        seed = dropout_seed(x.device)
        out = torch.empty_like(x)
        n = x.numel()
        _residual_dropout_fwd_kernel[(triton.cdiv(n, BLOCK),)](
            residual, x, out, seed, n, dropout_p, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
        ctx.save_for_backward(seed)
        ctx.dropout_p = dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (seed,) = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = torch.empty_like(grad_out)
        n = grad_out.numel()
        _dropout_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            grad_out, grad_x, seed, n, ctx.dropout_p, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
        return grad_out, grad_x, None


@torch.compiler.disable
def residual_dropout(residual: torch.Tensor, x: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """residual + dropout(x, dropout_p) in one pass each way, no mask kept; T5's sublayer output.

    dropout_p is rounded to a multiple of 2**-16 (0.1 -> 0.100006), the resolution of the random numbers.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual_dropout: residual {tuple(residual.shape)} {residual.dtype} and x {tuple(x.shape)} "
            f"{x.dtype} differ"
        )
    dropout_p = dropout_resolution(dropout_p)
    if dropout_p == 0:
        return residual + x
    return _ResidualDropout.apply(residual, x, dropout_p)


@triton.jit(do_not_specialize=["rows", "cols"])
def _rms_norm_bwd_kernel(
    GradY,
    X,
    W,
    GradResidual,
    GradX,
    GradWPartial,
    rows,
    cols,
    eps,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """RMSNorm's backward for the groups of ROWS rows pid, pid + programs, ...: the input's gradient plus the
    residual path's gradient, written once; this program's share of the weight's gradient, one fp32 row."""
    offs = tl.arange(0, BLOCK_COLS)
    inside = offs < cols
    w = tl.load(W + offs, mask=inside, other=0.0).to(tl.float32)
    grad_w = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    first, programs = tl.program_id(0), tl.num_programs(0)
    for i in range(0, tl.cdiv(tl.cdiv(rows, ROWS) - first, programs)):
        row = (first + i * programs) * ROWS + tl.arange(0, ROWS)
        ok = (row < rows)[:, None] & inside[None, :]
        at = row.to(tl.int64)[:, None] * cols + offs[None, :]
        x = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(GradY + at, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / cols + eps)
        x_hat = x * rstd[:, None]
        dx_hat = dy * w[None, :]
        dx = rstd[:, None] * (dx_hat - x_hat * (tl.sum(dx_hat * x_hat, 1) / cols)[:, None])
        dx += tl.load(GradResidual + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(GradX + at, dx.to(GradX.dtype.element_ty), mask=ok)
        grad_w += tl.sum(dy * x_hat, 0)
    tl.store(GradWPartial + tl.program_id(0).to(tl.int64) * cols + offs, grad_w, mask=inside)


# Each program sums its rows' share of the weight's gradient in registers, ROWS rows at a time (their loads
# in flight together); the programs' shares are then summed (bench/fused_ops.py --sweep).
NORM_BWD_PROGRAMS_PER_SM = 2
NORM_BWD_ROWS = 4


def norm_bwd_warps(cols: int) -> int:
    """Warps for the norm backward's programs on rows of `cols`: ~256 elements of a group of rows per warp,
    4 to 16, a power of two (what Triton compiles; T5-base's 768 columns would ask for 12)."""
    return min(16, max(4, triton.next_power_of_2(NORM_BWD_ROWS * cols // 256)))


class _RMSNormAndResidual(torch.autograd.Function):
    """(rms_norm(x), x): a sublayer's normed input and its residual, whose two gradients the backward sums
    in the norm's own pass instead of in a separate addition."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.nn.functional.rms_norm(x, (x.size(-1),), weight, eps), x

    @staticmethod
    def backward(ctx, grad_y, grad_residual):
        x, weight = ctx.saved_tensors
        cols = x.size(-1)
        flat = x.reshape(-1, cols)
        rows = flat.size(0)
        if grad_residual is None:
            grad_residual = torch.zeros_like(flat)
        grad_x = torch.empty_like(flat)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        programs = max(1, min(triton.cdiv(rows, NORM_BWD_ROWS), sms * NORM_BWD_PROGRAMS_PER_SM))
        partial = torch.empty(programs, cols, device=x.device, dtype=torch.float32)
        _rms_norm_bwd_kernel[(programs,)](
            grad_y.reshape(-1, cols).contiguous(),
            flat.contiguous(),
            weight,
            grad_residual.reshape(-1, cols).contiguous(),
            grad_x,
            partial,
            rows,
            cols,
            ctx.eps,
            BLOCK_COLS=triton.next_power_of_2(cols),
            ROWS=NORM_BWD_ROWS,
            num_warps=norm_bwd_warps(cols),
        )
        return grad_x.view_as(x), partial.sum(0).to(weight.dtype), None


@torch.compiler.disable
def norm_and_residual(x: torch.Tensor, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x), x)` for a sublayer `x + f(norm(x))`. With torch's RMSNorm (what trainer.model.load puts in
    T5's place) the backward adds the residual's gradient inside the norm's backward kernel: one pass over
    the hidden states instead of the norm's two (input, weight) and an addition. The projections of the
    output (trainer.kernels.projections) keep x, not the output, and make it again in their backward."""
    if type(norm) is torch.nn.RMSNorm and norm.eps is not None and norm.weight is not None:
        normed, residual = _RMSNormAndResidual.apply(x, norm.weight, norm.eps)
        if torch.is_grad_enabled():
            mark_rms_norm_output(normed, x, norm.weight, norm.eps)
        return normed, residual
    return norm(x), x


class _GatedGeluLinear(torch.autograd.Function):
    """wo(dropout(gelu_tanh(a) * b)), plus wo's low-rank update (LoRA) when `scaling` is not None. The
    product (wo's input) is not kept for wo's weight gradient: the backward's kernel makes it again while it
    reads a and b for their gradients, and writes a's gradient over the product's (a tokens x d_ff tensor less
    at every moment). The update keeps its small down-projection (tokens x rank) and, with its own dropout, a
    mask."""

    @staticmethod
    def forward(ctx, a, b, weight, dropout_p, weight_grad_in_place, scaling, lora_dropout_p, lora_a, lora_b):
        a, b = a.contiguous(), b.contiguous()
        seed = dropout_seed(a.device) if dropout_p > 0 else torch.zeros(1, dtype=torch.int64, device=a.device)
        product = torch.empty_like(a)
        n = a.numel()
        _gated_gelu_fwd_kernel[(triton.cdiv(n, BLOCK),)](
            a, b, product, seed, n, dropout_p, DROPOUT=dropout_p > 0, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
        out = torch.nn.functional.linear(product, weight)
        low_rank = ()
        if scaling is not None:
            update = LowRank(lora_a, lora_b, scaling, lora_dropout_p)
            flat_product = product.view(-1, product.size(-1))
            low_rank = (
                lora_a,
                lora_b,
                *low_rank_forward(flat_product, [out.view(-1, out.size(-1))], [update]),
            )
        ctx.save_for_backward(a, b, seed, weight, *low_rank)
        ctx.dropout_p, ctx.scaling, ctx.lora_dropout_p = dropout_p, scaling, lora_dropout_p
        ctx.parameter = weight if weight_grad_in_place else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, seed, weight, *low_rank = ctx.saved_tensors
        flat = grad_out.reshape(-1, grad_out.size(-1))
        grad_a = flat.mm(weight).view_as(a)  # the product's gradient, then a's (in place)
        if low_rank:
            lora_a, lora_b, u, keep = low_rank
            updates = [LowRank(lora_a, lora_b, ctx.scaling, ctx.lora_dropout_p)]
            v, (grad_lora_b,) = low_rank_input_grad([flat], updates, u, keep, grad_a.view(-1, a.size(-1)))
        grad_b, product = torch.empty_like(b), torch.empty_like(a)
        n = a.numel()
        p = ctx.dropout_p
        _gated_gelu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            grad_a, a, b, grad_a, grad_b, product, seed, n, p, DROPOUT=p > 0, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
        flat_product = product.view(-1, a.size(-1))
        grad_weight = grad_lora_a = None
        if ctx.needs_input_grad[2]:
            grad_weight = weight_gradient(flat, flat_product, ctx.parameter)
        if low_rank:
            (grad_lora_a,) = low_rank_down_grads(v, flat_product, keep, updates)
        else:
            grad_lora_b = None
        return grad_a, grad_b, grad_weight, None, None, None, None, grad_lora_a, grad_lora_b


@torch.compiler.disable  # a compiled block calls the kernels as they are, like the attention's
def gated_gelu_linear(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor,
    dropout_p: float = 0.0,
    weight_grad_in_place: bool = False,
    low_rank: LowRank | None = None,
) -> torch.Tensor:
    """linear(dropout(gelu_tanh(a) * b, dropout_p), weight), the GELU, product and dropout fused; a and b of
    one shape and dtype. weight_grad_in_place: the weight's gradient is added into its `.grad` by the matmul
    (trainer.kernels.projections.weight_gradient). low_rank: the output projection's LoRA update, added to it.

    dropout_p is rounded to a multiple of 2**-16 (0.1 -> 0.100006), the resolution of the random numbers.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"gated_gelu_linear: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} differ"
        )
    update = (None, 0.0, None, None)
    if low_rank is not None:
        update = (low_rank.scaling, low_rank.dropout_p, low_rank.a, low_rank.b)
    return _GatedGeluLinear.apply(a, b, weight, dropout_resolution(dropout_p), weight_grad_in_place, *update)


# Vocabulary entries a cross-entropy program holds at a time.
CE_BLOCK = 4096


@triton.jit(do_not_specialize=["vocab", "stride"])
def _cross_entropy_kernel(Logits, Labels, Loss, vocab, stride, BLOCK: tl.constexpr, GRAD: tl.constexpr):
    """One row of logits: its cross-entropy, fp32 (0 for the label -100), and with GRAD its softmax minus the
    label's one-hot (zeros for -100) written over the row in the logits' dtype."""
    row = tl.program_id(0).to(tl.int64)
    logits = Logits + row * stride
    label = tl.load(Labels + row)
    counted = label != -100
    offs = tl.arange(0, BLOCK)
    # Per lane: the running maximum and the sum of exp(x - maximum); lanes past the vocabulary stay -inf, 0.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(logits + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_ref) + tl.exp(x - m_ref)
        m = m_new
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(total * tl.exp(m - row_max), 0))
    target = tl.load(logits + tl.maximum(label, 0)).to(tl.float32)
    tl.store(Loss + row, tl.where(counted, lse - target, 0.0))
    if GRAD:
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            x = tl.load(logits + cols, mask=cols < vocab, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
            g = tl.where(counted, g, 0.0)
            tl.store(logits + cols, g.to(Logits.dtype.element_ty), mask=cols < vocab)


def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, grad: bool) -> torch.Tensor:
    """Each row's cross-entropy (fp32; 0 where the label is -100) of 16-bit `logits` (rows, vocab) against
    `labels` (rows,); with `grad`, the logits are overwritten by d(summed loss)/d(logits): softmax minus
    one-hot, zeros in -100 rows. One Triton kernel (a GPU, or TRITON_INTERPRET=1)."""
    if logits.dtype not in (torch.bfloat16, torch.float16) or logits.stride(-1) != 1:
        raise ValueError(f"cross_entropy_rows_: 16-bit logits with unit column stride, not {logits.dtype}")
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _cross_entropy_kernel[(rows,)](
            logits, labels, loss, vocab, logits.stride(0), BLOCK=CE_BLOCK, GRAD=grad, num_warps=8
        )
    return loss

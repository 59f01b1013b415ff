"""T5 attention as fused Triton kernels: scores, position bias, mask, softmax, dropout and the value product
in one pass, without the B x H x T x S tensors that eager attention writes and reads ~ten times per layer.

Eager T5 attention on FLAN-T5-XL spends ~0.9 s of a 2.6 s optimizer step (32k tokens x 2) in those passes:
the bias and mask additions (broadcast, so not vectorised), softmax, attention dropout, and their backward,
all twice with gradient checkpointing. Flash attention kernels cannot take T5's learned position bias, and
SDPA falls back to slow kernels with it (bench/NOTES.md). These kernels follow FlashAttention-2 (Dao, 2023)
and the Triton fused-attention tutorial, with what T5 needs:
- an additive bias shared by the batch, (H, T, S), whose gradient is summed over the batch inside the
  backward kernel (no per-row bias gradient is written);
- key padding as a (batch, keys) vector; causality by skipping the blocks above the diagonal;
- dropout on the attention probabilities from a counter-based hash (`uniform16`) of each probability's
  index, keyed by a seed drawn from torch's CUDA generator, so the backward and gradient checkpointing's
  recompute (which restores that generator) drop the same entries without storing a mask;
- no 1/sqrt(d) unless asked (T5 folds it into the weights).

T5 reaches them through transformers' attention interface (`attn_implementation: triton`, registered by
trainer.model.fused_t5), so its modules, masks and state dict are unchanged. On CPU (tests) the kernels run
under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trainer.kernels.dropout import attention_keep, dropout_resolution, dropout_seed

MASKED = -1e30  # score added for a padded key: exp() of it is 0, yet a fully padded row stays finite
# Backward key-block programs to aim for (16 per H100 SM); sets how many row groups each sum a bias gradient.
# 2112 beat 528 by 5-7% (more parallel work, a larger fp32 bias-gradient buffer: ~0.3 GB at 512 x 512).
BWD_PROGRAMS = 2112
# Tile sizes and launch settings (bench/attention_kernels.py --sweep measures the alternatives).
FWD_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
BWD_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
DELTA_BLOCK_M = 64  # query rows per program of the backward's rowsum(dO * O)


@triton.jit
def _scores(
    q,
    k,
    bias_ptrs,
    mask_ptrs,
    rows,
    cols,
    T,
    S,
    scale,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Score tile (BLOCK_M x BLOCK_N), fp32: q.k * scale + bias + key mask; out-of-range/causal keys -inf.

    The bias and the key mask have rows padded to a whole number of key blocks (key_stride): their tiles are
    read without a per-key bound, which is what lets Triton vectorise those loads."""
    s = tl.dot(q, k) * scale
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=rows[:, None] < T, other=0.0).to(tl.float32)
    if HAS_MASK:
        s += tl.load(mask_ptrs)[None, :]
    valid = cols[None, :] < S
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    return tl.where(valid, s, float("-inf"))


# Triton compiles a variant per value class (== 1, divisible by 16) of each int argument; lengths and rows
# change every batch, and each new variant costs a compile (~1 s). The bias and key-mask strides stay
# specialised: they are whole key blocks (key_stride), so the divisibility Triton sees is always the same.
VARYING = ["T", "S"]


@triton.jit(do_not_specialize=VARYING)
def _fwd_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    Out,
    LSE,
    Seed,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    som,
    sbh,
    sbm,
    smb,
    H,
    T,
    S,
    scale,
    dropout_p,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :], mask=rows[:, None] < T, other=0.0
    )
    seed = tl.load(Seed) if DROPOUT else 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = tl.minimum(S, (pid_m + 1) * BLOCK_M) if CAUSAL else S
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(
            K + b * skb + h * skh + cols[None, :] * skn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        v = tl.load(
            V + b * svb + h * svh + cols[:, None] * svn + offs_d[None, :], mask=cols[:, None] < S, other=0.0
        )
        s = _scores(
            q,
            k,
            Bias + h * sbh + rows[:, None] * sbm + cols[None, :],
            Mask + b * smb + cols,
            rows,
            cols,
            T,
            S,
            scale,
            HAS_BIAS,
            HAS_MASK,
            CAUSAL,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(attention_keep(seed, bh, rows, cols, T, S, dropout_p), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    if DROPOUT:
        acc = acc / (1.0 - dropout_p)
    tl.store(
        Out + b * sob + h * soh + rows[:, None] * som + offs_d[None, :],
        acc.to(Out.dtype.element_ty),
        mask=rows[:, None] < T,
    )
    tl.store(LSE + bh * T + rows, m_i + tl.log(l_i), mask=rows < T)


@triton.jit(do_not_specialize=[*VARYING, "B", "rows_per_group"])
def _bwd_kv_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    DO,
    LSE,
    Delta,
    Seed,
    DK,
    DV,
    DBias,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdob,
    sdoh,
    sdom,
    sbh,
    sbm,
    smb,
    B,
    H,
    T,
    S,
    scale,
    dropout_p,
    rows_per_group,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
):
    """dK, dV for one key block of one head, for the batch rows of one group; with BIAS_GRAD the group's bias
    gradient for those keys is summed here over its rows (this program alone writes that slice: no atomics);
    a frozen bias (LoRA's base, trainer.model.lora) needs none."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    seed = tl.load(Seed) if DROPOUT else 0
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    b_end = tl.minimum(B, (g + 1) * rows_per_group)
    for b in range(g * rows_per_group, b_end):
        bh = b * H + h
        k = tl.load(
            K + b * skb + h * skh + cols[None, :] * skn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        v = tl.load(
            V + b * svb + h * svh + cols[:, None] * svn + offs_d[None, :], mask=cols[:, None] < S, other=0.0
        )
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        for start_m in range(lo, T, BLOCK_M):
            rows = start_m + offs_m
            q = tl.load(
                Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :],
                mask=rows[:, None] < T,
                other=0.0,
            )
            do = tl.load(
                DO + b * sdob + h * sdoh + rows[:, None] * sdom + offs_d[None, :],
                mask=rows[:, None] < T,
                other=0.0,
            )
            lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0)
            delta = tl.load(Delta + bh * T + rows, mask=rows < T, other=0.0)
            s = _scores(
                q,
                k,
                Bias + h * sbh + rows[:, None] * sbm + cols[None, :],
                Mask + b * smb + cols,
                rows,
                cols,
                T,
                S,
                scale,
                HAS_BIAS,
                HAS_MASK,
                CAUSAL,
            )
            p = tl.exp(s - lse[:, None])
            p = tl.where(rows[:, None] < T, p, 0.0)
            dp = tl.dot(do, tl.trans(v).to(do.dtype))
            if DROPOUT:
                keep = attention_keep(seed, bh, rows, cols, T, S, dropout_p)
                p_kept = tl.where(keep, p / (1.0 - dropout_p), 0.0)
                dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
            else:
                p_kept = p
            dv += tl.dot(tl.trans(p_kept.to(do.dtype)), do)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
            if BIAS_GRAD:  # DBias: (groups, H, T, key_stride), the bias's layout per group
                # An atomic add (done in L2, nothing comes back) instead of load + add + store; still
                # deterministic: this program alone adds to this slice, its adds to an address in order.
                db_ptrs = DBias + (g * H + h) * sbh + rows[:, None] * sbm + cols[None, :]
                tl.atomic_add(db_ptrs, ds, mask=rows[:, None] < T, sem="relaxed")
        tl.store(
            DK + b * skb + h * skh + cols[:, None] * skn + offs_d[None, :],
            (dk * scale).to(DK.dtype.element_ty),
            mask=cols[:, None] < S,
        )
        tl.store(
            DV + b * svb + h * svh + cols[:, None] * svn + offs_d[None, :],
            dv.to(DV.dtype.element_ty),
            mask=cols[:, None] < S,
        )


@triton.jit(do_not_specialize=VARYING)
def _bwd_q_kernel(
    Q,
    K,
    V,
    Bias,
    Mask,
    DO,
    LSE,
    Delta,
    Seed,
    DQ,
    sqb,
    sqh,
    sqm,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdob,
    sdoh,
    sdom,
    sbh,
    sbm,
    smb,
    H,
    T,
    S,
    scale,
    dropout_p,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :], mask=rows[:, None] < T, other=0.0
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + rows[:, None] * sdom + offs_d[None, :], mask=rows[:, None] < T, other=0.0
    )
    lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0)
    delta = tl.load(Delta + bh * T + rows, mask=rows < T, other=0.0)
    seed = tl.load(Seed) if DROPOUT else 0
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    hi = tl.minimum(S, (pid_m + 1) * BLOCK_M) if CAUSAL else S
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(
            K + b * skb + h * skh + cols[None, :] * skn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        v = tl.load(
            V + b * svb + h * svh + cols[None, :] * svn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        s = _scores(
            q,
            k,
            Bias + h * sbh + rows[:, None] * sbm + cols[None, :],
            Mask + b * smb + cols,
            rows,
            cols,
            T,
            S,
            scale,
            HAS_BIAS,
            HAS_MASK,
            CAUSAL,
        )
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, v.to(do.dtype))
        if DROPOUT:
            keep = attention_keep(seed, bh, rows, cols, T, S, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), tl.trans(k))
    tl.store(
        DQ + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=rows[:, None] < T,
    )


@triton.jit(do_not_specialize=["sob", "som", "T"])
def _bwd_delta_kernel(Out, DO, Delta, sob, soh, som, H, T, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """Delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in fp32: the softmax backward's correction term.
    O and dO share the (B, T, H, D) layout (strides sob, som, soh; unit stride over D)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = b.to(tl.int64) * sob + h * soh + rows[:, None] * som + tl.arange(0, D)[None, :]
    inside = rows[:, None] < T
    o = tl.load(Out + offs, mask=inside, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * T + rows, tl.sum(o * do, axis=1), mask=rows < T)


def softmax_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) in fp32, (B, H, T): the softmax backward's correction term. `out` and `grad_out` are
    (B, T, H, D) with the same strides and a unit last one."""
    B, T, H, D = out.shape
    assert grad_out.stride() == out.stride() and out.stride(3) == 1
    delta = torch.empty((B, H, T), dtype=torch.float32, device=out.device)
    _bwd_delta_kernel[(triton.cdiv(T, DELTA_BLOCK_M), B * H)](
        out, grad_out, delta, out.stride(0), out.stride(2), out.stride(1), H, T, BLOCK_M=DELTA_BLOCK_M, D=D
    )
    return delta


class _T5Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, mask, scale, dropout_p, causal):
        B, H, T, D = q.shape
        S = k.shape[2]
        if bias is not None:  # rows padded to key_stride(S) (zeros), as the kernels read them
            bias = torch.nn.functional.pad(bias, (0, key_stride(S) - S)).contiguous()
        # (B, T, H, D): the layout T5's output projection reads
        out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        seed = dropout_seed(q.device) if dropout_p > 0 else torch.zeros(1, dtype=torch.int64, device=q.device)
        has_bias, has_mask = bias is not None, mask is not None
        _fwd_kernel[(triton.cdiv(T, FWD_CONFIG["BLOCK_M"]), B * H)](
            q,
            k,
            v,
            bias if has_bias else q,  # any tensor stands in for an absent one: the kernel never reads it
            mask if has_mask else q,
            out,
            lse,
            seed,
            *_strides(q, k, v, out.transpose(1, 2), bias, mask),
            H,
            T,
            S,
            scale,
            dropout_p,
            HAS_BIAS=has_bias,
            HAS_MASK=has_mask,
            CAUSAL=causal,
            DROPOUT=dropout_p > 0,
            D=D,
            **FWD_CONFIG,
        )
        ctx.save_for_backward(q, k, v, bias, mask, out, lse, seed)
        ctx.scale, ctx.dropout_p, ctx.causal = scale, dropout_p, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, mask, out, lse, seed = ctx.saved_tensors
        B, H, T, D = q.shape
        S = k.shape[2]
        has_bias, has_mask = bias is not None, mask is not None
        bias_grad = has_bias and ctx.needs_input_grad[3]
        # rowsum(dO * O): the softmax backward's correction term, dropout included (O is the dropped output).
        grad_out = grad_out.contiguous()
        delta = softmax_delta(out, grad_out)
        do = grad_out.transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        key_blocks = triton.cdiv(S, BWD_CONFIG["BLOCK_N"])
        groups, rows_per_group = bias_grad_groups(B, H, S) if bias_grad else (B, 1)
        dbias = torch.zeros((groups, *bias.shape), dtype=torch.float32, device=q.device) if bias_grad else q
        strides = _strides(q, k, v, do, bias, mask)
        flags = dict(
            HAS_BIAS=has_bias,
            HAS_MASK=has_mask,
            CAUSAL=ctx.causal,
            DROPOUT=ctx.dropout_p > 0,
            D=D,
            **BWD_CONFIG,
        )
        bias_arg, mask_arg = (bias if has_bias else q), (mask if has_mask else q)
        assert dk.stride() == k.stride() and dv.stride() == v.stride() and dq.stride() == q.stride()
        _bwd_kv_kernel[(key_blocks, H, groups)](
            q,
            k,
            v,
            bias_arg,
            mask_arg,
            do,
            lse,
            delta,
            seed,
            dk,
            dv,
            dbias,
            *strides,
            B,
            H,
            T,
            S,
            ctx.scale,
            ctx.dropout_p,
            rows_per_group,
            BIAS_GRAD=bias_grad,
            **flags,
        )
        _bwd_q_kernel[(triton.cdiv(T, BWD_CONFIG["BLOCK_M"]), B * H)](
            q,
            k,
            v,
            bias_arg,
            mask_arg,
            do,
            lse,
            delta,
            seed,
            dq,
            *strides,
            H,
            T,
            S,
            ctx.scale,
            ctx.dropout_p,
            **flags,
        )
        grad_bias = dbias[..., :S].sum(0).to(bias.dtype) if bias_grad else None
        return dq, dk, dv, grad_bias, None, None, None, None


def key_stride(keys: int) -> int:
    """Row length of the bias and key-mask buffers the kernels read: `keys` rounded up to whole key blocks."""
    block = max(FWD_CONFIG["BLOCK_N"], BWD_CONFIG["BLOCK_N"])
    return triton.cdiv(keys, block) * block


def bias_grad_groups(rows: int, heads: int, keys: int) -> tuple[int, int]:
    """(row groups, rows per group) of the backward with a position bias: each group sums its rows' bias
    gradient into its own fp32 (H, T, S) slice; as few groups as fill the GPU with BWD_PROGRAMS programs."""
    key_blocks = triton.cdiv(keys, BWD_CONFIG["BLOCK_N"])
    per_group = triton.cdiv(rows, min(rows, max(1, triton.cdiv(BWD_PROGRAMS, key_blocks * heads))))
    return triton.cdiv(rows, per_group), per_group


def _strides(q, k, v, rows, bias, mask) -> tuple[int, ...]:
    """The strides the kernels take: q, k, v and `rows` (the output, or its gradient) by (batch, head,
    position); the bias by (head, query); the key mask by batch (0 for an absent bias or mask)."""
    per_row = [x.stride(i) for x in (q, k, v, rows) for i in range(3)]
    bias_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    return (*per_row, *bias_strides, mask.stride(0) if mask is not None else 0)


def t5_attention(
    q, k, v, bias=None, key_padding=None, *, scale: float = 1.0, dropout_p: float = 0.0, causal: bool = False
) -> torch.Tensor:
    """softmax(q k^T * scale + bias, over the kept keys) v, dropout on the probabilities: (B, T, H, D).

    q: (B, H, T, D); k, v: (B, H, S, D), any strides with a unit last one. bias: (H, T, S), shared by the
    batch, differentiable. key_padding: (B, S), nonzero/True where a key may be attended. causal: key j >
    query i is masked as well (its blocks are skipped). A query with no key left averages all of its keys
    (as eager does with its additive minimum mask) instead of producing NaN. dropout_p is rounded to a
    multiple of 2**-16 (0.1 -> 0.100006), the resolution of the kernels' random numbers.
    """
    dropout_p = dropout_resolution(dropout_p)
    mask = None
    if key_padding is not None:
        S = key_padding.size(1)
        mask = torch.zeros((key_padding.size(0), key_stride(S)), dtype=torch.float32, device=q.device)
        mask[:, :S].masked_fill_(key_padding == 0, MASKED)
    return _T5Attention.apply(q, k, v, bias, mask, scale, dropout_p, causal)


def supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Tile shapes need a power-of-two head size >= 16; bf16/fp16 (fp32 would run tl.dot in TF32)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16)

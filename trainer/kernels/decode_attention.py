"""One decoding step's attention: a single query per row against that row's cached keys and values, with
each row's own number of valid keys and, for T5's self-attention, its relative position bias.

A decoder step at batch 64 is bound by memory, not arithmetic: it reads the weights once and every row's
cache once. Eager attention (and SDPA) over a preallocated cache would read all of it, valid or not, and
need a mask tensor per step; a cache sized to the tokens so far changes shape every step, which a CUDA
graph cannot replay. This kernel reads each row's valid length from device memory (`lengths`), so one
graph replays every step, and it reads only the keys that exist. One program per (row, head) walks its
keys in blocks with an online softmax (FlashAttention's recurrence; the query is one vector, so the
products are sums rather than tensor-core dots).

T5's self-attention bias depends only on the distance between the query and the key (the decoder's
buckets are unidirectional), so it comes in as a (heads, distances) table, `bias[h, q - k]`, made once per
generation by the model's own bucket function (trainer.model.t5_decoding); the cross-attention has none.
No 1/sqrt(d) scaling: T5 folds it into its weights.

Off the GPU the same math runs in torch (trainer.model.t5_decoding.decode_attention_reference), which the
tests hold this kernel to under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys per iteration and warps per program, for the self-attention (with its bias and its new key) and the
# cross-attention; `python3 bench/decode_kernels.py --sweep` measures the alternatives (72 rows, an H200:
# these are the fastest of 12 each, 15-25% ahead of BLOCK 64 with 4 warps).
SELF_CONFIG = dict(BLOCK=64, num_warps=2)
CROSS_CONFIG = dict(BLOCK=32, num_warps=1)


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lengths_ptr,
    bias_ptr,
    new_k_ptr,
    new_v_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_ob,
    stride_oh,
    stride_bias_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NEW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    n = tl.load(lengths_ptr + row).to(tl.int32)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qb + head * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)
    k_base = k_ptr + row * stride_kb + head * stride_kh
    v_base = v_ptr + row * stride_kb + head * stride_kh
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    cached = n - 1 if HAS_NEW else n  # the new key (position n - 1) is in registers, not read back
    for start in range(0, cached, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        valid = keys < cached
        tile = valid[:, None] & dim_ok[None, :]
        offsets = keys[:, None] * stride_kl + dims[None, :]
        k = tl.load(k_base + offsets, mask=tile, other=0.0).to(tl.float32)
        v = tl.load(v_base + offsets, mask=tile, other=0.0).to(tl.float32)  # in flight with the keys
        s = tl.sum(k * q[None, :], axis=1)
        if HAS_BIAS:  # the query is the row's last valid position, n - 1
            bias = tl.load(bias_ptr + head * stride_bias_h + (n - 1 - keys), mask=valid, other=0.0)
            s += bias.to(tl.float32)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = m_new
    if HAS_NEW:  # the newest token's key and value: attended to here, stored at position n - 1
        new = row * stride_qb + head * stride_qh + dims
        k_new = tl.load(new_k_ptr + new, mask=dim_ok, other=0.0)
        v_new = tl.load(new_v_ptr + new, mask=dim_ok, other=0.0)
        tl.store(k_base + (n - 1) * stride_kl + dims, k_new, mask=dim_ok)
        tl.store(v_base + (n - 1) * stride_kl + dims, v_new, mask=dim_ok)
        s_new = tl.sum(k_new.to(tl.float32) * q, axis=0)
        if HAS_BIAS:
            s_new += tl.load(bias_ptr + head * stride_bias_h).to(tl.float32)  # distance 0
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp(m - m_new)
        p_new = tl.exp(s_new - m_new)
        acc = acc * alpha + p_new * v_new.to(tl.float32)
        total = total * alpha + p_new
    out = acc / tl.where(total > 0, total, 1.0)  # a row without keys (an idle slot) writes zeros, not NaN
    out_ptrs = out_ptr + row * stride_ob + head * stride_oh + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    bias: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """softmax(q . k + bias) v for one query per row, on the GPU: q (B, H, D); k, v (>= B, H, L, D) caches
    whose first `lengths[b]` positions are row b's keys (rows past B are not read); `bias` (H, >= L) indexed
    by the distance from the query (at position lengths[b] - 1) to the key, or None. `new`: the keys and
    values (B, H, D) of each row's newest position, lengths[b] - 1, written into the caches there by the
    kernel (the self-attention's step). Returns (B, H, D) in q's dtype. `config`: the launch's BLOCK and
    num_warps (default: SELF_CONFIG with `new`, else CROSS_CONFIG). (trainer.model.t5_decoding's
    decode_attention_reference is the same in torch.)"""
    rows, heads, dim = q.shape
    if k.stride(-1) != 1 or v.stride() != k.stride() or q.stride(-1) != 1:
        raise ValueError("decode_attention needs caches of one layout with contiguous head dimensions")
    if new is not None and any(t.stride() != q.stride() for t in new):
        raise ValueError("decode_attention needs the new keys and values laid out as the queries")
    out = torch.empty_like(q)
    new_k, new_v = new if new is not None else (q, q)
    _decode_attention_kernel[(rows, heads)](
        q,
        k,
        v,
        lengths,
        bias if bias is not None else q,
        new_k,
        new_v,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        out.stride(0),
        out.stride(1),
        bias.stride(0) if bias is not None else 0,
        HEAD_DIM=dim,
        HEAD_DIM_PAD=triton.next_power_of_2(dim),
        HAS_BIAS=bias is not None,
        HAS_NEW=new is not None,
        **(config or (SELF_CONFIG if new is not None else CROSS_CONFIG)),
    )
    return out

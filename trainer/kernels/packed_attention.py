"""T5 attention as Triton kernels, forward and backward, over rows of records told apart by segment ids, with
T5's relative position bias computed inside them: the trainer's one attention for training and evaluation.

A packed row holds records back to back: segment ids 1, 2, ... contiguous and increasing in the encoder and in
the decoder row alike, 0 for the padding at the tail (docs of the packed-batch contract:
trainer.model.packed_t5); a padded row is one record, segment 1 up to its length. Query i attends key j iff
they share a nonzero segment (and j <= i in the decoder's self-attention). On padded batches these kernels ran
1.14-1.31x as fast as the dense-bias kernels they replaced (`python3 bench/packed_attention.py`). What they do
beyond FlashAttention-2 (Dao, 2023):

- Masks come from one segment id per position, compared in the score tile.
- Block skipping: segments are contiguous and increasing, so the keys that a query block attends form one
  range [lo, hi) per row (for cross-attention: the encoder span of the block's first to last decoder
  segment), and so do the queries attending a key block. `PackedAttentionLayout.build` computes these ranges
  once per batch (a few small torch ops, shared by every layer); each kernel visits only the 64 x 64 tiles in
  them (the forward's and the query backward's from the range's first key, not a block start), so a tile
  whose queries and keys share no segment is never computed.
- The position bias comes from T5's (buckets, heads) table, `relative_attention_bias.weight`: inside a segment
  the relative position is j - i, and every distance of at least max_distance falls in the last bucket of its
  side, so a per-head table of the 2 x max_distance + 1 clamped distances (fp32, 1 KiB per head, built once
  per batch) gives each score its bias by a gather that stays in L1. Nothing of size T x S is read or written.
- The bias-table gradient: each key/value-backward program owns one key block of one head for a group of rows
  and walks the query tiles of each row, aligned to block starts, so a tile's distances are 64 t + (-63..63),
  t = (key block - query tile) in tiles. A tile at least max_distance away (|t| >= FAR_TILES) has one bucket:
  its column sums go to one accumulator row. A nearer tile is sheared (row i rotated left by i, `tl.gather`)
  so that column c holds the distances 64 t + c (upper part) and 64 t + c - 64 (lower part): two masked
  column sums give its 127 diagonal sums, added to the accumulator rows of distance windows t and t - 1. Each
  program writes its (windows, 64) accumulator once; torch sums the programs' slices and folds distances into
  buckets. No atomics, no dense bias gradient: deterministic, and ~2 KiB per program.
- Dropout from trainer.kernels.dropout (a `uniform16` hash of each probability's
  index, keyed by a seed from torch's CUDA generator): checkpoint recompute drops the same probabilities.

No 1/sqrt(d) (T5 folds it into its weights). On CPU (tests) the kernels run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trainer.kernels.dropout import attention_keep, dropout_resolution, dropout_seed

# Query and key tile size; square tiles: the bias gradient's shear maps a tile's rows onto its columns.
BLOCK = 64
FWD_CONFIG = dict(num_warps=4, num_stages=3)
BWD_CONFIG = dict(num_warps=4, num_stages=2)


# Triton compiles a variant per value class (== 1, divisible by 16) of each int argument; lengths and rows
# change every batch, and each new variant costs a compile (~1 s).
VARYING = ["T", "S"]
# Key/value-backward programs to aim for (16 per H100 SM); sets how many row groups each sum a bias gradient.
BWD_PROGRAMS = 2112
DELTA_BLOCK_M = 64  # query rows per program of the backward's rowsum(dO * O)


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


def bias_grad_groups(rows: int, heads: int, keys: int) -> tuple[int, int]:
    """(row groups, rows per group) of the backward with a position bias: each group sums its rows' bias
    gradient into its own fp32 (H, T, S) slice; as few groups as fill the GPU with BWD_PROGRAMS programs."""
    key_blocks = triton.cdiv(keys, BLOCK)
    per_group = triton.cdiv(rows, min(rows, max(1, triton.cdiv(BWD_PROGRAMS, key_blocks * heads))))
    return triton.cdiv(rows, per_group), per_group


def supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Tile shapes need a power-of-two head size >= 16; bf16/fp16 (fp32 would run tl.dot in TF32)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RelativeBias:
    """T5's relative position bias of one attention kind: encoder self-attention is bidirectional, the
    decoder's unidirectional (T5Attention._relative_position_bucket's parameters)."""

    bidirectional: bool
    num_buckets: int = 32
    max_distance: int = 128

    def buckets(self, distances: torch.Tensor) -> torch.Tensor:
        """The bucket of each relative position (key - query), as T5 buckets them (Raffel et al., 2020;
        transformers' `T5Attention._relative_position_bucket`, which tests/test_packed_attention.py holds this
        to): half the buckets (per direction when bidirectional) for exact distances, the rest for
        logarithmically wider ones up to max_distance, beyond which all share the last bucket."""
        num_buckets, buckets = self.num_buckets, 0
        if self.bidirectional:
            num_buckets //= 2
            buckets = (distances > 0).to(torch.long) * num_buckets
            distances = distances.abs()
        else:
            distances = -torch.min(distances, torch.zeros_like(distances))
        max_exact = num_buckets // 2
        large = max_exact + (
            torch.log(distances.float() / max_exact)
            / math.log(self.max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        large = torch.min(large, torch.full_like(large, num_buckets - 1))
        return buckets + torch.where(distances < max_exact, distances, large)


def far_tiles(max_distance: int) -> int:
    """Tiles this far apart (in tiles) or more hold distances of at least max_distance only: one bucket."""
    return triton.cdiv(max_distance + BLOCK - 1, BLOCK)


def gradient_rows(max_distance: int) -> int:
    """Rows of a key/value-backward program's bias-gradient accumulator: 2 x far_tiles distance windows of
    BLOCK distances, then the far sums before and after the diagonal (rounded up to a power of two)."""
    return triton.next_power_of_2(2 * far_tiles(max_distance) + 2)


def gradient_distances(max_distance: int, device) -> torch.Tensor:
    """The relative position of each accumulator entry (row, column), flattened: window w (row w + far) holds
    distances 64 w + column; the far rows hold -max_distance and +max_distance; unused rows 0 (left 0)."""
    far = far_tiles(max_distance)
    rows = torch.arange(gradient_rows(max_distance), device=device)[:, None]
    cols = torch.arange(BLOCK, device=device)[None, :]
    d = (rows - far) * BLOCK + cols
    d = torch.where(rows == 2 * far, -max_distance, d)
    d = torch.where(rows == 2 * far + 1, max_distance, d)
    return torch.where(rows > 2 * far + 1, 0, d).reshape(-1)


def block_ranges(block_segments: torch.Tensor, other_segments: torch.Tensor) -> torch.Tensor:
    """For each row and BLOCK-sized block of `block_segments` (R, L), the range [lo, hi) of positions of
    `other_segments` (R, M) in the block's segments, as (R, cdiv(L, BLOCK), 2) int32; [0, 0) for a block of
    padding. Segments are contiguous and increasing, padding (0) only at a row's tail."""
    rows, length = block_segments.shape
    blocks = triton.cdiv(length, BLOCK)
    padded = torch.nn.functional.pad(block_segments, (0, blocks * BLOCK - length))
    first = padded[:, ::BLOCK].contiguous()
    last = padded.view(rows, blocks, BLOCK).amax(-1).contiguous()  # the block's last nonzero segment
    key = torch.where(other_segments == 0, torch.iinfo(other_segments.dtype).max, other_segments).contiguous()
    lo = torch.searchsorted(key, first)
    hi = torch.searchsorted(key, last, right=True)
    empty = first == 0
    ranges = torch.stack([lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)], dim=-1)
    return ranges.to(torch.int32).contiguous()


class PackedAttentionLayout:
    """Which keys each query of a packed batch attends, for one attention kind (encoder self-, decoder self-
    or cross-attention): what the kernels need besides q, k, v. Passed to transformers' T5 blocks as their
    `position_bias` argument (trainer.model.packed_t5): T5 then computes no dense bias, and the attention
    function registered by trainer.model.fused_t5 hands it to `packed_attention`.

    The position-bias table belongs to the first block of each stack: that block's attention sets it
    (`use_bias_table`), the later blocks read it, as T5 shares the first block's bias. (Under FSDP the first
    block's weight exists only during that block's forward; what is kept here is a copy derived from it.)

    A plain class, not a dataclass: FSDP2 copies a dataclass passed to a module's forward and casts its float
    tensors to the compute dtype, which would give each block a bf16 copy of the fp32 tables and leave the
    first block's table on a copy the later blocks never see.
    """

    def __init__(
        self,
        query_segments: torch.Tensor,
        key_segments: torch.Tensor,
        key_ranges: torch.Tensor,
        query_ranges: torch.Tensor,
        causal: bool,
        position_bias: RelativeBias | None,
    ):
        self.query_segments = query_segments  # (R, T) int32, 0 = padding
        self.key_segments = key_segments  # (R, S) int32
        self.key_ranges = key_ranges  # (R, cdiv(T, BLOCK), 2) int32: keys [lo, hi) of each query block
        self.query_ranges = query_ranges  # (R, cdiv(S, BLOCK), 2) int32: queries [lo, hi) of each key block
        self.causal = causal
        self.position_bias = position_bias  # None: no position bias (T5's cross-attention)
        # fp32 (buckets, H), differentiable: set by the first block
        self.bias_table: torch.Tensor | None = None
        # fp32 (H, 2 x max_distance + 1): bias of each clamped distance
        self.distance_bias: torch.Tensor | None = None
        # fp32 (accumulator entries, buckets): each entry's bucket
        self.gradient_buckets: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_segments: torch.Tensor,
        key_segments: torch.Tensor,
        *,
        causal: bool,
        position_bias: RelativeBias | None = None,
    ) -> PackedAttentionLayout:
        """The layout of queries with segment ids `query_segments` (R, T) over keys `key_segments` (R, S)."""
        query_segments = query_segments.to(torch.int32).contiguous()
        key_segments = key_segments.to(torch.int32).contiguous()
        key_ranges = block_ranges(query_segments, key_segments)
        query_ranges = block_ranges(key_segments, query_segments)
        if causal:  # keys <= the block's last query; queries >= the block's first key
            if query_segments.shape != key_segments.shape:
                raise ValueError("causal attention needs queries and keys of one row length")
            starts = torch.arange(key_ranges.size(1), device=key_ranges.device, dtype=torch.int32) * BLOCK
            key_ranges[..., 1] = torch.minimum(key_ranges[..., 1], starts + BLOCK)
            query_ranges[..., 0] = torch.maximum(query_ranges[..., 0], starts[: query_ranges.size(1)])
            for ranges in (key_ranges, query_ranges):  # a block of padding keeps [0, 0)
                ranges.masked_fill_((ranges[..., :1] >= ranges[..., 1:]), 0)
        return cls(query_segments, key_segments, key_ranges, query_ranges, causal, position_bias)

    def use_bias_table(self, weight: torch.Tensor) -> None:
        """Take the position bias from `weight`, T5's (buckets, heads) `relative_attention_bias.weight`."""
        bias = self.position_bias
        assert bias is not None, "this attention has no position bias"
        table = weight.float()  # a copy for a 16-bit weight: the gradients of every layer sum in fp32
        m = bias.max_distance
        distances = torch.arange(-m, m + 1, device=weight.device)
        self.distance_bias = table.detach()[bias.buckets(distances)].t().contiguous()
        entry_buckets = bias.buckets(gradient_distances(m, weight.device))
        self.gradient_buckets = torch.nn.functional.one_hot(entry_buckets, bias.num_buckets).float()
        self.bias_table = table


@triton.jit
def _query_segments(QSeg, rows, T):
    """Segment ids of the tile's queries, padding (and rows past T) as -1: they match no key."""
    seg = tl.load(QSeg + rows, mask=rows < T, other=0)
    return tl.where(seg == 0, -1, seg)


@triton.jit
def _scores(q, k, qseg, kseg, rows, cols, dist, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, MAX_DISTANCE):
    """Score tile, fp32: q.k + the bias of clamped distance j - i; -inf where the query and key are in
    different segments (keys past S have segment 0, queries past T -1) or, causal, where j > i."""
    s = tl.dot(q, k)
    if HAS_BIAS:
        d = tl.minimum(tl.maximum(cols[None, :] - rows[:, None], -MAX_DISTANCE), MAX_DISTANCE)
        s += tl.load(dist + d + MAX_DISTANCE)
    valid = qseg[:, None] == kseg[None, :]
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    return tl.where(valid, s, float("-inf"))


@triton.jit(do_not_specialize=VARYING)
def fwd_kernel(
    Q,
    K,
    V,
    QSeg,
    KSeg,
    KeyRanges,
    Dist,
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
    H,
    T,
    S,
    dropout_p,
    HAS_BIAS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    """Forward: one program per (query tile, row x head): the output tile and its log-sum-exp, over the keys
    of each query's segment (_PackedAttention.forward launches it)."""
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
    qseg = _query_segments(QSeg + b * T, rows, T)
    ranges = KeyRanges + (b * tl.cdiv(T, BLOCK_M) + pid_m) * 2
    lo = tl.load(ranges)
    hi = tl.load(ranges + 1)
    seed = tl.load(Seed) if DROPOUT else 0
    dist = Dist + h * (2 * MAX_DISTANCE + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):  # tiles from the range's first key, not a block start
        cols = start_n + offs_n
        k = tl.load(
            K + b * skb + h * skh + cols[None, :] * skn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        v = tl.load(
            V + b * svb + h * svh + cols[:, None] * svn + offs_d[None, :], mask=cols[:, None] < S, other=0.0
        )
        kseg = tl.load(KSeg + b * S + cols, mask=cols < S, other=0)
        s = _scores(q, k, qseg, kseg, rows, cols, dist, HAS_BIAS, CAUSAL, MAX_DISTANCE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may have no key of its segment in this tile (or anywhere: padding): subtract 0, not -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(attention_keep(seed, bh, rows, cols, T, S, dropout_p), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = l_i == 0.0  # padding queries: output 0, log-sum-exp 0 (finite; nothing reads either)
    l_i = tl.where(empty, 1.0, l_i)
    acc = acc / l_i[:, None]
    if DROPOUT:
        acc = acc / (1.0 - dropout_p)
    tl.store(
        Out + b * sob + h * soh + rows[:, None] * som + offs_d[None, :],
        acc.to(Out.dtype.element_ty),
        mask=rows[:, None] < T,
    )
    tl.store(LSE + bh * T + rows, tl.where(empty, 0.0, m_i + tl.log(l_i)), mask=rows < T)


@triton.jit(do_not_specialize=[*VARYING, "B", "rows_per_group"])
def bwd_kv_kernel(
    Q,
    K,
    V,
    QSeg,
    KSeg,
    QueryRanges,
    Dist,
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
    B,
    H,
    T,
    S,
    dropout_p,
    rows_per_group,
    HAS_BIAS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    FAR_TILES: tl.constexpr,
    GRADIENT_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
):
    """dK, dV of one key block of one head, for the rows of one group; with BIAS_GRAD (a position bias that
    is trained: not LoRA's frozen base), the bias gradient of those tiles by distance, written to this
    program's own slice of DBias (module docstring)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    key_blocks = tl.cdiv(S, BLOCK_N)
    seed = tl.load(Seed) if DROPOUT else 0
    dist = Dist + h * (2 * MAX_DISTANCE + 1)
    grad_rows = tl.arange(0, GRADIENT_ROWS)
    dbias = tl.zeros([GRADIENT_ROWS, BLOCK_N], tl.float32)
    b_end = tl.minimum(B, (g + 1) * rows_per_group)
    for b in range(g * rows_per_group, b_end):
        bh = b * H + h
        k = tl.load(
            K + b * skb + h * skh + cols[None, :] * skn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        v = tl.load(
            V + b * svb + h * svh + cols[:, None] * svn + offs_d[None, :], mask=cols[:, None] < S, other=0.0
        )
        kseg = tl.load(KSeg + b * S + cols, mask=cols < S, other=0)
        ranges = QueryRanges + (b * key_blocks + pid_n) * 2
        lo = tl.load(ranges)
        hi = tl.load(ranges + 1)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        # With a bias, tiles start at block starts: then a tile's distances are 64 t + (-63..63).
        start = lo // BLOCK_M * BLOCK_M if HAS_BIAS else lo
        for start_m in range(start, hi, BLOCK_M):
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
            qseg = _query_segments(QSeg + b * T, rows, T)
            s = _scores(q, k, qseg, kseg, rows, cols, dist, HAS_BIAS, CAUSAL, MAX_DISTANCE)
            p = tl.exp(s - lse[:, None])
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
            if BIAS_GRAD:
                t = (pid_n * BLOCK_N - start_m) // BLOCK_M  # exact: both are whole tiles
                if (t >= FAR_TILES) | (t <= -FAR_TILES):
                    far_row = tl.where(t > 0, 2 * FAR_TILES + 1, 2 * FAR_TILES)
                    dbias += tl.where(grad_rows[:, None] == far_row, tl.sum(ds, 0)[None, :], 0.0)
                else:
                    # The shear: row i rotated left by i; left of the wrap distance c, right of it c - 64.
                    wrapped = offs_m[:, None] + tl.arange(0, BLOCK_N)[None, :]
                    upper = wrapped < BLOCK_N
                    sheared = tl.gather(ds, wrapped & (BLOCK_N - 1), axis=1)
                    after = tl.sum(tl.where(upper, sheared, 0.0), 0)  # distances 64 t + c
                    before = tl.sum(tl.where(upper, 0.0, sheared), 0)  # distances 64 (t - 1) + c
                    dbias += tl.where(grad_rows[:, None] == t + FAR_TILES, after[None, :], 0.0)
                    dbias += tl.where(grad_rows[:, None] == t - 1 + FAR_TILES, before[None, :], 0.0)
        tl.store(
            DK + b * skb + h * skh + cols[:, None] * skn + offs_d[None, :],
            dk.to(DK.dtype.element_ty),
            mask=cols[:, None] < S,
        )
        tl.store(
            DV + b * svb + h * svh + cols[:, None] * svn + offs_d[None, :],
            dv.to(DV.dtype.element_ty),
            mask=cols[:, None] < S,
        )
    if BIAS_GRAD:
        slice_ = DBias + ((g * key_blocks + pid_n) * H + h) * (GRADIENT_ROWS * BLOCK_N)
        tl.store(slice_ + grad_rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], dbias)


@triton.jit(do_not_specialize=VARYING)
def bwd_q_kernel(
    Q,
    K,
    V,
    QSeg,
    KSeg,
    KeyRanges,
    Dist,
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
    H,
    T,
    S,
    dropout_p,
    HAS_BIAS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    MAX_DISTANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    """Backward of the queries: one program per (query tile, row x head): dQ (_PackedAttention.backward
    launches it)."""
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
    qseg = _query_segments(QSeg + b * T, rows, T)
    ranges = KeyRanges + (b * tl.cdiv(T, BLOCK_M) + pid_m) * 2
    lo = tl.load(ranges)
    hi = tl.load(ranges + 1)
    seed = tl.load(Seed) if DROPOUT else 0
    dist = Dist + h * (2 * MAX_DISTANCE + 1)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):  # tiles from the range's first key, not a block start
        cols = start_n + offs_n
        k = tl.load(
            K + b * skb + h * skh + cols[None, :] * skn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        v = tl.load(
            V + b * svb + h * svh + cols[None, :] * svn + offs_d[:, None], mask=cols[None, :] < S, other=0.0
        )
        kseg = tl.load(KSeg + b * S + cols, mask=cols < S, other=0)
        s = _scores(q, k, qseg, kseg, rows, cols, dist, HAS_BIAS, CAUSAL, MAX_DISTANCE)
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, v.to(do.dtype))
        if DROPOUT:
            keep = attention_keep(seed, bh, rows, cols, T, S, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), tl.trans(k))
    tl.store(
        DQ + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=rows[:, None] < T,
    )


def _strides(*tensors) -> tuple[int, ...]:
    """(batch, head, position) strides of each (R, H, L, D) tensor (unit stride over D)."""
    return tuple(x.stride(i) for x in tensors for i in range(3))


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias_table, distance_bias, layout, dropout_p):
        R, H, T, D = q.shape
        S = k.shape[2]
        out = torch.empty((R, T, H, D), dtype=q.dtype, device=q.device)  # the layout T5's `o` reads
        lse = torch.empty((R, H, T), dtype=torch.float32, device=q.device)
        seed = dropout_seed(q.device) if dropout_p > 0 else torch.zeros(1, dtype=torch.int64, device=q.device)
        has_bias = distance_bias is not None
        max_distance = layout.position_bias.max_distance if has_bias else 0
        fwd_kernel[(triton.cdiv(T, BLOCK), R * H)](
            q,
            k,
            v,
            layout.query_segments,
            layout.key_segments,
            layout.key_ranges,
            distance_bias if has_bias else q,  # any tensor stands in for an absent one: never read
            out,
            lse,
            seed,
            *_strides(q, k, v, out.transpose(1, 2)),
            H,
            T,
            S,
            dropout_p,
            HAS_BIAS=has_bias,
            CAUSAL=layout.causal,
            DROPOUT=dropout_p > 0,
            MAX_DISTANCE=max_distance,
            BLOCK_M=BLOCK,
            BLOCK_N=BLOCK,
            D=D,
            **FWD_CONFIG,
        )
        ctx.save_for_backward(q, k, v, distance_bias, out, lse, seed)
        ctx.layout, ctx.dropout_p = layout, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, distance_bias, out, lse, seed = ctx.saved_tensors
        layout, dropout_p = ctx.layout, ctx.dropout_p
        R, H, T, D = q.shape
        S = k.shape[2]
        has_bias = distance_bias is not None
        bias_grad = has_bias and ctx.needs_input_grad[3]
        max_distance = layout.position_bias.max_distance if has_bias else 0
        grad_out = grad_out.contiguous()
        delta = softmax_delta(out, grad_out)  # rowsum(dO * O), dropout included (O is the dropped output)
        do = grad_out.transpose(1, 2)  # (R, H, T, D) view of (R, T, H, D)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        assert dk.stride() == k.stride() and dv.stride() == v.stride() and dq.stride() == q.stride()
        key_blocks = triton.cdiv(S, BLOCK)
        groups, rows_per_group = bias_grad_groups(R, H, S) if bias_grad else (R, 1)
        rows = gradient_rows(max_distance) if bias_grad else 1
        # Every program writes its whole slice (zeros where it saw no tile): no initialisation needed.
        shape = (groups, key_blocks, H, rows * BLOCK)
        dbias = torch.empty(shape, dtype=torch.float32, device=q.device) if bias_grad else q
        strides = _strides(q, k, v, do)
        flags = dict(
            HAS_BIAS=has_bias,
            CAUSAL=layout.causal,
            DROPOUT=dropout_p > 0,
            MAX_DISTANCE=max_distance,
            BLOCK_M=BLOCK,
            BLOCK_N=BLOCK,
            D=D,
            **BWD_CONFIG,
        )
        dist = distance_bias if has_bias else q
        bwd_kv_kernel[(key_blocks, H, groups)](
            q,
            k,
            v,
            layout.query_segments,
            layout.key_segments,
            layout.query_ranges,
            dist,
            do,
            lse,
            delta,
            seed,
            dk,
            dv,
            dbias,
            *strides,
            R,
            H,
            T,
            S,
            dropout_p,
            rows_per_group,
            FAR_TILES=far_tiles(max_distance) if has_bias else 1,
            GRADIENT_ROWS=rows,
            BIAS_GRAD=bias_grad,
            **flags,
        )
        bwd_q_kernel[(triton.cdiv(T, BLOCK), R * H)](
            q,
            k,
            v,
            layout.query_segments,
            layout.key_segments,
            layout.key_ranges,
            dist,
            do,
            lse,
            delta,
            seed,
            dq,
            *strides,
            H,
            T,
            S,
            dropout_p,
            **flags,
        )
        grad_table = None
        if bias_grad:
            # Fixed-order sums (no index_add_: its CUDA atomics would add in a varying order)
            grad_table = (dbias.sum((0, 1)) @ layout.gradient_buckets).t()
        return dq, dk, dv, grad_table, None, None, None


def packed_attention(q, k, v, layout: PackedAttentionLayout, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T + T5 position bias, over the keys of each query's segment) v, dropout on the
    probabilities: (R, T, H, D). q: (R, H, T, D), k and v: (R, H, S, D), any strides with a unit last one;
    bf16 or fp16, head size a power of two >= 16. The bias is the layout's (`use_bias_table`), differentiable
    in the table. A padding query gets 0. dropout_p is rounded to a multiple of 2**-16."""
    if q.size(-1) < 16 or q.size(-1) & (q.size(-1) - 1):
        raise ValueError(f"packed attention needs a power-of-two head size >= 16, got {q.size(-1)}")
    if layout.position_bias is not None and layout.distance_bias is None:
        raise ValueError("packed attention with a position bias: call layout.use_bias_table(weight) first")
    table = layout.bias_table if layout.position_bias is not None else None
    distance_bias = layout.distance_bias if layout.position_bias is not None else None
    return _PackedAttention.apply(q, k, v, table, distance_bias, layout, dropout_resolution(dropout_p))


def dense_position_bias(table: torch.Tensor, bias: RelativeBias, queries: int, keys: int) -> torch.Tensor:
    """T5's dense (H, T, S) bias of relative position j - i from a (buckets, H) table (as T5Attention's
    compute_bias): inside a contiguous segment, j - i is the relative position of the record alone."""
    device = table.device
    distances = torch.arange(keys, device=device)[None, :] - torch.arange(queries, device=device)[:, None]
    return table[bias.buckets(distances)].permute(2, 0, 1)

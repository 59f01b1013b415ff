"""Adafactor's update (trainer.optim.adafactor_optimizer.Adafactor) for many same-shape weights at once, on
a GPU.

Each kernel reads every weight of the group through a device table of addresses, so the weights, gradients
and states stay where they are (no stacked copies in and out) and a group of any size costs four launches
(two for vectors) instead of a compiled call's ~8 per weight, which in a CUDA graph left the GPU idle between
small kernels. Per factored weight (rows, cols), the passes are:

1. `_row_stats`: (grad^2 + eps) summed along each row (the row state updated) and, per block of rows, down
   each column (fp32 partial sums);
2. `_col_stats`: the partial sums summed in a fixed order (the column state updated), and the row state's
   mean;
3. `_update_rms`: the update r * c * grad squared and summed per block of rows (vectors: their state updated
   here);
4. `_apply`: the update clipped by its RMS, weight decay, and the weight written (with Kahan compensation:
   rounded to the weight's dtype, the rounding error kept in the compensation buffer: bf16, or 8-bit codes in
   units of 1/256 of the weight's last bit, rounded stochastically by the hash of each element's index in
   the whole weight (trainer.kernels.dropout.uniform16), keyed by the step's seed, the scalars' fifth number,
   plus the weight's place in its group).

The gradient is read three times, each time times the step's gradient scale (gradient clipping, as a factor
instead of a pass that writes the gradients over), and the weight and its buffer once each way: ~14 bytes
per bf16 weight.
Sums are fixed-order (no atomics): the same inputs give the same bits.

FSDP2's shards (`update_shards`): each rank runs the same passes on its own rows of every weight (FSDP2
splits dim 0, as torch.chunk does), the row states split the same way, the column states whole on every
rank. What a pass needs from the other ranks comes in two all-reduces for all the weights together: after
pass 1 each weight's column sums and row-state sum (`_shard_stats`, then `_shard_col_state` updates the
column state and takes the row state's mean over the whole weight), after pass 3 each update's sum of
squares (its RMS over the whole weight).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trainer.kernels.dropout import uniform16

# Tile of a factored weight a program works through: BLOCK_ROWS rows, BLOCK_COLS columns at a time, by
# NUM_WARPS warps, loads pipelined STAGES deep. On an H100 at FLAN-T5-XL's shapes a step takes 20.1 ms this
# way, 26.0 with 64 x 64 tiles by 8 warps, 61 with 64 x 128 tiles by 4 (registers spilled; `python3
# bench/optimizer_step.py --sweep`); fewer rows per tile means more fp32 partial column sums: ~0.3 GB for
# XL's 288 weights of 2048 x 2048.
BLOCK_ROWS = 16
BLOCK_COLS = 256
NUM_WARPS = 4
STAGES = 2
# A vector weight (one program each) walks its elements this many at a time.
VECTOR_BLOCK = 1024
# Columns per program when the column sums are finished.
COL_STATS_BLOCK = 1024

_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _tensor(Table, n, TY: tl.constexpr):
    """The n-th tensor of a table of addresses, as a pointer to TY. Every address is a multiple of 16
    (`WeightGroup.supports`): said so, the loads and stores are 16-byte vectors, not one element each."""
    return tl.multiple_of(tl.load(Table + n), 16).to(tl.pointer_type(TY))


@triton.jit(do_not_specialize=["row_blocks"])
def _row_stats(
    G,
    Row,
    ColPartial,
    Scalars,
    rows,
    cols,
    row_blocks,
    eps,
    TY: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    STAGES: tl.constexpr,
):
    n, rb = tl.program_id(0), tl.program_id(1)
    grad = _tensor(G, n, TY)
    grad_scale = tl.load(Scalars + 3)
    r = rb * BR + tl.arange(0, BR)
    inside_rows = r < rows
    row_sum = tl.zeros([BR], tl.float32)
    partial = ColPartial + (n.to(tl.int64) * row_blocks + rb) * cols
    for c0 in tl.range(0, cols, BC, num_stages=STAGES):
        c = c0 + tl.arange(0, BC)
        inside = inside_rows[:, None] & (c < cols)[None, :]
        g = tl.load(grad + r.to(tl.int64)[:, None] * cols + c[None, :], mask=inside, other=0.0).to(tl.float32)
        g *= grad_scale
        sq = tl.where(inside, g * g + eps, 0.0)
        row_sum += tl.sum(sq, 1)
        tl.store(partial + c, tl.sum(sq, 0), mask=c < cols)
    beta = tl.load(Scalars + 1)
    row = _tensor(Row, n, tl.float32)
    old = tl.load(row + r, mask=inside_rows, other=0.0)
    tl.store(row + r, old * beta + row_sum / cols * (1.0 - beta), mask=inside_rows)


@triton.jit(do_not_specialize=["row_blocks"])
def _col_stats(Col, Row, ColPartial, RowMean, Scalars, rows, cols, row_blocks, BC: tl.constexpr):
    n, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    inside = c < cols
    total = tl.zeros([BC], tl.float32)
    for rb in range(0, row_blocks):
        total += tl.load(ColPartial + (n.to(tl.int64) * row_blocks + rb) * cols + c, mask=inside, other=0.0)
    beta = tl.load(Scalars + 1)
    col = _tensor(Col, n, tl.float32)
    old = tl.load(col + c, mask=inside, other=0.0)
    tl.store(col + c, old * beta + total / rows * (1.0 - beta), mask=inside)
    if cb == 0:
        row = _tensor(Row, n, tl.float32)
        acc = tl.zeros([BC], tl.float32)
        for r0 in range(0, rows, BC):
            r = r0 + tl.arange(0, BC)
            acc += tl.load(row + r, mask=r < rows, other=0.0)
        tl.store(RowMean + n, tl.sum(acc, 0) / rows)


@triton.jit(do_not_specialize=["row_blocks"])
def _shard_stats(Row, ColPartial, Stats, count, rows, cols, row_blocks, BC: tl.constexpr):
    """A shard's part of what the whole weight's statistics need: its column sums (the row blocks' partial
    sums in a fixed order) at Stats[n * cols], its row state's sum at Stats[count * cols + n]."""
    n, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    inside = c < cols
    total = tl.zeros([BC], tl.float32)
    for rb in range(0, row_blocks):
        total += tl.load(ColPartial + (n.to(tl.int64) * row_blocks + rb) * cols + c, mask=inside, other=0.0)
    tl.store(Stats + n.to(tl.int64) * cols + c, total, mask=inside)
    if cb == 0:
        row = _tensor(Row, n, tl.float32)
        acc = tl.zeros([BC], tl.float32)
        for r0 in range(0, rows, BC):
            r = r0 + tl.arange(0, BC)
            acc += tl.load(row + r, mask=r < rows, other=0.0)
        tl.store(Stats + count * cols + n, tl.sum(acc, 0))


@triton.jit
def _shard_col_state(Col, Stats, RowMean, Scalars, count, whole_rows, cols, BC: tl.constexpr):
    """From every rank's summed `_shard_stats`: the column state (whole on every rank) and the row state's
    mean over the whole weight."""
    n, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    inside = c < cols
    beta = tl.load(Scalars + 1)
    col = _tensor(Col, n, tl.float32)
    total = tl.load(Stats + n.to(tl.int64) * cols + c, mask=inside, other=0.0)
    old = tl.load(col + c, mask=inside, other=0.0)
    tl.store(col + c, old * beta + total / whole_rows * (1.0 - beta), mask=inside)
    if cb == 0:
        tl.store(RowMean + n, tl.load(Stats + count * cols + n) / whole_rows)


@triton.jit
def _factored_update(grad, grad_scale, row, col, RowMean, n, r, c, rows, cols):
    """The unclipped update of a factored weight's tile (rows r, columns c): r_factor * c_factor * grad."""
    inside = (r < rows)[:, None] & (c < cols)[None, :]
    g = tl.load(grad + r.to(tl.int64)[:, None] * cols + c[None, :], mask=inside, other=0.0).to(tl.float32)
    g *= grad_scale
    r_factor = tl.rsqrt(tl.load(row + r, mask=r < rows, other=1.0) / tl.load(RowMean + n))
    c_factor = tl.rsqrt(tl.load(col + c, mask=c < cols, other=1.0))
    return r_factor[:, None] * c_factor[None, :] * g


@triton.jit(do_not_specialize=["row_blocks"])
def _update_rms(
    G,
    Row,
    Col,
    Sq,
    RowMean,
    RmsPartial,
    Scalars,
    rows,
    cols,
    row_blocks,
    eps,
    FACTORED: tl.constexpr,
    TY: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    STAGES: tl.constexpr,
):
    n, rb = tl.program_id(0), tl.program_id(1)
    grad = _tensor(G, n, TY)
    row, col, sq = _tensor(Row, n, tl.float32), _tensor(Col, n, tl.float32), _tensor(Sq, n, tl.float32)
    beta, grad_scale = tl.load(Scalars + 1), tl.load(Scalars + 3)
    r = rb * BR + tl.arange(0, BR)
    acc = tl.zeros([BR, BC], tl.float32)
    for c0 in tl.range(0, cols, BC, num_stages=STAGES):
        c = c0 + tl.arange(0, BC)
        inside = (r < rows)[:, None] & (c < cols)[None, :]
        if FACTORED:
            u = _factored_update(grad, grad_scale, row, col, RowMean, n, r, c, rows, cols)
        else:  # a vector (one row): its state is updated here, and the update made from the new state
            g = tl.load(grad + c[None, :], mask=inside, other=0.0).to(tl.float32) * grad_scale
            state = tl.load(sq + c[None, :], mask=inside, other=1.0) * beta + (g * g + eps) * (1.0 - beta)
            tl.store(sq + c[None, :], state, mask=inside)
            u = tl.rsqrt(state) * g
        acc += tl.where(inside, u * u, 0.0)
    tl.store(RmsPartial + n.to(tl.int64) * row_blocks + rb, tl.sum(tl.sum(acc, 1), 0))


@triton.jit(do_not_specialize=["row_blocks", "numel", "index_offset"])
def _apply(
    P,
    G,
    Comp,
    Row,
    Col,
    Sq,
    RowMean,
    RmsPartial,
    Scalars,
    rows,
    cols,
    row_blocks,
    numel,
    clip_threshold,
    index_offset,
    FACTORED: tl.constexpr,
    KAHAN: tl.constexpr,
    KAHAN_8BIT: tl.constexpr,
    TY: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    STAGES: tl.constexpr,
):
    n, rb = tl.program_id(0), tl.program_id(1)
    weight, grad = _tensor(P, n, TY), _tensor(G, n, TY)
    row, col, sq = _tensor(Row, n, tl.float32), _tensor(Col, n, tl.float32), _tensor(Sq, n, tl.float32)
    blocks = tl.arange(0, ROW_BLOCKS)
    total = tl.sum(
        tl.load(RmsPartial + n.to(tl.int64) * row_blocks + blocks, mask=blocks < row_blocks, other=0.0)
    )
    clip = tl.maximum(tl.sqrt(total / numel) / clip_threshold, 1.0)
    lr, weight_decay, grad_scale = tl.load(Scalars), tl.load(Scalars + 2), tl.load(Scalars + 3)
    r = rb * BR + tl.arange(0, BR)
    for c0 in tl.range(0, cols, BC, num_stages=STAGES):
        c = c0 + tl.arange(0, BC)
        inside = (r < rows)[:, None] & (c < cols)[None, :]
        if FACTORED:
            u = _factored_update(grad, grad_scale, row, col, RowMean, n, r, c, rows, cols)
        else:
            g = tl.load(grad + c[None, :], mask=inside, other=0.0).to(tl.float32) * grad_scale
            u = tl.rsqrt(tl.load(sq + c[None, :], mask=inside, other=1.0)) * g
        u = u / clip * lr
        at = r.to(tl.int64)[:, None] * cols + c[None, :]
        w = tl.load(weight + at, mask=inside, other=0.0).to(tl.float32)
        if KAHAN:
            comp = _tensor(Comp, n, TY)
            w += tl.load(comp + at, mask=inside, other=0.0).to(tl.float32)
        if KAHAN_8BIT:
            codes = _tensor(Comp, n, tl.int8)
            w += tl.load(codes + at, mask=inside, other=0).to(tl.float32) * _code_unit(w)
        w = w - w * (weight_decay * lr) - u
        if KAHAN_8BIT:  # bf16 weights: rounded to nearest here, exactly (Triton's interpreter truncates)
            nearest = _round_to_bf16(w)
            tl.store(weight + at, nearest.to(TY), mask=inside)
        else:
            rounded = w.to(TY)
            tl.store(weight + at, rounded, mask=inside)
        if KAHAN:  # what the weight's dtype could not hold this step
            tl.store(comp + at, (w - rounded.to(tl.float32)).to(TY), mask=inside)
        if KAHAN_8BIT:  # the same, in whole units, rounded up with the probability of the remainder
            units = (w - nearest) / _code_unit(nearest)
            chance = uniform16(tl.load(Scalars + 4).to(tl.int32) + n, index_offset + at).to(tl.float32)
            units = tl.floor(units + (chance + 0.5) * (1.0 / 65536.0))
            tl.store(codes + at, tl.minimum(tl.maximum(units, -128.0), 127.0).to(tl.int8), mask=inside)


@triton.jit
def _round_to_bf16(w):
    """fp32 `w` rounded to the nearest bf16 (ties to even), as fp32: integer arithmetic on the bits."""
    bits = w.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _code_unit(w):
    """What one 8-bit Kahan code is worth next to the bf16 weight `w` (fp32, holding a bf16 value): 1/256 of
    its last bit, 2**(exponent - 15); the smallest normal number's for zero and subnormal weights."""
    exponent = (w.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return ((tl.maximum(exponent, 16) - 15) << 23).to(tl.float32, bitcast=True)


def _table(tensors: list[torch.Tensor], device) -> torch.Tensor:
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    return (
        addresses.pin_memory().to(device, non_blocking=True)
        if device.type == "cuda"
        else addresses.to(device)
    )


@dataclass(eq=False)
class WeightGroup:
    """Same-shape, same-dtype contiguous weights of one device with their gradients and Adafactor states,
    as tables of addresses the kernels read. Valid while none of these tensors moves (`addresses`)."""

    count: int
    rows: int
    cols: int
    factored: bool
    kahan: bool
    kahan_8bit: bool
    dtype: torch.dtype
    addresses: tuple[int, ...]
    tables: dict[str, torch.Tensor]
    # A shard's group (`update_shards`): the whole weight's rows and elements; the shard's are rows, cols;
    # where its first element lies in the whole weight (the 8-bit Kahan codes' random numbers are the
    # whole weight's).
    whole_rows: int = 0
    whole_numel: int = 0
    index_offset: int = 0

    @staticmethod
    def supports(weight: torch.Tensor, grad: torch.Tensor | None = None) -> bool:
        """Whether the kernels can update `weight` (with `grad`, by default its .grad): a plain contiguous
        CUDA tensor of at most two dimensions (more would need the leading ones factored separately) in a
        dtype they know, with a contiguous gradient of its dtype, both at addresses that are multiples of 16
        bytes (views into a larger buffer need not be; trainer.infra.distributed's gradient buffer aligns
        them)."""
        grad = weight.grad if grad is None else grad
        return (
            weight.is_cuda
            and type(weight.data) is torch.Tensor
            and weight.dim() <= 2
            and weight.dtype in _TRITON_DTYPES
            and weight.is_contiguous()
            and grad is not None
            and grad.dtype == weight.dtype
            and grad.is_contiguous()
            and weight.data_ptr() % 16 == 0
            and grad.data_ptr() % 16 == 0
        )

    @staticmethod
    def tensors_of(
        weights: list[torch.Tensor], states: list[dict], grads: list[torch.Tensor] | None = None
    ) -> dict[str, list[torch.Tensor]]:
        """What the kernels read and write, by table name (`grads`: the weights' .grad by default). A state
        the weights lack (the factored ones of a vector, a Kahan buffer without compensation) is never read:
        the weight stands in for it. The Kahan buffer: bf16 (`kahan_comp`) or 8-bit codes (`kahan_codes`)."""
        out = {"p": list(weights), "g": [w.grad for w in weights] if grads is None else list(grads)}
        pairs = zip(weights, states, strict=True)
        out["comp"] = [s.get("kahan_comp", s.get("kahan_codes", w)) for w, s in pairs]
        for table, key in [("row", "exp_avg_sq_row"), ("col", "exp_avg_sq_col")]:
            out[table] = [s.get(key, w) for w, s in zip(weights, states, strict=True)]
        out["sq"] = [s.get("exp_avg_sq", w) for w, s in zip(weights, states, strict=True)]
        return out

    @classmethod
    def build(
        cls,
        weights: list[torch.Tensor],
        states: list[dict],
        grads: list[torch.Tensor] | None = None,
        whole_shape: tuple[int, ...] | None = None,
        index_offset: int = 0,
    ) -> WeightGroup:
        """The group of `weights` (same shape and dtype) and their `states`. A group of shards
        (`update_shards`): `weights`, `grads` and the states are each rank's local tensors, `whole_shape` the
        weights' shape before FSDP2 split their rows, `index_offset` the index in the whole weight of the
        shard's first element."""
        first = weights[0]
        tensors = cls.tensors_of(weights, states, grads)
        if any(t.data_ptr() % 16 for ts in tensors.values() for t in ts if t.numel()):
            raise ValueError("Adafactor's kernels need tensors at addresses that are multiples of 16 bytes")
        rows, cols, factored = matrix_layout(tuple(first.shape))
        whole_rows = whole_numel = 0
        if whole_shape is not None:
            whole_rows, whole_cols, _ = matrix_layout(whole_shape)
            whole_numel = whole_rows * whole_cols
            if factored and whole_cols != cols:
                raise ValueError(f"a shard {tuple(first.shape)} of {whole_shape} not split by rows")
        return cls(
            count=len(weights),
            rows=rows,
            cols=cols,
            factored=factored,
            kahan="kahan_comp" in states[0],
            kahan_8bit="kahan_codes" in states[0],
            dtype=first.dtype,
            addresses=cls.addresses_of(tensors),
            tables={name: _table(ts, first.device) for name, ts in tensors.items()},
            whole_rows=whole_rows,
            whole_numel=whole_numel,
            index_offset=index_offset,
        )

    @staticmethod
    def addresses_of(tensors: dict[str, list[torch.Tensor]]) -> tuple[int, ...]:
        return tuple(t.data_ptr() for ts in tensors.values() for t in ts)

    def update(self, scalars: torch.Tensor, eps: float, clip_threshold: float) -> None:
        """One Adafactor step of every weight of the group. scalars: [lr, beta2t, weight decay, gradient
        scale, the 8-bit Kahan codes' seed], fp32, on the weights' device."""
        row_blocks = self._row_blocks()
        row_mean = torch.empty(self.count, dtype=torch.float32, device=scalars.device)
        if self.factored:
            col_partial = self._row_stats(scalars, eps)
            _col_stats[(self.count, triton.cdiv(self.cols, COL_STATS_BLOCK))](
                self.tables["col"],
                self.tables["row"],
                col_partial,
                row_mean,
                scalars,
                self.rows,
                self.cols,
                row_blocks,
                BC=COL_STATS_BLOCK,
            )
        rms_partial = self._update_rms(scalars, eps, row_mean)
        self._apply(scalars, row_mean, rms_partial, row_blocks, self.rows * self.cols, clip_threshold)

    # -- FSDP2's shards (update_shards): the same passes, the whole weight's sums from every rank

    def stats_size(self) -> int:
        """fp32 numbers this group adds to the first all-reduce: each weight's column sums and row-state
        sum (none for vectors, whose state is elementwise)."""
        return self.count * (self.cols + 1) if self.factored else 0

    def shard_stats(self, scalars: torch.Tensor, eps: float, stats: torch.Tensor) -> None:
        """Pass 1 on this rank's rows (its row states updated); its part of the column sums and row-state
        sums written into `stats` (this group's slice, summed over ranks next)."""
        if not self.factored:
            return
        if self.rows == 0:  # no rows here (a weight with fewer rows than ranks): nothing to add
            stats.zero_()
            return
        _shard_stats[(self.count, triton.cdiv(self.cols, COL_STATS_BLOCK))](
            self.tables["row"],
            self._row_stats(scalars, eps),
            stats,
            self.count,
            self.rows,
            self.cols,
            self._row_blocks(),
            BC=COL_STATS_BLOCK,
        )

    def shard_squares(
        self, scalars: torch.Tensor, eps: float, stats: torch.Tensor, squares: torch.Tensor
    ) -> torch.Tensor:
        """After the stats' all-reduce: the column states and the row states' means (returned), and each
        weight's sum of squared updates over this rank's part written into `squares` (summed over ranks
        next). Vectors update their state here."""
        row_mean = torch.empty(self.count, dtype=torch.float32, device=scalars.device)
        if self.factored:
            _shard_col_state[(self.count, triton.cdiv(self.cols, COL_STATS_BLOCK))](
                self.tables["col"],
                stats,
                row_mean,
                scalars,
                self.count,
                float(self.whole_rows),
                self.cols,
                BC=COL_STATS_BLOCK,
            )
        if self.rows * self.cols == 0:
            squares.zero_()
        else:
            torch.sum(self._update_rms(scalars, eps, row_mean).view(self.count, -1), dim=1, out=squares)
        return row_mean

    def shard_apply(
        self, scalars: torch.Tensor, row_mean: torch.Tensor, squares: torch.Tensor, clip_threshold: float
    ) -> None:
        """After the squares' all-reduce: the update, clipped by its RMS over the whole weight, written."""
        if self.rows * self.cols:
            self._apply(scalars, row_mean, squares, 1, self.whole_numel, clip_threshold)

    # -- the passes

    def _row_blocks(self) -> int:
        return triton.cdiv(self.rows, BLOCK_ROWS) if self.factored else 1

    def _tiling(self) -> dict:
        """What every pass's launch takes beyond its arguments: the weights' dtype and the tile."""
        br, bc = (BLOCK_ROWS, BLOCK_COLS) if self.factored else (1, VECTOR_BLOCK)
        return dict(TY=_TRITON_DTYPES[self.dtype], BR=br, BC=bc, STAGES=STAGES, num_warps=NUM_WARPS)

    def _row_stats(self, scalars: torch.Tensor, eps: float) -> torch.Tensor:
        """Pass 1 (factored weights): row states updated; the columns' partial sums per block of rows."""
        row_blocks = self._row_blocks()
        col_partial = torch.empty(
            self.count * row_blocks * self.cols, dtype=torch.float32, device=scalars.device
        )
        _row_stats[(self.count, row_blocks)](
            self.tables["g"],
            self.tables["row"],
            col_partial,
            scalars,
            self.rows,
            self.cols,
            row_blocks,
            eps,
            **self._tiling(),
        )
        return col_partial

    def _update_rms(self, scalars: torch.Tensor, eps: float, row_mean: torch.Tensor) -> torch.Tensor:
        """Pass 3: each weight's squared update summed per block of rows (vectors: their state updated)."""
        t, row_blocks = self.tables, self._row_blocks()
        rms_partial = torch.empty(self.count * row_blocks, dtype=torch.float32, device=scalars.device)
        _update_rms[(self.count, row_blocks)](
            t["g"],
            t["row"],
            t["col"],
            t["sq"],
            row_mean,
            rms_partial,
            scalars,
            self.rows,
            self.cols,
            row_blocks,
            eps,
            FACTORED=self.factored,
            **self._tiling(),
        )
        return rms_partial

    def _apply(
        self,
        scalars: torch.Tensor,
        row_mean: torch.Tensor,
        rms_partial: torch.Tensor,
        rms_blocks: int,
        numel: int,
        clip_threshold: float,
    ) -> None:
        """Pass 4: the update clipped by the RMS of `numel` elements (the sum of `rms_blocks` partial sums
        per weight), weight decay, the weight (and its Kahan buffer) written."""
        t = self.tables
        _apply[(self.count, self._row_blocks())](
            t["p"],
            t["g"],
            t["comp"],
            t["row"],
            t["col"],
            t["sq"],
            row_mean,
            rms_partial,
            scalars,
            self.rows,
            self.cols,
            rms_blocks,
            float(numel),
            clip_threshold,
            self.index_offset,
            FACTORED=self.factored,
            KAHAN=self.kahan,
            KAHAN_8BIT=self.kahan_8bit,
            ROW_BLOCKS=triton.next_power_of_2(rms_blocks),
            **self._tiling(),
        )


def update_shards(
    groups: list[tuple[WeightGroup, torch.Tensor, float, float]], all_reduce: Callable[[torch.Tensor], None]
) -> None:
    """One Adafactor step of FSDP2's shards: `groups` are (a group of shards, its scalars, eps,
    clip_threshold), in the same order on every rank; `all_reduce` sums a tensor over the ranks in place.
    Two all-reduces for all the groups."""
    device = groups[0][1].device
    stats = torch.empty(sum(g.stats_size() for g, *_ in groups), dtype=torch.float32, device=device)
    squares = torch.empty(sum(g.count for g, *_ in groups), dtype=torch.float32, device=device)
    stats_at, squares_at = (
        _offsets([g.stats_size() for g, *_ in groups]),
        _offsets([g.count for g, *_ in groups]),
    )
    for (group, scalars, eps, _), (a, b) in zip(groups, stats_at, strict=True):
        group.shard_stats(scalars, eps, stats[a:b])
    all_reduce(stats)
    row_means = [
        group.shard_squares(scalars, eps, stats[a:b], squares[c:d])
        for (group, scalars, eps, _), (a, b), (c, d) in zip(groups, stats_at, squares_at, strict=True)
    ]
    all_reduce(squares)
    for (group, scalars, _, clip_threshold), row_mean, (c, d) in zip(
        groups, row_means, squares_at, strict=True
    ):
        group.shard_apply(scalars, row_mean, squares[c:d], clip_threshold)


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def matrix_layout(shape: tuple[int, ...]) -> tuple[int, int, bool]:
    """(rows, columns, factored) the kernels see a weight of `shape` as: a matrix as itself (its second
    moment factored), anything smaller as one row."""
    if len(shape) == 2:
        return shape[0], shape[1], True
    return 1, math.prod(shape), False


def scratch_bytes(count: int, shape: tuple[int, ...]) -> int:
    """Bytes of fp32 partial sums an update of `count` weights of `shape` allocates."""
    rows, cols, factored = matrix_layout(shape)
    row_blocks = triton.cdiv(rows, BLOCK_ROWS) if factored else 1
    return 4 * count * (1 + row_blocks + (row_blocks * cols if factored else 0))

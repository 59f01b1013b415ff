"""The packed-row attention kernels (trainer.kernels.packed_attention) against the dense math in fp64.

On a machine without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), whose
tl.dot mishandles bfloat16: CPU runs use float16, the kernels' code paths are the same.
"""

from __future__ import annotations

import pytest
import torch
from packed_batches import segments

from trainer.kernels.packed_attention import (
    BLOCK,
    PackedAttentionLayout,
    RelativeBias,
    dense_position_bias,
    packed_attention,
)
from trainer.model.packed_t5 import reference_attention, segment_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TOL = 4 if DEVICE == "cuda" else 1  # bf16's rounding errors are ~8x fp16's
T5_BIDIRECTIONAL = RelativeBias(bidirectional=True)
T5_UNIDIRECTIONAL = RelativeBias(bidirectional=False)


def rows_of(lengths: list[list[int]], length: int) -> torch.Tensor:
    return torch.stack([segments(row, length) for row in lengths]).to(DEVICE)


def projections(rows, heads, length, head_dim, generator):
    """(R, H, L, D) views of (R, L, H, D) tensors, as T5's projections hand them over."""
    x = torch.randn(rows, length, heads, head_dim, generator=generator)
    return x.to(DEVICE, DTYPE).transpose(1, 2).requires_grad_()


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def check_against_reference(query_lengths, key_lengths, t, s, *, causal, bias, heads=2, head_dim=16):
    """Kernels' output and gradients (q, k, v, bias table) against fp64 dense math on the same inputs."""
    g = torch.Generator().manual_seed(0)
    qseg, kseg = rows_of(query_lengths, t), rows_of(key_lengths, s)
    layout = PackedAttentionLayout.build(qseg, kseg, causal=causal, position_bias=bias)
    q = projections(len(query_lengths), heads, t, head_dim, g)
    k, v = (projections(len(query_lengths), heads, s, head_dim, g) for _ in range(2))
    inputs = [q, k, v]
    if bias is not None:
        table = torch.randn(bias.num_buckets, heads, generator=g).to(DEVICE, DTYPE).requires_grad_()
        layout.use_bias_table(table)
        inputs.append(table)
    out = packed_attention(q, k, v, layout)
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE)
    grads = torch.autograd.grad(out.float(), inputs, grad_out)

    exact = [x.detach().double().requires_grad_() for x in inputs]
    dense_bias = dense_position_bias(exact[3], bias, t, s) if bias is not None else None
    ref = reference_attention(*exact[:3], qseg, kseg, causal=causal, bias=dense_bias)
    ref_grads = torch.autograd.grad(ref, exact, grad_out.double())
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert rel_err(out, ref) < 3e-3 * TOL
    for name, got, want in zip(["q", "k", "v", "bias table"], grads, ref_grads, strict=False):
        assert rel_err(got, want) < 5e-3 * TOL, name


# Rows of 150 positions: three query/key blocks, the last one partial; segments cross block boundaries.
def test_encoder_self_attention_matches_dense_math():
    # a segment of length 1, one filling a row but its last position, a row of padding only
    check_against_reference(
        [[70, 1, 50], [149], []], [[70, 1, 50], [149], []], 150, 150, causal=False, bias=T5_BIDIRECTIONAL
    )


def test_decoder_causal_self_attention_matches_dense_math():
    lengths = [[60, 1, 66], [3, 100, 20]]
    check_against_reference(lengths, lengths, 130, 130, causal=True, bias=T5_UNIDIRECTIONAL)


def test_cross_attention_matches_dense_math_with_head_size_64():
    # decoder segments over encoder segments of other lengths, the last record's source ending the row
    check_against_reference(
        [[60, 1, 66], [3, 100, 20]],
        [[20, 5, 65], [30, 10, 45]],
        130,
        90,
        causal=False,
        bias=None,
        head_dim=64,
    )


@pytest.mark.parametrize("causal", [False, True])
def test_bias_gradient_of_tiles_beyond_max_distance(causal):
    # max_distance 16: key blocks two or more tiles away hold one bucket (the kernel's whole-tile sums), the
    # nearer ones several (its per-distance sums); 200 positions reach three tiles away on both sides.
    bias = RelativeBias(bidirectional=not causal, num_buckets=8, max_distance=16)
    check_against_reference([[5, 190]], [[5, 190]], 200, 200, causal=causal, bias=bias)


def test_dropout_drops_the_same_probabilities_forward_and_backward():
    # With V = identity (S = D) each output row is the query's dropped, rescaled probability row: the mask.
    p, heads, n = 0.25, 2, 2 * BLOCK
    g = torch.Generator().manual_seed(0)
    seg = rows_of([[50, 1, 60]], n)
    layout = PackedAttentionLayout.build(seg, seg, causal=False, position_bias=T5_BIDIRECTIONAL)
    table = torch.randn(32, heads, generator=g).to(DEVICE, DTYPE).requires_grad_()
    layout.use_bias_table(table)
    # scores of std ~1 (not sqrt(D)): no kept probability may underflow to 0 in the half-precision output
    q = (projections(1, heads, n, n, g).detach() * n**-0.5).requires_grad_()
    k = projections(1, heads, n, n, g)
    eye = torch.eye(n, device=DEVICE, dtype=DTYPE).expand(1, heads, n, n)
    torch.manual_seed(7)
    shown = packed_attention(q, k, eye, layout, dropout_p=p).transpose(1, 2)  # (R, H, T, S)
    dense_bias = dense_position_bias(table.detach().double(), T5_BIDIRECTIONAL, n, n)
    probs = reference_attention(q.double(), k.double(), eye.double(), seg, seg, causal=False, bias=dense_bias)
    allowed = probs.transpose(1, 2) > 0
    dropped = (shown == 0) & allowed
    kept_rate_error = float(dropped[allowed].double().mean()) - p
    assert abs(kept_rate_error) < 5 * (p * (1 - p) / int(allowed.sum())) ** 0.5  # 5 standard deviations

    v = projections(1, heads, n, n, g)
    torch.manual_seed(7)  # the same seed: the same mask, whatever V is
    out = packed_attention(q, k, v, layout, dropout_p=p)
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE)
    grads = torch.autograd.grad(out.float(), (q, k, v, table), grad_out)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v, table)]
    ref = reference_attention(
        *exact[:3],
        seg,
        seg,
        causal=False,
        bias=dense_position_bias(exact[3], T5_BIDIRECTIONAL, n, n),
        dropped=dropped,
        p=p,
    )
    ref_grads = torch.autograd.grad(ref, exact, grad_out.double())
    assert rel_err(out, ref) < 3e-3 * TOL
    for name, got, want in zip(["q", "k", "v", "bias table"], grads, ref_grads, strict=True):
        assert rel_err(got, want) < 5e-3 * TOL, name

    torch.manual_seed(7)  # and the backward is deterministic: no atomics, fixed-order sums
    again = torch.autograd.grad(
        packed_attention(q, k, v, layout, dropout_p=p).float(), (q, k, v, table), grad_out
    )
    for a, b in zip(grads, again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_block_ranges_cover_exactly_the_attended_tiles(kind):
    # Random layouts, padding rows included: each block's range is the smallest that holds every key (or
    # query) it attends, so no attended pair is skipped and no tile outside the segments is visited.
    g = torch.Generator().manual_seed(1)
    t, s = (300, 300) if kind != "cross" else (300, 310)

    def random_rows(length):
        rows = []
        for _ in range(6):
            lengths, left = [], int(torch.randint(0, length + 1, (1,), generator=g))
            while left > 0:
                n = min(left, int(torch.randint(1, 90, (1,), generator=g)))
                lengths.append(n)
                left -= n
            rows.append(lengths)
        return rows

    qrows = random_rows(t)
    krows = qrows if kind != "cross" else [[max(1, n // 2) for n in r] for r in qrows]  # one source a record
    qseg = torch.stack([segments(r, t) for r in qrows])
    kseg = torch.stack([segments(r, s) for r in krows])
    causal = kind == "decoder"
    layout = PackedAttentionLayout.build(qseg, kseg, causal=causal)
    allowed = segment_mask(qseg, kseg, causal)  # (R, T, S)

    def tightest(mask):  # (R, blocks x BLOCK rows, cols) -> the [lo, hi) of each block's allowed columns
        blocks = mask.view(mask.size(0), -1, BLOCK, mask.size(2)).any(2)
        cols = torch.arange(mask.size(2))
        lo = torch.where(blocks, cols, mask.size(2)).amin(-1)
        hi = torch.where(blocks, cols + 1, 0).amax(-1)
        return torch.stack([torch.where(blocks.any(-1), lo, 0), hi], -1)

    def padded(mask, n):
        return torch.nn.functional.pad(mask, (0, 0, 0, -mask.size(1) % n))

    assert torch.equal(layout.key_ranges.long(), tightest(padded(allowed, BLOCK)))
    assert torch.equal(layout.query_ranges.long(), tightest(padded(allowed.transpose(1, 2), BLOCK)))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 16)])
def test_relative_buckets_are_t5s(bidirectional, num_buckets, max_distance):
    """The kernels' position buckets are transformers' T5 buckets, near and far, both directions."""
    from transformers.models.t5.modeling_t5 import T5Attention

    distances = torch.arange(-3 * max_distance, 3 * max_distance + 1)[None, :]
    got = RelativeBias(bidirectional, num_buckets, max_distance).buckets(distances)
    expected = T5Attention._relative_position_bucket(
        distances, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(got, expected)


def test_checkpoint_recompute_reproduces_dropout():
    """Gradient checkpointing's recompute restores torch's generator: the kernels draw the same seed and drop
    the same probabilities, so the checkpointed gradients are the plain ones, bit for bit."""
    g = torch.Generator().manual_seed(0)
    seg = rows_of([[20, 30], [45]], 64)
    layout = PackedAttentionLayout.build(seg, seg, causal=True, position_bias=T5_UNIDIRECTIONAL)
    table = torch.randn(32, 2, generator=g).to(DEVICE, DTYPE).requires_grad_()
    q, k, v = (projections(2, 2, 64, 16, g) for _ in range(3))

    def attend(q, k, v, table):
        layout.use_bias_table(table)
        return packed_attention(q, k, v, layout, dropout_p=0.3).float().square().sum()

    tensors = [q, k, v, table]
    torch.manual_seed(3)
    plain = torch.autograd.grad(attend(*tensors), tensors)
    torch.manual_seed(3)
    loss = torch.utils.checkpoint.checkpoint(attend, *tensors, use_reentrant=False)
    recomputed = torch.autograd.grad(loss, tensors)
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.equal(a, b)

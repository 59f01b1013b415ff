"""The fused T5 attention kernels (trainer.kernels.attention) against the plain math, and inside a real T5.

On a machine without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1). The
interpreter's tl.dot mishandles bfloat16, so CPU runs use float16: the kernels' code paths are the same.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from trainer.kernels import attention
from trainer.kernels.attention import t5_attention
from trainer.kernels.dropout import dropout_keep, dropout_resolution, uniform16
from trainer.model.fused_t5 import use_triton_attention

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16
# Error bounds below are fp16's; bf16 keeps 3 fewer mantissa bits (its rounding errors are ~8x larger).
TOL = 4 if torch.cuda.is_available() else 1  # bf16 there
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k, v, bias, keep, causal, dropped=None, p=0.0):
    """fp32 eager math; `dropped` (B, H, T, S) marks the probabilities dropout removed."""
    s = q.float() @ k.float().transpose(-1, -2)
    if bias is not None:
        s = s + bias.float()[None]
    if keep is not None:
        s = s.masked_fill(~keep[:, None, None, :], -1e30)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    probs = s.softmax(-1)
    if dropped is not None:
        probs = probs.masked_fill(dropped, 0.0) / (1 - p)
    return (probs @ v.float()).transpose(1, 2)


def inputs(b, h, t, s, d, *, bias=True, padded=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, T, H, D) projections viewed as (B, H, T, D), as T5 hands them over
    q, k, v = (torch.randn(b, n, h, d, generator=g).to(DEVICE, DTYPE).transpose(1, 2) for n in (t, s, s))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    pos = (torch.randn(h, t, s, generator=g)).to(DEVICE, DTYPE).requires_grad_() if bias else None
    keep = None
    if padded:
        lengths = torch.tensor([s - (i * 7) % max(s // 2, 1) for i in range(b)])
        keep = (torch.arange(s)[None, :] < lengths[:, None]).to(DEVICE)
    return q, k, v, pos, keep


def grads(out, grad_out, tensors):
    for x in tensors:
        x.grad = None
    out.float().backward(grad_out)
    return [x.grad.float().clone() for x in tensors]


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def assert_matches_eager(out, q, k, v, pos, eager):
    """`out` (the kernels on q, k, v, pos) and its gradients against `eager` on fp32 copies of them."""
    tensors = [x for x in (q, k, v, pos) if x is not None]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ours = grads(out, grad_out, tensors)
    copies = [None if x is None else x.detach().float().requires_grad_() for x in (q, k, v, pos)]
    ref = eager(*copies)
    expected = grads(ref, grad_out, [x for x in copies if x is not None])
    assert rel_err(out, ref) < 3e-3 * TOL
    for name, got, want in zip(["q", "k", "v", "bias"], ours, expected, strict=False):
        assert rel_err(got, want) < 5e-3 * TOL, name


@pytest.mark.parametrize(
    "b,h,t,s,d,causal,bias,padded",
    [
        (2, 3, 37, 37, 16, True, True, True),  # decoder self-attention: bias, causal, lengths off the tiles
        (3, 2, 70, 45, 32, False, True, True),  # encoder-like: bias, padding, query longer than one tile
        (2, 2, 5, 130, 16, False, False, True),  # cross-attention: no bias, keys over two tiles
        (2, 2, 66, 66, 64, True, True, False),  # no mask at all, head size 64 (FLAN-T5's)
    ],
)
def test_kernels_match_eager_math_forward_and_backward(b, h, t, s, d, causal, bias, padded):
    q, k, v, pos, keep = inputs(b, h, t, s, d, bias=bias, padded=padded)
    out = t5_attention(q, k, v, pos, keep, causal=causal)
    assert_matches_eager(out, q, k, v, pos, lambda *qkvb: reference(*qkvb, keep, causal))


def test_a_query_with_every_key_padded_averages_instead_of_nan():
    q, k, v, pos, keep = inputs(2, 2, 8, 8, 16)
    keep[1] = False
    out = t5_attention(q, k, v, pos, keep)
    assert torch.isfinite(out).all()
    assert rel_err(out[1], v[1].float().mean(1, keepdim=True).transpose(0, 1).expand(8, 2, 16)) < 2e-3 * TOL


# One tile, and several in both directions (the random numbers of a probability must not depend on the tile
# that computes it: forward and backward kernels walk the tiles in different orders).
@pytest.mark.parametrize(("b", "t", "s"), [(2, 16, 16), (1, 72, 128)])
def test_dropout_drops_the_same_probabilities_in_forward_and_backward(b, t, s):
    # With V = identity (S = D) the output row is the dropped, rescaled probability row: it shows the mask.
    p, h = 0.25, 2
    q, k, _, pos, keep = inputs(b, h, t, s, s)
    # Scores of std ~1 (not sqrt(s)): no probability may underflow to 0 in the half-precision output.
    q = (q.detach() * s**-0.5).requires_grad_()
    eye = torch.eye(s, device=DEVICE, dtype=DTYPE).expand(b, h, s, s)
    torch.manual_seed(7)
    shown = t5_attention(q, k, eye, pos, keep, dropout_p=p).transpose(1, 2)
    dropped = (shown == 0) & (reference(q, k, eye, pos, keep, False).transpose(1, 2) > 0)
    kept = keep[:, None, None, :].expand_as(dropped)
    n = int(kept.sum())
    assert abs(dropped[kept].float().mean() - p) < 5 * (p * (1 - p) / n) ** 0.5  # 5 standard deviations

    v = torch.randn(b, h, s, s, device=DEVICE).to(DTYPE).requires_grad_()
    torch.manual_seed(7)  # the same seed: the same mask, whatever V is
    out = t5_attention(q, k, v, pos, keep, dropout_p=p)
    assert_matches_eager(out, q, k, v, pos, lambda *qkvb: reference(*qkvb, keep, False, dropped=dropped, p=p))


def test_backward_is_deterministic(monkeypatch):
    # The bias gradient is summed over rows by atomic adds; each slice has one writer, in a fixed order.
    # Few backward programs: all 5 rows in one group, so several rows add into the same slice.
    monkeypatch.setattr(attention, "BWD_PROGRAMS", 2)
    assert attention.bias_grad_groups(5, 2, 40) == (1, 5)
    q, k, v, pos, keep = inputs(5, 2, 40, 40, 16, bias=True, padded=True)
    grads = []
    for _ in range(2):
        torch.manual_seed(3)
        out = t5_attention(q, k, v, pos, keep, dropout_p=0.1, causal=True)
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v, pos)))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@triton.jit
def _uniform16_kernel(Seed, Out, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + index, uniform16(tl.load(Seed), index).to(tl.int32))


def random_numbers(seed: int, n: int = 1 << 16) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _uniform16_kernel[(n // 4096,)](torch.tensor([seed], device=DEVICE), out, BLOCK=4096)
    return out.cpu().double()


@triton.jit
def _keep_kernel(Seed, Out, dropout_p, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + index, dropout_keep(tl.load(Seed), index, dropout_p).to(tl.int32))


@pytest.mark.parametrize("p", [0.1, dropout_resolution(0.1), 0.5, 1 / 65536, 0.0])
def test_dropout_keeps_the_elements_whose_number_reaches_p(p):
    # Every dropout in the kernels keeps u >= p * 2**16, so that the keep rate is exactly 1 - p for the
    # rounded p they get; and for any other p. 2**20 numbers: each 16-bit value ~16 times, the ones next to
    # the threshold included.
    n = 1 << 20
    keep = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _keep_kernel[(n // 4096,)](torch.tensor([777], device=DEVICE), keep, p, BLOCK=4096)
    assert torch.equal(keep.cpu().bool(), random_numbers(777, n) >= p * 65536)


def test_dropout_random_numbers_are_uniform_and_uncorrelated():
    # Dropout reads consecutive indices (neighbouring probabilities, a new seed per call): each stream must
    # be uniform over 16 bits, neighbours and the streams of nearby seeds uncorrelated.
    u = random_numbers(12345)
    n = u.numel()
    assert u.min() >= 0 and u.max() < 65536
    counts = torch.bincount((u // 256).long(), minlength=256).double()
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 255 + 5 * (2 * 255) ** 0.5  # chi-square, 255 degrees of freedom: 5 standard deviations

    def corr(x, y):
        return float(torch.corrcoef(torch.stack([x, y]))[0, 1])

    bound = 5 / n**0.5
    assert abs(corr(u[:-1], u[1:])) < bound
    assert abs(corr(u[:-8], u[8:])) < bound
    other = random_numbers(12346)
    assert abs(corr(u, other)) < bound
    # keep masks at p = 1/2 from the two seeds agree on half the elements
    agree = float(((u >= 32768) == (other >= 32768)).double().mean())
    assert abs(agree - 0.5) < 5 * (0.25 / n) ** 0.5


def test_checkpoint_recompute_reproduces_dropout():
    q, k, v, pos, keep = inputs(2, 2, 20, 20, 16)
    tensors = [q, k, v, pos]

    def attend(q, k, v, pos):
        return t5_attention(q, k, v, pos, keep, dropout_p=0.3, causal=True).float().square().sum()

    torch.manual_seed(3)
    plain = torch.autograd.grad(attend(*tensors), tensors)
    torch.manual_seed(3)
    loss = torch.utils.checkpoint.checkpoint(attend, *tensors, use_reentrant=False)
    recomputed = torch.autograd.grad(loss, tensors)
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.equal(a, b)


def test_tiny_t5_trains_and_generates_the_same_with_triton_attention(tiny_model_dir):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.loss import token_loss_sum
    from trainer.model.swaps import use_fused_t5_ops

    def load(use_triton: bool):
        # Loaded in fp32, then cast: in fp16 transformers keeps T5's `wo` in fp32 (mixed dtypes on CPU).
        model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
        model.to(DEVICE, DTYPE)
        use_fused_t5_ops(model)
        if use_triton:
            use_triton_attention(model)
        return model

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 7:], mask[1, 7:] = 0, 0
    labels = torch.randint(3, 100, (3, 9), generator=g)
    labels[2, 5:] = -100
    batch = {k: x.to(DEVICE) for k, x in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}
    results = {}
    for use_triton in (False, True):
        model = load(use_triton)
        model.eval()  # dropout off: the two must agree
        loss = token_loss_sum(model, batch)
        loss.backward()
        bias_grad = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad
        generated = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=6,
            do_sample=False,
        )
        results[use_triton] = (float(loss), bias_grad.float().clone(), generated)
    assert results[True][0] == pytest.approx(results[False][0], rel=2e-3)
    assert rel_err(results[True][1], results[False][1]) < 2e-2 * TOL
    assert torch.equal(results[True][2], results[False][2])

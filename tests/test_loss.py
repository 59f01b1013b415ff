"""The chunked LM-head cross-entropy (trainer.kernels.cross_entropy) against torch's cross_entropy: loss and
gradients."""

import pytest
import torch

from trainer.kernels.cross_entropy import LinearCrossEntropy, linear_cross_entropy


def _reference(hidden, weight, labels):
    logits = hidden.reshape(-1, hidden.size(-1)) @ weight.t()
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 11, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, 7:] = -100  # padding at a row's tail
    labels[2, :3] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _loss_and_grads(fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels)
    (loss * 0.5).backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk_tokens", [4, 7, 64])
def test_chunked_loss_and_gradients_equal_cross_entropy(chunk_tokens):
    hidden, weight, labels = _case()
    ours = _loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens), hidden, weight, labels
    )
    ref = _loss_and_grads(_reference, hidden, weight, labels)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
    assert float(ours[1][0, 7:].abs().sum()) == 0.0  # padding positions get no gradient


@pytest.mark.parametrize("chunk_tokens", [5, 64])
def test_rows_labelled_ignore_count_for_nothing_when_passed_in(chunk_tokens):
    """The path taken while a CUDA graph is captured: every row goes in, the -100 ones masked out."""
    hidden, weight, labels = _case(1)

    def all_rows(h, w, y):
        return LinearCrossEntropy.apply(h.reshape(-1, h.size(-1)), w, y.reshape(-1), chunk_tokens)

    ours = _loss_and_grads(all_rows, hidden, weight, labels)
    ref = _loss_and_grads(_reference, hidden, weight, labels)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
    assert float(ours[1][2, :3].abs().sum()) == 0.0


@pytest.mark.parametrize("vocab", [50, 64, 3])
def test_cross_entropy_kernel_equals_the_torch_ops(vocab, monkeypatch):
    """The GPU kernel (on CPU in Triton's interpreter) against the torch ops of the CPU path on the same bf16
    logits: row losses summed, and the gradient written over the logits, with vocabularies spanning several
    kernel blocks with a partial last one, whole blocks, one partial block; -100 rows count for nothing."""
    from trainer.kernels import cross_entropy as loss_mod
    from trainer.kernels import fused_ops

    monkeypatch.setattr(fused_ops, "CE_BLOCK", 16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(9, vocab, generator=g) * 4).to(device, torch.bfloat16)
    labels = torch.randint(0, vocab, (9,), generator=g).to(device)
    labels[[2, 6]] = -100
    expected_loss, expected_grad = loss_mod._chunk_loss(logits, labels, True, torch.float32)

    rows = logits.clone()
    losses = fused_ops.cross_entropy_rows_(rows, labels, grad=True)
    assert losses[[2, 6]].tolist() == [0.0, 0.0]
    torch.testing.assert_close(losses.sum(), expected_loss, rtol=1e-5, atol=1e-5)
    assert rows[[2, 6]].abs().sum() == 0
    # The gradient in bf16: the same rounding of (nearly) the same fp32 values, at most one bf16 step apart.
    torch.testing.assert_close(rows.float(), expected_grad.to(torch.bfloat16).float(), rtol=8e-3, atol=1e-6)
    assert (rows.float().sum(1)[labels != -100]).abs().max() < 0.05  # softmax minus one-hot sums to 0

    untouched = logits.clone()
    without_grad = fused_ops.cross_entropy_rows_(untouched, labels, grad=False)
    assert torch.equal(without_grad, losses) and torch.equal(untouched, logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_loss_and_gradients_on_the_gpu_equal_cross_entropy():
    """The GPU path (the cross-entropy kernel) on a bf16 model: loss and gradients as torch's cross_entropy
    over the same bf16 logits computes them, within bf16 rounding."""
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randn(2, 300, 64, generator=g) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
    weight = (torch.randn(5003, 64, generator=g) * 0.5).to("cuda", torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 5003, (2, 300), generator=g).cuda()
    labels[1, 250:] = -100
    ours = _loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, 128), hidden, weight, labels)

    def reference(h, w, y):
        logits = (h.reshape(-1, h.size(-1)) @ w.t()).float()
        return torch.nn.functional.cross_entropy(logits, y.reshape(-1), ignore_index=-100, reduction="sum")

    ref = _loss_and_grads(reference, hidden, weight, labels)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-3)
    for a, b in zip(ours[1:], ref[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)

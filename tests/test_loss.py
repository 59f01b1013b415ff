"""The chunked LM-head cross-entropy (trainer.loss) against torch's cross_entropy: loss and gradients."""

import pytest
import torch

from trainer.loss import _LinearCrossEntropy, linear_cross_entropy


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
        return _LinearCrossEntropy.apply(h.reshape(-1, h.size(-1)), w, y.reshape(-1), chunk_tokens)

    ours = _loss_and_grads(all_rows, hidden, weight, labels)
    ref = _loss_and_grads(_reference, hidden, weight, labels)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
    assert float(ours[1][2, :3].abs().sum()) == 0.0

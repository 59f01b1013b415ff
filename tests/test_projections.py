"""Projections that share an input (trainer.kernels.projections) inside a real T5: the same loss and gradients
as the plain model, with and without gradient checkpointing, the same state-dict keys, and no tensors left
behind."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from trainer.kernels.projections import (
    GroupedLinear,
    ProjectionGroup,
    accumulate_weight_grads_in_place,
    mark_rms_norm_output,
)
from trainer.model.loss import token_loss_sum
from trainer.model.swaps import use_projection_groups


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 11), generator=g)
    return dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.randint(3, 100, (3, 9), generator=g)
    )


def _train_without_dropout(model, checkpointing: bool):
    """Checkpointing needs training mode in transformers; dropout off, for comparisons."""
    if not checkpointing:
        return model
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        elif type(module).__name__ == "T5Attention":
            module.dropout = 0.0  # attention dropout: a float on the module
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _assert_same_gradients(plain, grouped):
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    grouped_grads = {n: p.grad for n, p in grouped.named_parameters()}
    assert plain_grads.keys() == grouped_grads.keys()
    for name, grad in plain_grads.items():  # fp32: the same sums in another order
        assert (grouped_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_grouped_projections_give_the_plain_models_loss_and_gradients(tiny_model_dir, checkpointing):
    plain, grouped = (AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir).eval() for _ in range(2))
    keys = list(plain.state_dict())
    blocks = len(plain.encoder.block) + len(plain.decoder.block)
    # self-attention q/k/v and o, feed-forward wi_0/wi_1 and wo per block; cross-attention q, k/v, o in the
    # decoder
    assert use_projection_groups(grouped) == 4 * blocks + 3 * len(plain.decoder.block)
    assert list(grouped.state_dict()) == keys
    losses = []
    for model in (plain, grouped):
        loss = token_loss_sum(_train_without_dropout(model, checkpointing), _batch())
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    _assert_same_gradients(plain, grouped)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_weight_gradients_accumulated_in_place_are_autograds_sums(tiny_model_dir, checkpointing):
    # Two micro-batches, as gradient accumulation runs them: the matmuls add into .grad where autograd adds
    # each product to it; the first creates it.
    plain, grouped = (AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir).eval() for _ in range(2))
    groups = use_projection_groups(grouped)
    assert accumulate_weight_grads_in_place(grouped) == groups
    second = {k: v.roll(1, dims=0) for k, v in _batch().items()}
    for model in (plain, grouped):
        _train_without_dropout(model, checkpointing)
        for batch in (_batch(), second):
            token_loss_sum(model, batch).backward()
    _assert_same_gradients(plain, grouped)


def test_projections_of_a_norms_output_keep_the_norms_input_and_make_the_output_again():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    norm_weight = (1 + 0.5 * torch.randn(16, generator=g)).requires_grad_()
    linears = [torch.nn.Linear(16, 8, bias=False) for _ in range(3)]

    def run(marked: bool):
        group = ProjectionGroup()
        members = [GroupedLinear(linear, group) for linear in linears]
        normed = torch.nn.functional.rms_norm(x, (16,), norm_weight, 1e-6)
        if marked:
            mark_rms_norm_output(normed, x, norm_weight, 1e-6)
        outs = [member(normed) for member in members]
        kept = [t.data_ptr() for t in outs[0].grad_fn.saved_tensors]
        loss = sum((out * (i + 1)).square().sum() for i, out in enumerate(outs))
        grads = torch.autograd.grad(loss, [x, norm_weight, *(linear.weight for linear in linears)])
        return kept, normed.data_ptr(), grads

    kept, normed, plain = run(marked=False)
    assert normed in kept
    kept, normed, marked = run(marked=True)
    assert normed not in kept and x.data_ptr() in kept  # the norm's input, which the norm keeps anyway
    for want, got in zip(plain, marked, strict=True):
        assert torch.equal(got, want)  # the same output made again: the same gradients, to the bit


def test_no_projection_output_is_held_after_the_forward_and_evaluation_is_the_plain_linear(tiny_model_dir):
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    use_projection_groups(model)
    token_loss_sum(model, _batch()).backward()
    groups = {id(m._group): m._group for m in model.modules() if isinstance(m, GroupedLinear)}
    assert groups and not any(group._pending for group in groups.values())
    linear = model.encoder.block[0].layer[0].SelfAttention.k
    x = torch.randn(2, 5, linear.in_features)
    with torch.no_grad():
        assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight))

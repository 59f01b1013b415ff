"""Projections that share an input (trainer.projections) inside a real T5: the same loss and gradients as the
plain model, with and without gradient checkpointing, the same state-dict keys, and no tensors left behind."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from trainer.projections import SharedInputLinear, use_shared_input_projections
from trainer.step import token_loss_sum


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 11), generator=g)
    return dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.randint(3, 100, (3, 9), generator=g)
    )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_grouped_projections_give_the_plain_models_loss_and_gradients(tiny_model_dir, checkpointing):
    plain, grouped = (AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir).eval() for _ in range(2))
    keys = list(plain.state_dict())
    blocks = len(plain.encoder.block) + len(plain.decoder.block)
    # self-attention q/k/v and feed-forward wi_0/wi_1 per block, cross-attention k/v per decoder block
    assert use_shared_input_projections(grouped) == 2 * blocks + len(plain.decoder.block)
    assert list(grouped.state_dict()) == keys
    results = []
    for model in (plain, grouped):
        if checkpointing:
            model.train()  # transformers checkpoints in training mode only; dropout off for the comparison
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
                elif type(module).__name__ == "T5Attention":
                    module.dropout = 0.0  # attention dropout: a float on the module
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = token_loss_sum(model, _batch())
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (grouped_loss, grouped_grads) = results
    assert grouped_loss == pytest.approx(plain_loss, rel=1e-6)
    assert plain_grads.keys() == grouped_grads.keys()
    for name, grad in plain_grads.items():  # fp32: the same sums in another order
        assert (grouped_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_no_projection_output_is_held_after_the_forward_and_evaluation_is_the_plain_linear(tiny_model_dir):
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    use_shared_input_projections(model)
    token_loss_sum(model, _batch()).backward()
    groups = {id(m._group): m._group for m in model.modules() if isinstance(m, SharedInputLinear)}
    assert groups and not any(group._pending for group in groups.values())
    linear = model.encoder.block[0].layer[0].SelfAttention.k
    x = torch.randn(2, 5, linear.in_features)
    with torch.no_grad():
        assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight))

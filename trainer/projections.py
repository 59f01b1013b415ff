"""Projections that share an input, with the input's gradient accumulated in the matmuls.

T5 calls its projections of one tensor one after the other: an attention's q, k and v (a cross-attention's
k and v, on the encoder's output), a gated feed-forward's wi_0 and wi_1. Autograd then sums their input
gradients with separate bf16 additions: a full read of two (tokens x d_model) tensors and a write per
projection after the first. Here the group's backward writes the first product and accumulates the others
into it in the matmul itself (addmm_, beta = 1). Pure torch: the same on every device.
"""

from __future__ import annotations

import weakref

import torch


class _SharedInputLinears(torch.autograd.Function):
    """x W_i^T for bias-free projections of one input x. The backward accumulates x's gradient in the matmuls
    (one mm, then addmm_ into it), where autograd would sum separate products with bf16 additions."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        return tuple(torch.nn.functional.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        flat_x = x.reshape(-1, x.size(-1))
        grad_x, grad_weights = None, []
        for grad, weight, needed in zip(grads, weights, ctx.needs_input_grad[1:], strict=True):
            if grad is None:
                grad_weights.append(None)
                continue
            flat = grad.reshape(-1, grad.size(-1))
            if ctx.needs_input_grad[0]:
                grad_x = flat.mm(weight) if grad_x is None else grad_x.addmm_(flat, weight)
            grad_weights.append(flat.t().mm(flat_x) if needed else None)
        return (None if grad_x is None else grad_x.view_as(x)), *grad_weights


class SharedInputGroup:
    """Projections that T5 calls one after the other on the same tensor (q, k and v; a cross-attention's k
    and v; wi_0 and wi_1). The first call computes all of them in one _SharedInputLinears; the others take
    their output from it. Weights are read from the member modules at each call (FSDP swaps them)."""

    def __init__(self):
        self.members: list[SharedInputLinear] = []
        self._source: weakref.ref | None = None
        self._version = -1
        self._pending: dict[int, torch.Tensor] = {}

    @torch.compiler.disable  # Python state between calls: run as it is inside a compiled block
    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        fresh = self._source is not None and self._source() is x and x._version == self._version
        if not (fresh and index in self._pending):
            outputs = _SharedInputLinears.apply(x, *(m.weight for m in self.members))
            self._pending = dict(enumerate(outputs))
            self._source, self._version = weakref.ref(x), x._version
        return self._pending.pop(index)


class SharedInputLinear(torch.nn.Module):
    """A bias-free nn.Linear in a SharedInputGroup, with the same `weight` Parameter (state-dict keys
    unchanged). Without gradients (evaluation, generation) it is the plain linear."""

    def __init__(self, linear: torch.nn.Linear, group: SharedInputGroup):
        super().__init__()
        self.weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._group, self._index = group, len(group.members)
        group.members.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.weight)
        return self._group.output(self._index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, shared input"


def use_shared_input_projections(model: torch.nn.Module) -> int:
    """Group the projections that share an input in each T5 block of `model` (self-attention's q, k, v; the
    cross-attention's k and v, on the encoder's output; the gated feed-forward's wi_0 and wi_1) in
    SharedInputGroups; returns the number of groups."""
    shared = []
    for module in model.modules():
        if hasattr(module, "SelfAttention"):  # T5LayerSelfAttention, or its fused version
            shared.append((module.SelfAttention, ("q", "k", "v")))
        if hasattr(module, "EncDecAttention"):
            shared.append((module.EncDecAttention, ("k", "v")))
        if hasattr(module, "wi_0") and hasattr(module, "wi_1"):
            shared.append((module, ("wi_0", "wi_1")))
    groups = 0
    for module, names in shared:
        linears = [getattr(module, name) for name in names]
        if all(type(linear) is torch.nn.Linear and linear.bias is None for linear in linears):
            group = SharedInputGroup()
            for name, linear in zip(names, linears, strict=True):
                setattr(module, name, SharedInputLinear(linear, group))
            groups += 1
    return groups

"""T5's bias-free projections, grouped by input, with a backward that spends fewer bytes than autograd's.

T5 calls its projections of one tensor one after the other: an attention's q, k and v (a cross-attention's
q on the decoder's normed states, its k and v on the encoder's output), a gated feed-forward's wi_0 and wi_1;
an attention's o alone. Each group runs as one autograd function (_Projections), whose backward:
- accumulates the input's gradient in the matmuls (one mm, then addmm_ into it, beta = 1), where autograd
  would sum separate products with bf16 additions (a full read of two tokens x d_model tensors and a write);
- makes a layer norm's output again from the norm's input when the input is one (`mark_rms_norm_output`,
  which trainer.fused_ops' sublayers call): the group keeps the norm's input, which the norm keeps anyway,
  instead of a second tokens x d_model tensor per sublayer, and one RMSNorm kernel makes it again;
- with `accumulate_weight_grads_in_place` (one process: DDP and FSDP hook autograd's accumulation), adds
  each weight's gradient into its `.grad` in the matmul itself, where autograd would write the product and
  add it to `.grad` (with gradient accumulation or a CUDA graph's gradients kept in place, every
  micro-step: a read of two weight-sized tensors and a write).
Pure torch: the same on every device.
"""

from __future__ import annotations

import weakref

import torch

RMS_NORM_OUTPUT = "_rms_norm_of"  # attribute of a layer norm's output: (its input, weight, eps)


def mark_rms_norm_output(normed: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Say that `normed` is `rms_norm(x, weight, eps)`: projections of it keep x and make it again in their
    backward instead of keeping it."""
    setattr(normed, RMS_NORM_OUTPUT, (x, weight, eps))


def weight_gradient(
    grad: torch.Tensor, x: torch.Tensor, parameter: torch.nn.Parameter | None = None
) -> torch.Tensor | None:
    """The gradient grad^T x of a linear layer's weight (grad, x: 2-D); with `parameter` (the weight itself,
    as the module holds it: a checkpoint's recompute hands the backward detached copies), added into its
    `.grad` by the matmul (made there when None) and None returned, so autograd adds nothing."""
    if parameter is None:
        return grad.t().mm(x)
    if parameter.grad is None:
        parameter.grad = grad.t().mm(x)
    else:
        parameter.grad.addmm_(grad.t(), x)
    return None


class _Projections(torch.autograd.Function):
    """x W_i^T for bias-free projections of one input x (see the module's docstring for the backward)."""

    @staticmethod
    def forward(ctx, x, weight_grads_in_place, *weights):
        norm = getattr(x, RMS_NORM_OUTPUT, None)
        if norm is not None:  # keep the norm's input, make its output again in the backward
            source, norm_weight, ctx.eps = norm
            ctx.save_for_backward(source, norm_weight, *weights)
        else:
            ctx.eps = None
            ctx.save_for_backward(x, *weights)
        ctx.parameters = weights if weight_grads_in_place else (None,) * len(weights)
        return tuple(torch.nn.functional.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.eps is not None:
            source, norm_weight, *weights = ctx.saved_tensors
            x = torch.nn.functional.rms_norm(source, (source.size(-1),), norm_weight, ctx.eps)
        else:
            x, *weights = ctx.saved_tensors
        flat_x = x.reshape(-1, x.size(-1))
        grad_x, grad_weights = None, []
        needs = ctx.needs_input_grad[2:]
        for grad, weight, parameter, needed in zip(grads, weights, ctx.parameters, needs, strict=True):
            if grad is None:
                grad_weights.append(None)
                continue
            flat = grad.reshape(-1, grad.size(-1))
            if ctx.needs_input_grad[0]:
                grad_x = flat.mm(weight) if grad_x is None else grad_x.addmm_(flat, weight)
            grad_weights.append(weight_gradient(flat, flat_x, parameter) if needed else None)
        return (None if grad_x is None else grad_x.view_as(x)), None, *grad_weights


class ProjectionGroup:
    """Projections that T5 calls one after the other on the same tensor (q, k and v; a cross-attention's k
    and v; wi_0 and wi_1), or one alone (o). The first call computes all of them in one _Projections; the
    others take their output from it. Weights are read from the member modules at each call (FSDP swaps
    them)."""

    def __init__(self):
        self.members: list[GroupedLinear] = []
        self.weight_grads_in_place = False
        self._source: weakref.ref | None = None
        self._version = -1
        self._pending: dict[int, torch.Tensor] = {}

    @torch.compiler.disable  # Python state between calls: run as it is inside a compiled block
    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        fresh = self._source is not None and self._source() is x and x._version == self._version
        if not (fresh and index in self._pending):
            weights = (m.weight for m in self.members)
            outputs = _Projections.apply(x, self.weight_grads_in_place, *weights)
            self._pending = dict(enumerate(outputs))
            self._source, self._version = weakref.ref(x), x._version
        return self._pending.pop(index)


class GroupedLinear(torch.nn.Module):
    """A bias-free nn.Linear in a ProjectionGroup, with the same `weight` Parameter (state-dict keys
    unchanged). Without gradients (evaluation, generation) it is the plain linear."""

    def __init__(self, linear: torch.nn.Linear, group: ProjectionGroup):
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
        shared = (
            f", shared input with {len(self._group.members) - 1} more" if len(self._group.members) > 1 else ""
        )
        return f"in_features={self.in_features}, out_features={self.out_features}{shared}"


def use_projection_groups(model: torch.nn.Module) -> int:
    """Put each T5 block's projections of `model` in ProjectionGroups (self-attention's q, k, v and its o;
    the cross-attention's q, its k and v, and its o; the gated feed-forward's wi_0 and wi_1); returns the
    number of groups. A gated feed-forward whose wo trainer.fused_ops runs is left to it."""
    groups_of = []
    for module in model.modules():
        if hasattr(module, "SelfAttention"):  # T5LayerSelfAttention, or its fused version
            groups_of += [(module.SelfAttention, ("q", "k", "v")), (module.SelfAttention, ("o",))]
        if hasattr(module, "EncDecAttention"):
            attention = module.EncDecAttention
            groups_of += [(attention, ("q",)), (attention, ("k", "v")), (attention, ("o",))]
        if hasattr(module, "wi_0") and hasattr(module, "wi_1"):
            groups_of.append((module, ("wi_0", "wi_1")))
    groups = 0
    for module, names in groups_of:
        linears = [getattr(module, name) for name in names]
        if all(type(linear) is torch.nn.Linear and linear.bias is None for linear in linears):
            group = ProjectionGroup()
            for name, linear in zip(names, linears, strict=True):
                setattr(module, name, GroupedLinear(linear, group))
            groups += 1
    return groups


def accumulate_weight_grads_in_place(model: torch.nn.Module) -> int:
    """Let `model`'s projection groups (and trainer.fused_ops' feed-forward output projections) add their
    weights' gradients into `.grad` in the matmuls. Only for one process: DDP and FSDP act on autograd's
    gradient accumulation, which then never runs for these weights. Returns the number of modules switched."""
    switched = 0
    for module in model.modules():
        group = module._group if isinstance(module, GroupedLinear) else module
        if hasattr(group, "weight_grads_in_place") and not group.weight_grads_in_place:
            group.weight_grads_in_place = True
            switched += 1
    return switched

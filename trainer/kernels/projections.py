"""T5's bias-free projections, grouped by input, with a backward that spends fewer bytes than autograd's.

T5 calls its projections of one tensor one after the other: an attention's q, k and v (a cross-attention's
q on the decoder's normed states, its k and v on the encoder's output), a gated feed-forward's wi_0 and wi_1;
an attention's o alone. Each group runs as one autograd function (_Projections), whose backward:
- accumulates the input's gradient in the matmuls (one mm, then addmm_ into it, beta = 1), where autograd
  would sum separate products with bf16 additions (a full read of two tokens x d_model tensors and a write);
- makes a layer norm's output again from the norm's input when the input is one (`mark_rms_norm_output`,
  which trainer.kernels.fused_ops' sublayers call): the group keeps the norm's input, which the norm keeps
  anyway, instead of a second tokens x d_model tensor per sublayer, and one RMSNorm kernel makes it again;
- with `accumulate_weight_grads_in_place` (not under FSDP, which hooks autograd's accumulation), adds
  each weight's gradient into its `.grad` in the matmul itself, where autograd would write the product and
  add it to `.grad` (with gradient accumulation or a CUDA graph's gradients kept in place, every
  micro-step: a read of two weight-sized tensors and a write).
A frozen weight (LoRA's base, trainer.model.lora) gets no gradient matmul at all. A member may carry a
low-rank update (`LowRank`, LoRA's adapter), computed inside the group's function: the members'
down-projections as one matmul of the shared input, their small products kept for the backward
(`low_rank_forward`, `low_rank_input_grad`, `low_rank_down_grads`; trainer.kernels.fused_ops' fused output
projection uses them too). Pure torch: the same on every device.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

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


class LowRank(NamedTuple):
    """A low-rank update of a bias-free projection y = x W^T (LoRA's adapter, trainer.model.lora): y +=
    scaling x' a^T b^T, x' = dropout(x, dropout_p); a (r, in) and b (out, r) in any float dtype (the adapter's
    own: fp32 over a bf16 base), multiplied in x's dtype (as autocast does), their gradients returned in
    theirs."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout_p: float


def low_rank_forward(
    x: torch.Tensor, outputs: list[torch.Tensor], updates: list[LowRank]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Add each update's term to its output, in place: outputs[i] += scaling_i x' a_i^T b_i^T (x: (n, in),
    outputs (n, out_i), 2-D). The down-projections of all updates are one matmul, u = x' [a_1; a_2; ...]^T
    (n, sum of ranks), which the backward needs (with the dropout's mask) and the caller keeps: returns (u,
    the mask or None). The updates share one dropout draw (one p: one LoRA config)."""
    p = updates[0].dropout_p
    keep = None
    if p > 0:
        keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
        x = x * keep / (1.0 - p)
    u = x.mm(torch.cat([up.a for up in updates]).to(x.dtype).t())
    start = 0
    for out, up in zip(outputs, updates, strict=True):
        rank = up.a.size(0)
        out.addmm_(u[:, start : start + rank], up.b.to(x.dtype).t(), alpha=up.scaling)
        start += rank
    return u, keep


def low_rank_input_grad(
    grads: list[torch.Tensor | None],
    updates: list[LowRank],
    u: torch.Tensor,
    keep: torch.Tensor | None,
    grad_x: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The backward of `low_rank_forward` up to the down-projections: v = (scaling_i grad_i b_i)_i (n, sum of
    ranks), the up-projections' gradients (scaling_i grad_i^T u_i, None where grads[i] is None), and, into
    `grad_x` (n, in) when given, the input's gradient v [a_1; a_2; ...] (through the dropout's mask)."""
    parts, grad_bs = [], []
    start = 0
    for grad, up in zip(grads, updates, strict=True):
        rank = up.a.size(0)
        if grad is None:
            parts.append(u.new_zeros(u.size(0), rank))
            grad_bs.append(None)
        else:
            parts.append(grad.mm(up.b.to(grad.dtype)).mul_(up.scaling))
            grad_bs.append((grad.t().mm(u[:, start : start + rank]) * up.scaling).to(up.b.dtype))
        start += rank
    v = torch.cat(parts, dim=1)
    if grad_x is not None:
        a = torch.cat([up.a for up in updates]).to(v.dtype)
        if keep is None:
            grad_x.addmm_(v, a)
        else:
            grad_x.add_(v.mm(a).mul_(keep), alpha=1.0 / (1.0 - updates[0].dropout_p))
    return v, grad_bs


def low_rank_down_grads(
    v: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None, updates: list[LowRank]
) -> list[torch.Tensor]:
    """The down-projections' gradients v_i^T x' (x: the forward's input, (n, in); `keep`: its dropout
    mask)."""
    if keep is not None:
        x = x * keep / (1.0 - updates[0].dropout_p)
    grad_a = v.t().mm(x)
    ranks = [up.a.size(0) for up in updates]
    return [g.to(up.a.dtype) for g, up in zip(grad_a.split(ranks), updates, strict=True)]


class _Projections(torch.autograd.Function):
    """x W_i^T (+ the members' low-rank updates) for bias-free projections of one input x (see the module's
    docstring for the backward). `scalings`: per member its update's scaling, None without one; `tensors`: the
    weights, then (a, b) of each update."""

    @staticmethod
    def forward(ctx, x, weight_grads_in_place, scalings, dropout_p, *tensors):
        weights = tensors[: len(scalings)]
        pairs = tensors[len(scalings) :]
        updates = _updates(pairs, scalings, dropout_p)
        outputs = tuple(torch.nn.functional.linear(x, w) for w in weights)
        low_rank = ()
        if updates:
            flat = [outputs[i].view(-1, outputs[i].size(-1)) for i, s in enumerate(scalings) if s is not None]
            u, keep = low_rank_forward(x.reshape(-1, x.size(-1)), flat, updates)
            low_rank = (u, keep)
        norm = getattr(x, RMS_NORM_OUTPUT, None)
        if norm is not None:  # keep the norm's input, make its output again in the backward
            source, norm_weight, ctx.eps = norm
            ctx.save_for_backward(source, norm_weight, *tensors, *low_rank)
        else:
            ctx.eps = None
            ctx.save_for_backward(x, *tensors, *low_rank)
        ctx.parameters = weights if weight_grads_in_place else (None,) * len(weights)
        ctx.scalings, ctx.dropout_p = scalings, dropout_p
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.eps is not None:
            source, norm_weight, *saved = ctx.saved_tensors
            x = torch.nn.functional.rms_norm(source, (source.size(-1),), norm_weight, ctx.eps)
        else:
            x, *saved = ctx.saved_tensors
        k = len(ctx.scalings)
        pairs_end = k + 2 * sum(s is not None for s in ctx.scalings)
        weights, pairs = saved[:k], saved[k:pairs_end]
        flat_x = x.reshape(-1, x.size(-1))
        grad_x, grad_weights = None, []
        needs = ctx.needs_input_grad[4 : 4 + k]
        for grad, weight, parameter, needed in zip(grads, weights, ctx.parameters, needs, strict=True):
            if grad is None:
                grad_weights.append(None)
                continue
            flat = grad.reshape(-1, grad.size(-1))
            if ctx.needs_input_grad[0]:
                grad_x = flat.mm(weight) if grad_x is None else grad_x.addmm_(flat, weight)
            grad_weights.append(weight_gradient(flat, flat_x, parameter) if needed else None)
        grad_pairs: list[torch.Tensor | None] = []
        if pairs:
            u, keep = saved[pairs_end], saved[pairs_end + 1]
            updates = _updates(pairs, ctx.scalings, ctx.dropout_p)
            adapted = [
                None if g is None else g.reshape(-1, g.size(-1))
                for g, s in zip(grads, ctx.scalings, strict=True)
                if s is not None
            ]
            if grad_x is None and ctx.needs_input_grad[0]:
                grad_x = flat_x.new_zeros(flat_x.shape)
            v, grad_bs = low_rank_input_grad(adapted, updates, u, keep, grad_x)
            grad_as = low_rank_down_grads(v, flat_x, keep, updates)
            grad_pairs = [g for pair in zip(grad_as, grad_bs, strict=True) for g in pair]
        grad_x = None if grad_x is None else grad_x.view_as(x)
        return grad_x, None, None, None, *grad_weights, *grad_pairs


def _updates(pairs: tuple, scalings: tuple, dropout_p: float) -> list[LowRank]:
    """The LowRank updates of the members with one (`scalings` not None), from their (a, b) `pairs`."""
    given = [s for s in scalings if s is not None]
    return [LowRank(a, b, s, dropout_p) for a, b, s in zip(pairs[::2], pairs[1::2], given, strict=True)]


class ProjectionGroup:
    """Projections that T5 calls one after the other on the same tensor (q, k and v; a cross-attention's k
    and v; wi_0 and wi_1), or one alone (o). The first call computes all of them in one _Projections; the
    others take their output from it. Weights are read from the member modules at each call (FSDP swaps
    them)."""

    def __init__(self):
        self.members: list[GroupedLinear] = []
        # Per member: what gives its low-rank update at call time (trainer.model.lora: its LoRA layer's
        # adapter, None while disabled or merged), or None.
        self.low_rank: list[Callable[[], LowRank | None] | None] = []
        self.weight_grads_in_place = False
        self._source: weakref.ref | None = None
        self._version = -1
        self._pending: dict[int, torch.Tensor] = {}

    @torch.compiler.disable  # Python state between calls: run as it is inside a compiled block
    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        fresh = self._source is not None and self._source() is x and x._version == self._version
        if not (fresh and index in self._pending):
            weights = [m.weight for m in self.members]
            updates = [None if f is None else f() for f in self.low_rank]
            scalings = tuple(None if up is None else up.scaling for up in updates)
            given = [up for up in updates if up is not None]
            dropout_p = given[0].dropout_p if given else 0.0
            pairs = [t for up in given for t in (up.a, up.b)]
            outputs = _Projections.apply(x, self.weight_grads_in_place, scalings, dropout_p, *weights, *pairs)
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
        group.low_rank.append(None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.weight)
        return self._group.output(self._index, x)

    def extra_repr(self) -> str:
        shared = (
            f", shared input with {len(self._group.members) - 1} more" if len(self._group.members) > 1 else ""
        )
        return f"in_features={self.in_features}, out_features={self.out_features}{shared}"


def accumulate_weight_grads_in_place(model: torch.nn.Module) -> int:
    """Let `model`'s projection groups (and trainer.kernels.fused_ops' feed-forward output projections) add
    their weights' gradients into `.grad` in the matmuls. Not under FSDP: it acts on autograd's gradient
    accumulation, which then never runs for these weights. Returns the number of modules switched."""
    switched = 0
    for module in model.modules():
        group = module._group if isinstance(module, GroupedLinear) else module
        if hasattr(group, "weight_grads_in_place") and not group.weight_grads_in_place:
            group.weight_grads_in_place = True
            switched += 1
    return switched

"""The modules of a loaded FLAN-T5 swapped for faster ones that compute the same: fused norms and GELUs,
grouped projections (trainer.kernels.projections), and on a GPU the Triton kernels' attention, feed-forward
and sublayers (trainer.model.fused_t5)."""

from __future__ import annotations

import logging

import torch

from trainer.kernels.projections import GroupedLinear, ProjectionGroup
from trainer.model.model_shape import transformers_major, transformers_version

log = logging.getLogger(__name__)


def use_projection_groups(model: torch.nn.Module) -> int:
    """Put each T5 block's projections of `model` in ProjectionGroups (self-attention's q, k, v and its o;
    the cross-attention's q, its k and v, and its o; the feed-forward's wi_0 and wi_1 (or wi), and its wo);
    returns the number of groups. A gated feed-forward whose wo the fused function runs
    (trainer.model.fused_t5.FusedGatedGelu, with its `wo_low_rank`) keeps that wo."""
    groups_of = []
    for module in model.modules():
        if hasattr(module, "SelfAttention"):  # T5LayerSelfAttention, or its fused version
            groups_of += [(module.SelfAttention, ("q", "k", "v")), (module.SelfAttention, ("o",))]
        if hasattr(module, "EncDecAttention"):
            attention = module.EncDecAttention
            groups_of += [(attention, ("q",)), (attention, ("k", "v")), (attention, ("o",))]
        if hasattr(module, "wi_0") and hasattr(module, "wi_1"):
            groups_of.append((module, ("wi_0", "wi_1")))
        if hasattr(module, "wi"):  # a feed-forward without the gate
            groups_of.append((module, ("wi",)))
        if hasattr(module, "wo") and not hasattr(module, "wo_low_rank"):
            groups_of.append((module, ("wo",)))
    groups = 0
    for module, names in groups_of:
        linears = [getattr(module, name) for name in names]
        if all(type(linear) is torch.nn.Linear and linear.bias is None for linear in linears):
            group = ProjectionGroup()
            for name, linear in zip(names, linears, strict=True):
                setattr(module, name, GroupedLinear(linear, group))
            groups += 1
    return groups


def use_triton_attention_where_it_runs(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> None:
    """The Triton attention kernels (trainer.kernels.packed_attention, through trainer.model.fused_t5) where
    they run: CUDA, 16-bit dtype, transformers >= 5."""
    try:
        # Triton ships with torch's Linux CUDA wheels, not everywhere: imported only here, where it is used.
        from trainer.kernels.packed_attention import supported
        from trainer.model.fused_t5 import use_triton_attention
    except ImportError as e:
        log.info("attention: triton kernels not used (%s); eager attention instead", e)
        return
    if device.type != "cuda":  # the documented default off a GPU: eager attention, nothing to say
        return
    why = None
    if not supported(model.config.d_kv, dtype):
        why = f"head size {model.config.d_kv} in {dtype} is not supported"
    elif transformers_major() < 5:
        why = f"transformers {transformers_version()} has no attention interface (needs >= 5)"
    if why:
        log.info("attention: triton kernels not used (%s); eager attention instead", why)
        return
    use_triton_attention(model)


def use_fused_t5_ops(model: torch.nn.Module) -> tuple[int, int, int, int, int]:
    """Swap T5's Python-written layer norm and GELU for fused kernels; returns the counts (norms, GELUs,
    gated feed-forwards, sublayers with a fused residual dropout, projection groups).

    T5LayerNorm (RMS norm, fp32 statistics) is ~7 elementwise kernels and gelu_new
    (0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))) ~8, each a full pass over B x T x d_ff in forward and more
    in backward: at FLAN-T5-XL size they take about as long as the matmuls. `nn.RMSNorm` (same weight
    Parameter, so state-dict keys and checkpoints are unchanged) and `nn.GELU(approximate="tanh")` compute the
    same functions in one kernel each; results differ only in bf16 rounding (RMSNorm rounds once, at the end).
    On CUDA, the gated feed-forward's GELU, product and dropout become one Triton kernel each way, and so do
    each sublayer's output dropout and residual sum (trainer.model.fused_t5); elsewhere they stay torch
    ops. Projections run in groups by input (trainer.kernels.projections), everywhere.
    """
    gated = residual = 0
    if next(model.parameters()).is_cuda:
        # Triton: imported where a GPU runs it (torch's wheels for other platforms come without it)
        from trainer.model.fused_t5 import use_fused_gated_gelu, use_fused_residual_dropout

        gated = use_fused_gated_gelu(model)
        residual = use_fused_residual_dropout(model)
    norms = gelus = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind.endswith("LayerNorm") and hasattr(child, "variance_epsilon"):
                fused = torch.nn.RMSNorm(child.weight.shape, eps=child.variance_epsilon)
                fused.weight = child.weight
                setattr(parent, name, fused)
                norms += 1
            elif kind == "NewGELUActivation":
                setattr(parent, name, torch.nn.GELU(approximate="tanh"))
                gelus += 1
    return norms, gelus, gated, residual, use_projection_groups(model)

"""FLAN-T5's modules running on trainer.kernels: T5 attention through transformers' attention interface onto
the Triton attention kernels (trainer.kernels.packed_attention), the gated feed-forward as one fused
function, and the sublayers' output dropout and residual sum as one kernel. Each swapped module holds the
original submodules under the same names, so state-dict keys and checkpoints are unchanged.

Needs Triton (torch's Linux wheels bring it): trainer.model.swaps imports this module only where the
kernels run."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.kernels.fused_ops import gated_gelu_linear, norm_and_residual, residual_dropout
from trainer.kernels.packed_attention import PackedAttentionLayout, packed_attention
from trainer.kernels.projections import LowRank
from trainer.model.model_shape import transformers_major

NAME = "triton"  # the attn_implementation name this module registers with transformers


@torch.compiler.disable  # a compiled block calls the kernels as they are (graph break around attention)
def transformers_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_bias=None, **kwargs
):
    """transformers' attention-interface signature, as T5Attention calls it (transformers >= 5). The trainer's
    own forwards (training and evaluation losses: trainer.model.packed_t5; the decoding engine's encoder)
    pass an attention layout as the position bias: the Triton kernels. Calls from transformers' own code
    (Hugging Face's `generate` for the settings only it has, e.g. beam search, with its cache) bring T5's
    dense bias: SDPA, with the bias and the padding as its additive mask."""
    if isinstance(position_bias, PackedAttentionLayout):
        return transformers_packed_attention(module, query, key, value, position_bias, dropout, scaling)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"expected a (batch, keys) padding mask, got shape {tuple(attention_mask.shape)}")
    q_len, k_len = query.size(2), key.size(2)
    mask = torch.zeros((1, 1, q_len, k_len), dtype=query.dtype, device=query.device)
    if position_bias is not None:  # (1, H, T, S); zeros for T5's cross-attention
        mask = mask + position_bias.to(query.dtype)
    lowest = torch.finfo(query.dtype).min
    if attention_mask is not None:
        mask = mask.masked_fill(~attention_mask.bool()[:, None, None, :], lowest)
    # The mask is padding only (key_padding_mask): causality is added here. With a cache the queries are the
    # newest positions and may see every cached key.
    if getattr(module, "is_causal", False) and q_len == k_len:
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).triu(1)
        mask = mask.masked_fill(future, lowest)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=1.0 if scaling is None else scaling
    )
    return out.transpose(1, 2), None


def key_padding_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    **kwargs,
):
    """transformers' mask hook: the 2D padding mask as it is (causality is the kernel's `causal` flag), as for
    flash attention, but without its `.all()` check, which would synchronise with the GPU on every call."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def use_triton_attention(model: torch.nn.Module) -> None:
    """Route `model`'s T5 attention (transformers >= 5) through these kernels; weights, masks unchanged.

    The caller checks `supported` and the device: the kernels need a GPU (or TRITON_INTERPRET=1 on CPU).
    """
    # transformers >= 5 only (the caller checks): imported here so that this module loads under 4.x too
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, transformers_attention)
    AttentionMaskInterface.register(NAME, key_padding_mask)
    # The encoder and decoder stacks hold their own copies of the config.
    for sub in (model, getattr(model, "encoder", None), getattr(model, "decoder", None)):
        if sub is not None:
            sub.config._attn_implementation = NAME


def transformers_packed_attention(module, query, key, value, layout: PackedAttentionLayout, dropout, scaling):
    """transformers' T5Attention calling in with an attention layout as its position bias
    (`transformers_attention` dispatches here). The first block of a stack holds the bias table and hands it
    to the layout."""
    if scaling not in (None, 1.0):
        raise ValueError(f"packed T5 attention takes no score scaling, got {scaling}")
    if layout.position_bias is not None and getattr(module, "has_relative_attention_bias", False):
        layout.use_bias_table(module.relative_attention_bias.weight)
    return packed_attention(query, key, value, layout, dropout_p=dropout), None


class FusedGatedGelu(torch.nn.Module):
    """T5DenseGatedActDense with gelu_new (FLAN-T5, T5 v1.1): wo(dropout(gelu_tanh(wi_0 x) * wi_1 x)), the
    GELU, product, dropout and wo as one autograd function (gated_gelu_linear).

    Holds the original wi_0, wi_1 and wo Linear modules under the same names, so state-dict keys and
    checkpoints are unchanged. A LoRA layer in wo's place (trainer.model.lora) is read through `wo_low_rank`.
    """

    def __init__(self, dense: torch.nn.Module):
        super().__init__()
        self.wi_0, self.wi_1, self.wo = dense.wi_0, dense.wi_1, dense.wo
        self.dropout_p = dense.dropout.p
        self.weight_grads_in_place = False  # trainer.kernels.projections.accumulate_weight_grads_in_place
        # What gives wo's low-rank update at call time (trainer.model.lora: its LoRA layer's adapter), or
        # None.
        self.wo_low_rank: Callable[[], LowRank | None] | None = None
        self.train(dense.training)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        a, b = self.wi_0(hidden_states), self.wi_1(hidden_states)
        p = self.dropout_p if self.training else 0.0
        update = self.wo_low_rank() if self.wo_low_rank is not None else None
        return gated_gelu_linear(a, b, self.wo.weight, p, self.weight_grads_in_place, update)


def use_fused_gated_gelu(model: torch.nn.Module) -> int:
    """Swap each gated-GELU (gelu_new) T5 feed-forward of `model` for FusedGatedGelu; returns the count.

    The caller checks the device: the kernels need a GPU (or TRITON_INTERPRET=1 on CPU).
    """
    swapped = 0
    for parent in list(model.modules()):
        dense = getattr(parent, "DenseReluDense", None)
        if type(dense).__name__ == "T5DenseGatedActDense" and _is_gelu_tanh(dense.act):
            parent.DenseReluDense = FusedGatedGelu(dense)
            swapped += 1
    return swapped


class FusedT5LayerFF(torch.nn.Module):
    """T5LayerFF, x + dropout(DenseReluDense(layer_norm(x))), with the dropout and the sum as one kernel
    (residual_dropout). Holds the original submodules under the same names (state-dict keys unchanged)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.DenseReluDense, self.layer_norm = layer.DenseReluDense, layer.layer_norm
        self.dropout = layer.dropout
        self.train(layer.training)

    def forward(self, hidden_states):
        normed, residual = norm_and_residual(hidden_states, self.layer_norm)
        return residual_dropout(residual, self.DenseReluDense(normed), _train_p(self.dropout))


class FusedT5LayerSelfAttention(torch.nn.Module):
    """T5LayerSelfAttention (transformers 5) with the output dropout and the residual sum as one kernel."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.SelfAttention, self.layer_norm = layer.SelfAttention, layer.layer_norm
        self.dropout = layer.dropout
        self.train(layer.training)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, past_key_values=None, **kwargs):
        normed, residual = norm_and_residual(hidden_states, self.layer_norm)
        out, position_bias, weights = self.SelfAttention(
            normed,
            mask=attention_mask,
            position_bias=position_bias,
            past_key_values=past_key_values,
            **kwargs,
        )
        return residual_dropout(residual, out, _train_p(self.dropout)), position_bias, weights


class FusedT5LayerCrossAttention(torch.nn.Module):
    """T5LayerCrossAttention (transformers 5) with the output dropout and the residual sum as one kernel."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.EncDecAttention, self.layer_norm = layer.EncDecAttention, layer.layer_norm
        self.dropout = layer.dropout
        self.train(layer.training)

    def forward(
        self,
        hidden_states,
        key_value_states,
        attention_mask=None,
        position_bias=None,
        past_key_values=None,
        **kwargs,
    ):
        normed, residual = norm_and_residual(hidden_states, self.layer_norm)
        out, position_bias, weights = self.EncDecAttention(
            normed,
            mask=attention_mask,
            key_value_states=key_value_states,
            position_bias=position_bias,
            past_key_values=past_key_values,
            **kwargs,
        )
        return residual_dropout(residual, out, _train_p(self.dropout)), position_bias, weights


def _train_p(dropout: torch.nn.Dropout) -> float:
    return dropout.p if dropout.training else 0.0


def use_fused_residual_dropout(model: torch.nn.Module) -> int:
    """Swap T5's sublayers (feed-forward; with transformers >= 5, whose sublayer signatures these follow,
    self- and cross-attention) for versions whose output dropout and residual sum are one kernel each way;
    returns the count. The caller checks the device: the kernels need a GPU (or TRITON_INTERPRET=1 on CPU)."""
    fused = {"T5LayerFF": FusedT5LayerFF}
    if transformers_major() >= 5:
        fused.update(
            T5LayerSelfAttention=FusedT5LayerSelfAttention, T5LayerCrossAttention=FusedT5LayerCrossAttention
        )
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in fused:
                setattr(parent, name, fused[type(child).__name__](child))
                swapped += 1
    return swapped


def _is_gelu_tanh(act: torch.nn.Module) -> bool:
    """gelu_new, or torch's GELU(tanh) that trainer.model.swaps.use_fused_t5_ops puts in its place."""
    if type(act).__name__ == "NewGELUActivation":
        return True
    return isinstance(act, torch.nn.GELU) and act.approximate == "tanh"

"""FLAN-T5's training loss over packed rows: several records per row, no padding between them.

The batch (the loader's packed micro-batch, a dict of int64 tensors) has, besides `input_ids`,
`attention_mask` and `labels`:
- `encoder_segment_ids` (R, Ls) and `decoder_segment_ids` (R, Lt): record k of a row is segment k (1, 2, ...)
  in both rows, contiguous and increasing left to right; 0 marks the padding at a row's tail;
- `encoder_positions`, `decoder_positions`: each token's position inside its record (0, 1, 2, ...).

`packed_loss_sum` runs the HF model's own parameters and modules, block by block: the embedding, each
`T5Block` (its gradient checkpointing, the fused sublayers of trainer.kernels.fused_ops, FSDP's hooks on it as
they are), the final norms and the LM head through trainer.model.loss's chunked cross-entropy. Only attention
changes: a query attends the keys of its own record (and, in the decoder, not the later ones), and T5's
relative position of a pair is j - i, which inside one contiguous record is its position difference in the
record alone. So the loss is the sum over records of each one's loss computed alone.

Two ways to attend:
- with the Triton attention in use (`attn_implementation: triton`): each block receives, as its
  `position_bias`, a `PackedAttentionLayout` (trainer.kernels.packed_attention): segment-masked Triton kernels
  with the relative bias computed inside them; no (T, S) tensor anywhere;
- otherwise (CPU, eager or SDPA attention): T5's own attention with dense additive (R, 1, T, S) masks built
  from the segment ids; T5's first block computes its usual dense bias from j - i.
"""

from __future__ import annotations

import torch

from trainer.kernels.cross_entropy import linear_cross_entropy
from trainer.model.model_shape import scales_decoder_outputs, transformers_major, transformers_version


def segment_mask(query_segments: torch.Tensor, key_segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """(R, T, S) bool: query i may attend key j (same nonzero segment; j <= i when causal)."""
    allowed = (query_segments[:, :, None] == key_segments[:, None, :]) & (query_segments[:, :, None] != 0)
    if causal:
        t, s = query_segments.size(1), key_segments.size(1)
        allowed &= torch.ones(t, s, dtype=torch.bool, device=allowed.device).tril()
    return allowed


def decoder_input_ids(
    labels: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor, start_id: int, pad_id: int
) -> torch.Tensor:
    """T5's `_shift_right` per record: each record's labels shifted right by one, its first position
    `start_id`; padding (segment 0) and any -100 label become `pad_id`."""
    shifted = labels.roll(1, dims=1)
    ids = torch.where(positions == 0, start_id, shifted)
    return torch.where((segments == 0) | (ids == -100), pad_id, ids)


def one_record_per_row(attention_mask: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A padded batch as packed rows of one record each: encoder segment ids (the right-padded prompts' mask),
    decoder segment ids (1 up to each row's last label, 0 in the -100 tail) and decoder positions. Its
    `packed_loss_sum` is the padded batch's loss: T5's decoder attends no padding before a row's last label
    either."""
    real = (labels != -100).int()
    decoder_segment_ids = real.flip(1).cummax(1).values.flip(1)
    positions = torch.arange(labels.size(1), device=labels.device).expand_as(labels)
    return attention_mask.int(), decoder_segment_ids, positions


def encoder_hidden_states(encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The T5 encoder stack's last hidden states for right-padded prompts, through the Triton attention's
    layouts (each row one record): what `encoder(input_ids, attention_mask).last_hidden_state` gives."""
    from trainer.kernels.packed_attention import PackedAttentionLayout, RelativeBias

    config = encoder.config
    segments = attention_mask.int()
    bias = RelativeBias(
        bidirectional=True,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )
    layout = PackedAttentionLayout.build(segments, segments, causal=False, position_bias=bias)
    return _run_stack(encoder, input_ids, None, layout)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (R, T, S) bool mask as T5's eager attention adds it: (R, 1, T, S), 0 or the dtype's minimum."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )[:, None]


def _run_stack(stack, input_ids, mask, bias, encoder_hidden=None, cross_mask=None, cross_bias=None):
    """T5Stack.forward for training, block by block (the blocks' own calls: checkpointing and hooks)."""
    hidden = stack.dropout(stack.embed_tokens(input_ids))
    for block in stack.block:
        # transformers 5: (hidden, self-attention bias, cross-attention bias); the first block computes or
        # (packed kernels) fills in the biases, the later ones reuse them.
        hidden, bias, cross_bias = block(hidden, mask, bias, encoder_hidden, cross_mask, cross_bias)[:3]
    return stack.dropout(stack.final_layer_norm(hidden))


def packed_loss_sum(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    encoder_segment_ids: torch.Tensor,
    decoder_segment_ids: torch.Tensor,
    decoder_positions: torch.Tensor,
) -> torch.Tensor:
    """Sum of target-token cross-entropies (fp32) of a packed batch for a T5 `model`
    (T5ForConditionalGeneration, transformers >= 5)."""
    if transformers_major() < 5:
        raise RuntimeError(f"packed batches need transformers >= 5, this is {transformers_version()}")
    config = model.config
    dec_ids = decoder_input_ids(
        labels, decoder_segment_ids, decoder_positions, config.decoder_start_token_id, config.pad_token_id
    )
    # trainer.model.fused_t5.NAME, without Triton
    if model.encoder.config._attn_implementation == "triton":
        # Triton: imported where the kernels run (torch's wheels for other platforms come without it)
        from trainer.kernels.packed_attention import PackedAttentionLayout, RelativeBias

        relative = dict(num_buckets=config.relative_attention_num_buckets)
        relative["max_distance"] = config.relative_attention_max_distance
        enc, dec = encoder_segment_ids, decoder_segment_ids
        encoder_bias = PackedAttentionLayout.build(
            enc, enc, causal=False, position_bias=RelativeBias(bidirectional=True, **relative)
        )
        decoder_bias = PackedAttentionLayout.build(
            dec, dec, causal=True, position_bias=RelativeBias(bidirectional=False, **relative)
        )
        cross_bias = PackedAttentionLayout.build(dec, enc, causal=False)
        encoder_mask = decoder_mask = cross_mask = None
    else:
        dtype = model.encoder.embed_tokens.weight.dtype
        encoder_mask = _additive(segment_mask(encoder_segment_ids, encoder_segment_ids, False), dtype)
        decoder_mask = _additive(segment_mask(decoder_segment_ids, decoder_segment_ids, True), dtype)
        cross_mask = _additive(segment_mask(decoder_segment_ids, encoder_segment_ids, False), dtype)
        encoder_bias = decoder_bias = cross_bias = None
    encoder_hidden = _run_stack(model.encoder, input_ids, encoder_mask, encoder_bias)
    decoder_hidden = _run_stack(
        model.decoder, dec_ids, decoder_mask, decoder_bias, encoder_hidden, cross_mask, cross_bias
    )
    if scales_decoder_outputs(config):
        decoder_hidden = decoder_hidden * (config.d_model**-0.5)
    return linear_cross_entropy(decoder_hidden, model.get_output_embeddings().weight, labels)


def reference_attention(q, k, v, query_segments, key_segments, *, causal, bias=None, dropped=None, p=0.0):
    """What the kernels compute, in plain torch (in q's dtype; use fp32/fp64 copies): q, k, v as for
    `packed_attention`, bias (H, T, S) or None, `dropped` (R, H, T, S) marks the probabilities dropout
    removed. A query with no key (padding) gets 0."""
    allowed = segment_mask(query_segments, key_segments, causal)[:, None]  # (R, 1, T, S)
    s = q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias[None]
    s = s.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(s.softmax(-1), nan=0.0)  # a row of -inf only: 0, as the kernels give
    if dropped is not None:
        probs = probs.masked_fill(dropped, 0.0) / (1 - p)
    return (probs @ v).transpose(1, 2)

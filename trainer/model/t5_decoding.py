"""T5's decoder one token at a time over preallocated caches: the model side of the decoding engine
(trainer.eval.decoding).

Hugging Face's `generate` runs the decoder through its stack of modules with a cache object that grows and
masks made each step; every kernel of every step is launched from Python. Here the step is the same
arithmetic written for fixed shapes: each row feeds one token at its own position, writes that token's
keys and values into its slot of a static cache, and attends over its valid prefix
(trainer.kernels.decode_attention), so the whole step can be captured once as a CUDA graph and replayed.

The step calls the model's own submodules for everything but attention (its norms, projections,
feed-forward and head, whatever trainer.model.swaps or LoRA made of them), so it computes what the
model computes: only the attention and the cache are this module's.
"""

from __future__ import annotations

import torch

from trainer.kernels.projections import GroupedLinear
from trainer.model.packed_t5 import encoder_hidden_states

PACKED_QKV = "trainer_packed_qkv"  # a self-attention's q, k and v weights as one (3 x inner, d_model) tensor


def t5_of(model: torch.nn.Module) -> torch.nn.Module:
    """The T5ForConditionalGeneration inside `model` (itself, or PEFT's model around it)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for candidate in (inner, getattr(inner, "model", None)):
        if candidate is not None and hasattr(candidate, "decoder") and hasattr(candidate, "lm_head"):
            return candidate
    raise TypeError(f"{type(model).__name__} is not a T5 encoder-decoder with a language-model head")


def supports_static_decoding(model: torch.nn.Module) -> str | None:
    """None when `decoding_parts` can run `model`; else why not, in a few words."""
    try:
        t5 = t5_of(model)
    except TypeError as e:
        return str(e)
    blocks = list(getattr(t5.decoder, "block", []))
    if not blocks:
        return "the model has no decoder blocks"
    first = blocks[0].layer[0]
    if not hasattr(first, "SelfAttention") or not hasattr(first.SelfAttention, "relative_attention_bias"):
        return "the decoder's first block has no relative position bias (not T5's layout)"
    if any(len(block.layer) != 3 for block in blocks):
        return "a decoder block is not self-attention, cross-attention, feed-forward"
    return None


def decode_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    bias: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """trainer.kernels.decode_attention's attention in torch (the CPU's, and the kernel's reference): `new`
    written into the caches at each row's position lengths - 1, then scores in fp32 as T5's eager attention
    makes them (matmul, + bias, softmax in fp32), the value product in the caches' dtype."""
    rows = q.size(0)
    if new is not None:
        index = torch.arange(rows, device=q.device)
        at = lengths.long() - 1
        k[index, :, at] = new[0]
        v[index, :, at] = new[1]
    k, v = k[:rows], v[:rows]
    positions = torch.arange(k.size(2), device=q.device)
    valid = positions[None, :] < lengths[:, None].to(positions.dtype)  # (B, L)
    scores = torch.matmul(q.unsqueeze(2), k.transpose(-1, -2)).squeeze(2).float()  # (B, H, L)
    if bias is not None:
        distance = (lengths[:, None].to(positions.dtype) - 1 - positions[None, :]).clamp(min=0)  # (B, L)
        scores = scores + bias[:, distance].permute(1, 0, 2).float()
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(v.dtype)
    return torch.matmul(probs.unsqueeze(2), v).squeeze(2)


def pack_self_attention(model: torch.nn.Module) -> int:
    """Put each decoder self-attention's q, k and v weights in one tensor, the Parameters views of it (the
    state dict, its keys and values unchanged), so that a decoding step makes the three projections in one
    matmul: at 72 rows on an H200 three 2048 x 2048 matmuls read their weights at a third of the GPU's
    bandwidth, one of three times the width at more (bench/decode_kernels.py --profile). For a model that
    only generates (trainer.eval.generate.load_for_generation): training replaces Parameters. Plain
    bias-free projections only (a LoRA layer keeps its own). Returns how many were packed."""
    packed = 0
    for block in t5_of(model).decoder.block:
        attention = block.layer[0].SelfAttention
        linears = [attention.q, attention.k, attention.v]
        if not all(
            type(m) in (torch.nn.Linear, GroupedLinear) and getattr(m, "bias", None) is None for m in linears
        ):
            continue
        with torch.no_grad():
            weights = torch.cat([m.weight for m in linears])
        rows = linears[0].weight.size(0)
        for i, linear in enumerate(linears):
            linear.weight = torch.nn.Parameter(weights[i * rows : (i + 1) * rows], requires_grad=False)
        setattr(attention, PACKED_QKV, weights)
        packed += 1
    return packed


def packed_qkv(attention: torch.nn.Module) -> torch.Tensor | None:
    """`pack_self_attention`'s tensor of `attention`, while its q, k and v weights are still views of it."""
    weights = getattr(attention, PACKED_QKV, None)
    if weights is None:
        return None
    rows = weights.size(0) // 3
    linears = (attention.q, attention.k, attention.v)
    if all(getattr(m, "weight", None) is not None for m in linears) and all(
        m.weight.data_ptr() == weights[i * rows].data_ptr() for i, m in enumerate(linears)
    ):
        return weights
    return None


class T5DecodingParts:
    """The modules a decoding step calls, and the shapes of the caches it needs.

    `step` is graph-safe: no host synchronisation, no allocation that depends on values, every shape fixed
    by its inputs' shapes."""

    def __init__(self, model: torch.nn.Module):
        t5 = t5_of(model)
        config = t5.config
        self.encoder = t5.encoder
        self.embed = t5.decoder.embed_tokens
        self.blocks = list(t5.decoder.block)
        self.final_norm = t5.decoder.final_layer_norm
        self.lm_head = t5.lm_head
        # transformers >= 5.2x names it scale_decoder_outputs; earlier, a tied head implied it
        scaled = getattr(config, "scale_decoder_outputs", config.tie_word_embeddings)
        self.output_scale = config.d_model**-0.5 if scaled else None
        self.heads, self.head_dim, self.d_model = config.num_heads, config.d_kv, config.d_model
        self.layers = len(self.blocks)
        self.vocab_size = self.lm_head.out_features
        first = self.blocks[0].layer[0].SelfAttention
        self._bias_source = first
        self.packed = [packed_qkv(block.layer[0].SelfAttention) for block in self.blocks]
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.attention = decode_attention_reference
        if self.device.type == "cuda":  # Triton: imported where a GPU runs it
            from trainer.kernels.decode_attention import decode_attention

            self.attention = decode_attention

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes in one of the two caches: layers x keys and values x heads x size."""
        return self.layers * 2 * self.heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def distance_bias(self, length: int) -> torch.Tensor:
        """The self-attention's position bias by distance, (heads, length): column d is the bias of a key d
        positions before the query, from the model's own bucket function and table (as
        T5Attention.compute_bias makes it for a decoder)."""
        attention = self._bias_source
        distance = torch.arange(length, device=self.device)
        buckets = attention._relative_position_bucket(
            -distance,  # memory position - query position
            bidirectional=False,
            num_buckets=attention.relative_attention_num_buckets,
            max_distance=attention.relative_attention_max_distance,
        )
        return attention.relative_attention_bias(buckets).t().contiguous()  # (heads, length)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states (B, S, d_model) of right-padded prompts."""
        if self.encoder.config._attn_implementation == "triton":  # trainer.model.fused_t5.NAME
            return encoder_hidden_states(self.encoder, input_ids, attention_mask)
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def cross_keys_values(self, hidden: torch.Tensor):
        """Per decoder layer, the cross-attention's keys and values of the encoder's output, each (B, H, S,
        D): computed once per prompt."""
        rows, length = hidden.shape[:2]
        for block in self.blocks:
            attention = block.layer[1].EncDecAttention
            k = attention.k(hidden).view(rows, length, self.heads, self.head_dim).transpose(1, 2)
            v = attention.v(hidden).view(rows, length, self.heads, self.head_dim).transpose(1, 2)
            yield k, v

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        self_keys: torch.Tensor,
        self_values: torch.Tensor,
        cross_keys: torch.Tensor,
        cross_values: torch.Tensor,
        source_lengths: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 logits (B, vocab) of the token after `tokens` (B,), each fed at its row's position
        `positions` (B,): writes the tokens' keys and values into `self_keys`/`self_values` (layers, >= B,
        H, L, D) at those positions, attends over each row's positions 0..position, and over the first
        `source_lengths` (B,) positions of `cross_keys`/`cross_values` (layers, >= B, H, S, D). `bias`:
        `distance_bias(L)`."""
        rows = tokens.size(0)
        lengths = (positions + 1).to(torch.int32)
        shape = (rows, self.heads, self.head_dim)
        x = self.embed(tokens).unsqueeze(1)  # (B, 1, d_model), as the modules see a one-token sequence
        for layer, block in enumerate(self.blocks):
            self_layer, cross_layer, ff_layer = block.layer
            attention = self_layer.SelfAttention
            h = self_layer.layer_norm(x)
            if self.packed[layer] is not None:
                qkv = torch.nn.functional.linear(h, self.packed[layer]).view(rows, 3, *shape[1:])
                q, k, v = qkv.unbind(1)
            else:
                q, k, v = (attention.q(h).view(shape), attention.k(h).view(shape), attention.v(h).view(shape))
            out = self.attention(q, self_keys[layer], self_values[layer], lengths, bias, (k, v))
            x = x + attention.o(out.view(rows, 1, -1))
            attention = cross_layer.EncDecAttention
            q = attention.q(cross_layer.layer_norm(x)).view(shape)
            out = self.attention(q, cross_keys[layer], cross_values[layer], source_lengths)
            x = x + attention.o(out.view(rows, 1, -1))
            x = x + ff_layer.DenseReluDense(ff_layer.layer_norm(x))
        x = self.final_norm(x)
        if self.output_scale is not None:
            x = x * self.output_scale
        return self.lm_head(x).view(rows, -1).float()

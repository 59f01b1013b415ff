"""Predict the peak GPU memory of a training step, by component, before anything is loaded.

The model is a T5 encoder-decoder (FLAN-T5) trained with bf16 weights and gradients, gradient checkpointing
(non-reentrant) on every T5 block, and AdamW (optimi, Kahan-compensated) or Adafactor. Every term below names
the tensor it counts, following `transformers.models.t5.modeling_t5` (eager attention, T5LayerNorm, gelu_new)
and PyTorch's autograd rules for which tensors an op saves for backward.

The step's peak is the largest of these moments (weights, gradients and optimizer states are alive at all of
them: gradients persist across accumulated micro-batches and optimizer states across steps):
- end of forward / start of backward: every checkpointed block input, the tensors saved outside the blocks
  (final layer norms, dropout masks, LM head input), the logits, the loss's log-softmax and their gradients;
- backward of one decoder block: the block is recomputed, so all its saved tensors exist at once, plus the
  gradients of its widest op; the encoder's checkpoints and the gradient flowing into the encoder output are
  still alive; likewise for an encoder block (all decoder checkpoints are freed by then);
- the optimizer step: optimizer temporaries (optimi's foreach step reuses the gradients as scratch: none).
Allocator slack (blocks the caching allocator holds but cannot reuse) is one fraction of the rest.

With LoRA (`adapter: lora`, trainer.model.lora; `lora`, a LoraShape): the weights are the frozen base in its
dtype plus the fp32 adapters; gradients and optimizer states are the adapters' alone; the blocks keep each
adapted group's small down-projection (tokens x rank, and with lora_dropout its input's mask); no gradient of
the LM head, the embeddings or the position biases is made (no head-gradient accumulator in the loss, no bias
gradients in the attention's backward).

`plan_run` turns a config into the run's RunPlan: the token budget and the number of decoder blocks left
un-checkpointed, where the config leaves them to the plan. `trainer plan` prints a plan
(trainer.plan.plan_report).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from trainer.infra.memory import GIB
from trainer.kernels.cross_entropy import CHUNK_TOKENS as CE_CHUNK_TOKENS
from trainer.model.model_shape import LoraShape, ModelShape, load_shape
from trainer.optim import OPTIMIZERS, kahan_buffer_bytes

logger = logging.getLogger(__name__)

# Caching-allocator fragmentation as a fraction of the predicted allocated peak. With
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True freed blocks are remapped rather than split, and the
# gradients are one buffer made before the first activation (trainer.infra.distributed.GradientBuffer): the
# reserved peak was 0.1 GiB above the allocated one for the rtx5090 preset (packed rows, CUDA graphs; one GPU
# and ddp on two) and 0.2 GiB for padded 32k-token micro-batches, both under 1% (`python3 bench/multi_gpu.py`
# on H100s at 32 GiB). 2% covers that with room for batch shapes not measured.
ALLOCATOR_SLACK = 0.02
# A budget is accepted only if its predicted peak (slack included) stays under this share of the card, because
# the data loader's longest rows and the allocator's worst moment vary from step to step.
SAFETY_MARGIN = 0.92
# Typical recipe lengths in tokens (medians): source ~96, target ~256.
TYPICAL_SOURCE, TYPICAL_TARGET = 96, 256


@dataclass
class MemoryPlan:
    """Predicted peak bytes by component; `peak` is the sum (slack included)."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int  # at the peak moment, logits excluded
    logits: int  # logits, log-softmax and their gradients when the peak is at the loss
    optimizer_temp: int  # step scratch, when the optimizer step is the peak moment (then activations are 0)
    allocator_slack: int
    peak_moment: str  # "loss", "decoder block backward", "encoder block backward" or "optimizer step"

    @property
    def allocated(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.logits
            + self.optimizer_temp
        )

    @property
    def peak(self) -> int:
        return self.allocated + self.allocator_slack

    def components(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer states": self.optimizer_states,
            "activations": self.activations,
            "logits + loss": self.logits,
            "optimizer step scratch": self.optimizer_temp,
            "allocator slack": self.allocator_slack,
        }


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def optimizer_state_bytes(
    shape: ModelShape,
    optimizer: str,
    bf16_update: str,
    dtype: str = "bfloat16",
    lora: LoraShape | None = None,
    shards: int = 1,
) -> int:
    """Bytes of optimizer state for the whole model, or for `lora`'s fp32 adapters, or on one of `shards`
    FSDP ranks: the optimizer's own states (trainer.optim: each declares them) and, for 16-bit weights with
    Kahan-compensated updates, one compensation buffer per weight (in its dtype, or 8-bit codes), sharded
    like the weights."""
    spec, e = OPTIMIZERS[optimizer], _DTYPE_BYTES[dtype]
    states = spec.state_bytes(shape, e, lora, shards)
    if lora is None:
        states += shape.sharded_params(shards) * kahan_buffer_bytes(spec, e, bf16_update)
    return states


def _acc_bytes(e: int) -> int:
    """Bytes of the loss's accumulation dtype: fp32, or fp64 for a float64 model."""
    return max(4, e)


def _layer_norm_saved(n: int, d: int, e: int, fused: bool = True, weight_grad: bool = True) -> int:
    """`nn.RMSNorm` (the trainer's T5 layer norm) on n tokens, beyond its input (the residual stream, counted
    where it is made): the rsqrt (fp32, per token) and the output (saved by the following linear layers).
    fused: CUDA's fused kernel; without it (CPU) the composite saves two fp32 n x d tensors as well, one of
    them (the normalised input the weight multiplies) only for the weight's gradient (`weight_grad`: not
    for LoRA's frozen norms)."""
    return n * 4 + n * d * e + (0 if fused else (2 if weight_grad else 1) * n * d * 4)


def _sublayer_norm_saved(n: int, d: int, e: int, fused: bool = True, weight_grad: bool = True) -> int:
    """A sublayer's layer norm on n tokens, beyond its input. On CUDA
    (trainer.kernels.fused_ops.norm_and_residual) it keeps only its input, and the projections of its output
    keep that input too and make the output again in their backward (trainer.kernels.projections): nothing
    more. Elsewhere: `_layer_norm_saved`."""
    return 0 if fused else _layer_norm_saved(n, d, e, fused=False, weight_grad=weight_grad)


def _lora_groups(groups, lora: LoraShape | None, e: int) -> tuple[int, int]:
    """(saved bytes, extra bytes at the backward's widest moment) of a sublayer's adapted projection groups
    (trainer.kernels.projections.low_rank_forward), given as (tokens, input width, projection names): each
    keeps its down-projection u (tokens x the adapted members' summed rank), with lora dropout its input's
    mask (bool); its backward adds v (u's shape) and, with dropout, the input dropped again and v's product
    through the mask (two tokens x width tensors); the widest group's counts."""
    saved = widest = 0
    for tokens, width, names in groups if lora is not None else ():
        rank = lora.r * sum(name in lora.targets for name in names)
        if rank:
            dropout = tokens * width if lora.dropout > 0 else 0
            saved += tokens * rank * e + dropout
            widest = max(widest, tokens * rank * e + 2 * dropout * e)
    return saved, widest


def _attention_sublayer(
    b,
    q_len,
    kv_len,
    shape,
    e,
    mask,
    *,
    attention="eager",
    bias_rows=None,
    fused=True,
    cross=False,
    lora=None,
):
    """(saved bytes, bytes alive at its backward's widest moment) of a T5 attention sublayer; `cross`: the
    decoder's cross-attention (q of the decoder's tokens, k and v of the encoder's); `lora`: its adapters
    (`_lora_groups`), with a frozen position bias (no gradient for it).

    Eager (transformers' eager_attention_forward) saves: the layer norm; bmm-ready copies of q (b x q_len) and
    of k, v (b x kv_len; for cross-attention computed from the encoder output); the softmax output, dropout
    mask and dropout output (B x H x q x k); the contiguous attention output (saved by the o projection); the
    output dropout's mask; the residual sum (saved by the next layer norm's multiply). Its widest backward
    moment is the dropout backward on the scores: the softmax output, the mask, the gradients of the dropout
    output and of the softmax output, with the layer norm, q and k still saved, and the gradient of v.

    SDPA (memory-efficient kernel with T5's bias as a float mask) saves q, k, v (the projections' outputs),
    the bias mask `torch.where(padding, position_bias, min)` (bias_rows x H x q x k: B rows when a padding
    mask exists), its output and log-sum-exp (fp32), and the contiguous output; in backward the bias gradient
    and the `where`'s gradient for the position bias (both B x H x q x k) and the q/k/v gradients. Not
    checked on CPU (with dropout the CPU runs the math path): the GPU calibration decides.

    Triton (trainer.kernels.packed_attention, padded rows as one record each) saves q, k, v, its output (B x T
    x H x D) and the log-sum-exp (fp32, B x H x T); the position bias comes from T5's small table inside the
    kernels (nothing of q x k); in backward the q/k/v grads and the fp32 row terms rowsum(dO * O) (B x H x q,
    one kernel).
    """
    d, inner, h, p = shape.d_model, shape.inner, shape.num_heads, shape.dropout_rate
    n, m = b * q_len, b * kv_len
    scores = b * h * q_len * kv_len
    drop = mask if p > 0 else 0
    if cross:
        projections = [(n, d, ("q",)), (m, d, ("k", "v")), (n, inner, ("o",))]
    else:
        projections = [(n, d, ("q", "k", "v")), (n, inner, ("o",))]
    adapters, adapters_widest = _lora_groups(projections, lora, e)
    ln = _sublayer_norm_saved(n, d, e, fused, weight_grad=lora is None)
    qkv = n * inner * e + 2 * m * inner * e
    # o's input (with Triton the kernels' (B, T, H, D) output, saved by them too: o reads it as a view, so it
    # is counted once, below), the output dropout's mask (none with Triton: trainer.kernels.fused_ops fuses it
    # with the residual sum), the residual sum
    tail = (0 if attention == "triton" else n * inner * e + n * d * drop) + n * d * e
    if attention == "triton":
        lse = b * h * q_len * 4
        saved = ln + qkv + n * inner * e + lse + tail + adapters
        # + the norm's output, made again for the projections' backward
        return saved, saved + qkv + lse + n * d * e + adapters_widest
    if attention == "sdpa":
        bias = (b if bias_rows is None else bias_rows) * h * q_len * kv_len * e
        lse = b * h * (-(-q_len // 32) * 32) * 4
        saved = ln + qkv + bias + n * inner * e + lse + tail + adapters
        # grad of the bias and the where's gradient for the position bias, both B x H x q x k; q/k/v grads.
        bias_grads = 2 * scores * e if lora is None else 0
        widest = saved - tail + bias_grads + qkv + adapters_widest
        return saved, widest
    probs = scores * (e + drop + (e if p > 0 else 0))  # softmax out, dropout mask, dropout out
    saved = ln + qkv + probs + tail + adapters
    widest = ln + n * inner * e + m * inner * e + scores * (3 * e + drop) + m * inner * e
    return saved, widest + adapters + adapters_widest


def _ff_sublayer(n, shape, e, mask, fused=True, lora=None):
    """(saved bytes, widest backward moment) of the T5 feed-forward sublayer on n tokens; `lora`: its
    adapters (`_lora_groups`).

    Saved: the layer norm; wi_0's output (saved by the fused GELU(tanh)), the gelu output and wi_1's output
    (saved by their product), the product's dropout mask and output (saved by wo); wo's output dropout mask
    and the residual sum. Widest backward moment: the product's backward, with the n x d_ff tensors it and
    gelu saved, the product's gradient and the two gradients it makes.
    """
    d, f, p = shape.d_model, shape.d_ff, shape.dropout_rate
    nf = n * f
    drop = mask if p > 0 else 0
    projections = [(n, d, ("wi_0", "wi_1") if shape.gated else ("wi",)), (n, f, ("wo",))]
    adapters, adapters_widest = _lora_groups(projections, lora, e)
    # On CUDA the output dropout and the residual sum are one kernel (trainer.kernels.fused_ops): no mask
    # kept.
    residual = n * d * e + (0 if fused else n * d * drop)
    if fused and shape.gated:
        # trainer.kernels.fused_ops on CUDA (gated_gelu_linear): wi_0's and wi_1's outputs kept, the product
        # not (the backward's kernel makes it again for wo's weight gradient; dropout drawn again, no mask).
        # Widest: that kernel, with a, b, the product's gradient (becoming a's), b's gradient and the product.
        saved = _sublayer_norm_saved(n, d, e, fused, lora is None) + 2 * nf * e + residual + adapters
        return saved, 5 * nf * e + adapters + adapters_widest
    ln = _layer_norm_saved(n, d, e, fused, weight_grad=lora is None)
    acts = (1 + (2 if shape.gated else 0)) * nf * e  # wi_0 .. wi_1 outputs
    dropped = nf * (drop + e) if p > 0 else (nf * e if shape.gated else 0)  # wo's input (or its dropout)
    saved = ln + acts + dropped + residual + adapters
    widest = ln + acts + (3 if shape.gated else 2) * nf * e + adapters
    return saved, max(widest, saved + nf * e) + adapters_widest


def _block_saved(
    shape: ModelShape,
    b: int,
    length: int,
    e: int,
    cross_len: int | None,
    mask: int = 1,
    attention: str = "eager",
    fused: bool = True,
    packed: bool = False,
    lora: LoraShape | None = None,
) -> tuple[int, int]:
    """(saved bytes, backward peak bytes) of one recomputed T5 block on b rows of `length` tokens.

    The recompute saves every sublayer's tensors; the backward then walks the sublayers in reverse, freeing
    each one's saved tensors, so the peak is the largest (saved by earlier sublayers + this sublayer's widest
    moment). Excludes the block input (a checkpoint) and tensors shared across blocks (position bias, masks,
    encoder output). cross_len: source length for a decoder block (adds cross-attention), None for encoder.
    packed: packed rows (see plan_memory). lora: the adapters (see plan_memory).
    """
    n = b * length
    # SDPA's decoder self-attention has no padding mask (causal only): its bias mask is 1 x H x T x T; packed
    # rows mask each row's records apart: R x H x T x T.
    self_rows = 1 if (attention == "sdpa" and cross_len is not None and not packed) else None
    subs = [
        _attention_sublayer(
            b,
            length,
            length,
            shape,
            e,
            mask,
            attention=attention,
            bias_rows=self_rows,
            fused=fused,
            lora=lora,
        )
    ]
    if cross_len is not None:  # T5's cross-attention has no position bias (the Triton kernels skip its zeros)
        subs.append(
            _attention_sublayer(
                b,
                length,
                cross_len,
                shape,
                e,
                mask,
                attention=attention,
                fused=fused,
                cross=True,
                lora=lora,
            )
        )
    subs.append(_ff_sublayer(n, shape, e, mask, fused, lora))
    total = sum(saved for saved, _ in subs)
    peak, before = 0, 0
    for saved, widest in subs:
        peak = max(peak, before + widest)
        before += saved
    return total, peak


def _loss_bytes(n_rows: int, d: int, v: int, e: int, fused: bool, head_grad: bool = True) -> int:
    """Peak bytes of the chunked cross-entropy (trainer.model.loss) on N = `n_rows` target rows, chunks of C
    rows: the gathered rows (N x d) and their int64 indices, the hidden-state gradient (N x d, kept for
    backward) and the head's fp32 gradient accumulator (V x d); per chunk the logits (C x V), which the GPU's
    kernel overwrites with their gradient, and the head-gradient product in bf16 and fp32 (V x d). Torch's ops
    (`fused` false: on CPU) first make an fp32 copy of the logits beside them. A frozen head (`head_grad`
    false: LoRA) has no accumulator and no product."""
    chunk = min(n_rows, CE_CHUNK_TOKENS)
    head = v * d if head_grad else 0
    kept = n_rows * 8 + n_rows * d * e * 2 + head * _acc_bytes(e)
    per_chunk = chunk * v * e + head * (e + _acc_bytes(e))
    return kept + (per_chunk if fused else max(chunk * v * (4 + e), per_chunk))


def plan_memory(
    shape: ModelShape,
    *,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    bf16_update: str = "kahan",
    gradient_checkpointing: bool = True,
    rows: int,
    src_len: int,
    tgt_len: int,
    device: str = "cuda",
    attn_implementation: str = "eager",
    decoder_blocks_without_checkpointing: int = 0,
    encoder_blocks_without_checkpointing: int = 0,
    packed: bool = False,
    lora: LoraShape | None = None,
    strategy: str = "ddp",
    processes: int = 1,
    fsdp_reshard_after_forward: bool = True,
    fsdp_sync_each_micro_batch: bool = True,
) -> MemoryPlan:
    """Predicted peak of the trainer's training step (trainer.model.loss.Seq2SeqLMLoss over the model with
    trainer.model.swaps.use_fused_t5_ops) on `rows` rows padded to src_len source and tgt_len target tokens,
    on one GPU of a run of `processes`.

    device: "cuda" keeps dropout masks as bool (fused dropout) and runs RMSNorm as one kernel; elsewhere
    dropout saves a mask in the compute dtype (`input * noise`) and RMSNorm is a composite, which is how the
    CPU tests check these formulas.
    attn_implementation: "eager" (checked term by term on CPU), "sdpa" (memory-efficient kernel) or "triton"
    (trainer.kernels.packed_attention); the last two are calibrated on the GPU (bench/train_throughput.py).
    decoder_blocks_without_checkpointing, encoder_blocks_without_checkpointing: with checkpointing, the last
    k blocks of a stack keep everything they save from the forward to their backward (which comes first in
    the stack's backward), instead of recomputing it.
    packed: packed rows (trainer.model.packed_t5; R rows of src_len/tgt_len holding several records, every
    position a real token but a row's tail). With eager or SDPA attention the blocks get dense (R, 1, T, S)
    segment masks in place of the padding masks: the same terms (SDPA's decoder mask then has R rows). With
    the Triton kernels no (T, S) tensor exists at all: the kernels compute T5's relative bias from the segment
    layout (trainer.kernels.packed_attention), so the bias copies, the shared biases and their gradients are
    gone. With `cuda_graphs` the same: the captured update reuses the captured micro-step's memory pool
    (trainer.run.cuda_graphs).
    lora: LoRA adapters over the frozen base (trainer.model.lora; the module docstring says what changes).
    strategy, processes: `ddp` is one process's plan on every GPU (its gradients are summed in place; NCCL's
    own buffers live outside PyTorch's allocator, in the card's margin); `fsdp` over several processes is
    `sharded_state` below, the activations as in one process (bf16 compute). (LoRA trains without fsdp.)
    """
    e = _DTYPE_BYTES[dtype]
    b, s, t = rows, src_len, tgt_len
    d, h, v = shape.d_model, shape.num_heads, shape.vocab_size
    le, ld = shape.num_layers, shape.num_decoder_layers
    p_drop = shape.dropout_rate
    params = shape.num_params()
    weights = params * e
    gradients = params * e  # .grad in the param dtype, kept between accumulated micro-batches
    if lora is not None:  # fp32 adapters (PEFT's autocast_adapter_dtype) and their gradients only
        weights += 4 * shape.lora_num_params(lora)
        gradients = 4 * shape.lora_num_params(lora)
    states = optimizer_state_bytes(shape, optimizer, bf16_update, dtype, lora)
    # Alive from the forward to the end of the backward only (not at the optimizer step): FSDP's gathered
    # weights, reduce-scatter buffers and unsharded gradients.
    gathered = reduce_buffers = backward_gradients = 0
    sharded = strategy == "fsdp" and processes > 1 and lora is None
    if sharded:
        weights, gathered, gradients, reduce_buffers, backward_gradients, states = sharded_state(
            shape,
            dtype,
            optimizer,
            bf16_update,
            processes,
            fsdp_reshard_after_forward,
            fsdp_sync_each_micro_batch,
        )

    mask_bytes = (1 if device == "cuda" else e) if p_drop > 0 else 0
    if attn_implementation not in ("eager", "sdpa", "triton"):
        raise ValueError(f"attn_implementation must be eager, sdpa or triton, got {attn_implementation!r}")
    # The Triton kernels run on CUDA only; elsewhere the trainer keeps eager attention.
    attention = "eager" if (attn_implementation == "triton" and device != "cuda") else attn_implementation
    fused = device == "cuda"
    enc_block, enc_bwd = _block_saved(shape, b, s, e, None, mask_bytes, attention, fused, packed, lora)
    dec_block, dec_bwd = _block_saved(shape, b, t, e, s, mask_bytes, attention, fused, packed, lora)
    # Relative position biases shared by a stack's blocks (1 x H x q x k), and their gradients: none with the
    # Triton kernels (their bias comes from T5's table).
    shared_bias = 0 if attention == "triton" else e
    # Padding masks, made once per stack and passed to every block (batches padded to the longest row almost
    # always have padding): eager adds float masks B x 1 x q x k; SDPA takes bool masks (causal: none); the
    # Triton kernels read the B x S padding mask (negligible) and apply causality themselves.
    mask_e = {"eager": e, "sdpa": 1, "triton": 0}[attention]

    # Tensors alive through the whole backward of a stack, besides the per-block checkpoints:
    # encoder: the embedding dropout's mask, the relative position bias (1 x H x S x S, made by block 0 and
    # passed to every block), the padding mask (B x 1 x S x S), the final layer norm's saved tensors (its
    # output goes to dropout, which saves only its mask), the final dropout's mask and output (the encoder
    # output every cross-attention reads).
    final_norm_s = _layer_norm_saved(b * s, d, e, fused, weight_grad=lora is None) - b * s * d * e
    enc_shared = b * s * d * mask_bytes + h * s * s * shared_bias + b * s * s * mask_e + final_norm_s
    enc_shared += b * s * d * (mask_bytes + e)
    # decoder: embedding dropout mask, relative position bias (1 x H x T x T), the cross-attention's zero bias
    # (1 x H x T x S), causal mask (B x 1 x T x T, eager only) and padding mask for the encoder
    # (B x 1 x T x S), the final layer norm and dropout's mask. The dropout's output (the decoder output) is
    # alive only until the loss has its gradient: the chunked cross-entropy saves no input.
    causal_mask = b * t * t * e if attention == "eager" else 0
    dec_shared = b * t * d * mask_bytes + (h * t * t + h * t * s) * shared_bias + causal_mask
    dec_shared += b * t * s * mask_e
    dec_norm = _layer_norm_saved(b * t, d, e, fused, weight_grad=lora is None)
    dec_shared += dec_norm - b * t * d * e + b * t * d * mask_bytes

    if gradient_checkpointing:
        enc_keep = le * b * s * d * e  # each encoder block's input hidden states
        dec_keep = ld * b * t * d * e
        unchecked = min(ld, max(0, decoder_blocks_without_checkpointing))
        if unchecked:
            # Their saved tensors stay from the forward; their backward (the decoder's first) adds only its
            # scratch, and the checkpointed blocks' recompute comes after they are freed. A kept block's input
            # is the kept block before it's output, already among that block's saved tensors (the residual
            # sum): only the first kept block's input is a tensor of its own.
            dec_keep += unchecked * dec_block - (unchecked - 1) * b * t * d * e
            dec_bwd -= dec_block
        unchecked = min(le, max(0, encoder_blocks_without_checkpointing))
        if unchecked:  # the same in the encoder, whose kept tensors stay through the whole decoder
            enc_keep += unchecked * enc_block - (unchecked - 1) * b * s * d * e
            enc_bwd -= enc_block
    else:  # everything every block saves stays until its backward; inputs as with kept blocks above
        enc_keep = b * s * d * e + le * enc_block
        dec_keep = b * t * d * e + ld * dec_block
        enc_bwd, dec_bwd = enc_bwd - enc_block, dec_bwd - dec_block  # only the backward scratch is new

    logits_peak = _loss_bytes(b * t, d, v, e, fused and e == 2, head_grad=lora is None)

    # Gradients flowing between blocks: the hidden-state gradient (two alive at a block boundary) and, during
    # the decoder's backward, the accumulated gradients of the encoder output and of the shared position
    # biases (none for LoRA's frozen ones).
    bias_grad = shared_bias if lora is None else 0
    flow_dec = 2 * b * t * d * e + b * s * d * e + (h * t * t + h * t * s) * bias_grad
    flow_enc = 2 * b * s * d * e + h * s * s * bias_grad

    moments = {
        "loss": (enc_keep + enc_shared + dec_keep + dec_shared + b * t * d * e, logits_peak),
        "decoder block backward": (
            enc_keep + enc_shared + dec_keep + dec_shared + flow_dec + dec_bwd,
            0,
        ),
        "encoder block backward": (enc_keep + enc_shared + flow_enc + enc_bwd, 0),
    }
    # What the optimizer's step allocates (trainer.optim declares it: Adafactor's partial sums; optimi's
    # foreach step uses the gradients as its scratch buffer).
    opt_temp = OPTIMIZERS[optimizer].step_scratch_bytes(shape, lora, processes if sharded else 1)
    # FSDP2's unsharded bf16 gradients exist from a block's backward on (none at the loss)
    made_by_backward = {m: 0 if m == "loss" else backward_gradients for m in moments}
    moment, (acts, logits) = max(moments.items(), key=lambda kv: sum(kv[1]) + made_by_backward[kv[0]])
    if opt_temp > acts + logits + gathered + reduce_buffers + made_by_backward[moment]:
        moment, acts, logits = "optimizer step", 0, 0
    else:
        opt_temp = 0
        weights = weights + gathered
        gradients = gradients + reduce_buffers + made_by_backward[moment]
    allocated = weights + gradients + states + acts + logits + opt_temp
    return MemoryPlan(
        weights=weights,
        gradients=gradients,
        optimizer_states=states,
        activations=acts,
        logits=logits,
        optimizer_temp=opt_temp,
        allocator_slack=int(allocated * ALLOCATOR_SLACK),
        peak_moment=moment,
    )


def sharded_state(
    shape: ModelShape,
    dtype: str,
    optimizer: str,
    bf16_update: str,
    processes: int,
    reshard_after_forward: bool,
    sync_each_micro_batch: bool,
) -> tuple[int, int, int, int, int, int]:
    """One GPU's (sharded weights, gathered weights, sharded gradients, reduce-scatter buffers, unsharded
    gradients, optimizer states) under FSDP2 (trainer.run.parallel.wrap) over `processes` ranks.

    Sharded: each weight's ceil(rows / processes) rows (FSDP2 pads the shards to one size), in `dtype`, and
    its gradient likewise; the optimizer states as `optimizer_state_bytes` shards them. Gathered (bf16): the
    root's weights (embeddings, LM head, final norms; gathered through the step) and two blocks' (the one
    running and the next, prefetched: FSDP2's all-gather stream keeps that much memory reserved), or every
    block's with `reshard_after_forward` false. Reduce-scatter buffers, in `dtype` (trainer.run.parallel
    reduces in the weights' dtype): the inputs of two blocks (one reducing while the next runs) or of the
    root, made on FSDP2's reduce-scatter stream, whose memory stays reserved through the step; without
    `sync_each_micro_batch` every weight's gradient, accumulated over the micro-batches. Unsharded
    gradients, from the first block's backward on (none at the loss): a block's bf16 gradients as the
    backward makes them, and the root's, which live through the whole backward.
    A memory snapshot of XXL on 2 GPUs at the loss (`profile_memory`) has each of these terms but the
    reserved buffers as allocated bytes, to 0.1 GiB in 39 GiB."""
    e = _DTYPE_BYTES[dtype]
    block = max(shape.block_params(decoder=True), shape.block_params(decoder=False))
    root = shape.root_params()
    all_blocks = shape.num_params() - root
    weights = shape.sharded_params(processes) * e
    gathered = 2 * root + 2 * (2 * block if reshard_after_forward else all_blocks)
    gradients = shape.sharded_params(processes) * e
    reduce_buffers = e * max(2 * block, root)
    if not sync_each_micro_batch:
        reduce_buffers += e * shape.num_params()
    unsharded = 2 * block + 2 * root
    states = optimizer_state_bytes(shape, optimizer, bf16_update, dtype, shards=processes)
    return weights, gathered, gradients, reduce_buffers, unsharded, states


def _budget_shapes(
    max_tokens: int, src_cap: int, tgt_cap: int, worst_case: bool, packed: bool = False
) -> list[tuple[int, int, int]]:
    """Micro-batch shapes a budget can produce: typical recipe rows, and (worst case) the budget spent on rows
    at the maximum lengths, or on short-source rows with maximal targets (the logits grow with the target).
    Packed: the one shape of every batch, the budget's rows of src_cap + tgt_cap (the row lengths)."""
    if packed:
        return [(max(1, max_tokens // (src_cap + tgt_cap)), src_cap, tgt_cap)]
    src, tgt = min(src_cap, TYPICAL_SOURCE), min(tgt_cap, TYPICAL_TARGET)
    shapes = [(max(1, max_tokens // (src + tgt)), src, tgt)]
    if worst_case:
        shapes.append((max(1, max_tokens // (src_cap + tgt_cap)), src_cap, tgt_cap))
        short_src = min(src_cap, 32)
        shapes.append((max(1, max_tokens // (short_src + tgt_cap)), short_src, tgt_cap))
    return shapes


def budget_peak(
    shape: ModelShape, max_tokens: int, *, src_cap=512, tgt_cap=512, worst_case=True, **kw
) -> MemoryPlan:
    """The largest predicted plan over the micro-batch shapes `max_tokens` can produce."""
    shapes = _budget_shapes(max_tokens, src_cap, tgt_cap, worst_case, kw.get("packed", False))
    plans = [plan_memory(shape, rows=r, src_len=s, tgt_len=t, **kw) for r, s, t in shapes]
    return max(plans, key=lambda p: p.peak)


def largest_token_budget(
    shape: ModelShape,
    gpu_bytes: int,
    *,
    src_cap: int = 512,
    tgt_cap: int = 512,
    worst_case: bool = True,
    margin: float = SAFETY_MARGIN,
    multiple: int = 256,
    **kw,
) -> int:
    """Largest max_tokens (a multiple of `multiple`) whose predicted peak is under margin x gpu_bytes, or 0.

    worst_case: also check the budget spent on rows at the maximum lengths (what a token-budget loader can
    yield for long recipes); else only typical recipe lengths.
    """
    limit = gpu_bytes * margin

    def fits(tokens: int) -> bool:
        return (
            budget_peak(shape, tokens, src_cap=src_cap, tgt_cap=tgt_cap, worst_case=worst_case, **kw).peak
            <= limit
        )

    lo, hi = 0, multiple
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            return lo
    while hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_batch_size(
    shape: ModelShape, gpu_bytes: int, *, src_len: int, tgt_len: int, margin: float = SAFETY_MARGIN, **kw
) -> int:
    """Largest rows per micro-batch at src_len/tgt_len padded lengths that fits; 0 if none."""
    limit = gpu_bytes * margin
    rows = 0
    while plan_memory(shape, rows=rows + 1, src_len=src_len, tgt_len=tgt_len, **kw).peak <= limit:
        rows += 1
        if rows > 1 << 16:
            break
    return rows


def plan_kwargs(cfg, blocks: tuple[int, int] | None = None, processes: int = 1) -> dict:
    """plan_memory's keyword arguments for `cfg` on one GPU of a run of `processes` (the un-checkpointed
    (decoder, encoder) blocks: the given numbers, else the config's)."""
    # Triton runs only on CUDA (eager elsewhere); other kernels transformers offers are planned like SDPA.
    attn = cfg.attn_implementation if cfg.attn_implementation in ("eager", "triton") else "sdpa"
    if blocks is None:
        blocks = (
            cfg.decoder_blocks_without_checkpointing or 0,
            cfg.encoder_blocks_without_checkpointing or 0,
        )
    return dict(
        dtype=cfg.dtype,
        optimizer=cfg.optimizer,
        bf16_update=cfg.bf16_update,
        gradient_checkpointing=cfg.gradient_checkpointing,
        attn_implementation=attn,
        decoder_blocks_without_checkpointing=blocks[0],
        encoder_blocks_without_checkpointing=blocks[1],
        packed=cfg.packing,
        lora=LoraShape.of(cfg),
        strategy=cfg.distributed_strategy,
        processes=processes,
        fsdp_reshard_after_forward=cfg.fsdp_reshard_after_forward,
        fsdp_sync_each_micro_batch=cfg.fsdp_sync_each_micro_batch,
    )


def row_lengths(cfg) -> tuple[int, int]:
    """The longest source and target rows the loader yields for `cfg`: the maximum lengths, or with packing
    the packed row lengths (set, or else the maximum lengths rounded up to pad_to_multiple_of (8), the
    loader's shortest choice; it may choose longer rows of as many tokens in all)."""
    if not cfg.packing:
        return cfg.max_source_length, cfg.max_target_length
    m = cfg.pad_to_multiple_of or 8
    return (
        cfg.packed_source_length or -(-cfg.max_source_length // m) * m,
        cfg.packed_target_length or -(-cfg.max_target_length // m) * m,
    )


def choose_max_tokens(cfg, gpu_bytes: int, processes: int = 1) -> int:
    """Starting token budget for the loop when the config sets neither batch size nor max_tokens."""
    shape = load_shape(cfg.model_name_or_path)
    src, tgt = row_lengths(cfg)
    kw = plan_kwargs(cfg, processes=processes)
    tokens = largest_token_budget(shape, gpu_bytes, src_cap=src, tgt_cap=tgt, **kw)
    # Never below one row at the maximum lengths: the loader must be able to yield its longest row alone.
    floor = src + tgt
    if tokens < floor:
        logger.warning(
            "memory plan: even one row of max_source_length + max_target_length tokens is predicted not to "
            "fit in %.1f GiB; trying micro-batches of %d tokens (one such row) anyway",
            gpu_bytes / GIB,
            floor,
        )
        tokens = floor
    logger.info(
        "memory plan: micro-batches of up to %d tokens fit in %.1f GiB of GPU memory (max_tokens or "
        "per_device_train_batch_size in the config set it yourself)",
        tokens,
        gpu_bytes / GIB,
    )
    return tokens


def micro_batch_peak(
    shape: ModelShape,
    cfg,
    max_tokens: int | None,
    blocks: tuple[int, int],
    packed_rows: tuple | None = None,
    processes: int = 1,
) -> MemoryPlan:
    """The predicted peak of `cfg`'s largest micro-batch on one GPU of `processes`, `blocks` (decoder,
    encoder) the numbers of each stack's last blocks without checkpointing:
    the loader's packed rows (rows, source length, target length) when given, else
    per_device_train_batch_size rows of the longest lengths, else the worst the budget `max_tokens` yields."""
    kw = plan_kwargs(cfg, blocks, processes)
    if packed_rows is not None:
        rows, src, tgt = packed_rows
        return plan_memory(shape, rows=rows, src_len=src, tgt_len=tgt, **kw)
    src, tgt = row_lengths(cfg)
    if cfg.per_device_train_batch_size is not None:
        return plan_memory(shape, rows=cfg.per_device_train_batch_size, src_len=src, tgt_len=tgt, **kw)
    return budget_peak(shape, max_tokens, src_cap=src, tgt_cap=tgt, **kw)


def planned_peak_bytes(cfg, plan: RunPlan) -> int:
    """The predicted peak of the run `plan` makes of `cfg` (its micro-batch, blocks and packed rows)."""
    return planned_peak(cfg, plan).peak


def planned_peak(cfg, plan: RunPlan) -> MemoryPlan:
    """The predicted peak, by component, of the run `plan` makes of `cfg` on one of its GPUs."""
    shape = load_shape(cfg.model_name_or_path)
    return micro_batch_peak(
        shape, cfg, plan.max_tokens, plan.blocks_without_checkpointing, plan.packed_rows, plan.processes
    )


def choose_blocks_without_checkpointing(
    cfg,
    gpu_bytes: int,
    max_tokens: int | None = None,
    packed_rows: tuple | None = None,
    processes: int = 1,
) -> tuple[int, int]:
    """How many of the last (decoder, encoder) blocks can skip checkpointing (keeping their activations,
    saving their recompute) with the micro-batch (`max_tokens`, default the config's; or the loader's
    `packed_rows`) still within SAFETY_MARGIN of `gpu_bytes`, worst case. Decoder blocks first, then, once
    every decoder block keeps its activations, encoder blocks; a number the config sets is kept."""
    if not cfg.gradient_checkpointing:
        return 0, 0
    shape = load_shape(cfg.model_name_or_path)
    tokens = max_tokens if max_tokens is not None else cfg.max_tokens

    def fits(decoder: int, encoder: int) -> bool:
        peak = micro_batch_peak(shape, cfg, tokens, (decoder, encoder), packed_rows, processes).peak
        return peak <= SAFETY_MARGIN * gpu_bytes

    decoder, encoder = cfg.decoder_blocks_without_checkpointing, cfg.encoder_blocks_without_checkpointing
    if decoder is None:
        decoder = 0
        while decoder < shape.num_decoder_layers and fits(decoder + 1, encoder or 0):
            decoder += 1
    if encoder is None:
        encoder = 0
        while (
            decoder >= shape.num_decoder_layers and encoder < shape.num_layers and fits(decoder, encoder + 1)
        ):
            encoder += 1
    return decoder, encoder


def gpu_bytes_for(cfg) -> int | None:
    """This process's GPU memory (gpu_memory_limit_gib when set), None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if cfg.gpu_memory_limit_gib:
        gpu_bytes = min(gpu_bytes, int(cfg.gpu_memory_limit_gib * GIB))
    return gpu_bytes


@dataclass(frozen=True)
class RunPlan:
    """What a run uses where its config leaves the choice to the memory plan (`plan_run` makes it). The config
    itself is never changed; the loop, the model loader and the loader read these values from here."""

    per_device_train_batch_size: int | None  # rows per micro-batch (the config's), or else
    max_tokens: int | None  # a token budget per micro-batch: the config's, or the plan's
    decoder_blocks_without_checkpointing: int  # the last decoder blocks that keep their activations
    encoder_blocks_without_checkpointing: int  # the same in the encoder
    # Packing: the loader's rows (rows, source length, target length), which it chooses from the data once
    # it is indexed (plan_packed_rows); until then None, and the plan assumes rows of the maximum lengths.
    packed_rows: tuple[int, int, int] | None = None
    processes: int = 1  # the run's processes (torchrun's WORLD_SIZE): the plan is one GPU's

    @property
    def blocks_without_checkpointing(self) -> tuple[int, int]:
        """(decoder, encoder) blocks that keep their activations."""
        return self.decoder_blocks_without_checkpointing, self.encoder_blocks_without_checkpointing

    def micro_batch(self, split: int = 1) -> str:
        """The micro-batch in words, after the loader batches are split into `split` parts (OOM back-off)."""
        if self.max_tokens:
            return f"{self.max_tokens // split} tokens"
        return f"{max(1, (self.per_device_train_batch_size or 1) // split)} rows"

    def applied_to(self, cfg):
        """A copy of `cfg` with the planned values filled in: the config the run trains with, as checkpoints
        store it, and what `data.stream_for` (which takes the batching from a config) reads. With eval_files
        nothing of train_files is held out: eval_fraction is 0 there."""
        return dataclasses.replace(
            cfg,
            max_tokens=self.max_tokens,
            decoder_blocks_without_checkpointing=self.decoder_blocks_without_checkpointing,
            encoder_blocks_without_checkpointing=self.encoder_blocks_without_checkpointing,
            eval_fraction=0.0 if cfg.eval_files else cfg.eval_fraction,
        )


def plan_run(cfg, gpu_bytes: int | None = None, processes: int | None = None) -> RunPlan:
    """The memory plan's choices for `cfg` on a card of `gpu_bytes` (default: this process's GPU), one of
    `processes` (default: torchrun's WORLD_SIZE, else 1): a token budget when the config sets neither
    max_tokens nor per_device_train_batch_size, and how many decoder and encoder blocks skip checkpointing
    where decoder_blocks_without_checkpointing or encoder_blocks_without_checkpointing is null. Without a GPU:
    two rows of the maximum lengths, and every block checkpointed where the config leaves it open."""
    if gpu_bytes is None:
        gpu_bytes = gpu_bytes_for(cfg)
    if processes is None:
        processes = int(os.environ.get("WORLD_SIZE", 1))
    max_tokens = cfg.max_tokens
    if cfg.per_device_train_batch_size is None and max_tokens is None:
        if gpu_bytes is None:
            max_tokens = 2 * sum(row_lengths(cfg))
            logger.info(
                "batching: micro-batches of up to %d tokens (two rows of the maximum lengths; no GPU to plan "
                "for); set max_tokens or per_device_train_batch_size to choose",
                max_tokens,
            )
        else:
            max_tokens = choose_max_tokens(cfg, gpu_bytes, processes)
    if gpu_bytes is not None:
        blocks = choose_blocks_without_checkpointing(cfg, gpu_bytes, max_tokens, processes=processes)
    else:
        blocks = (
            cfg.decoder_blocks_without_checkpointing or 0,
            cfg.encoder_blocks_without_checkpointing or 0,
        )
    return RunPlan(cfg.per_device_train_batch_size, max_tokens, *blocks, processes=processes)


def plan_packed_rows(plan: RunPlan, cfg, packed_shape: dict, gpu_bytes: int | None = None) -> RunPlan:
    """`plan` for the packed rows the loader chose from the data (its `packed_shape`: rows, source_len,
    target_len), which the budget could only assume to be rows of the maximum lengths: where the config
    leaves them to the plan, the numbers of blocks without checkpointing are chosen again on them."""
    rows = (packed_shape["rows"], packed_shape["source_len"], packed_shape["target_len"])
    plan = dataclasses.replace(plan, packed_rows=rows)
    if gpu_bytes is None:
        gpu_bytes = gpu_bytes_for(cfg)
    if gpu_bytes is None:
        return plan
    decoder, encoder = choose_blocks_without_checkpointing(
        cfg, gpu_bytes, plan.max_tokens, rows, plan.processes
    )
    plan = dataclasses.replace(
        plan, decoder_blocks_without_checkpointing=decoder, encoder_blocks_without_checkpointing=encoder
    )
    peak = planned_peak_bytes(cfg, plan)
    logger.info(
        "memory plan: packed rows of %d x (%d + %d) tokens; the last %d decoder and %d encoder blocks "
        "without gradient checkpointing, predicted peak %.1f GiB of %.1f",
        *rows,
        decoder,
        encoder,
        peak / GIB,
        gpu_bytes / GIB,
    )
    if peak > SAFETY_MARGIN * gpu_bytes:
        logger.warning(
            "memory plan: these packed rows are predicted to need %.1f GiB, over %.0f%% of the GPU's %.1f: "
            "set max_tokens lower (the out-of-memory back-off would halve the micro-batch)",
            peak / GIB,
            100 * SAFETY_MARGIN,
            gpu_bytes / GIB,
        )
    return plan


def with_planned_batch(cfg, gpu_bytes: int | None = None):
    """`cfg` with the plan's values filled in (`plan_run(cfg, gpu_bytes).applied_to(cfg)`), for scripts that
    hand a complete config on."""
    return plan_run(cfg, gpu_bytes).applied_to(cfg)


def probe_shapes(cfg, plan: RunPlan) -> list[tuple[int, int, int]]:
    """(rows, source length, target length) of the largest micro-batches the loader can yield for `cfg` and
    its `plan`: the loader's packed rows, per_device_train_batch_size rows of the longest lengths, or the
    worst shapes of the token budget."""
    if plan.packed_rows is not None:
        return [plan.packed_rows]
    src, tgt = row_lengths(cfg)
    if cfg.per_device_train_batch_size is not None:
        return [(cfg.per_device_train_batch_size, src, tgt)]
    return _budget_shapes(plan.max_tokens, src, tgt, worst_case=True, packed=cfg.packing)

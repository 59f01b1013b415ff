"""Named GPUs' peak rates and memory, and the arithmetic that turns a measured MFU into tokens/s on one.

MFU (model FLOPs utilisation) is the share of a GPU's dense bf16 tensor rate that training turns into model
FLOPs: 6 x [(encoder + cross-attention K/V params) x source tokens + (rest of the decoder + LM head) x
target tokens], real (non-pad) tokens only, checkpoint recompute not counted (`flops_per_token`). Measured on
one GPU (bench/train_throughput.py), it predicts another's tokens/s as MFU x that GPU's peak / FLOPs per
token. The prediction assumes the same MFU on the other card: close between cards of one design (H100, H200),
rougher across them (the step's memory-bound kernels scale with bandwidth, not with the tensor rate).

Peak rates are dense (no structured sparsity) bf16 tensor-core rates with fp32 accumulation, which is what
training uses. GeForce cards run that at half their fp16-accumulate rate (the number on their spec sheets);
data-centre cards run both at the same rate. Sources:
- RTX 5090: NVIDIA RTX Blackwell GPU Architecture whitepaper (2025), GeForce RTX 5090: FP16/BF16 tensor
  419 TFLOP/s dense with FP16 accumulate (838 sparse), 209.5 with FP32 accumulate; 32 GB GDDR7, 1792 GB/s.
- RTX 4090: NVIDIA Ada GPU Architecture whitepaper (2022), GeForce RTX 4090: 330.3 TFLOP/s dense with FP16
  accumulate, 165.2 with FP32 accumulate (FP16 and BF16 alike); 24 GB GDDR6X, 1008 GB/s.
- RTX 4080: the same whitepaper, GeForce RTX 4080: 194.9 TFLOP/s dense with FP16 accumulate, 97.5 with FP32
  accumulate; 16 GB GDDR6X, 716.8 GB/s.
- RTX 3090: NVIDIA Ampere GA102 GPU Architecture whitepaper (2020), GeForce RTX 3090: 142 TFLOP/s dense with
  FP16 accumulate, 71 with FP32 accumulate (BF16 alike); 24 GB GDDR6X, 936 GB/s.
- A100 80GB SXM: NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOP/s dense; 80 GB HBM2e, 2039 GB/s.
- H100 SXM: NVIDIA H100 Tensor Core GPU datasheet: BF16 989 TFLOP/s dense (1979 sparse); 80 GB HBM3,
  3.35 TB/s.
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet: BF16 989 TFLOP/s dense (1979 sparse); 141 GB HBM3e,
  4.8 TB/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from trainer.model.model_shape import LoraShape, ModelShape


@dataclass(frozen=True)
class GpuSpec:
    name: str
    aliases: tuple[str, ...]  # lower-case, letters and digits only; torch.cuda.get_device_name() included
    bf16_tflops: float  # dense bf16 tensor rate with fp32 accumulation: what training runs at
    spec_sheet_tflops: float  # dense fp16 tensor rate as marketed (GeForce: with fp16 accumulation, 2x)
    memory_gb: float  # as sold (decimal GB; torch reports a little less as usable)
    bandwidth_gb_s: float

    @property
    def bf16_flops(self) -> float:
        return self.bf16_tflops * 1e12


GPUS: dict[str, GpuSpec] = {
    "rtx5090": GpuSpec("RTX 5090", ("rtx5090", "5090"), 209.5, 419.0, 32, 1792),
    "rtx4090": GpuSpec("RTX 4090", ("rtx4090", "4090"), 165.2, 330.3, 24, 1008),
    "rtx4080": GpuSpec("RTX 4080", ("rtx4080", "4080"), 97.5, 194.9, 16, 716.8),
    "rtx3090": GpuSpec("RTX 3090", ("rtx3090", "3090"), 71.0, 142.0, 24, 936),
    # Ada's professional cards run bf16 with fp32 accumulation at the full tensor rate (GeForce at half).
    "l40s": GpuSpec("L40S", ("l40s",), 362.05, 362.05, 48, 864),
    "rtx6000ada": GpuSpec("RTX 6000 Ada", ("rtx6000ada", "rtx6000adageneration"), 364.2, 364.2, 48, 960),
    "a100": GpuSpec("A100 80GB SXM", ("a100", "a10080gb", "a100sxm480gb"), 312.0, 312.0, 80, 2039),
    "h100": GpuSpec("H100 SXM", ("h100", "h100sxm", "h10080gbhbm3", "h100sxm580gb"), 989.0, 989.0, 80, 3350),
    "h200": GpuSpec("H200 SXM", ("h200", "h200sxm", "h200141gb"), 989.0, 989.0, 141, 4800),
}


def gpu_spec(name: str) -> GpuSpec:
    """The spec of a named GPU: "RTX 5090", "rtx5090", "5090", "H100", or a `torch.cuda.get_device_name()`
    such as "NVIDIA H100 80GB HBM3". Raises ValueError naming the known GPUs for anything else (an H100 PCIe
    or an A100 40GB is another card, with other rates)."""
    key = re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia").removeprefix("geforce")
    for spec in GPUS.values():
        if key in spec.aliases:
            return spec
    known = ", ".join(spec.name for spec in GPUS.values())
    raise ValueError(f"unknown GPU {name!r}; known: {known}")


def flops_per_token(config: Any, lora: LoraShape | None = None) -> tuple[float, float]:
    """Training FLOPs (6 x parameters touched) per real source token and per real target token of a T5
    `config` (d_model, d_ff, d_kv, num_heads, num_layers, num_decoder_layers, vocab_size; gated feed-forward).

    A source token passes the encoder and, as keys and values, every decoder block's cross-attention; a target
    token the rest of the decoder (self-attention, cross-attention's query and output, feed-forward) and the
    LM head. Attention's score and value products and the embeddings are left out, as in MFU's usual count.
    With `lora` (trainer.model.lora) the frozen base costs 4 x its parameters (forward and input gradients: no
    weight gradients) and the adapters 6 x theirs."""
    d, f, inner = config.d_model, config.d_ff, config.num_heads * config.d_kv
    encoder_block = 4 * d * inner + 3 * d * f  # q, k, v, o + gated feed-forward (wi_0, wi_1, wo)
    cross_kv = 2 * d * inner
    decoder_block_rest = 4 * d * inner + 2 * d * inner + 3 * d * f  # self q, k, v, o + cross q, o + FF
    decoder_layers = config.num_decoder_layers or config.num_layers
    per_source = config.num_layers * encoder_block + decoder_layers * cross_kv
    per_target = decoder_layers * decoder_block_rest + config.vocab_size * d
    if lora is None:
        return 6.0 * per_source, 6.0 * per_target
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    projections = shape.projections()

    def adapters(names: tuple[str, ...]) -> int:
        return sum(lora.r * sum(projections[n][:2]) for n in names if n in lora.targets)

    feed_forward = ("wi_0", "wi_1", "wi", "wo")
    adapters_source = config.num_layers * adapters(("q", "k", "v", "o", *feed_forward))
    adapters_source += decoder_layers * adapters(("k", "v"))
    adapters_target = decoder_layers * (adapters(("q", "k", "v", "o")) + adapters(("q", "o", *feed_forward)))
    return 4.0 * per_source + 6.0 * adapters_source, 4.0 * per_target + 6.0 * adapters_target


def flops_per_real_token(
    config: Any, mean_source_tokens: float, mean_target_tokens: float, lora: LoraShape | None = None
) -> float:
    """Training FLOPs per real token for records of these mean lengths (source and target, </s> included)."""
    per_source, per_target = flops_per_token(config, lora)
    total = mean_source_tokens + mean_target_tokens
    return (per_source * mean_source_tokens + per_target * mean_target_tokens) / total


def predicted_tokens_per_s(gpu: str | GpuSpec, mfu: float, flops_per_real_token: float) -> float:
    """Real tokens/s on `gpu` at `mfu` (a fraction, e.g. 0.298) for a model and data costing
    `flops_per_real_token` (`flops_per_real_token()`)."""
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be a fraction in (0, 1], got {mfu}")
    return mfu * spec.bf16_flops / flops_per_real_token


def predicted_epoch_seconds(
    gpu: str | GpuSpec,
    mfu: float,
    config: Any,
    source_tokens: int,
    target_tokens: int,
    lora: LoraShape | None = None,
) -> float:
    """Seconds for one pass over data with these real token totals (all records' sources and targets) on
    `gpu` at `mfu`."""
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    per_source, per_target = flops_per_token(config, lora)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be a fraction in (0, 1], got {mfu}")
    return (per_source * source_tokens + per_target * target_tokens) / (mfu * spec.bf16_flops)

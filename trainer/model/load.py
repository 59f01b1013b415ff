"""Loading the model once, in its training dtype, straight onto the training device."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainer.infra.memory import GIB
from trainer.model.model_files import dtype_kwarg, from_pretrained, is_adapter_dir
from trainer.model.swaps import use_fused_t5_ops, use_triton_attention_where_it_runs

log = logging.getLogger(__name__)

LOAD_PEAK_FACTOR = 1.05  # peak GPU memory while loading, relative to the weights' bytes ...
# ... plus this much: the allocator rounds every tensor up to whole blocks and loading keeps small transient
# buffers, which outweigh 5% of a small model's weights (the quickstart's tiny T5 failed a bare 1.05x on a
# GPU).
LOAD_PEAK_SLACK = 64 * 2**20
LAST_LOAD: dict = {}  # what the last load measured (weights and peak bytes), for the run summary


def _from_pretrained(path: str, dtype: torch.dtype, device: torch.device, attn: str, random_init: bool):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    if random_init:  # architecture only (benchmarks): random weights built on the device in their dtype
        config = AutoConfig.from_pretrained(path)
        config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device(device):
            return AutoModelForSeq2SeqLM.from_config(
                config, attn_implementation=attn, **{dtype_kwarg(): dtype}
            )
    kwargs = {dtype_kwarg(): dtype, "attn_implementation": attn}
    if device.type != "cpu":
        kwargs["device_map"] = {"": device}  # weights go straight to the GPU, no CPU copy of the model
    if is_adapter_dir(path):
        # peft takes seconds to import: only LoRA models import it (through trainer.model.lora)
        from trainer.model.lora import load_merged

        return load_merged(path, **kwargs)
    return from_pretrained(path, **kwargs)


def load_model(
    cfg,
    device: torch.device,
    *,
    path: str | Path | None = None,
    random_init: bool | None = None,
    blocks_without_checkpointing: tuple[int, int] = (0, 0),
):
    """Load cfg.model_name_or_path (or `path`, e.g. a checkpoint) once, in cfg.dtype, onto `device`: for
    training, and for generation and evaluation (trainer.eval.generate.load_for_generation). A LoRA
    adapter directory loads the base it names with the adapter merged into it.

    On CUDA, asserts the peak memory during the load is at most 1.05x the weights + 64 MiB (no fp32 copy, no
    second copy on the device; not for a merged adapter, whose merge has temporaries). Attention:
    cfg.attn_implementation. Gradient checkpointing is non-reentrant, except for the last
    `blocks_without_checkpointing` (decoder, encoder) blocks (the run's plan decides how many); use_cache is
    off (turned on for generation).
    """
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    path = str(path or cfg.model_name_or_path)
    random_init = cfg.random_init if random_init is None else random_init
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    attn = "eager" if cfg.attn_implementation == "triton" else cfg.attn_implementation
    model = _from_pretrained(path, dtype, device, attn, random_init)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    n_params = sum(p.numel() for p in model.parameters())
    if on_cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        log.info(
            "model: %s loaded in %s, %.2f GiB weights, load peak %.2f GiB (%.3fx the weights)",
            path,
            cfg.dtype,
            weight_bytes / GIB,
            peak / GIB,
            peak / max(weight_bytes, 1),
        )
        LAST_LOAD.update(weight_bytes=weight_bytes, peak_bytes=peak)
        # Random init (benchmarks) has initialisation temporaries; the check is about loading weight files.
        checked = not random_init and not is_adapter_dir(path)
        if checked and peak > LOAD_PEAK_FACTOR * weight_bytes + LOAD_PEAK_SLACK:
            raise RuntimeError(
                f"loading {path} peaked at {peak / 2**20:,.0f} MiB on the GPU, more than {LOAD_PEAK_FACTOR}x "
                f"its {weight_bytes / 2**20:,.0f} MiB of weights (+{LOAD_PEAK_SLACK // 2**20} MiB): it was "
                "copied twice"
            )
    else:
        LAST_LOAD.update(weight_bytes=weight_bytes, peak_bytes=None)
        log.info("model: %s loaded in %s on %s, %.1fM parameters", path, cfg.dtype, device, n_params / 1e6)
    param_device = next(model.parameters()).device
    if param_device.type != device.type:
        raise RuntimeError(f"model loaded on {param_device}, expected {device}")
    if cfg.attn_implementation == "triton":
        use_triton_attention_where_it_runs(model, device, dtype)
    attn_used = getattr(model.config, "_attn_implementation", None) or cfg.attn_implementation
    norms, gelus, gated, residual, shared = use_fused_t5_ops(model)
    fused = f"{norms} layer norms and {gelus} GELUs in one kernel each"
    if gated or residual:
        fused += f", {gated} gated-GELU feed-forwards and {residual} residual dropouts as Triton kernels"
    fused += f", projections in {shared} groups (input gradients summed in their matmuls)"
    log.info("attention: %s; fused ops: %s", attn_used, fused)
    model.config.use_cache = False
    keep_the_evaluations_decoding(model, cfg)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
        skip_checkpointing(model, *blocks_without_checkpointing)
    if cfg.torch_compile:
        compile_blocks(model)
    return model


def keep_the_evaluations_decoding(model: torch.nn.Module, cfg) -> None:
    """The decoding limits the run's evaluations use (generation_max_new_tokens, generation_num_beams) go into
    the model's generation_config, which every checkpoint and final/ save: `trainer evaluate` and `trainer
    generate` on them decode as the evaluations did, and score the same."""
    if cfg.generation_max_new_tokens is not None:
        model.generation_config.max_new_tokens = cfg.generation_max_new_tokens
    if cfg.generation_num_beams is not None:
        model.generation_config.num_beams = cfg.generation_num_beams


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Gradient (activation) checkpointing on every block, non-reentrant. transformers 5.24 renamed the call
    (the old name warns of its removal); earlier releases have only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def skip_checkpointing(
    model: torch.nn.Module, decoder_blocks: int, encoder_blocks: int = 0
) -> tuple[int, int]:
    """Turn gradient checkpointing off for the last `decoder_blocks` decoder blocks and the last
    `encoder_blocks` encoder blocks: they keep their activations and skip the recompute. Their backward runs
    first in their stack, so the checkpointed blocks' recompute finds their memory freed
    (trainer.plan.memory_plan counts it so). Returns how many were switched in each; 0 where transformers
    checkpoints a stack as a whole (no per-block switch)."""
    switched = []
    for stack, blocks in ((model.decoder, decoder_blocks), (model.encoder, encoder_blocks)):
        count = 0
        for block in list(stack.block)[-blocks:] if blocks > 0 else []:
            if getattr(block, "gradient_checkpointing", None) is True:
                block.gradient_checkpointing = False
                count += 1
        switched.append(count)
    if decoder_blocks or encoder_blocks:
        log.info(
            "gradient checkpointing: off for the last %d of %d decoder blocks and the last %d of %d encoder "
            "blocks",
            switched[0],
            len(model.decoder.block),
            switched[1],
            len(model.encoder.block),
        )
    return switched[0], switched[1]


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each encoder and decoder block (dynamic shapes: batches vary in rows and lengths).

    Blocks share their code, so the compiled graphs are reused across blocks; gradient checkpointing stays
    around each block's forward. Returns the number of blocks compiled.
    """
    blocks = [*model.encoder.block, *model.decoder.block]
    for block in blocks:
        block.compile(dynamic=True)
    log.info("torch.compile: %d blocks (compiled on first use)", len(blocks))
    return len(blocks)

"""The model as the run trains it under torchrun: `ddp` (rank 0's weights broadcast, the whole model on every
rank) or `fsdp` (FSDP2 around the loss module, one unit per T5 block). What the two strategies are and how
the ranks talk: trainer.infra.distributed."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.infra.distributed import collective, is_distributed, world_size
from trainer.model.loss import Seq2SeqLMLoss

log = logging.getLogger(__name__)

# FSDP2's compute dtype: the weights are all-gathered in it. (The CPU tests run the packed Triton kernels in
# Triton's interpreter, which computes fp16 right but not bf16: they set fp16 here.)
FSDP_COMPUTE_DTYPE = torch.bfloat16
# The dtype FSDP2 reduce-scatters gradients in; None: the weights' own. bf16 weights get bf16 gradients
# either way, and ddp all-reduces them in bf16 (on 2 GPUs the sum of two is rounded once, as an fp32 sum cast
# to bf16 is); fp32 master weights get fp32. bench/multi_gpu.py's `fsdpN_fp32_reduce` measures fp32.
FSDP_REDUCE_DTYPE: torch.dtype | None = None


def wrap(model: torch.nn.Module, cfg, device: torch.device) -> torch.nn.Module:
    """The module the loop computes the loss through: `model` itself for one process and for `ddp` (whose
    ranks start from rank 0's weights: broadcast here), FSDP2 around `Seq2SeqLMLoss(model)` for `fsdp`. Build
    the optimizer afterwards (FSDP replaces the parameters by shards)."""
    if not is_distributed():
        return model
    if cfg.distributed_strategy == "ddp":
        with collective("broadcasting rank 0's weights"), torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        log.info(
            "distributed: ddp over %d ranks (the whole model on each, gradients summed by one all-reduce "
            "per optimizer step)",
            world_size(),
        )
        return model
    # Newer torch warns at every block's forward that an output is a view: T5's blocks return the position
    # bias the next blocks share, a view of the first block's. Nothing writes it in place (which would drop
    # FSDP2's pre-backward hook): tests/test_distributed.py's FSDP2 losses equal one process's.
    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor", UserWarning)
    loss_module = Seq2SeqLMLoss(model)
    weights_dtype = next(model.parameters()).dtype
    reduce_dtype = FSDP_REDUCE_DTYPE or weights_dtype
    mp = MixedPrecisionPolicy(param_dtype=FSDP_COMPUTE_DTYPE, reduce_dtype=reduce_dtype)
    blocks = [*model.encoder.block, *model.decoder.block]
    for block in blocks:
        # With cuda_graphs the last block to run forward keeps its gathered weights for its backward, which
        # comes right after: torchtitan captures FSDP2 so, having found that resharding that block too makes
        # a capture depend on an event of uncaptured work (CUDA_ERROR_STREAM_CAPTURE_ISOLATION).
        kept = cfg.cuda_graphs and block is blocks[-1]
        fully_shard(block, mp_policy=mp, reshard_after_forward=cfg.fsdp_reshard_after_forward and not kept)
    fully_shard(loss_module, mp_policy=mp)
    if device.type == "cuda":
        # Sharding freed the whole weights each rank loaded. Cached, that memory would serve the default
        # stream only, not FSDP2's streams nor a CUDA graph's warm-up stream: it would add to their peak.
        torch.cuda.empty_cache()
    kept_note = ""
    if not cfg.fsdp_reshard_after_forward:
        kept_note = ", gathered weights kept from forward to backward"
    elif cfg.cuda_graphs:
        kept_note = ", the last block's gathered weights kept for its backward (cuda_graphs)"
    log.info(
        "distributed: FSDP2 over %d ranks, %d T5 blocks + root, bf16 compute, %s gradient reduction %s, "
        "%s sharded weights and optimizer states%s",
        world_size(),
        len(blocks),
        {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(reduce_dtype, str(reduce_dtype)),
        "after every micro-batch" if cfg.fsdp_sync_each_micro_batch else "once per optimizer step",
        weights_dtype,
        kept_note,
    )
    return loss_module

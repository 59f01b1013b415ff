"""Several processes under torchrun: the process group, DDP or FSDP2 around the model, sums across ranks.

torchrun starts one process per GPU and sets RANK, WORLD_SIZE and LOCAL_RANK. With WORLD_SIZE 1 (or unset)
no process group is started and every helper here is a no-op, so a single-process run is unchanged.

- `ddp`: every rank holds the whole model, its gradients and the optimizer states; gradients are averaged
  across ranks once per optimizer step (the other micro-batches run under `no_sync`).
- `fsdp` (FSDP2, `fully_shard`): weights, gradients and optimizer states are split across ranks. Each T5 block
  is one unit, the root (embeddings, LM head, final norms) another. A unit's weights are all-gathered in bf16
  just before use and freed after; gradients are reduce-scattered in fp32; the sharded weights and the
  optimizer states keep cfg.dtype (fp32 weights give fp32 AdamW states).

What DDP or FSDP wraps is the loss module (`trainer.loss.Seq2SeqLMLoss` around the HF model), so their hooks
see the whole step, the LM head's direct use in the loss included. The HF model inside keeps its parameter
names, which is what checkpoints store: they load whatever the strategy and the number of ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as torchrun sets them; (0, 1, 0) for a plain process."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def quiet_other_ranks() -> None:
    """Ranks other than 0 log warnings and errors only, so the console shows each message once."""
    if env()[0] != 0:
        logging.getLogger("trainer").setLevel(logging.WARNING)


def init(device: torch.device) -> None:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); nothing for a single process."""
    world_size = env()[1]
    if world_size <= 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    log.info("process group: %d ranks, backend %s", world_size, dist.get_backend())


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sums over ranks, in float64 (token counts stay exact); one all-reduce."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on one."""
    return all_sum([1.0 if flag else 0.0])[0] > 0


def wrap(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """The module the loop calls for the loss: `model` itself for one process, else DDP or FSDP2 around
    `Seq2SeqLMLoss(model)`. Build the optimizer afterwards (FSDP replaces the parameters by shards)."""
    if not is_distributed():
        return model
    from trainer.loss import Seq2SeqLMLoss

    loss_module = Seq2SeqLMLoss(model)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            loss_module,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no second copy
        )
        log.info("distributed: DDP over %d ranks", world_size())
        return wrapped
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = [*model.encoder.block, *model.decoder.block]
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(loss_module, mp_policy=mp)
    log.info(
        "distributed: FSDP2 over %d ranks, %d T5 blocks + root, bf16 compute, fp32 gradient reduction, "
        "%s sharded weights and optimizer states",
        world_size(),
        len(blocks),
        next(model.parameters()).dtype,
    )
    return loss_module


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (what runs without collectives); FSDP modules are their own."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def gradient_sync(module: torch.nn.Module, sync: bool):
    """Context for one micro-batch's forward+backward: DDP all-reduces gradients only when `sync` (the last
    micro-batch of a step). FSDP reduce-scatters every micro-batch: its gradients stay sharded, which is
    why it is used."""
    from torch.nn.parallel import DistributedDataParallel

    if not sync and isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def full_weights(module: torch.nn.Module):
    """FSDP: the root's weights (embeddings, LM head) gathered for code that calls the HF model's parts
    directly, e.g. `generate`; the blocks gather their own. Collective: every rank must enter."""
    if not is_sharded(module):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The total L2 norm of `params`' gradients (a device scalar), over all ranks for FSDP's sharded ones."""
    from torch.distributed.tensor import DTensor

    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return total

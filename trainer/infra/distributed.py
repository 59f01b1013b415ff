"""Several processes under torchrun: the process group, the two strategies, sums across ranks, and what a
rank does when another one dies.

torchrun starts one process per GPU and sets RANK, WORLD_SIZE and LOCAL_RANK. With WORLD_SIZE 1 (or unset)
no process group is started and every helper here is a no-op, so a single-process run is unchanged.

- `ddp` (replicated data parallel): every rank holds the whole model, its gradients and the optimizer states,
  and trains exactly as one process does (the same memory, the weight gradients added into `.grad` by the
  matmuls, the Adafactor kernels, CUDA graphs). Rank 0's weights are broadcast once at the start; the
  gradients are views of one flat buffer per dtype (`GradientBuffer`, as in a single process), summed over
  ranks in place by one all-reduce after the step's last micro-batch. With gradient accumulation torch's DDP
  would overlap its bucketed all-reduce with the last micro-batch's backward only; its buckets took memory
  beyond one process's, it needs autograd's own gradient accumulation (no in-place weight gradients), and a
  CUDA graph cannot replay its hooks.
- `fsdp` (FSDP2, `fully_shard`): weights, gradients and optimizer states are split across ranks. Each T5 block
  is one unit, the root (embeddings, LM head, final norms) another. A unit's weights are all-gathered in bf16
  just before use; gradients are reduce-scattered in cfg.dtype (bf16 weights: as ddp all-reduces them); the
  sharded weights and the optimizer states keep cfg.dtype. `fsdp_reshard_after_forward: false` keeps each
  block's gathered weights from its forward to its backward (no second all-gather, the whole model's bf16
  weights on every GPU); `fsdp_sync_each_micro_batch: false` reduce-scatters once per optimizer step (the
  whole model's gradients on every GPU until then).

What FSDP wraps is the loss module (`trainer.model.loss.Seq2SeqLMLoss` around the HF model), so its hooks see
the whole step, the LM head's direct use in the loss included. The HF model inside keeps its parameter names,
which is what checkpoints store: they load whatever the strategy and the number of ranks.

The process group has a CPU backend (gloo) beside NCCL: the numbers the ranks agree on (token counts, stop
flags, an out-of-memory flag) go through it, so agreeing never waits for the GPU. A rank that dies (a crash,
a kill) ends the others: torchrun stops the ranks of its node and the collectives of the others fail
(`PeerLost`, one line); a rank that vanishes without closing its connections (a machine that went down)
is given up after `ddp_timeout` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.infra.stopping import PeerLost

log = logging.getLogger(__name__)

# Where each gradient starts in a GradientBuffer: as the caching allocator aligns its blocks, so
# that the matmuls writing into them and the Adafactor kernels (16-byte vector loads) see what they would see
# for gradients of their own.
GRADIENT_ALIGNMENT_BYTES = 512


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


def init(device: torch.device, timeout_s: float | None = None) -> None:
    """Join torchrun's process group: NCCL for CUDA tensors and gloo for CPU tensors on a GPU, gloo alone on
    the CPU; nothing for a single process. A collective that waits `timeout_s` seconds for another rank
    fails (None: torch's default)."""
    world_size = env()[1]
    if world_size <= 1 or dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
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


@contextlib.contextmanager
def collective(what: str):
    """Around a collective: a failure because another rank is gone becomes one PeerLost line naming this
    rank and what it was doing (gloo: the peer closed its connection; NCCL: a communicator error)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, PeerLost):
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        message = (
            f"rank {rank()} stops: {what} failed because another process of this run ended or cannot be "
            f"reached ({reason}); the log of the rank that failed first says why"
        )
        # Said now: torchrun stops this process soon after the other one ended, maybe before it unwinds.
        log.error("%s", message)
        raise PeerLost(message) from None


def barrier(group=None) -> None:
    if is_distributed():
        with collective("a barrier"):
            dist.barrier(group=group)


def background_group():
    """A gloo process group of every rank, for collectives of a background thread (checkpoint writes): two
    threads' collectives on one group would interleave in another order on each rank. None for one process.
    Collective: every rank makes it."""
    if not is_distributed():
        return None
    with collective("making a process group for background writes"):
        return dist.new_group(backend="gloo")


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    with collective("a broadcast"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sums over ranks, in float64 (token counts stay exact); one all-reduce on the CPU backend,
    which never waits for the GPU."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    with collective("agreeing on the step"):
        dist.all_reduce(t)
    return t.tolist()


def ranks_where(flag: bool) -> list[int]:
    """The ranks where `flag` is true, on every rank (one all-reduce); [0] or [] for one process."""
    if not is_distributed():
        return [0] if flag else []
    marks = [0.0] * world_size()
    marks[rank()] = 1.0 if flag else 0.0
    return [r for r, mark in enumerate(all_sum(marks)) if mark > 0]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (this rank's FSDP2 shard); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class GradientBuffer:
    """The gradients of `params` as views of one flat buffer per dtype, allocated once before the first
    activation, each view starting at a multiple of GRADIENT_ALIGNMENT_BYTES. Gradients that autograd
    allocates in the first backward land between that micro-step's activations and leave the caching
    allocator's memory fragmented for the rest of the run; a buffer made first does not. The gradients stay
    where they are from step to step (zeroed in place), as a CUDA graph needs them. Under `ddp` with several
    ranks they are summed over ranks in place by one all-reduce per buffer (`all_reduce`), with no memory
    beyond the gradients themselves."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        sizes: dict[torch.dtype, int] = {}
        offsets = []
        for p in params:
            align = max(1, GRADIENT_ALIGNMENT_BYTES // p.element_size())
            start = -(-sizes.get(p.dtype, 0) // align) * align
            offsets.append(start)
            sizes[p.dtype] = start + p.numel()
        device = params[0].device
        self.buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self.views = [
            self.buffers[p.dtype][start : start + p.numel()].view_as(p)
            for p, start in zip(params, offsets, strict=True)
        ]
        # Attached at the first step (`attach`), not now: a checkpoint's optimizer states load into states the
        # optimizer makes from a step on zero gradients, which torch.distributed.checkpoint skips when
        # gradients exist.

    def attach(self) -> None:
        """Every gradient its view of the buffer again: a gradient set to None (`zero_grad(set_to_none=True)`
        after running out of memory) becomes its zeroed view; one made elsewhere is copied into it."""
        with torch.no_grad():
            for p, view in zip(self.params, self.views, strict=True):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view

    def all_reduce(self) -> None:
        """Sum every rank's gradients in place (queued on the GPU: the host does not wait); nothing with one
        process."""
        if not is_distributed():
            return
        with collective("summing the gradients"):
            for buffer in self.buffers.values():
                dist.all_reduce(buffer)


def gradient_buffer(train_module: torch.nn.Module) -> GradientBuffer | None:
    """The gradient buffer of `train_module`'s trainable weights; None under FSDP2, whose gradients are
    shards that it makes itself."""
    if is_sharded(train_module):
        return None
    return GradientBuffer([p for p in train_module.parameters() if p.requires_grad])


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
    """The total L2 norm of `params`' gradients (a device scalar). FSDP's sharded gradients: the norm of
    each rank's shards, squared, summed over ranks by one all-reduce on the GPU."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params]
    if not grads or not isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(grads)
    squared = torch.nn.utils.get_total_norm([g.to_local() for g in grads]).float().square()
    with collective("summing the gradient norm"):
        dist.all_reduce(squared, group=grads[0].device_mesh.get_group())
    return squared.sqrt()

"""A training micro-step (forward, backward, gradient accumulation) captured once as a CUDA graph and replayed
for every micro-batch of the same shape (`cuda_graphs: true`).

An eager micro-step launches ~5k kernels from Python. At the preset's 32k-token micro-batches the GPU is
busier than the host; at 8k tokens the host is the limit, and small micro-batches are what lets every decoder
block keep its activations (no recompute) in 32 GiB. A replayed graph costs the host one call, so small
micro-batches run at the GPU's pace (bench/cuda_graphs.py). Packed batches (`packing: true`) make that
possible: every micro-batch of a run has one shape.

How: the first WARMUP micro-steps of a shape run eagerly on a side stream (lazy initialisation; every
gradient then exists), the next one is captured over static input tensors (torch.cuda.graph: nothing runs
while capturing) and replayed, and so is every later one: its batch is copied into the static inputs, its
scale (1 / the step's target tokens) into a static scalar. The graph adds into the gradients where they are,
so they must stay: the update zeroes them in place (`zero_grad(set_to_none=False)`). Dropout stays random:
the graph draws from torch's CUDA generator, whose offset every replay advances. A new shape warms up first.
Gradients that were freed or moved, or `reset()` (before an evaluation, after running out of memory: the
graph's memory pool holds a micro-step's activations) capture again at the next micro-step of a warm shape:
an eager micro-step's cached blocks would come on top of the memory the run holds by then.

Under torchrun (`ddp`) every rank replays its own graphs; the all-reduce of the gradients runs between the
last micro-step and the update, outside both graphs. Under FSDP2 (`fsdp`) the graph holds the micro-step's
collectives too, as torchtitan captures them: FSDP2's hooks run once, while capturing, and its all-gathers
and reduce-scatters are replayed on their own streams, overlapping the blocks' compute as in an eager step;
the reduce-scattered gradients add into the sharded gradients where they are. The ranks capture together
(their micro-steps are in step). The update, whose two all-reduces go through the host's process group,
runs eagerly (`capture_update` false): once per optimizer step, not per micro-step.

The optimizer step (trainer.optim.adafactor_optimizer.Adafactor) is captured too, into the micro-step graph's
memory pool: its fp32 scratch reuses the activations' memory instead of coming on top of it, and its kernels
(a few per weight shape, trainer.kernels.adafactor_kernels) cost the host one replay. The host keeps the step
counts and queues the step's scalars before each replay (`Adafactor.advance`, which the loop calls while the
GPU is still on the backward); the graph is the update itself (`apply`). The first update runs eagerly (it
makes the optimizer's states), after the micro-step graph is dropped, to be captured again.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from trainer.infra.distributed import local_shard

# Other threads use the GPU while this one captures: NCCL's watchdog under torchrun queries its events, the
# background checkpoint writer runs. In CUDA's default (global) capture mode another thread's call ends the
# capture with an error (a run on one GPU failed so during its second background save); in this mode only
# the capturing thread's calls are checked. (The collectives stay outside the graphs.)
CAPTURE_MODE = "thread_local"

if TYPE_CHECKING:
    from trainer.optim.adafactor_optimizer import Adafactor

log = logging.getLogger(__name__)

WARMUP = 2  # eager micro-steps of a shape before its capture


class MicroStepGraph:
    """`run(batch, scale)`: `(loss_fn(**batch) * scale).backward()` and the detached loss, as a replayed CUDA
    graph once its shape is warm. `params`: the trainable parameters (their gradients are the graph's)."""

    def __init__(self, loss_fn, params: list[torch.nn.Parameter], capture_update: bool = True):
        self.loss_fn = loss_fn
        self.params = params
        self.capture_update = capture_update
        self.graph: torch.cuda.CUDAGraph | None = None
        self.update_graph: torch.cuda.CUDAGraph | None = None  # the optimizer's update, in the graph's pool
        self.update_key: tuple | None = None  # the update's layout (Adafactor.advance)
        self.stepped = False  # an update ran eagerly: the optimizer's states exist
        self.key: tuple | None = None  # the captured shape and gradient addresses
        self.static: dict[str, torch.Tensor] = {}
        self.scale: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.warm: dict[tuple, int] = {}  # eager micro-steps run so far, per shape
        self.side = torch.cuda.Stream()
        self.captures = 0
        self.capture_seconds = 0.0  # the host's time in captures, with their syncs (the run's goodput)

    def run(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        shape = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()))
        key = (shape, self._grad_addresses())
        if self.graph is None or key != self.key:
            if self.warm.get(shape, 0) < WARMUP:
                self.warm[shape] = self.warm.get(shape, 0) + 1
                return self._eager(batch, scale)
            self._capture(batch, key)
        for k, v in batch.items():
            self.static[k].copy_(v, non_blocking=True)
        self.scale.fill_(scale)
        self.graph.replay()
        return self.loss.clone()

    def update(self, optimizer: Adafactor, layout: tuple) -> None:
        """Adafactor's `apply` for the step its `advance` prepared (`layout`, what advance returned), replayed
        from a graph in the micro-step graph's memory pool once that graph exists (eagerly without
        `capture_update`)."""
        if not self.capture_update:
            optimizer.step()
            return
        if self.graph is None or not self.stepped:
            if self.graph is not None:
                # The first update runs eagerly, after `advance` made the optimizer's states outside the
                # graph's pool: its scratch would come on top of that pool, given back first (the micro-step
                # is captured again).
                self.reset()
            optimizer.step()  # `step`, not `apply`: torch's scheduler checks that the optimizer stepped first
            self.stepped = True
            return
        if self.update_graph is None or layout != self.update_key:
            self.update_graph = None
            graph = torch.cuda.CUDAGraph()
            # Its temporaries reuse the pool's free blocks (the micro-step's activations); the two graphs
            # replay in the order they were captured, never at once, as sharing a pool requires.
            before, started = torch.cuda.memory_reserved(), time.monotonic()
            try:
                with torch.cuda.graph(
                    graph, pool=self.graph.pool(), stream=self.side, capture_error_mode=CAPTURE_MODE
                ):
                    optimizer.apply()
            except BaseException:
                self.reset()
                raise
            self.capture_seconds += time.monotonic() - started
            self.update_graph, self.update_key = graph, layout
            grown = (torch.cuda.memory_reserved() - before) / 2**30
            log.info(
                "cuda_graphs: optimizer update captured in the micro-step's memory pool (%+.2f GiB)", grown
            )
        self.update_graph.replay()

    def reset(self) -> None:
        """Drop the graphs and their memory pool; the next micro-step captures again."""
        had_graph = self.graph is not None
        if had_graph:
            # The last replay may still be running on the current stream. The allocator waits only for the
            # capture's stream before it unmaps the pool's memory (expandable segments), so a replay still
            # in flight would read and write unmapped memory: an illegal memory access, at random, more
            # often on a busy GPU.
            torch.cuda.synchronize()
        self.graph, self.key, self.static, self.scale, self.loss = None, None, {}, None, None
        self.update_graph, self.update_key = None, None
        if had_graph:
            torch.cuda.empty_cache()  # the pool's memory back to the device: for an evaluation, a new capture

    def _grad_addresses(self) -> tuple[int, ...]:
        """Where each gradient lies (under FSDP2 its local shard), 0 for none."""
        return tuple(0 if p.grad is None else local_shard(p.grad).data_ptr() for p in self.params)

    def _eager(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            loss = self.loss_fn(**batch)
            (loss * scale).backward()
            loss = loss.detach()
        torch.cuda.current_stream().wait_stream(self.side)
        return loss

    def _capture(self, batch: dict[str, torch.Tensor], key: tuple) -> None:
        started = time.monotonic()
        self.reset()
        for p in self.params:  # the graph adds into gradients that exist
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        key = (key[0], self._grad_addresses())
        self.static = {k: torch.empty_like(v) for k, v in batch.items()}
        self.scale = torch.zeros((), dtype=torch.float32, device=batch["labels"].device)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's cached activations: the graph allocates from its own pool
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        try:
            # On the warm-up's stream: autograd's nodes of an earlier micro-step stay on theirs, and a
            # capture on another would leave their gradient accumulation out.
            with torch.cuda.graph(graph, stream=self.side, capture_error_mode=CAPTURE_MODE):
                loss = self.loss_fn(**self.static)
                (loss * self.scale).backward()
                self.loss = loss.detach()
        except BaseException:
            self.reset()
            raise
        self.graph, self.key = graph, key
        self.captures += 1
        self.capture_seconds += time.monotonic() - started
        rows = {k: tuple(v.shape) for k, v in batch.items() if k in ("input_ids", "labels")}
        pool = (torch.cuda.memory_reserved() - before) / 2**30
        log.info(
            "cuda_graphs: micro-step captured for micro-batches of %s (capture %d, memory pool %.2f GiB)",
            rows,
            self.captures,
            pool,
        )

"""Checkpoints written in the background: the loop stops only while the state is copied off the GPU.

A checkpoint of FLAN-T5-XL is ~17 GB (the weights twice, the Kahan buffer, the optimizer's states); written in
the loop it stopped training for ~30 s. Here `save` takes the contents of a step boundary
(trainer.checkpoint.store.gather_checkpoint), copies their tensors into host memory (`HostStager`: page-locked
buffers kept from one save to the next, non-blocking copies and one wait for the GPU) and returns; a daemon
thread writes the copy (trainer.checkpoint.store.write_checkpoint: the temporary directory, the completion
marker last, the rename) while the next steps train. Under torchrun every rank stages and writes its own part,
the writers' collectives on a gloo group of their own (trainer.infra.distributed.background_group).

What holds, as for checkpoints written in the loop:
- a checkpoint directory exists only complete (the write is the same function, renamed into place last);
  a run killed at any moment leaves complete checkpoints and a temporary directory the next run removes;
- the next save waits for the previous write (one write in flight; the staged buffers are reused);
- a write that fails (a full disk: one line) fails the run at the next step boundary, as it would have there;
- the end of the run, a signal's save and an error's save wait for the write in flight;
- what follows a checkpoint (removing the ones past save_total_limit, the Hub's staging, the reports) runs
  once it is written (`written`), on the loop's thread.

A machine whose free host memory cannot hold a checkpoint's tensors saves in the loop instead, said once
(`background_saves`); the copy needs as much host memory as the checkpoint's tensors (`trainer plan` shows
it).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import mmap
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from trainer.checkpoint.store import CheckpointContents, write_checkpoint
from trainer.infra import distributed

log = logging.getLogger(__name__)

# Host memory a staged copy must leave free: the loader's threads, the Hub's uploads, the OS's page cache.
HOST_MEMORY_RESERVE_BYTES = 4 << 30


@dataclass(frozen=True)
class Written:
    """A checkpoint written: its step, its directory, and the seconds the write took."""

    step: int
    path: Path
    seconds: float


def tensor_bytes(state) -> int:
    """The bytes of the tensors in a (nested) state dict as a staged copy holds them: each tensor once (tied
    weights, the same view under several names, are one)."""
    return sum(
        distributed.local_shard(t).numel() * distributed.local_shard(t).element_size()
        for t in _skeleton(state)[1]
    )


def background_saves(needed_bytes: int, available_bytes: int | None) -> str | None:
    """None when a staged copy of `needed_bytes` fits in `available_bytes` of free host memory (with
    HOST_MEMORY_RESERVE_BYTES left); else why saves stay in the loop, in a few words."""
    if available_bytes is None:
        return None
    if needed_bytes + HOST_MEMORY_RESERVE_BYTES > available_bytes:
        gib = 1 << 30
        return (
            f"a checkpoint's tensors take {needed_bytes / gib:.1f} GiB and the host has "
            f"{available_bytes / gib:.1f} GiB free ({HOST_MEMORY_RESERVE_BYTES / gib:.0f} GiB kept)"
        )
    return None


def available_host_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # no psutil, or a system it cannot read: decide as if it fits
        return None


class HostStager:
    """Copies of a state's tensors in host memory, in buffers kept from one save to the next (page-locked
    where the tensors are on a GPU: the copies run at the bus's speed, and XL's ~10 GB of page-locked memory
    is not allocated again at every save). FSDP's DTensors are copied as their local shards and come back as
    DTensors.

    Not PyTorch's own stager (torch.distributed.checkpoint.staging.DefaultStager): torch 2.11's fails at
    every save after the first (a KeyError on `dict`, seen on a GPU machine), and the copy is simple enough
    to own. Nor PyTorch's pinned allocator (`pin_memory=True`): it rounds every block up to a power of two,
    which would page-lock ~14 GB for XL's 10."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._locked: dict[int, int] = {}  # buffer index -> the address registered with CUDA
        weakref.finalize(self, _unlock, self._locked)

    def reserve(self, state: dict) -> None:
        """Allocate the buffers `stage` copies a state of this structure into, copying nothing."""
        # Page-locking refused: `stage` allocates what is missing, and says so if it fails again.
        with contextlib.suppress(TypeError, RuntimeError):
            self._fit(_skeleton(state)[1])

    def stage(self, state: dict) -> dict:
        """`state` with each tensor copied into host memory (a tensor met twice: one copy) and everything
        else deep-copied. The buffers are written over at the next call: the write of this copy must be done
        by then (CheckpointWriter.save waits for it)."""
        from torch.distributed.tensor import DTensor

        skeleton, tensors = _skeleton(state)
        self._fit(tensors)
        copies, on_gpu = [], False
        for i, tensor in enumerate(tensors):
            local, buffer = distributed.local_shard(tensor), self._buffers[i]
            on_gpu = on_gpu or local.is_cuda
            buffer.copy_(local, non_blocking=local.is_cuda)
            if isinstance(tensor, DTensor):
                # Its spec around the host copy, as PyTorch's stager does (DTensor.from_local would move the
                # copy back to the mesh's GPU).
                buffer = DTensor(buffer, tensor._spec, requires_grad=False)
            copies.append(buffer)
        if on_gpu:
            torch.cuda.synchronize()  # the copies are done before the writer reads them

        def fill(x):
            if isinstance(x, _TensorSlot):
                return copies[x.index]
            if isinstance(x, dict):
                return type(x)((k, fill(v)) for k, v in x.items())
            if type(x) in (list, tuple):
                return type(x)(fill(v) for v in x)
            return x

        return fill(skeleton)

    def _fit(self, tensors: list[torch.Tensor]) -> None:
        """Buffers for `tensors`, made anew where none fits (the first save, a new shape). Page-locking runs
        on a thread of its own: a refused cudaHostRegister stays the calling thread's last CUDA error, which
        that thread's next kernel launch would raise."""
        locals_ = [distributed.local_shard(t) for t in tensors]
        missing = [
            i
            for i, like in enumerate(locals_)
            if i >= len(self._buffers)
            or self._buffers[i].shape != like.shape
            or self._buffers[i].dtype != like.dtype
        ]
        if not missing:
            return
        failed: list[BaseException] = []

        def make() -> None:
            try:
                for i in missing:
                    if i in self._locked:
                        _unlock({i: self._locked.pop(i)})
                    buffer = _host_buffer(locals_[i])
                    if locals_[i].is_cuda and buffer.numel():
                        self._locked[i] = buffer.data_ptr()
                    if i < len(self._buffers):
                        self._buffers[i] = buffer
                    else:
                        self._buffers.append(buffer)
            except BaseException as e:
                failed.append(e)

        maker = threading.Thread(target=make, name="checkpoint-buffers", daemon=True)
        maker.start()
        maker.join()
        if failed:
            raise failed[0]

    def close(self) -> None:
        _unlock(self._locked)
        self._buffers = []


def _view(tensor: torch.Tensor) -> object:
    """What makes two tensors the same data: a model's state dict holds a tied weight as a tensor per name,
    each a view of one storage."""
    local = distributed.local_shard(tensor)
    if local.device.type == "meta" or local.numel() == 0:
        return id(tensor)
    storage = local.untyped_storage().data_ptr()
    return (local.device, storage, local.storage_offset(), local.shape, local.stride(), local.dtype)


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped as `like`; where `like` is on a GPU, page-locked memory of exactly its
    size: an anonymous mapping of its own (no other buffer shares its pages) registered with CUDA."""
    nbytes = like.numel() * like.element_size()
    if not like.is_cuda or nbytes == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    buffer = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=like.dtype).view(like.shape)
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if error != cudart.cudaError.success:
        raise RuntimeError(
            f"page-locking {nbytes:,} bytes of host memory: {cudart.cudaGetErrorString(error)}"
        )
    return buffer


def _unlock(locked: dict[int, int]) -> None:
    """Unregister the page-locked buffers in `locked` from CUDA (before their memory is unmapped)."""
    for address in locked.values():
        torch.cuda.cudart().cudaHostUnregister(address)
    locked.clear()


@dataclass(frozen=True)
class _TensorSlot:
    index: int


def _skeleton(state: dict) -> tuple[dict, list[torch.Tensor]]:
    """`state` with each tensor replaced by its slot in the list of its tensors (in order of first
    appearance, the same data met twice once: `_view`) and everything else deep-copied; and that list."""
    tensors: list[torch.Tensor] = []
    index: dict[object, int] = {}

    def strip(x):
        if isinstance(x, torch.Tensor):
            key = _view(x)
            if key not in index:
                index[key] = len(tensors)
                tensors.append(x)
            return _TensorSlot(index[key])
        if isinstance(x, dict):  # a model's state dict is an OrderedDict
            return type(x)((k, strip(v)) for k, v in x.items())
        if type(x) in (list, tuple):
            return type(x)(strip(v) for v in x)
        return copy.deepcopy(x)

    return strip(state), tensors


class CheckpointWriter:
    """`save(contents)` after each gather_checkpoint; `written()` at each step boundary; `wait()` where the
    run must not go on before the write is done (the end, a signal, an error). One per run."""

    def __init__(self, background: bool = True, group=None):
        self.background = background
        self.group = group  # the background writes' process group under torchrun (background_group)
        self._stager = None
        self._thread: threading.Thread | None = None
        self._writing: CheckpointContents | None = None
        self._started = 0.0
        self._result: Written | BaseException | None = None
        self._written: list[Written] = []
        self._decided = False
        self._reserving: threading.Thread | None = None

    @property
    def wants_buffers(self) -> bool:
        """Whether `reserve` has host buffers to allocate: background saves, nothing reserved or staged."""
        return self.background and self._stager is None and not self._decided

    def reserve(self, dcp_state: dict) -> None:
        """Allocate the host buffers the first background save copies `dcp_state` (the model's and the
        optimizer's state dicts, as they will be saved) into, in a thread beside training: page-locking ~10 GB
        takes seconds, which the first save would otherwise pause for. Nothing where host memory is short (the
        first save decides, and says so)."""
        if not self.wants_buffers:
            return
        if background_saves(tensor_bytes(dcp_state), available_host_bytes()) is not None:
            return
        self._stager = HostStager()
        self._reserving = threading.Thread(
            target=self._stager.reserve, args=(dcp_state,), name="checkpoint-buffers", daemon=True
        )
        self._reserving.start()

    def _reserved(self) -> None:
        """Until `reserve`'s allocation is done."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def save(self, contents: CheckpointContents) -> bool:
        """Write `contents`: in the background once staged (True), or here when host memory is short
        (False). Waits for the previous write first (its error, if it failed, is raised)."""
        self.wait()
        self._reserved()
        staged = None
        if self.background:
            why = None
            if not self._decided:
                self._decided = True
                why = background_saves(tensor_bytes(contents.dcp_state), available_host_bytes())
            staged = self._stage(contents) if why is None else None
            if why is None and staged is None:
                why = "the state cannot be copied to host memory here (see the warning above)"
            # Every rank writes the same way: one writing in the loop and another in the background would
            # wait for each other on different process groups.
            others = distributed.all_sum([float(why is not None)])[0] > (why is not None)
            if why is not None or others:
                self.background, staged = False, None
                if self._stager is not None:  # reserved before the decision: not needed
                    self._stager.close()
                    self._stager = None
                log.warning(
                    "checkpoints: written in the loop, not in the background: %s",
                    why or "another rank cannot copy its state to host memory",
                )
        if staged is None:
            started = time.monotonic()
            path = write_checkpoint(contents)
            self._written.append(Written(contents.step, path, time.monotonic() - started))
            return False
        self._writing, self._started, self._result = staged, time.monotonic(), None
        self._thread = threading.Thread(target=self._write, name="checkpoint-writer", daemon=True)
        self._thread.start()
        return True

    def _stage(self, contents: CheckpointContents) -> CheckpointContents | None:
        """`contents` with every tensor copied into host memory (the weights for model.safetensors are the
        same copy as dcp/'s model state, or already in host memory: FSDP's gathered); None, said once, where
        the copy fails (page-locking refused): saves stay in the loop."""
        try:
            if self._stager is None:
                self._stager = HostStager()
            dcp_state = self._stager.stage(contents.dcp_state)
        except (TypeError, RuntimeError) as e:
            log.warning(
                "checkpoints: the state cannot be copied to host memory here (%s: %s)",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            return None
        weights = contents.weights
        if weights is contents.dcp_state["model"]:
            weights = dcp_state["model"]
        return replace(contents, dcp_state=dcp_state, weights=weights)

    def _write(self) -> None:
        contents = self._writing
        try:
            path = write_checkpoint(contents, self.group)
            self._result = Written(contents.step, path, time.monotonic() - self._started)
        except BaseException as e:  # raised on the loop's thread, at its next look (`written`, `wait`)
            self._result = e

    def wait(self) -> None:
        """Until the write in flight is done; raises its error. An interrupt while waiting (a second Ctrl-C)
        abandons the write: its temporary directory is removed, and the interrupt goes on."""
        if self._thread is None:
            return
        try:
            while self._thread.is_alive():
                self._thread.join(timeout=0.2)  # short joins: a signal's handler runs in between
        except KeyboardInterrupt:
            if distributed.rank() == 0 and self._writing is not None:
                shutil.rmtree(self._writing.tmp, ignore_errors=True)
            self._thread = self._writing = None
            raise
        self._collect()

    def written(self) -> list[Written]:
        """The checkpoints written since the last call, without waiting; raises the error of a write that
        failed."""
        if self._thread is not None and not self._thread.is_alive():
            self._collect()
        done, self._written = self._written, []
        return done

    def _collect(self) -> None:
        result, self._thread, self._writing = self._result, None, None
        if isinstance(result, BaseException):
            raise result
        if result is not None:
            self._written.append(result)

    @property
    def in_flight(self) -> int | None:
        """The step of the checkpoint being written in the background, or None (none, or done)."""
        alive = self._thread is not None and self._thread.is_alive()
        return self._writing.step if alive and self._writing is not None else None

    def abandon(self) -> None:
        """Leave the write in flight unfinished (an interrupt: the process ends now): its temporary directory
        is removed; the thread, a daemon, ends with the process."""
        writing = self._thread is not None and self._thread.is_alive() and self._writing is not None
        if writing and distributed.rank() == 0:
            shutil.rmtree(self._writing.tmp, ignore_errors=True)
        self._thread = self._writing = None

    def close(self) -> None:
        """Wait for the write in flight, and free the staged buffers."""
        try:
            self.wait()
        finally:
            self._reserved()
            if self._stager is not None:
                self._stager.close()
                self._stager = None

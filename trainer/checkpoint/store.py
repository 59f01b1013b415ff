"""Atomic, resumable checkpoints: `<output_dir>/checkpoint-<step>/`, for one process or several.

A checkpoint is written into `checkpoint-<step>.tmp-<pid of rank 0>` and renamed into place only once
complete, and its last file is the completion marker `trainer_state.json`; a directory without it (a run
killed mid-write) is never picked for resume. A write that fails (a full disk: one line, trainer.infra.disk)
or is interrupted (a second Ctrl-C) removes its temporary directory; one a killed run left behind is removed
by the next run once it holds output_dir's lock (`remove_stale_temporaries`). A checkpoint is deleted
(rotation, a save of the same step again) by renaming it out of the checkpoints' names first (`delete_tree`),
so a kill mid-way leaves a stale temporary too, never a half checkpoint under its name. Contents:

- `dcp/`: model weights and optimizer states through `torch.distributed.checkpoint` (DCP), keyed by parameter
  name. Each rank writes its own part (with FSDP, its shards) and DCP re-splits on load, so a checkpoint saved
  by 2 ranks resumes on 1, 4, or with the other strategy. This is what resume loads the optimizer from.
- `model.safetensors` + `config.json`: the whole model via save_pretrained (rank 0, FSDP shards gathered), so
  any checkpoint loads with `from_pretrained` (the best one, for evaluation); resume builds the model from it.
  A LoRA run (trainer.model.lora) saves its adapter instead, in PEFT's format (`adapter_model.safetensors`,
  `adapter_config.json` naming the base), and dcp/ holds the adapters and their optimizer states alone: the
  frozen base is the config's model_name_or_path, which resume loads again.
- `tokenizer.json` and `recipe_template.json` (the prompt template, trainer.data.prompt): with the two above,
  the checkpoint generates on its own (`trainer generate --model <output_dir>/checkpoint-<step>`).
- `scheduler.pt`; `rng.pt` (python, numpy, torch, cuda) and `rng-<rank>.pt` for the other ranks.
- `trainer_state.json`: Hugging Face's TrainerState keys (global_step, epoch, log_history, best_metric,
  best_global_step, best_model_checkpoint), then step, loader position, world size, config, W&B run id,
  OOM-adjusted micro-batch, the best evaluation and the early-stopping count
  (trainer.run.run_state.RunState.trainer_state).

A save is two parts: `gather_checkpoint` takes the state at a step boundary (collective), `write_checkpoint`
writes it; trainer.checkpoint.writer runs the second in a background thread from a copy in host memory, so
that training goes on meanwhile (`save_checkpoint` runs both here). Which checkpoint a run resumes from and
how: trainer.checkpoint.resume; the finished model (`final/`): trainer.checkpoint.export.

Several ranks: every rank calls `save_checkpoint` (it is collective); the output directory must be one shared
filesystem for all of them (a multi-node run needs a network filesystem there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from trainer.data.prompt import save_prompt_template
from trainer.infra import disk, distributed
from trainer.model.model_files import write_config

log = logging.getLogger(__name__)

MARKER = "trainer_state.json"
NAME = re.compile(r"^checkpoint-(\d+)$")  # a checkpoint directory's name: checkpoint-<step>


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class CheckpointContents:
    """What checkpoint-<step> holds, taken at a step boundary (`gather_checkpoint`) and written by
    `write_checkpoint`, at once or, from a host-memory copy (trainer.checkpoint.writer), in the background."""

    step: int
    output_dir: Path
    tmp: Path  # rank 0's temporary directory, known to every rank
    dcp_state: dict[str, Any]  # {"model": ..., "optim": ...}: this rank's part, for dcp/
    weights: dict[str, Any] | None  # model.safetensors' tensors (rank 0); None: none to write (an adapter
    # is written into `tmp` by gather_checkpoint, and other ranks write none)
    model: Any  # the HF model: its config and save_pretrained (the weights come from `weights`)
    rng: dict[str, Any]
    scheduler_state: dict[str, Any]
    trainer_state: dict[str, Any]
    tokenizer_file: str | Path | None
    prompt_config: Any
    needed_bytes: int  # what the disk needs for it (the newest checkpoint's size, else an estimate)

    @property
    def final(self) -> Path:
        return self.output_dir / f"checkpoint-{self.step}"


def save_checkpoint(output_dir: str | Path, step: int, **state) -> Path:
    """Write checkpoint-<step> atomically and return its path (an existing one for `step` is replaced):
    `gather_checkpoint(output_dir, step, **state)` then `write_checkpoint`, in this thread. Collective under
    torchrun."""
    return write_checkpoint(gather_checkpoint(output_dir, step, **state))


def gather_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    tokenizer_file: str | Path | None = None,
    rng: dict[str, Any] | None = None,
    prompt_config=None,
) -> CheckpointContents:
    """What checkpoint-<step> will hold, as it is now: the state dicts (the tensors themselves, not copies:
    they change with the next step), and rank 0's temporary directory, made. Under FSDP the whole model is
    gathered to rank 0's memory for model.safetensors; a LoRA run's adapter (small) is written into the
    temporary directory at once. Collective under torchrun.

    `model` is the HF model (not FSDP's loss module around it: its parameter names are the checkpoint's
    keys). `rng`: the RNG states to store (default: the current ones); the loop passes those of the step
    boundary, since a step interrupted by a signal has already drawn dropout masks. `prompt_config`: the
    config the model trains with, whose prompt template (`recipe_template.json`) goes beside the tokenizer, so
    that the checkpoint generates on its own."""
    output_dir = Path(output_dir)
    rank = distributed.rank()
    tmp = output_dir / f"checkpoint-{step}.tmp-{os.getpid()}"
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    tmp = distributed.broadcast_object(tmp)  # rank 0's directory, made before any rank writes into it
    needed = checkpoint_bytes(output_dir) or disk.state_bytes(model, optimizer)
    dcp_state = state_dicts(model, optimizer)
    model_state = dcp_state["model"]
    weights = None
    with disk.removed_on_failure(tmp, needed_bytes=needed, remove=rank == 0):
        if is_adapter_model(model):  # LoRA (one process or DDP: every rank holds the same adapters)
            if rank == 0:
                # peft takes seconds to import: only LoRA runs import it (through trainer.model.lora)
                from trainer.model.lora import save_adapter

                save_adapter(model, tmp)
        elif not any(isinstance(t, DTensor) for t in model_state.values()):
            # One process, or ddp (every rank holds the whole model): rank 0's own weights, the same tensors
            # as dcp/'s, staged once with them; nothing to gather.
            weights = model_state if rank == 0 else None
        else:  # FSDP's shards: the whole model gathered to rank 0
            weights = whole_model_weights(model)
    return CheckpointContents(
        step=step,
        output_dir=output_dir,
        tmp=tmp,
        dcp_state=dcp_state,
        weights=weights,
        model=model,
        rng=rng if rng is not None else rng_state(),
        scheduler_state=scheduler.state_dict(),
        trainer_state=dict(trainer_state, step=step),
        tokenizer_file=tokenizer_file,
        prompt_config=prompt_config,
        needed_bytes=needed,
    )


def write_checkpoint(contents: CheckpointContents, group=None) -> Path:
    """Write `contents` into its temporary directory, the completion marker last, and rename it to
    checkpoint-<step>; returns that path. A failure or an interrupt (a second Ctrl-C) removes the partial
    directory; a full disk is one line naming the space free and needed; earlier checkpoints are untouched.
    Collective under torchrun, over `group` (default: the run's; a background thread's writes pass their
    own, trainer.infra.distributed.background_group)."""
    rank = distributed.rank()
    tmp, final = contents.tmp, contents.final
    with disk.removed_on_failure(tmp, needed_bytes=contents.needed_bytes, remove=rank == 0):
        if contents.weights is not None:
            save_pretrained(contents.model, tmp, contents.weights)
        with _one_process_is_intended():
            dcp.save(contents.dcp_state, checkpoint_id=tmp / "dcp", process_group=group)
        torch.save(contents.rng, tmp / _rng_file(rank))
        distributed.barrier(group)  # every rank's files are in place
        if rank == 0:
            if contents.tokenizer_file is not None:
                shutil.copy(contents.tokenizer_file, tmp / "tokenizer.json")
            if contents.prompt_config is not None:
                save_prompt_template(tmp, contents.prompt_config)
            torch.save(contents.scheduler_state, tmp / "scheduler.pt")
            with open(tmp / MARKER, "w", encoding="utf-8") as f:  # written last: the completion marker
                json.dump(contents.trainer_state, f, indent=2, default=str)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                delete_tree(final)
            os.rename(tmp, final)
            log.info("saved checkpoint %s", final)
    distributed.barrier(group)  # no rank reads or rotates checkpoints before the rename
    return final


def is_adapter_model(model) -> bool:
    """Whether `model` is a PEFT model (trainer.model.lora): it saves, checkpoints and loads its adapters
    alone."""
    return hasattr(model, "peft_config")


def state_dicts(model, optimizer) -> dict[str, dict]:
    """The state dicts a checkpoint's dcp/ holds (the tensors themselves): {"model": ..., "optim": ...}."""
    model_state, optim_state, _ = _states(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _states(model, optimizer) -> tuple[dict, dict, StateDictOptions]:
    """The model and optimizer state dicts DCP saves and loads, and the options to set them with: every
    weight, or a PEFT model's trained ones (its adapters; DCP's own ignore_frozen_params keeps the tied
    embedding's other names, e.g. encoder.embed_tokens.weight)."""
    if not is_adapter_model(model):
        return *get_state_dict(model, optimizer), StateDictOptions()
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_state.items() if k in trained}, optim_state, options


def whole_model_weights(model) -> dict[str, Any] | None:
    """Under torchrun, the whole model's state dict gathered into rank 0's host memory (FSDP's shards, or
    ddp's copy: final/ takes it), None on the other ranks; in one process None (the model's own).
    Collective."""
    if not distributed.is_distributed():
        return None
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full if distributed.rank() == 0 else None  # cpu_offload + full_state_dict: rank 0 receives them


def save_pretrained(model, path: str | Path, weights: dict[str, Any] | None = None) -> None:
    """What `model.save_pretrained(path)` writes, with `weights` as its state dict (None: the model's own):
    model.safetensors (one name per tied weight, as Hugging Face keeps them), config.json saying how its LM
    head is (trainer.model.model_files.write_config) and generation_config.json.

    The weights go through safetensors itself: the checkpoint writer's thread hands it the staged host copy
    as it is, with no model method in between."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = model.state_dict() if weights is None else weights
    aliases = dict(model.named_parameters(remove_duplicate=False))
    kept = {name for name, _ in model.named_parameters()}  # a tied weight's first name (shared.weight)
    tensors = {}
    for name, tensor in weights.items():
        if name in aliases and name not in kept:
            continue
        tensor = tensor.detach().to("cpu")
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view of a larger tensor: safetensors writes whole storages
        tensors[name] = tensor.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    if tensors:
        model.config.dtype = next(iter(tensors.values())).dtype
    model.config.save_pretrained(path)
    if model.can_generate():
        model.generation_config.save_pretrained(path)
    write_config(model, path)


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP without a process group works in one process, and warns that it assumes so: it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-{rank}.pt"


def is_complete(path: Path) -> bool:
    return path.is_dir() and NAME.match(path.name) is not None and (path / MARKER).is_file()


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in output_dir, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for p in output_dir.iterdir():
        m = NAME.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def checkpoint_bytes(output_dir: str | Path) -> int | None:
    """The size of the newest complete checkpoint in `output_dir`, or None when there is none."""
    found = list_checkpoints(output_dir)
    return disk.directory_bytes(found[-1][1]) if found else None


def free_space_warning(
    output_dir: str | Path, one_checkpoint_bytes: int, save_total_limit: int, planned_saves: int
) -> str | None:
    """A warning when `output_dir`'s disk cannot hold the checkpoints the run will keep at its peak: the
    `save_total_limit` kept ones plus the one written before the oldest is removed (all `planned_saves`
    when the limit is 0 or not reached), counting those already there. None when they fit. (The best
    checkpoint by eval loss, when older than the kept ones, is one more.)"""
    at_peak = min(save_total_limit + 1, planned_saves) if save_total_limit > 0 else planned_saves
    existing = len(list_checkpoints(output_dir))
    needed = max(0, at_peak - existing) * one_checkpoint_bytes
    free = disk.free_bytes(output_dir)
    if free is None or free >= needed:
        return None
    return (
        f"output_dir {output_dir}: {disk.format_bytes(free)} free, but the run keeps up to {at_peak} "
        f"checkpoints of about {disk.format_bytes(one_checkpoint_bytes)} each (save_total_limit "
        f"{save_total_limit}, {existing} already there): about {disk.format_bytes(needed)} more are needed. "
        "The run will stop with a full disk at a checkpoint; free space, lower save_total_limit, or set "
        "output_dir on a bigger disk"
    )


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (a missing, empty or truncated file), or None.

    Reads only headers and the small files: the trainer state, the safetensors headers, DCP's metadata (every
    byte range it names must exist), the scheduler and RNG states."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / MARKER).is_file():
        return f"no {MARKER}"
    try:
        state = json.loads((path / MARKER).read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return f"{MARKER} holds no step"
        index = path / "model.safetensors.index.json"
        if (path / "adapter_config.json").is_file():  # a LoRA run's (trainer.model.lora)
            weights = ["adapter_model.safetensors"]
        elif index.is_file():
            weights = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        else:
            weights = ["model.safetensors"]
        for name in weights:
            with safe_open(path / name, framework="pt"):
                pass
        metadata = FileSystemReader(path / "dcp").read_metadata()
        for item in metadata.storage_data.values():
            data = path / "dcp" / item.relative_path
            if data.stat().st_size < item.offset + item.length:
                return f"dcp/{item.relative_path} is truncated"
        torch.load(path / "scheduler.pt", weights_only=True)
        torch.load(path / "rng.pt", weights_only=False)
    except Exception as e:  # any unreadable part makes the checkpoint unusable; say which
        return f"{type(e).__name__}: {e}"
    return None


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))


def load_training_state(path: str | Path, model, optimizer, scheduler) -> None:
    """Restore model weights and optimizer states (DCP, re-split for this run's ranks and strategy), the
    scheduler and the RNG states from a checkpoint. `model` is the HF model, already wrapped for this run and
    with `optimizer` built over it. Collective under torchrun.

    RNG: each rank restores its own states; a rank the saving run did not have (more ranks now) takes rank
    0's."""
    path = Path(path)
    model_state, optim_state, options = _states(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=path / "dcp")
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / _rng_file(distributed.rank())
    set_rng_state(torch.load(rng_file if rng_file.exists() else path / "rng.pt", weights_only=False))


DELETING = ".tmp-deleting-"  # what `delete_tree` renames a directory to, before it removes it


def delete_tree(path: Path) -> None:
    """Remove the directory `path`, renamed first to `<name>.tmp-deleting-<pid>`: out of the names a reader
    takes (a checkpoint, final/), so that a kill mid-way leaves what `remove_stale_temporaries` removes at the
    next start, not a half directory under its name."""
    trash = path.with_name(f"{path.name}{DELETING}{os.getpid()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale_temporaries(output_dir: str | Path) -> list[Path]:
    """Delete what saves or deletions of earlier runs left half-done (`checkpoint-<step>.tmp-<pid>`,
    `final.tmp`, `<name>.tmp-deleting-<pid>`: a run killed while saving or rotating). Call it only while
    holding output_dir's lock (trainer.infra.run_lock): then no other trainer is writing them. Returns what
    was removed."""
    output_dir = Path(output_dir)
    stale = [
        *output_dir.glob("checkpoint-*.tmp-*"),
        output_dir / "final.tmp",
        *output_dir.glob(f"final{DELETING}*"),
    ]
    removed = [p for p in stale if p.is_dir()]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int, best: Path | None = None) -> list[Path]:
    """Delete all but the newest `save_total_limit` complete checkpoints, keeping `best`. Returns what was
    removed."""
    output_dir = Path(output_dir)
    removed: list[Path] = []
    if save_total_limit <= 0:
        return removed
    found = [p for _, p in list_checkpoints(output_dir)]
    keep = set(found[-save_total_limit:])
    if best is not None:
        keep.add(Path(best))
    for p in found:
        if p not in keep:
            delete_tree(p)
            removed.append(p)
    return removed

"""Atomic, resumable checkpoints: `<output_dir>/checkpoint-<step>/`.

A checkpoint is written into `checkpoint-<step>.tmp-<pid>` and renamed into place only once complete, and its
last file is the completion marker `trainer_state.json`; a directory without it (a run killed mid-write) is
never picked for resume. Contents: the model via save_pretrained (safetensors), `optimizer.pt`,
`scheduler.pt`, `rng.pt` (python, numpy, torch, cuda), and `trainer_state.json` (step, loader state, config,
W&B run id, OOM-adjusted micro-batch, eval losses).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MARKER = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


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


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    tokenizer_file: str | Path | None = None,
    rng: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint-<step> atomically and return its path (an existing one for `step` is replaced).

    `rng`: the RNG states to store (default: the current ones); the loop passes those of the step boundary,
    since a step interrupted by a signal has already drawn dropout masks."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"checkpoint-{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer_file is not None:
        shutil.copy(tokenizer_file, tmp / "tokenizer.json")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng if rng is not None else rng_state(), tmp / "rng.pt")
    state = dict(trainer_state, step=step)
    with open(tmp / MARKER, "w", encoding="utf-8") as f:  # written last: the completion marker
        json.dump(state, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    log.info("saved checkpoint %s", final)
    return final


def is_complete(path: Path) -> bool:
    return path.is_dir() and _NAME.match(path.name) is not None and (path / MARKER).is_file()


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in output_dir, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for p in output_dir.iterdir():
        m = _NAME.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """resume "auto": the newest complete checkpoint (None if there is none); "never": None; else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"resume: {path} is not a complete checkpoint (no {MARKER})")
    return path


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))


def load_training_state(path: str | Path, optimizer, scheduler) -> None:
    """Restore optimizer, scheduler and RNG states from a checkpoint (the model loads via from_pretrained)."""
    path = Path(path)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))


def rotate_checkpoints(output_dir: str | Path, save_total_limit: int, best: Path | None = None) -> list[Path]:
    """Delete all but the newest `save_total_limit` complete checkpoints, keeping `best`; also removes stale
    temporary directories of earlier crashed saves. Returns what was removed."""
    output_dir = Path(output_dir)
    removed = []
    for p in output_dir.glob("checkpoint-*.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid != str(os.getpid()):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if save_total_limit <= 0:
        return removed
    found = [p for _, p in list_checkpoints(output_dir)]
    keep = set(found[-save_total_limit:])
    if best is not None:
        keep.add(Path(best))
    for p in found:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed

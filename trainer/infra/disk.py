"""A full disk in one line, a half-written checkpoint removed, the sizes a checkpoint takes (the warning
before a run that cannot fit them is trainer.checkpoint.store.free_space_warning).

A full disk reaches the trainer in several forms: `OSError` ENOSPC / EDQUOT (shutil.copy, open), safetensors'
`SafetensorError("... No space left on device (os error 28)")`, and torch.distributed.checkpoint's
`CheckpointException` (a BaseException, not an Exception), whose `.failures` hold one exception per rank,
e.g. torch.save's `RuntimeError("... unexpected pos 704 vs 598")` with the OSError as its context.
`out_of_space` finds the OSError (or the message) in any of them; `out_of_space_message` turns it into one
line naming the path, the space free and the space a checkpoint needs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# How Rust (safetensors, tokenizers) and C++ (torch) libraries word an ENOSPC / EDQUOT they do not raise as
# an OSError.
_MESSAGES = [
    (re.compile(r"No space left on device|os error 28\b|StorageFull", re.I), errno.ENOSPC),
    (re.compile(r"Disk quota exceeded|os error 122\b|QuotaExceeded", re.I), errno.EDQUOT),
]

# torch's zip writer failing without an OSError in reach (C++ code, or a rank's exception pickled by DCP).
_WRITE_FAILED = re.compile(r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed|file write failed", re.I)
_NEARLY_FULL_BYTES = 1 << 20  # less free than this after a failed write: the write filled the disk


class DiskFullError(Exception):
    """Out of disk space, said in one line (the original exception is its __cause__)."""


def _exceptions_in(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception behind it: its __cause__ and __context__, an exception group's members and
    DCP's per-rank `.failures` (torch.distributed.checkpoint.api.CheckpointException), each once."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]


def interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind `exc`, if there is one: a KeyboardInterrupt raised inside torch.save's stream
    writes comes out as the zip writer's RuntimeError ("unexpected pos ...") with the interrupt as its
    context, or wrapped by DCP."""
    return next((e for e in _exceptions_in(exc) if isinstance(e, KeyboardInterrupt)), None)


def out_of_space(exc: BaseException, path: str | Path | None = None) -> tuple[int, str | None] | None:
    """(errno, path or None) when `exc` is, wraps or was caused by an out-of-space error (ENOSPC, EDQUOT),
    looking through __cause__, __context__, exception groups and DCP's per-rank `.failures`; else None.

    Exceptions DCP gathers from the ranks lose their __context__ (pickled), so torch's bare "unexpected pos"
    or "failed writing" also counts when `path`'s filesystem has (almost) nothing left."""
    by_message = None
    write_failed = False
    for e in _exceptions_in(exc):
        if isinstance(e, OSError) and e.errno in _ERRNOS:
            return e.errno, _written_path(e)
        if not isinstance(getattr(e, "failures", None), dict):
            # DCP's own str is every rank's traceback; its failures are looked at one by one
            text = str(e)
            by_message = by_message or next((c for pattern, c in _MESSAGES if pattern.search(text)), None)
            write_failed = write_failed or _WRITE_FAILED.search(text) is not None
    if by_message is not None:
        return by_message, None
    if write_failed and path is not None:
        free = free_bytes(path)
        if free is not None and free < _NEARLY_FULL_BYTES:
            return errno.ENOSPC, None
    return None


def out_of_space_message(
    exc: BaseException, path: str | Path | None = None, needed_bytes: int | None = None
) -> str | None:
    """One line for an out-of-space `exc` (None for any other error): the cause, the path written (the
    error's own, else `path`), the space free there and, when known, the space needed."""
    if isinstance(exc, DiskFullError):
        return str(exc)
    found = out_of_space(exc, path)
    return None if found is None else _message(found, path, needed_bytes)


def _message(found: tuple[int, str | None], path: str | Path | None, needed_bytes: int | None) -> str:
    code, written = found
    where = written or (str(path) if path is not None else None)
    line = f"disk full: {_ERRNOS[code]}"
    if where:
        line += f" writing {where}"
    free = free_bytes(where) if where else None
    sizes = [f"{format_bytes(free)} free"] if free is not None else []
    if needed_bytes:
        sizes.append(f"about {format_bytes(needed_bytes)} needed")
    if sizes:
        line += f" ({', '.join(sizes)})"
    there = "there" if where else "on output_dir's disk"
    return line + f"; free space {there}, lower save_total_limit, or set output_dir on a bigger disk"


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` beside it first, then rename it into place: a reader never sees half a file,
    and a kill or a full disk leaves the old one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def removed_on_failure(
    tmp: str | Path, *, needed_bytes: int | None = None, remove: bool = True
) -> Iterator[None]:
    """Around a write into the temporary directory `tmp` (a checkpoint's, final/'s): on any failure or
    interrupt, `tmp` is deleted (when `remove`: rank 0 under torchrun), so that a full disk is not left
    fuller and no partial directory stays behind; an out-of-space error becomes DiskFullError in one line
    naming the space free (after the removal) and `needed_bytes`. An error a Ctrl-C caused (torch.save's
    zip writer failing on the interrupted write) is raised as that KeyboardInterrupt: the run was
    interrupted. Earlier checkpoints are not touched."""
    try:
        yield
    except BaseException as e:
        interrupt = interrupt_in(e)
        found = None if interrupt is not None or isinstance(e, SystemExit) else out_of_space(e, tmp)
        if remove:  # after out_of_space looked at the free space: the removal frees some
            shutil.rmtree(tmp, ignore_errors=True)
        if interrupt is not None and interrupt is not e:
            raise interrupt from None
        if found is None:
            raise
        raise DiskFullError(_message(found, tmp, needed_bytes)) from e


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the filesystem of `path` (its nearest existing parent), or None."""
    p = Path(path).absolute()
    for candidate in (p, *p.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def directory_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def estimate_checkpoint_bytes(n_params: int, weight_bytes: int, state_bytes_per_param: float) -> int:
    """What one checkpoint of a model with `n_params` trained parameters of `weight_bytes` bytes takes on
    disk: the weights twice (model.safetensors and dcp/) and the optimizer's states at `state_bytes_per_param`
    (trainer.optim's declaration, with a Kahan buffer), before the first checkpoint gives the real size."""
    return int(2 * n_params * weight_bytes + n_params * state_bytes_per_param)


def state_bytes(model, optimizer) -> int:
    """What a checkpoint of `model` and `optimizer` holds now: the trained weights twice (model.safetensors,
    or a LoRA run's adapter, and dcp/) and every optimizer state tensor. (Local sizes: under FSDP, this rank's
    shards.)"""
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    states = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if hasattr(t, "element_size")
    )
    return 2 * weights + states


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _written_path(e: OSError) -> str | None:
    # shutil.copy(src, dst) fails with filename=src, filename2=dst: the destination is what filled the disk.
    return e.filename2 or e.filename or None

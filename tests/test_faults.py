"""Faults a user meets, probed with real processes, signals, files and a small filesystem: nothing is lost,
nothing is silent, an expected fault is one line.

The pieces (trainer.run_lock, trainer.disk, trainer.jsonl, trainer.model_files, trainer.sample's demo-data
rule) are tested here directly. Tests marked `xfail(strict=True)` check what the training loop does with
them, and fail until the loop calls them; strict, so that they are unmarked once it does.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from discord_server import discord_server  # noqa: F401

LOOP = "the training loop does not call it yet"

# A small run of the tiny model: a few seconds of training on a quiet machine.
RUN = dict(
    dtype="float32",
    max_source_length=64,
    max_target_length=96,
    per_device_train_batch_size=8,
    eval_fraction=0.05,
    eval_max_batches=1,
    learning_rate=1e-3,
    max_steps=2,
    logging_steps=1,
    eval_steps=1000,
    save_steps=1000,
    num_eval_generations=1,
    generation_max_new_tokens=4,
    gradient_checkpointing=False,
    report_to="none",
    progress_bar=False,
    discord_progress_minutes=-1,
)

# Runs the trainer CLI with one phase blocked until the test signals the process: "data" (indexing the
# data), "model" (loading the weights), "save" (writing a checkpoint). A marker file says it got there.
_BLOCKING_SCRIPT = """
import os, sys, time
from pathlib import Path

WHERE = os.environ.get("FAULT_BLOCK_IN", "")
MARKER = Path(os.environ.get("FAULT_MARKER", "/nonexistent"))


def blocking(original, where):
    def wrapper(*args, **kwargs):
        if where == WHERE and not MARKER.exists():
            MARKER.write_text(str(os.getpid()))
            time.sleep(120)  # the test signals the process while it waits here
        return original(*args, **kwargs)

    return wrapper


import trainer.checkpoint
import trainer.data
from transformers import AutoModelForSeq2SeqLM

trainer.data.stream_for = blocking(trainer.data.stream_for, "data")
trainer.checkpoint.save_pretrained = blocking(trainer.checkpoint.save_pretrained, "save")
AutoModelForSeq2SeqLM.from_pretrained = blocking(AutoModelForSeq2SeqLM.from_pretrained, "model")
from trainer.cli import main

sys.exit(main(sys.argv[1:]))
"""

# Holds <output_dir>'s lock until killed.
_LOCK_HOLDER = """
import sys, time
from trainer.run_lock import RunLock

RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISCORD_", "WANDB_", "FAULT_"))}
    env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **extra)
    return env


def _config(tmp_path: Path, name: str, model_dir: Path, data: Path, **kw) -> tuple[Path, Path]:
    values = dict(RUN, model_name_or_path=str(model_dir), train_files=[str(data)])
    values["output_dir"] = str(tmp_path / name)
    values.update(kw)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(values))
    return config, Path(values["output_dir"])


def _trainer(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        env=env or _env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _rows(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Wait until `predicate()`; fail if the process ended first. `timeout` only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, _ = proc.communicate()
            pytest.fail(f"the process ended (code {proc.returncode}) before {what}:\n{out[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.05)


@pytest.fixture
def held_lock(tmp_path):
    """Start a process that holds the lock on a directory; yields (process, output_dir)."""
    out = tmp_path / "locked-out"
    script = tmp_path / "hold_lock.py"
    script.write_text(_LOCK_HOLDER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc, out
    finally:
        proc.kill()
        proc.wait()


def _mount_small_fs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")


@pytest.fixture
def small_fs(tmp_path):
    """A real 3 MiB filesystem (tmpfs), so that writes fail with ENOSPC as on a full disk."""
    path = tmp_path / "small"
    _mount_small_fs(path, "3m")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


# -- 1. one trainer per output_dir ------------------------------------------------------------------------


def test_a_second_process_gets_the_holder_and_sigkill_leaves_no_stale_lock(held_lock):
    from trainer.run_lock import OutputDirLocked, RunLock, lock_holder

    proc, out = held_lock
    with pytest.raises(OutputDirLocked) as refused:
        RunLock(out).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert f"pid {proc.pid} on host {socket.gethostname()}, started 20" in message, message
    assert str(out) in message and "another output_dir" in message
    assert lock_holder(out)["pid"] == proc.pid

    proc.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel releases the lock
    proc.wait()
    assert lock_holder(out) is None
    with RunLock(out) as lock:
        assert lock.held
        assert json.loads((out / ".trainer.lock").read_text())["pid"] == os.getpid()
    assert (out / ".trainer.lock").read_text() == ""  # released: no holder named any more


def test_the_lock_is_per_output_dir_and_also_refuses_this_process(tmp_path):
    from trainer.run_lock import OutputDirLocked, RunLock

    # A second open of the lock file, as a second trainer's, is refused even in the same process.
    with RunLock(tmp_path / "a"), RunLock(tmp_path / "b"), pytest.raises(OutputDirLocked):
        RunLock(tmp_path / "a").acquire()
    with RunLock(tmp_path / "a") as again:
        assert again.held


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    # NFS mounted without a lock manager refuses flock with ENOLCK; no such mount here, so flock says it.
    import fcntl

    from trainer.run_lock import RunLock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING"), RunLock(tmp_path / "out") as lock:
        assert not lock.held
    assert "refuses file locks" in caplog.text and "second trainer" in caplog.text


_RANKS_SCRIPT = """
import sys, torch
from trainer import distributed
from trainer.run_lock import OutputDirLocked, lock_output_dir

distributed.init(torch.device("cpu"))
try:
    lock = lock_output_dir(sys.argv[1])
except OutputDirLocked as e:
    print(f"rank {distributed.rank()} refused: {e}", flush=True)
    distributed.destroy()
    sys.exit(2)
print(f"rank {distributed.rank()} locked, holding {lock.held}", flush=True)
distributed.barrier()
distributed.destroy()
"""


def test_under_torchrun_every_rank_exits_2_together_when_rank_0_cannot_lock(tmp_path, held_lock):
    proc, out = held_lock
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    refused = subprocess.run([*cmd, str(out)], env=_env(), capture_output=True, text=True, timeout=600)
    console = refused.stdout + refused.stderr
    assert refused.returncode != 0, console
    for rank in (0, 1):
        assert re.search(rf"rank {rank} refused: output_dir .*\(pid {proc.pid} on host", console), console
    assert "exitcode  : 2" in console  # torchrun's summary of the failed ranks

    free = subprocess.run(
        [*cmd, str(tmp_path / "free")], env=_env(), capture_output=True, text=True, timeout=600
    )
    assert free.returncode == 0, free.stdout + free.stderr
    assert "rank 0 locked, holding True" in free.stdout and "rank 1 locked, holding False" in free.stdout


@pytest.mark.xfail(strict=True, reason=LOOP)
def test_a_second_trainer_on_the_same_output_dir_exits_2_naming_the_first(
    tmp_path, tiny_model_dir, sample_csv, held_lock
):
    proc, out = held_lock
    config, _ = _config(tmp_path, "second", tiny_model_dir, sample_csv, output_dir=str(out))
    done = _trainer("train", "--config", str(config))
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: output_dir") and f"pid {proc.pid}" in last, last
    assert sorted(p.name for p in out.iterdir()) == [".trainer.lock"]  # nothing of the second run in it

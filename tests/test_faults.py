"""Faults a user meets, probed with real processes, signals, files and a small filesystem: nothing is lost,
nothing is silent, an expected fault is one line.

The pieces (trainer.infra.run_lock, trainer.infra.disk, trainer.infra.jsonl, trainer.model.model_files,
trainer.data.sample's demo-data rule) are tested here directly, and through real training runs: what the loop
does with them, and what it keeps when a run ends on an error, a signal or a full disk.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from discord_server import discord_server  # noqa: F401

from trainer.config import ConfigError

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

# Runs the trainer CLI with one phase blocked (the first time it is reached) until the test signals the
# process or removes the marker file that says it got there: "data" (indexing the data), "model" (loading the
# weights), "save" (writing a checkpoint), "torch_save" (inside torch.save, writing a checkpoint's optimizer
# states into a stream), "step" (the first optimizer update), "evaluate" (an evaluation).
_BLOCKING_SCRIPT = """
import os, sys, time
from pathlib import Path

WHERE = os.environ.get("FAULT_BLOCK_IN", "")
MARKER = Path(os.environ.get("FAULT_MARKER", "/nonexistent"))
blocked = []


def blocking(original, where):
    def wrapper(*args, **kwargs):
        if where == WHERE and not blocked:
            blocked.append(where)
            MARKER.write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while MARKER.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return original(*args, **kwargs)

    return wrapper


class BlockingStream:  # its first write blocks as `blocking` does: a signal then arrives inside torch.save

    def __init__(self, stream):
        self.stream = stream
        self.write = blocking(stream.write, "torch_save")

    def __getattr__(self, name):
        return getattr(self.stream, name)


import torch

_torch_save = torch.save


def torch_save(obj, f, *args, **kwargs):
    if hasattr(f, "write"):
        f = BlockingStream(f)
    return _torch_save(obj, f, *args, **kwargs)


torch.save = torch_save
import trainer.checkpoint.store
import trainer.data.loader
from transformers import AutoModelForSeq2SeqLM

trainer.data.loader.stream_for = blocking(trainer.data.loader.stream_for, "data")
trainer.checkpoint.store.save_pretrained = blocking(trainer.checkpoint.store.save_pretrained, "save")
AutoModelForSeq2SeqLM.from_pretrained = blocking(AutoModelForSeq2SeqLM.from_pretrained, "model")
import trainer.run.train  # after the patches above: it imports stream_for by name

trainer.run.train.optimizer_step = blocking(trainer.run.train.optimizer_step, "step")
trainer.run.train.evaluate = blocking(trainer.run.train.evaluate, "evaluate")
from trainer.cli import main

sys.exit(main(sys.argv[1:]))
"""

# Holds <output_dir>'s lock until killed.
_LOCK_HOLDER = """
import sys, time
from trainer.infra.run_lock import RunLock

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
    from trainer.infra.run_lock import OutputDirLocked, RunLock, lock_holder

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
    from trainer.infra.run_lock import OutputDirLocked, RunLock

    # A second open of the lock file, as a second trainer's, is refused even in the same process.
    with RunLock(tmp_path / "a"), RunLock(tmp_path / "b"), pytest.raises(OutputDirLocked):
        RunLock(tmp_path / "a").acquire()
    with RunLock(tmp_path / "a") as again:
        assert again.held


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    # NFS mounted without a lock manager refuses flock with ENOLCK; no such mount here, so flock says it.
    import fcntl

    from trainer.infra.run_lock import RunLock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING"), RunLock(tmp_path / "out") as lock:
        assert not lock.held
    assert "refuses file locks" in caplog.text and "second trainer" in caplog.text


_RANKS_SCRIPT = """
import sys, torch
from trainer.infra import distributed
from trainer.infra.run_lock import OutputDirLocked, lock_output_dir

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


@pytest.mark.slow
def test_under_torchrun_every_rank_exits_2_together_when_rank_0_cannot_lock(tmp_path, held_lock):
    """Slow because torchrun starts two ranks while another trainer holds the lock."""
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


# -- 2. a full disk ---------------------------------------------------------------------------------------


def test_out_of_space_is_recognised_in_each_form_a_save_raises(small_fs, tmp_path):
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    from trainer.infra.disk import out_of_space, out_of_space_message

    big = torch.zeros(1 << 20)  # 4 MiB, more than the filesystem holds
    (tmp_path / "big.bin").write_bytes(bytes(4 << 20))
    raised = []
    for write in (
        lambda: shutil.copy(tmp_path / "big.bin", small_fs / "copy.bin"),  # OSError ENOSPC
        lambda: safetensors.torch.save_file({"w": big}, small_fs / "w.safetensors"),  # SafetensorError
        lambda: dcp.save({"w": big}, checkpoint_id=small_fs / "dcp"),  # CheckpointException (BaseException)
    ):
        try:
            write()
        except BaseException as e:
            raised.append(e)
        for p in small_fs.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert [type(e).__name__ for e in raised] == ["OSError", "SafetensorError", "CheckpointException"]
    for e in raised:
        assert out_of_space(e) is not None, repr(e)
        line = out_of_space_message(e, small_fs, needed_bytes=5 << 20)
        assert line.startswith("disk full: no space left on device writing ") and "\n" not in line, line
        assert re.search(r"\(\d+(\.\d)? [KM]iB free, about 5\.0 MiB needed\)", line), line
    assert str(small_fs / "copy.bin") in out_of_space_message(raised[0])  # the destination, not the source
    assert out_of_space_message(FileNotFoundError(errno.ENOENT, "gone", "x")) is None
    assert out_of_space_message(RuntimeError("unexpected pos 704 vs 598"), tmp_path) is None  # disk not full


def _tiny_training_state(model_dir: Path):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.config import TrainConfig
    from trainer.optim import build_optimizer
    from trainer.run.schedule import build_scheduler

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    cfg = TrainConfig(optimizer="adamw", dtype="float32", max_steps=3)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6]])).loss.backward()
    optimizer.step()  # the optimizer's states exist, as in a checkpoint after training
    return model, optimizer, build_scheduler(optimizer, cfg, 3)


def test_a_full_disk_during_a_checkpoint_removes_it_and_keeps_the_earlier_one(tmp_path, tiny_model_dir):
    from trainer.checkpoint import store as ckpt
    from trainer.infra.disk import DiskFullError, directory_bytes, format_bytes, removed_on_failure

    model, optimizer, scheduler = _tiny_training_state(tiny_model_dir)
    fs = tmp_path / "fs"
    _mount_small_fs(fs, "12m")  # one checkpoint of the tiny model (7.6 MiB) fits, not two
    try:
        out = fs / "out"
        state = dict(model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={})
        first = ckpt.save_checkpoint(out, 1, **state)
        size = directory_bytes(first)
        tmp = out / f"checkpoint-2.tmp-{os.getpid()}"  # where save_checkpoint writes, then renames
        with pytest.raises(DiskFullError) as full, removed_on_failure(tmp, needed_bytes=size):
            ckpt.save_checkpoint(out, 2, **state)
        message = str(full.value)
        assert message.startswith(f"disk full: no space left on device writing {tmp}") and "\n" not in message
        assert re.search(rf"\(\d\.\d MiB free, about {format_bytes(size)} needed\)", message), message
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1"]
        assert ckpt.checkpoint_problem(first) is None
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def test_a_deletion_cut_short_leaves_no_half_checkpoint_under_its_name(tmp_path, tiny_model_dir, monkeypatch):
    """Rotation deletes a checkpoint by renaming it out of the checkpoints' names first: a kill in the middle
    of the removal (here: the removal stops after its first file) leaves a stale temporary that resume never
    takes and the next start removes, not a checkpoint-<step> without its DCP metadata."""
    from trainer.checkpoint import store as ckpt

    model, optimizer, scheduler = _tiny_training_state(tiny_model_dir)
    for step in (1, 2):
        ckpt.save_checkpoint(
            tmp_path, step, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}
        )

    def killed_after_one_file(path, ignore_errors=False):
        (Path(path) / "dcp" / ".metadata").unlink()
        raise SystemExit("killed")

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(SystemExit):
        ckpt.rotate_checkpoints(tmp_path, save_total_limit=1)
    monkeypatch.undo()
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert ckpt.checkpoint_problem(tmp_path / "checkpoint-2") is None
    (left,) = tmp_path.glob("checkpoint-1*")
    assert left.name.startswith(f"checkpoint-1{ckpt.DELETING}")
    assert ckpt.remove_stale_temporaries(tmp_path) == [left] and not left.exists()


def test_the_estimate_of_a_checkpoint_is_close_to_a_real_one(tmp_path, tiny_model_dir):
    from trainer.checkpoint import store as ckpt
    from trainer.infra.disk import directory_bytes, estimate_checkpoint_bytes, state_bytes
    from trainer.optim.adamw import ADAMW

    model, optimizer, scheduler = _tiny_training_state(tiny_model_dir)
    saved = ckpt.save_checkpoint(
        tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}
    )
    n_params = sum(p.numel() for p in model.parameters())
    estimate = estimate_checkpoint_bytes(n_params, 4, ADAMW.checkpoint_bytes_per_param(4))
    # DCP adds a few KiB per stored tensor: 17% of this tiny model's checkpoint, nothing at FLAN-T5-XL size.
    assert 0.8 <= estimate / directory_bytes(saved) <= 1.0, (estimate, directory_bytes(saved))
    assert 0.99 <= estimate / state_bytes(model, optimizer) <= 1.0  # AdamW's step counters: a few bytes


def test_a_disk_too_small_for_the_checkpoints_is_a_warning_at_start(small_fs):
    from trainer.checkpoint.store import free_space_warning

    one = 1200 << 10  # 3 MiB free: room for 2 checkpoints of 1.2 MiB, not 3
    warning = free_space_warning(small_fs, one, save_total_limit=2, planned_saves=10)
    assert "keeps up to 3 checkpoints of about 1.2 MiB each (save_total_limit 2, 0 already there)" in warning
    assert "3.0 MiB free" in warning and "about 3.5 MiB more are needed" in warning, warning
    assert free_space_warning(small_fs, one, save_total_limit=1, planned_saves=10) is None  # 1 kept + 1
    assert free_space_warning(small_fs, one, save_total_limit=5, planned_saves=2) is None  # 2 saves in all
    assert free_space_warning(small_fs, one, save_total_limit=0, planned_saves=3) is not None  # keeps all 3
    (small_fs / "checkpoint-7").mkdir()
    (small_fs / "checkpoint-7" / "trainer_state.json").write_text("{}")  # one is there already: 2 more
    assert free_space_warning(small_fs, one, save_total_limit=2, planned_saves=10) is None


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory, tiny_model_dir, sample_csv):
    """A real training run whose output_dir is on a 4 MiB filesystem: the first checkpoint (7.6 MiB) fails
    inside torch.distributed.checkpoint, whose CheckpointException is a BaseException."""
    tmp_path = tmp_path_factory.mktemp("full-disk")
    fs = tmp_path / "fs"
    _mount_small_fs(fs, "4m")
    try:
        config, out = _config(
            tmp_path, "run", tiny_model_dir, sample_csv, output_dir=str(fs / "out"), save_steps=2
        )
        done = _trainer("train", "--config", str(config))
        yield done, out
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def test_a_full_disk_ends_the_run_with_one_line_not_a_traceback(full_disk_run):
    done, out = full_disk_run
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: disk full: no space left on device"), last


def test_a_full_disk_leaves_no_partial_checkpoint_and_was_announced(full_disk_run):
    done, out = full_disk_run
    assert list(out.glob("checkpoint-*")) == []  # the partial checkpoint-2.tmp-* is removed
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"trainer: disk full: no space left on device writing {out}/checkpoint-2"), last
    assert re.search(r"\(\d+(\.\d)? [KM]iB free, about \d+(\.\d)? MiB needed\)", last), last
    assert "free, but the run keeps up to" in done.stderr  # the start-up warning


_BASE_EXCEPTION_SCRIPT = """
import os, sys, traceback
import trainer.cli
from torch.distributed.checkpoint.api import CheckpointException


def fail(args):  # as DCP raises it: one exception per failed rank
    failure = RuntimeError("upload to " + os.environ["HF_TOKEN"] + " failed")
    raise CheckpointException("save failed", {0: (failure, traceback.StackSummary())})


trainer.cli.run_command = fail
sys.exit(trainer.cli.main(["train", "--config", "unused.yaml"]))
"""


def test_a_base_exception_is_logged_through_the_masking_logger(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(_BASE_EXCEPTION_SCRIPT)
    secret = "hf_fakeTokenForTheCrashPath0123456789"
    done = subprocess.run(
        [sys.executable, str(script)], env=_env(HF_TOKEN=secret), capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "CRITICAL trainer: failed" in done.stderr and "CheckpointException" in done.stderr, done.stderr
    assert secret not in done.stderr and "upload to *** failed" in done.stderr


# -- 4. a broken model directory --------------------------------------------------------------------------


def _damaged(tmp_path: Path, tiny_model_dir: Path, damage) -> Path:
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    damage(path)
    return path


def _cut(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda p: _cut(p / "model.safetensors", lambda n: n - 1),
            r"model\.safetensors is truncated: tensor",
        ),
        (lambda p: _cut(p / "model.safetensors", lambda n: 100), r"model\.safetensors is truncated or not"),
        (lambda p: _cut(p / "model.safetensors", lambda n: 0), r"model\.safetensors is truncated \(0 bytes"),
        (lambda p: (p / "model.safetensors").unlink(), r"no weights \(none of model\.safetensors"),
        (lambda p: _cut(p / "config.json", lambda n: n // 2), r"config\.json is not valid JSON \(line"),
        (lambda p: (p / "config.json").unlink(), r"config\.json is missing"),
        (lambda p: (p / "tokenizer.json").unlink(), r"tokenizer\.json is missing"),
        (lambda p: _cut(p / "tokenizer.json", lambda n: n // 2), r"tokenizer\.json is not valid JSON"),
    ],
    ids=["cut-1-byte", "cut-to-100", "empty", "no-weights", "config-cut", "no-config", "no-tok", "tok-cut"],
)
def test_a_damaged_model_directory_is_one_line_naming_the_file(tmp_path, tiny_model_dir, damage, message):
    from trainer.model.model_files import check_model_dir

    path = _damaged(tmp_path, tiny_model_dir, damage)
    with pytest.raises(ConfigError, match=message) as bad:
        check_model_dir(str(path))
    assert "\n" not in str(bad.value) and str(path) in str(bad.value)


def test_a_whole_model_directory_passes_with_its_parameter_count(tmp_path, tiny_model_dir):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.model_files import check_model_dir

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    found = check_model_dir(str(tiny_model_dir))
    assert found.n_params == sum(p.numel() for p in model.parameters())
    (tmp := tmp_path / "no-weights").mkdir()
    shutil.copy(tiny_model_dir / "config.json", tmp / "config.json")
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp / "tokenizer.json")
    assert check_model_dir(str(tmp), weights=False).n_params is None  # random_init needs no weights
    with pytest.raises(ConfigError, match="no such directory"):
        check_model_dir(str(tiny_model_dir.parent / "missing" / "model"))


def test_sharded_and_pytorch_bin_weights_are_checked(tmp_path, tiny_model_dir):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.model_files import check_model_dir

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="500KB")
    shutil.copy(tiny_model_dir / "tokenizer.json", sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and check_model_dir(str(sharded)).n_params == n_params
    _cut(shards[-1], lambda n: n - 10)
    with pytest.raises(ConfigError, match=rf"{shards[-1].name} is truncated"):
        check_model_dir(str(sharded))
    shards[0].unlink()
    with pytest.raises(ConfigError, match=rf"{shards[0].name} is missing \(a shard listed in model"):
        check_model_dir(str(sharded))

    pickled = tmp_path / "bin"  # the older format: torch.save of the state dict
    pickled.mkdir()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model_dir / name, pickled)
    assert check_model_dir(str(pickled)).n_params is None
    _cut(pickled / "pytorch_model.bin", lambda n: n - 100)
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin is truncated"):
        check_model_dir(str(pickled))


_CACHED_CHECK = """
import sys
from trainer.config import ConfigError
from trainer.model.model_files import check_model_dir

for name in sys.argv[1:]:
    try:
        print(name, "->", check_model_dir(name))
    except ConfigError as e:
        print(name, "->", e)
"""


def test_a_hub_id_is_checked_as_far_as_it_is_cached(tmp_path, tiny_model_dir):
    # The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<revision>/<files>}.
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--recipes" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (cache / "models--acme--recipes" / "refs").mkdir()
    (cache / "models--acme--recipes" / "refs" / "main").write_text("0123abcd")
    _cut(snapshot / "model.safetensors", lambda n: n // 2)
    script = tmp_path / "check.py"
    script.write_text(_CACHED_CHECK)
    done = subprocess.run(
        [sys.executable, str(script), "acme/recipes", "acme/not-downloaded"],
        env=_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"acme/recipes -> {snapshot}/model.safetensors is truncated" in done.stdout, done.stdout
    assert "acme/not-downloaded -> None" in done.stdout  # training downloads it


def test_a_truncated_model_fails_the_dry_run_in_one_line(tmp_path, tiny_model_dir, sample_csv):
    model = _damaged(tmp_path, tiny_model_dir, lambda p: _cut(p / "model.safetensors", lambda n: n // 2))
    config, _ = _config(tmp_path, "dry", model, sample_csv)
    done = _trainer("train", "--config", str(config), "--dry-run")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"trainer: model error: {model}/model.safetensors")


def test_a_relative_model_path_that_does_not_exist_names_the_working_directory(tmp_path, sample_csv):
    config, _ = _config(tmp_path, "relative", Path("models/tiny/final"), sample_csv)
    done = _trainer("train", "--config", str(config), "--dry-run", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"trainer: model error: model_name_or_path models/tiny/final (resolved against {tmp_path}): no such "
        "directory"
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub-unreachable"])
def test_a_hub_model_not_in_the_cache_is_a_model_error_saying_how_to_get_it(tmp_path, sample_csv, offline):
    # An empty Hugging Face cache; the Hub either off on purpose, or not reachable (nothing listens there).
    env = _env(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    config, _ = _config(tmp_path, "hub", "google/flan-t5-xl", sample_csv)
    done = _trainer("train", "--config", str(config), "--dry-run", env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"trainer: model error: google/flan-t5-xl: its tokenizer.json is not in the Hugging Face cache "
        f"({tmp_path / 'hub'})"
    ), last
    assert last.endswith(
        "download the model once where the Hub is reachable (`hf download google/flan-t5-xl`), or mount a "
        "Hugging Face cache that holds it (HF_HOME)"
    ), last
    assert ("HF_HUB_OFFLINE is set" in last) == offline
    # One try at the Hub, not half a minute of retries, and no advice to check a connection that is off.
    assert "Retrying" not in done.stderr and "check your connection" not in done.stderr, done.stderr


# -- 6. a cut last line in train_log.jsonl ----------------------------------------------------------------


def test_repair_drops_a_cut_last_line_and_the_next_row_starts_a_line(tmp_path, caplog):
    from trainer.infra.jsonl import append_jsonl_row, repair_jsonl

    log = tmp_path / "train_log.jsonl"
    for step in (1, 2):
        append_jsonl_row(log, {"step": step, "loss": 2.0})
    with open(log, "a") as f:
        f.write('{"step": 3, "lo')  # the power went off mid-row
    with caplog.at_level("WARNING"):
        assert repair_jsonl(log) == 1
    assert "dropped line 3, not a whole JSON row (the last line, cut off mid-write)" in caplog.text
    append_jsonl_row(log, {"step": 3, "loss": 1.5})
    assert [r["step"] for r in _rows(log)] == [1, 2, 3]
    assert repair_jsonl(log) == 0 and repair_jsonl(tmp_path / "absent.jsonl") == 0


def test_repair_drops_zero_bytes_and_keeps_a_whole_row_without_its_newline(tmp_path):
    from trainer.infra.jsonl import repair_jsonl

    log = tmp_path / "train_log.jsonl"
    log.write_bytes(b'{"step": 1}\n{"step": 2}\n' + b"\0" * 300)  # ext4 after a power loss: zeros
    assert repair_jsonl(log) == 1 and log.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    log.write_bytes(b'{"step": 1}\n{"step": 2, "loss": NaN}')  # whole, NaN as json.dumps writes it
    assert repair_jsonl(log) == 0 and log.read_bytes() == b'{"step": 1}\n{"step": 2, "loss": NaN}\n'
    log.write_bytes(b'{"step": 1}\n{"step": 2, "lo{"step": 2}\n{"step": 3}\n')  # a row glued onto a cut one
    assert repair_jsonl(log) == 1 and [r["step"] for r in _rows(log)] == [1, 3]


def test_a_row_that_does_not_fit_on_the_disk_is_not_left_half_written(small_fs):
    from trainer.infra.jsonl import append_jsonl_row

    log = small_fs / "train_log.jsonl"
    row = {"step": 0, "loss": 1.0, "note": "x" * 3000}  # longer than a page: some fits, the rest does not
    with pytest.raises(OSError) as full:
        for step in range(10_000):
            append_jsonl_row(log, dict(row, step=step))
    assert full.value.errno == errno.ENOSPC
    rows = _rows(log)  # every line is a whole row
    assert [r["step"] for r in rows] == list(range(len(rows))) and log.read_bytes().endswith(b"\n")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir, sample_csv):
    """A real 2-step run that finished (checkpoint-2 and final/); tests work on copies of it."""
    tmp_path = tmp_path_factory.mktemp("finished")
    config, out = _config(tmp_path, "run", tiny_model_dir, sample_csv, save_steps=2)
    done = _trainer("train", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _copy_of(run: Path, tmp_path: Path, tiny_model_dir: Path, sample_csv: Path, **kw) -> tuple[Path, Path]:
    config, out = _config(tmp_path, "copy", tiny_model_dir, sample_csv, save_steps=2, **kw)
    shutil.copytree(run, out)
    return config, out


def test_a_resumed_run_after_a_cut_line_keeps_the_log_readable(
    finished_run, tmp_path, tiny_model_dir, sample_csv
):
    config, out = _copy_of(finished_run, tmp_path, tiny_model_dir, sample_csv, max_steps=4)
    with open(out / "train_log.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 2.1')  # a run cut off while writing step 3's row
    done = _trainer("train", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(out / "train_log.jsonl")  # every line parses
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]  # and "eval_loss" rows at 2 and 4


# -- 8. the loop's own faults -----------------------------------------------------------------------------


def test_rerunning_a_finished_run_keeps_its_heartbeat(finished_run, tmp_path, tiny_model_dir, sample_csv):
    config, out = _copy_of(finished_run, tmp_path, tiny_model_dir, sample_csv)
    assert json.loads((out / "heartbeat").read_text())["step"] == 2
    done = _trainer("train", "--config", str(config))
    assert done.returncode == 0 and "already finished" in done.stderr, done.stderr[-3000:]
    assert json.loads((out / "heartbeat").read_text())["step"] == 2  # the healthcheck reports where it is


@pytest.mark.parametrize("phase", ["save", "torch_save"])
@pytest.mark.slow
def test_a_double_ctrl_c_during_a_save_leaves_nothing_and_the_rerun_says_it_starts_over(
    tmp_path, tiny_model_dir, sample_csv, phase
):
    """Slow because two trainer processes start, the first held inside its save until the second Ctrl-C."""
    config, out = _config(tmp_path, "ctrl-c", tiny_model_dir, sample_csv, max_steps=1000)
    script, marker = tmp_path / "blocking.py", tmp_path / "saving"
    script.write_text(_BLOCKING_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "train", "--config", str(config)],
        env=_env(FAULT_BLOCK_IN=phase, FAULT_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = out / "train_log.jsonl"
        _wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3, proc, "3 logged steps")
        proc.send_signal(signal.SIGINT)  # first Ctrl-C: save a checkpoint at the next boundary
        _wait_for(marker.exists, proc, "the checkpoint save")
        proc.send_signal(signal.SIGINT)  # second Ctrl-C, while the checkpoint is being written
        console, _ = proc.communicate(timeout=100)
    finally:
        proc.kill()
    # Inside torch.save the interrupt surfaces as its zip writer's RuntimeError ("unexpected pos"): still an
    # interrupt, said as such.
    assert proc.returncode == 130, console[-3000:]
    assert console.strip().splitlines()[-1] == "trainer: interrupted", console[-3000:]
    assert "Traceback" not in console and "unexpected pos" not in console, console[-3000:]
    assert list(out.glob("checkpoint-*")) == []  # the half-written checkpoint is removed

    rerun = _trainer("train", "--config", str(config), "--set", "max_steps=2")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert re.search(
        r"no (usable |complete )?checkpoint.*(start(s|ing)? over|from step 0)", rerun.stderr, re.I
    )
    assert "dropping" not in rerun.stderr, rerun.stderr[-3000:]


def _blocked_run(tmp_path: Path, config: Path, phase: str) -> tuple[subprocess.Popen, Path]:
    """Start `trainer train` with `phase` blocked; returns the process and the marker saying it got there."""
    script, marker = tmp_path / "blocking.py", tmp_path / f"in-{phase}"
    script.write_text(_BLOCKING_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "train", "--config", str(config)],
        env=_env(FAULT_BLOCK_IN=phase, FAULT_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, marker


def _with_data_file_cut_while_blocked(tmp_path: Path, config: Path, data: Path, phase: str):
    """Run until `phase`, cut the data file to nothing there (a file rewritten under a running job), go on;
    returns the exit code and the console."""
    proc, marker = _blocked_run(tmp_path, config, phase)
    try:
        _wait_for(marker.exists, proc, f"the {phase} phase")
        data.write_text("")
        marker.unlink()
        console, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, console


@pytest.mark.slow
def test_sigkill_at_any_moment_of_background_writes_leaves_only_complete_checkpoints(
    tmp_path, tiny_model_dir, sample_csv
):
    """A checkpoint at every step, written in the background (a write takes longer than a step, so one is
    nearly always in flight), and the run killed with SIGKILL 8 times at random moments: every
    checkpoint-<step> directory is complete and resumable, what a kill cut short (a write, or the deletion of
    a rotated checkpoint) is a temporary directory the next run removes, and the last run resumes from the
    newest checkpoint and finishes. Its log shows each save waiting for the write before it.
    Slow because nine trainer processes start, eight of them killed after two new saves each."""
    from trainer.checkpoint.store import checkpoint_problem, list_checkpoints

    config, out = _config(
        tmp_path, "kill", tiny_model_dir, sample_csv, max_steps=100_000, save_steps=1, save_total_limit=2
    )
    draw = random.Random(0)
    cut_short = 0
    for _ in range(8):
        newest = max((step for step, _ in list_checkpoints(out)), default=0)
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer", "train", "--config", str(config)],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for(
                lambda n=newest: any(s > n + 1 for s, _ in list_checkpoints(out)), proc, "two new saves"
            )
            time.sleep(draw.uniform(0.0, 0.6))
        finally:
            proc.kill()
            proc.wait()
        for path in out.glob("checkpoint-*"):
            if ".tmp-" in path.name:
                cut_short += 1
            else:
                assert checkpoint_problem(path) is None, path
    assert cut_short >= 1  # some kills fell inside a write: the test saw what it is about

    newest = max(step for step, _ in list_checkpoints(out))
    left_over = bool(list(out.glob("checkpoint-*.tmp-*")))  # whether the last kill fell inside a write
    done = _trainer("train", "--config", str(config), "--set", f"max_steps={newest + 3}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"checkpoint-{newest}" in done.stderr
    assert ("left half-done by an earlier run" in done.stderr) == left_over
    assert not list(out.glob("checkpoint-*.tmp-*"))
    events = re.findall(r"checkpoint-(\d+) (staged|written)", done.stderr)
    expected = [(str(step), kind) for step in range(newest + 1, newest + 4) for kind in ("staged", "written")]
    assert events == expected, events  # each write done before the next save is staged


def test_a_data_error_mid_run_saves_the_last_completed_step_first(tmp_path, tiny_model_dir, sample_csv):
    data = tmp_path / "recipes.csv"
    shutil.copy(sample_csv, data)
    config, out = _config(tmp_path, "data-error", tiny_model_dir, data, max_steps=1000)
    code, console = _with_data_file_cut_while_blocked(tmp_path, config, data, "step")
    assert code == 2, console[-3000:]
    assert console.strip().splitlines()[-1].startswith(f"trainer: data error: {data}"), console[-3000:]
    assert "Traceback" not in console
    from trainer.checkpoint.resume import find_resume_checkpoint
    from trainer.checkpoint.store import load_trainer_state

    saved = find_resume_checkpoint("auto", out)
    assert saved is not None, console[-3000:]  # the steps trained before the error are kept
    logged = [r["step"] for r in _rows(out / "train_log.jsonl") if "loss" in r]
    assert load_trainer_state(saved)["step"] == logged[-1] >= 1
    assert f"saved {saved}; the same command resumes from it" in console


def test_an_evaluation_that_fails_at_the_end_leaves_the_last_step_saved(tmp_path, tiny_model_dir, sample_csv):
    data = tmp_path / "recipes.csv"
    shutil.copy(sample_csv, data)
    # save_steps 1000 > max_steps: the only checkpoint of the run is the one written at its end.
    config, out = _config(tmp_path, "eval-error", tiny_model_dir, data, max_steps=3)
    code, console = _with_data_file_cut_while_blocked(tmp_path, config, data, "evaluate")
    assert code == 2, console[-3000:]
    assert "Traceback" not in console
    from trainer.checkpoint.resume import find_resume_checkpoint
    from trainer.checkpoint.store import load_trainer_state

    saved = find_resume_checkpoint("auto", out)
    assert saved is not None and load_trainer_state(saved)["step"] == 3, console[-3000:]


@pytest.mark.parametrize(
    ("sig", "phase"),
    [(signal.SIGTERM, "data"), (signal.SIGTERM, "model"), (signal.SIGINT, "model")],
    ids=["sigterm-indexing", "sigterm-loading", "ctrl-c-loading"],
)
def test_a_signal_before_training_starts_is_logged_reported_and_exits_128_plus_it(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    discord_server,  # noqa: F811
    sig,
    phase,
):
    config, out = _config(tmp_path, "early", tiny_model_dir, sample_csv, max_steps=1000)
    script, marker = tmp_path / "blocking.py", tmp_path / f"in-{phase}"
    script.write_text(_BLOCKING_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "train", "--config", str(config)],
        env=_env(FAULT_BLOCK_IN=phase, FAULT_MARKER=str(marker), DISCORD_WEBHOOK_URL=discord_server.url),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(marker.exists, proc, f"the {phase} phase")
        proc.send_signal(sig)
        # The block lasts 120 s: a loop that only looked at the signal after the phase would not end here.
        console, _ = proc.communicate(timeout=100)
    finally:
        proc.kill()
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, console[-3000:]
    assert re.search(rf"{name}.*before training started", console), console[-3000:]
    assert "Traceback" not in console
    if phase == "model":  # Discord heard "Training started" (sent before the model loads): it hears the end
        assert discord_server.wait_for(2, timeout=15)
        assert "before training started" in discord_server.titles()[-1], discord_server.titles()


def test_demo_data_is_written_only_inside_the_quickstart_directory(tmp_path, monkeypatch):
    from trainer.data.sample import ensure_demo_data, is_quickstart_path

    monkeypatch.chdir(tmp_path)
    assert is_quickstart_path("data/quickstart/recipes.csv") and is_quickstart_path(
        tmp_path / "data/quickstart"
    )
    assert not is_quickstart_path("/tmp/nothere.csv") and not is_quickstart_path(
        "data/quickstart/../real.csv"
    )
    files = ["data/quickstart/recipes.csv", str(tmp_path / "elsewhere.csv")]
    model = "data/quickstart/tiny-flan-t5"
    assert ensure_demo_data(files, model, n=20, fmt=None, dry_run=True) == [Path(files[0]), Path(model)]
    assert (
        not (tmp_path / "data").exists() and not (tmp_path / "elsewhere.csv").exists()
    )  # a dry run writes nothing
    assert ensure_demo_data(files, model, n=20, fmt=None) == [Path(files[0]), Path(model)]
    assert (tmp_path / files[0]).stat().st_size > 0 and (tmp_path / model / "config.json").is_file()
    assert not (tmp_path / "elsewhere.csv").exists()
    assert ensure_demo_data(files, str(tmp_path / "model"), n=20, fmt=None) == []  # present, or not ours
    assert not (tmp_path / "model").exists()


def test_dry_run_and_demo_data_write_nothing_outside_the_quickstart_directory(tmp_path):
    quickstart = yaml.safe_load((Path(__file__).parents[1] / "configs" / "quickstart.yaml").read_text())
    config = tmp_path / "quickstart.yaml"
    config.write_text(yaml.safe_dump(dict(quickstart, max_steps=2, output_dir=str(tmp_path / "out"))))
    data, model = tmp_path / "nothere.csv", tmp_path / "nomodel"
    # In a scratch working directory: data/quickstart/ there is the quickstart's own, and empty.
    dry = _trainer(
        "train", "--config", str(config), "--dry-run", "--set", f"train_files=[{data}]", cwd=tmp_path
    )
    assert not data.exists(), "a dry run wrote demo data"
    assert not (tmp_path / "data").exists(), "a dry run built the tiny model"
    assert dry.returncode == 2, dry.stderr[-3000:]
    overrides = [f"train_files=[{data}]", f"model_name_or_path={model}"]
    real = _trainer("train", "--config", str(config), "--set", *overrides, cwd=tmp_path)
    assert not data.exists() and not model.exists(), "demo data written outside data/quickstart/"
    assert real.returncode == 2, real.stderr[-3000:]

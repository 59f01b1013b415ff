"""W&B through the Reporter, offline, read back from the run's own files; secrets stay out of the run dir."""

from __future__ import annotations

import json
import logging
import struct
import time
from pathlib import Path

import pytest
from discord_server import discord_server, files_containing  # noqa: F401

from trainer.config import TrainConfig
from trainer.metrics import FAST_TEST_ENV, GENERATION_COLUMNS
from trainer.redact import SECRET_ENV_VARS
from trainer.report import Reporter


def read_wandb_run(run_dir: Path, timeout: float = 10.0) -> dict:
    """Read an offline W&B run from its `run-<id>.wandb` file: run id, config, history rows, summary.

    wandb's service process may still be writing the file for a moment after `run.finish()` returns, so this
    waits (up to `timeout`) for the run's exit record.
    """
    deadline = time.monotonic() + timeout
    while True:
        run = _parse_wandb_file(run_dir)
        if run["exited"] or time.monotonic() > deadline:
            return run
        time.sleep(0.05)


def _parse_wandb_file(run_dir: Path) -> dict:
    """The file is wandb's record log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of
    chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) holding
    serialized `wandb_internal_pb2.Record` protobufs.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    out: dict = {"run_id": None, "config": {}, "history": [], "summary": {}, "exited": False}

    def key(item) -> str:
        return item.key or "/".join(item.nested_key)

    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run_id"] = record.run.run_id
            out["config"].update({key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            out["history"].append({key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            out["exited"] = True
    return out


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """No credentials, no network: a HOME without ~/.netrc and no W&B variables from the outside."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_RUN_ID", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    for name in SECRET_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "home" / ".cache" / "wandb"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "home" / ".local" / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv(FAST_TEST_ENV, "1")  # offline runs skip the system-metrics sampler
    return tmp_path


def _cfg(out: Path, **kw) -> TrainConfig:
    kw = {"report_to": "wandb", "run_name": "unit-run", "wandb_project": "unit", **kw}
    return TrainConfig(output_dir=str(out), **kw)


def _run_dirs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def test_no_api_key_logs_offline_and_says_so_once(wandb_env, caplog):
    out = wandb_env / "run"
    with caplog.at_level(logging.INFO):
        r = Reporter(_cfg(out))
        for step in range(1, 4):
            r.log_metrics({"train/loss": 3.0 - step, "train/lr": 1e-4 * step, "train/grad_norm": 0.5}, step)
        r.evaluated(
            step=3,
            eval_loss=0.75,
            generations=[
                {"ingredients": "eggs, milk", "generated": "Whisk.", "reference": "Whisk well."},
                {"ingredients": "rice", "generated": "Boil.", "reference": "Simmer."},
            ],
        )
        r.oom_backoff(step=3, micro_batch="2 rows", accumulation=16)
        r.nan_skipped(step=3, skipped_total=2)
        r.finished(final_loss=0.5, duration_s=12.0, model_dir=str(out / "final"))
        run_id = r.run_id
        r.close()
    assert sum("logging offline" in rec.getMessage() for rec in caplog.records) == 1
    (run_dir,) = _run_dirs(out)
    assert run_dir.name.endswith(run_id)
    run = read_wandb_run(run_dir)
    assert run["run_id"] == run_id
    assert run["config"]["run_name"] == "unit-run" and run["config"]["learning_rate"] == 1e-4
    losses = {row["train/global_step"]: row["train/loss"] for row in run["history"] if "train/loss" in row}
    assert losses == {1: 2.0, 2: 1.0, 3: 0.0}
    assert run["summary"]["eval/loss"] == 0.75
    assert run["summary"]["train/oom_backoffs"] == 1 and run["summary"]["train/skipped_nan_steps"] == 2
    assert run["summary"]["final_loss"] == 0.5
    # The generations table: written as a wandb Table file with the agreed columns.
    table = json.loads((run_dir / "files" / run["summary"]["eval/generations/path"]).read_text())
    assert table["columns"] == GENERATION_COLUMNS
    assert table["data"] == [[3, "eggs, milk", "Whisk.", "Whisk well."], [3, "rice", "Boil.", "Simmer."]]


def test_resume_continues_the_same_run(wandb_env):
    out = wandb_env / "run"
    first = Reporter(_cfg(out))
    first.log_metrics({"train/loss": 2.0}, 10)
    run_id = first.run_id
    first.stopped_by_signal(signal_name="SIGTERM", step=10, checkpoint=str(out / "checkpoint-10"))
    first.close()
    # The loop stores run_id in the checkpoint and passes it back on resume.
    second = Reporter(_cfg(out), run_id=run_id)
    assert second.run_id == run_id
    second.log_metrics({"train/loss": 1.0}, 11)
    second.close()
    assert second.run_id == run_id  # still known after close (the final checkpoint may be written late)
    runs = [read_wandb_run(d) for d in _run_dirs(out)]  # one directory per process, both for one run
    assert [run["run_id"] for run in runs] == [run_id, run_id]
    losses = [[row["train/loss"] for row in run["history"] if "train/loss" in row] for run in runs]
    assert sorted(losses) == [[1.0], [2.0]]
    resumed = next(run for run in runs if run["history"] and run["history"][-1].get("train/loss") == 1.0)
    assert resumed["history"][-1]["train/global_step"] == 11


def test_secrets_stay_out_of_config_run_dir_and_messages(wandb_env, monkeypatch, discord_server, caplog):  # noqa: F811
    secrets = {
        "WANDB_API_KEY": "wandb-fake-key-0123456789abcdef0123456789",
        "HF_TOKEN": "hf_fakeTokenValue0123456789",
        "HUGGING_FACE_HUB_TOKEN": "hf_otherFakeToken987654321",
        "DISCORD_WEBHOOK_URL": discord_server.url,
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_MODE", "offline")  # a key is set, but this test must not go online
    out = wandb_env / "run"
    # A careless user pasted a token into a path; the W&B config must still not hold it.
    cfg = _cfg(out, train_files=[f"/data/{secrets['HF_TOKEN']}/recipes.csv"], discord_progress_minutes=0)
    with caplog.at_level(logging.DEBUG):
        r = Reporter(cfg)
        r.started(model="tiny", data=cfg.train_files[0], effective_batch="4", planned_steps=5)
        r.progress(step=1, total=5, loss=1.0, tokens_per_s=10.0, eta_s=4.0, memory_gib=None)
        r.log_metrics({"train/loss": 1.0}, 1)
        r.evaluated(
            step=1,
            eval_loss=1.0,
            generations=[{"ingredients": secrets["WANDB_API_KEY"], "generated": "x", "reference": "y"}],
        )
        try:
            raise ConnectionError(
                f"POST {discord_server.url} failed; token={secrets['HUGGING_FACE_HUB_TOKEN']}"
            )
        except ConnectionError as e:
            r.crashed(e)
        r.close(timeout=10)
    assert len(discord_server.payloads) == 4
    sent = b"".join(q.body for q in discord_server.requests).decode()
    (run_dir,) = _run_dirs(out)
    run = read_wandb_run(run_dir)  # also waits until wandb has written everything
    assert run["config"]["train_files"] == ["/data/***/recipes.csv"]
    assert len(list(out.rglob("*"))) > 5, "the W&B run directory is (nearly) empty"
    assert files_containing(out, [*secrets.values(), discord_server.token]) == []
    for name, value in secrets.items():
        assert value not in sent, f"{name} sent to Discord"
        assert value not in caplog.text, f"{name} in the logs"
    assert discord_server.token not in sent and discord_server.token not in caplog.text


def test_wandb_failures_never_stop_training(wandb_env, caplog):
    blocker = wandb_env / "not-a-dir"
    blocker.write_text("a file where the run directory should be")
    with caplog.at_level(logging.WARNING):
        r = Reporter(_cfg(blocker))  # W&B cannot create its directory: init fails
        for step in range(5):
            r.log_metrics({"train/loss": 1.0}, step)
        r.finished(final_loss=1.0, duration_s=1.0, model_dir="x")
        r.close()
    assert r.run_id is None
    assert sum("W&B init failed" in rec.getMessage() for rec in caplog.records) == 1

    caplog.clear()
    out = wandb_env / "run"
    with caplog.at_level(logging.WARNING):
        r = Reporter(_cfg(out))
        r._wandb.run.finish()  # the run dies under us (as when wandb's service process is gone)
        for step in range(30):
            r.log_metrics({"train/loss": 1.0}, step)
        r.close()
    assert sum("W&B log failed" in rec.getMessage() for rec in caplog.records) == 1


def test_wandb_off_when_not_asked_or_not_main(wandb_env):
    for reporter in (
        Reporter(_cfg(wandb_env / "a", report_to="none")),
        Reporter(_cfg(wandb_env / "b"), is_main=False),
    ):
        reporter.log_metrics({"train/loss": 1.0}, 1)
        reporter.close()
        assert reporter.run_id is None
    assert not (wandb_env / "a").exists() and not (wandb_env / "b").exists()
    # A run id from a checkpoint survives even with W&B off, so a later resume with W&B on can continue it.
    assert Reporter(_cfg(wandb_env / "c", report_to="none"), run_id="abc123").run_id == "abc123"

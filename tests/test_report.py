"""W&B through the Reporter, offline, read back from the run's own files; secrets stay out of the run dir."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from discord_server import dead_webhook_url, discord_server, files_containing, limit_violations  # noqa: F401

from trainer.config import TrainConfig
from trainer.data.prompt import TEMPLATE_FILE
from trainer.infra.redact import SECRET_ENV_VARS
from trainer.report.reporter import Reporter
from trainer.report.wandb_logger import FAST_TEST_ENV, SAMPLE_COLUMNS


def read_wandb_run(run_dir: Path, timeout: float = 10.0) -> dict:
    """Read an offline W&B run from its `run-<id>.wandb` file: run id, config, history rows, summary, logged
    artifacts (name, type, aliases, metadata, files: artifact path -> the staged copy wandb sync uploads).

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
    out: dict = {"run_id": None, "config": {}, "history": [], "summary": {}, "artifacts": [], "exited": False}

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
        elif kind == "artifact":
            a = record.artifact
            out["artifacts"].append(
                {
                    "name": a.name,
                    "type": a.type,
                    "aliases": list(a.aliases),
                    "metadata": json.loads(a.metadata or "{}"),
                    "files": {e.path: e.local_path for e in a.manifest.contents},
                }
            )
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
    kw = {"report_to": ["wandb"], "run_name": "unit-run", "wandb_project": "unit", **kw}
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
            metrics={"eval_loss": 0.75, "eval_rougeL": 21.5, "eval_ingredient_coverage": 0.5},
            samples=[
                {"prompt": "eggs, milk", "generated": "Whisk.", "reference": "Whisk well.", "rougeL": 66.7},
                {"prompt": "rice", "generated": "Boil.", "reference": "Simmer.", "structure": False},
            ],
        )
        r.oom_backoff(step=3, micro_batch="2 rows", accumulation=16)
        r.nan_skipped(step=3, skipped_total=2)
        goodput = {"goodput": 0.9, "wall_s": 10.0, "steps_s": 9.0, "save_s": 0.5, "evaluation_s": 0.5}
        r.finished(final_loss=0.5, duration_s=12.0, model_dir=str(out / "final"), goodput=goodput)
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
    assert run["summary"]["eval/loss"] == 0.75 and run["summary"]["eval/rougeL"] == 21.5
    assert run["summary"]["eval/ingredient_coverage"] == 0.5
    assert run["summary"]["train/oom_backoffs"] == 1 and run["summary"]["train/skipped_nan_steps"] == 2
    assert run["summary"]["final_loss"] == 0.5
    assert run["summary"]["goodput"] == 0.9 and run["summary"]["goodput/save_s"] == 0.5
    # The generations table: written as a wandb Table file with the agreed columns.
    table = json.loads((run_dir / "files" / run["summary"]["eval/generations/path"]).read_text())
    assert table["columns"] == SAMPLE_COLUMNS
    assert table["data"] == [
        [3, "eggs, milk", "Whisk.", "Whisk well.", 66.7, None, None, None],
        [3, "rice", "Boil.", "Simmer.", None, None, None, False],
    ]


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
            metrics={"eval_loss": 1.0},
            samples=[{"prompt": secrets["WANDB_API_KEY"], "generated": "x", "reference": "y"}],
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


MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", TEMPLATE_FILE}


def test_a_run_logs_eval_metrics_samples_and_model_artifacts_offline(
    wandb_env, monkeypatch, tiny_model_dir, sample_csv
):
    from trainer.run.train import train

    monkeypatch.setenv("WANDB_LOG_MODEL", "checkpoint")
    out = wandb_env / "run"
    cfg = TrainConfig.from_dict(
        {
            "model_name_or_path": str(tiny_model_dir),
            "dtype": "float32",
            "train_files": [str(sample_csv)],
            "max_source_length": 64,
            "max_target_length": 96,
            "per_device_train_batch_size": 8,
            "eval_fraction": 0.05,
            "eval_max_batches": 1,
            "max_steps": 4,
            "eval_steps": 2,
            "save_steps": 2,
            "eval_generation_records": 4,
            "num_eval_generations": 2,
            "generation_max_new_tokens": 8,
            "gradient_checkpointing": False,
            # The loss falls, so "greater is better" keeps step 2 as the best and puts it in final/.
            "metric_for_best_model": "eval_loss",
            "greater_is_better": True,
            "load_best_model_at_end": True,
            "output_dir": str(out),
            "report_to": "wandb",
            "run_name": "artifacts",
            "wandb_project": "unit",
            "progress_bar": False,
            "discord_progress_minutes": -1,
        }
    )
    assert train(cfg) == 0
    (run_dir,) = _run_dirs(out)
    run = read_wandb_run(run_dir)
    evals = {row["train/global_step"]: row for row in run["history"] if "eval/loss" in row}
    assert sorted(evals) == [2, 4]
    assert all(
        {"eval/rougeL", "eval/bleu", "eval/ingredient_coverage", "eval/structure"} <= set(r)
        for r in evals.values()
    )
    tables = [row["eval/generations/path"] for row in run["history"] if "eval/generations/path" in row]
    assert len(tables) == 2
    table = json.loads((run_dir / "files" / tables[0]).read_text())
    assert table["columns"] == SAMPLE_COLUMNS and len(table["data"]) == 2
    assert all(row[1].startswith("Write a recipe with these ingredients: ") for row in table["data"])

    # WANDB_LOG_MODEL=checkpoint: each checkpoint, then final/, as versions of one model artifact, with the
    # model's files only (no optimizer or resume state), kept in the offline run for `wandb sync`.
    artifacts = [a for a in run["artifacts"] if a["type"] == "model"]  # the tables are artifacts too
    assert [a["name"] for a in artifacts] == ["model-artifacts"] * 3
    assert [sorted(a["aliases"]) for a in artifacts] == [
        ["best", "checkpoint_global_step_2", "latest"],
        ["checkpoint_global_step_4", "latest"],
        ["best", "final_model", "latest"],
    ]
    for a in artifacts:
        assert set(a["files"]) >= MODEL_FILES, sorted(a["files"])
        assert not {"trainer_state.json", "scheduler.pt", "rng.pt"} & set(a["files"])
        assert all(Path(staged).is_file() for staged in a["files"].values())
    assert "README.md" in artifacts[2]["files"] and artifacts[2]["metadata"]["best_global_step"] == 2
    assert artifacts[2]["metadata"]["eval_loss"] == evals[4]["eval/loss"]  # the last evaluation's metrics


@pytest.mark.parametrize(
    ("value", "logged"), [("end", ["final"]), ("false", []), (None, []), ("true", ["final"])]
)
def test_wandb_log_model_end_logs_only_the_final_model(wandb_env, monkeypatch, tiny_model_dir, value, logged):
    if value is not None:
        monkeypatch.setenv("WANDB_LOG_MODEL", value)
    out = wandb_env / "run"
    r = Reporter(_cfg(out))
    r.checkpoint_saved(step=1, path=str(tiny_model_dir))
    r.model_saved(step=1, path=str(tiny_model_dir))
    r.close()
    run = read_wandb_run(_run_dirs(out)[0])
    assert [
        ("final" if "final_model" in a["aliases"] else "checkpoint")
        for a in run["artifacts"]
        if a["type"] == "model"
    ] == logged


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
        Reporter(_cfg(wandb_env / "a", report_to=[])),
        Reporter(_cfg(wandb_env / "b"), is_main=False),
    ):
        reporter.log_metrics({"train/loss": 1.0}, 1)
        reporter.close()
        assert reporter.run_id is None
    assert not (wandb_env / "a").exists() and not (wandb_env / "b").exists()
    # A run id from a checkpoint survives even with W&B off, so a later resume with W&B on can continue it.
    assert Reporter(_cfg(wandb_env / "c", report_to=[]), run_id="abc123").run_id == "abc123"


# --- a real tiny training run, through the `trainer` CLI, against the local Discord server ---------------

RUN_SECRETS = {
    "WANDB_API_KEY": "wandb-fake-key-5f0e1d2c3b4a59687766554433221100",
    "HF_TOKEN": "hf_fakeRunTokenAbCdEf0123456789",
    "HUGGING_FACE_HUB_TOKEN": "hf_fakeHubTokenZyXwVu9876543210",
}
RUN_STEPS = 6
# Reporter.close() gives queued Discord messages this long at exit (its default; the loop calls close()).
CLOSE_TIMEOUT_S = 10.0
# What closing the notifier says it waited may exceed its deadline by the time a loaded machine takes to
# schedule the thread again: generous, and far below the slow server's 120 s.
CLOSE_SLACK_S = 5.0
CLOSE_LINE = (
    r"(?P<left>\d+) message\(s\) not sent within the (?P<timeout>[\d.]+)s close timeout "
    r"\(waited (?P<waited>[\d.]+) s\)"
)
CLOSED_LINE = r"Discord: nothing left to send; closing waited (?P<waited>[\d.]+) s"


@pytest.fixture(scope="module")
def fault_script() -> Path:
    """The trainer's command line with injected faults (tests/run_with_faults.py)."""
    return Path(__file__).parent / "run_with_faults.py"


def _run_config(tmp_path: Path, tiny_model_dir: Path, sample_csv: Path, name: str, **kw) -> tuple[Path, Path]:
    out = tmp_path / name
    values = {
        "model_name_or_path": str(tiny_model_dir),
        "dtype": "float32",
        "train_files": [str(sample_csv)],
        "max_source_length": 64,
        "max_target_length": 96,
        "per_device_train_batch_size": 8,
        "eval_fraction": 0.05,
        "eval_max_batches": 1,
        "learning_rate": 1e-3,
        "max_steps": RUN_STEPS,
        "logging_steps": 1,
        "eval_steps": 3,
        "save_steps": 3,
        "num_eval_generations": 1,
        "generation_max_new_tokens": 8,
        "gradient_checkpointing": False,
        "output_dir": str(out),
        "report_to": "wandb",
        "run_name": name,
        "wandb_project": "e2e",
        "discord_progress_minutes": 0,
        **kw,
    }
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(values))
    return config, out


def _run_env(tmp_path: Path, webhook_url: str, **faults: int | str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "DISCORD_", "HF_", "FAULT_"))}
    env.pop("HUGGING_FACE_HUB_TOKEN", None)
    home = tmp_path / "home"
    env.update(
        RUN_SECRETS,
        DISCORD_WEBHOOK_URL=webhook_url,
        WANDB_MODE="offline",  # a key is set, but the test must not go online
        HOME=str(home),
        NETRC=str(home / ".netrc"),
        WANDB_CONFIG_DIR=str(home / ".config" / "wandb"),
        WANDB_CACHE_DIR=str(home / ".cache" / "wandb"),
        WANDB_DATA_DIR=str(home / ".local" / "wandb"),
        TOKENIZERS_PARALLELISM="false",
    )
    env.update({f"FAULT_{k.upper()}": str(v) for k, v in faults.items()})
    return env


def _train(
    script: Path, config: Path, env: dict[str, str], flags: tuple[str, ...] = (), timeout: float = 300
):
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), *flags, "train", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, time.monotonic() - start


def _no_secret_anywhere(out: Path, console: str, webhook_url: str, token: str) -> None:
    needles = [*RUN_SECRETS.values(), webhook_url, token]
    assert files_containing(out, needles) == [], "a secret was written into the run's output directory"
    for needle in needles:
        assert needle not in console, f"{needle[:8]}… on the console"


def test_a_real_run_reports_every_event_to_discord_and_wandb(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    fault_script,
    discord_server,  # noqa: F811
):
    from trainer.checkpoint.resume import find_resume_checkpoint
    from trainer.checkpoint.store import load_trainer_state

    # The data under a directory named like the HF token: the path is in the config that each checkpoint
    # stores, and it must be masked there too.
    data = tmp_path / RUN_SECRETS["HF_TOKEN"] / "recipes.csv"
    data.parent.mkdir()
    shutil.copy(sample_csv, data)
    config, out = _run_config(tmp_path, tiny_model_dir, data, "good")
    # Micro-batch 2 runs out of memory (step 2 is retried as two half batches: 3 and 4); micro-batch 6, the
    # second half of step 3, turns NaN, so that step is skipped.
    env = _run_env(tmp_path, discord_server.url, oom_at=2, nan_at="6")
    done, _ = _train(fault_script, config, env)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console

    titles = discord_server.titles()
    assert titles[0] == "Training started: good" and titles[-1] == "Training finished: good", titles
    assert titles.count("Progress") == RUN_STEPS
    assert titles.count("Out of memory: micro-batch halved") == 1
    assert titles.count("Non-finite loss: step skipped") == 1
    assert titles.count("Evaluation") == 2  # steps 3 and 6
    assert titles.count("Checkpoint saved") == 2
    assert all(q.status == 204 for q in discord_server.requests)
    assert all(limit_violations(p) == [] for p in discord_server.payloads)
    started = {f["name"]: f["value"] for f in discord_server.payloads[0]["embeds"][0]["fields"]}
    assert started["Planned steps"] == str(RUN_STEPS) and started["Model"] == str(tiny_model_dir)
    evaluation = next(
        p["embeds"][0] for p in discord_server.payloads if p["embeds"][0]["title"] == "Evaluation"
    )
    evaluation = {f["name"]: f["value"] for f in evaluation["fields"]}
    assert {"Eval loss", "ROUGE-L", "BLEU", "Ingredient coverage", "Sample 1: prompt"} <= set(evaluation)
    assert evaluation["Sample 1: prompt"].startswith("Write a recipe with these ingredients: ")

    # W&B, offline: the run directory read back with wandb's own record format.
    (run_dir,) = sorted((out / "wandb").glob("offline-run-*"))
    run = read_wandb_run(run_dir)
    assert run["exited"]
    steps = {row["train/global_step"] for row in run["history"] if "train/loss" in row}
    assert steps == set(range(1, RUN_STEPS + 1))
    logged = {k for row in run["history"] for k in row}
    assert {
        "train/loss",
        "train/learning_rate",
        "train/epoch",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/samples_per_s",
        "train/oom_backoffs",
        "train/skipped_nan_steps",
        "eval/loss",
        "eval/rougeL",
        "eval/ingredient_coverage",
    } <= logged, sorted(logged)
    tables = [row for row in run["history"] if "eval/generations/_type" in row]
    assert len(tables) == 2 and all(row["eval/generations/_type"] == "table-file" for row in tables)
    assert run["summary"]["train/oom_backoffs"] == 1 and run["summary"]["train/skipped_nan_steps"] == 1
    assert run["config"]["run_name"] == "good"
    records, skipped = run["summary"]["data/records"], run["summary"]["data/skipped_records"]
    assert records > 0 and f"({records:,} records, {skipped:,} skipped)" in started["Data"], started["Data"]
    # The run id is stored with the checkpoint, so a resume continues this W&B run.
    assert load_trainer_state(find_resume_checkpoint("auto", out))["wandb_run_id"] == run["run_id"]

    _no_secret_anywhere(out, console, discord_server.url, discord_server.token)


def test_a_crash_in_a_real_run_is_reported_and_redacted(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    fault_script,
    discord_server,  # noqa: F811
):
    config, out = _run_config(tmp_path, tiny_model_dir, sample_csv, "crash", report_to="none")
    # Steps 1 and 2 turn NaN, then step 3 raises an error quoting every secret.
    env = _run_env(tmp_path, discord_server.url, nan_from=1, crash_at=3)
    done, _ = _train(fault_script, config, env)
    console = done.stdout + done.stderr
    assert done.returncode == 1, console
    assert "RuntimeError: upstream call failed" in console and "***" in console
    titles = discord_server.titles()
    assert titles[0] == "Training started: crash" and titles[-1] == "Training crashed: RuntimeError", titles
    assert titles.count("Non-finite loss: step skipped") == 2
    crash = discord_server.payloads[-1]["embeds"][0]
    assert "Traceback" in crash["description"] and "upstream call failed: *** *** " in crash["description"]
    assert all(limit_violations(p) == [] for p in discord_server.payloads)
    _no_secret_anywhere(out, console, discord_server.url, discord_server.token)


def test_a_crash_while_loading_the_model_is_reported(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    fault_script,
    discord_server,  # noqa: F811
):
    # Whole files (a truncated one is a config error before the start, test_faults.py), but a config.json
    # whose d_ff does not match the weights: loading them fails.
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    model_config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(model_config, d_ff=model_config["d_ff"] * 2)))
    config, out = _run_config(tmp_path, broken, sample_csv, "load", report_to="none")
    done, _ = _train(fault_script, config, _run_env(tmp_path, discord_server.url))
    console = done.stdout + done.stderr
    assert done.returncode == 1, console
    titles = discord_server.titles()
    assert titles[0] == "Training started: load" and titles[-1].startswith("Training crashed: "), titles


def test_sigterm_in_a_real_run_is_reported(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    fault_script,
    discord_server,  # noqa: F811
):
    config, out = _run_config(
        tmp_path, tiny_model_dir, sample_csv, "stopped", report_to="none", max_steps=500
    )
    proc = subprocess.Popen(
        [sys.executable, str(fault_script), "train", "--config", str(config)],
        env=_run_env(tmp_path, discord_server.url),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while "Progress" not in discord_server.titles() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # what `docker stop` sends
        console, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, console
    titles = discord_server.titles()
    assert titles[-1] == "Training stopped by SIGTERM", titles
    assert "Checkpoint saved" in titles
    _no_secret_anywhere(out, console, discord_server.url, discord_server.token)


@pytest.mark.slow
def test_a_slow_or_dead_server_adds_at_most_the_close_timeout(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    fault_script,
    discord_server,  # noqa: F811
    dead_webhook_url,  # noqa: F811
):
    """The same real run against a healthy server, one that never answers in time and a dead one: the run
    ends with messages still queued (had the steps waited on the network, none would be), and closing waits
    at most the close timeout for them. What is bounded is the wait the notifier measures in close(), which
    its deadline controls, not the run's wall clock, which a busy machine stretches at will. The slow and the
    dead server's runs go side by side (one of them mostly waits).
    Slow because each run waits out a Discord server's close timeout, which is what it measures."""

    def run(name: str, url: str, *flags: str) -> str:
        config, _ = _run_config(tmp_path, tiny_model_dir, sample_csv, name, report_to="none")
        done, _ = _train(fault_script, config, _run_env(tmp_path, url), flags)
        assert done.returncode == 0, done.stderr
        return done.stderr

    run("healthy", discord_server.url)
    assert len(discord_server.payloads) >= RUN_STEPS + 4  # started, progress per step, evals, checkpoints
    # Every try times out (after the client's 5 s), so each message takes over 30 s before it is given up:
    # far more, for the run's dozen messages, than the run lasts.
    discord_server.script.delay = 120.0
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(run, "slow", discord_server.url)
        dead = pool.submit(run, "dead", dead_webhook_url, "--verbose")
        console = slow.result()
        not_sent = re.search(CLOSE_LINE, console)
        assert not_sent, console
        assert int(not_sent["left"]) >= 1 and float(not_sent["timeout"]) == CLOSE_TIMEOUT_S
        assert float(not_sent["waited"]) <= CLOSE_TIMEOUT_S + CLOSE_SLACK_S, not_sent[0]
        # A dead server refuses at once; whether anything is left at the end depends on how long the run
        # took, so the close's own line is read at debug level when everything went (or was given up) in time.
        console = dead.result()
    closed = re.search(CLOSE_LINE, console) or re.search(CLOSED_LINE, console)
    assert closed, console
    assert float(closed["waited"]) <= CLOSE_TIMEOUT_S + CLOSE_SLACK_S, closed[0]


def _progress_etas(discord_server) -> dict[int, float]:  # noqa: F811
    """Step -> the ETA (seconds) of each Discord progress message."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    etas = {}
    for payload in discord_server.payloads:
        embed = payload["embeds"][0]
        if embed["title"] == "Progress":
            fields = {f["name"]: f["value"] for f in embed["fields"]}
            step = int(fields["Step"].split("/")[0].replace(",", ""))
            etas[step] = sum(int(part[:-1]) * units[part[-1]] for part in fields["ETA"].split())
    return etas


def _step_times(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["time"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_the_eta_after_a_checkpoint_and_after_a_resume_is_the_step_time_times_the_steps_left(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    fault_script,
    discord_server,  # noqa: F811
):
    """The ETA Discord shows right after a checkpoint, in a first process and in one that resumed, against the
    time per step that process measured (train log) times the steps left. (It used to divide the time since
    the start by the steps since the last checkpoint: 5x too long one step after it.)
    Slow because an ETA needs steps of a known time: two runs of slowed steps."""
    env = _run_env(tmp_path, discord_server.url, step_sleep_s=0.5)  # steps of >= 0.5 s: ETAs of seconds
    checks = []
    for total, first in ((8, 0), (16, 8)):  # the second run resumes from checkpoint-8
        config, out = _run_config(
            tmp_path,
            tiny_model_dir,
            sample_csv,
            "eta",
            report_to="none",
            max_steps=total,
            save_steps=2,
            eval_steps=100,
        )
        done, _ = _train(fault_script, config, env)
        assert done.returncode == 0, done.stderr
        times, etas = _step_times(out), _progress_etas(discord_server)
        step = first + 3  # one step after this process's first checkpoint (at first + 2)
        per_step = (times[step] - times[first + 1]) / (step - first - 1)
        checks.append((step, etas[step], per_step * (total - step)))
    # The meter's average also holds this process's first step, which a busy machine can make several times
    # longer than the others; the old ETA was 5x too long (one step counted for five).
    for step, eta, expected in checks:
        assert expected / 2 <= eta <= 3.5 * expected, (step, eta, expected, checks)


@pytest.mark.slow
def test_a_restart_before_the_first_checkpoint_continues_the_same_wandb_run(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    fault_script,
    discord_server,  # noqa: F811
):
    """Slow because three trainer processes start, with W&B (offline) in each."""
    from trainer.checkpoint.resume import find_resume_checkpoint

    config, out = _run_config(tmp_path, tiny_model_dir, sample_csv, "kept", save_steps=100, eval_steps=100)
    # The first start fails in its first step, before any checkpoint (as a container killed there would; an
    # error after a completed step would save that step first).
    done, _ = _train(fault_script, config, _run_env(tmp_path, discord_server.url, crash_at=1))
    assert done.returncode == 1, done.stderr
    assert find_resume_checkpoint("auto", out) is None
    run_id = (out / "wandb_run_id").read_text().strip()
    # The restarted container: no checkpoint to resume from, yet the same W&B run, and Discord says so.
    done, _ = _train(fault_script, config, _run_env(tmp_path, discord_server.url))
    assert done.returncode == 0, done.stderr
    runs = [read_wandb_run(d) for d in sorted((out / "wandb").glob("offline-run-*"))]
    assert [run["run_id"] for run in runs] == [run_id, run_id]
    assert any(run["summary"].get("final_loss") is not None for run in runs)
    sent = discord_server.titles()
    titles = [t for t in sent if t != "Progress"]
    assert titles[:3] == [
        "Training started: kept",
        "Training crashed: RuntimeError",
        "Training restarted (attempt 2): kept",
    ], titles
    assert titles[-1] == "Training finished: kept", titles
    # The finished run run again does nothing: no message, and no restart counted.
    done, _ = _train(fault_script, config, _run_env(tmp_path, discord_server.url))
    assert done.returncode == 0 and "this run is already finished" in done.stderr, done.stderr
    assert discord_server.titles() == sent
    assert json.loads((out / "run_starts.json").read_text()) == {"starts": 2}


def read_tensorboard_events(directory: Path) -> list[list]:
    """Each event file of `directory` (oldest first) as its events: TFRecords (length, its masked CRC, the
    serialized tensorboard `Event`, its masked CRC), read with the protobuf classes tensorboardX ships."""
    from tensorboardX.proto.event_pb2 import Event

    files = []
    for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: float(p.name.split(".")[3])):
        data, pos, events = path.read_bytes(), 0, []
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            events.append(Event.FromString(data[pos + 12 : pos + 12 + length]))
            pos += 12 + length + 4
        files.append(events)
    return files


def _scalars(events: list) -> dict[str, dict[int, float]]:
    found: dict[str, dict[int, float]] = {}
    for event in events:
        for value in event.summary.value:
            if value.HasField("simple_value"):
                found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found


def test_tensorboard_gets_wandbs_scalars_and_a_resume_purges_the_steps_it_repeats(
    tiny_model_dir, sample_csv, tmp_path, monkeypatch
):
    """report_to: tensorboard writes output_dir/runs: the scalars W&B gets under the same names against the
    optimizer step, the generated recipes and the config as text, no secret; a run resumed from an older
    checkpoint starts its file with a purge at the step after it, so TensorBoard drops the earlier attempt's
    later points instead of drawing the curve twice, and keeps the checkpoint's own step (not logged
    again)."""
    from tiny_run import tiny_run_values

    from trainer.run.train import train

    secret = "hf_tensorboardSecretValue123456"
    monkeypatch.setenv("HF_TOKEN", secret)
    out = tmp_path / "out"
    steps = dict(max_steps=6, eval_steps=3, save_steps=3, save_total_limit=0, per_device_train_batch_size=8)
    evaluation = dict(
        eval_fraction=0.05, eval_max_batches=1, num_eval_generations=2, generation_max_new_tokens=8
    )
    values = tiny_run_values(tiny_model_dir, sample_csv, out, report_to="tensorboard", **steps, **evaluation)
    assert train(TrainConfig.from_dict(values)) == 0
    (first,) = read_tensorboard_events(out / "runs")
    scalars = _scalars(first)
    assert sorted(scalars["train/loss"]) == [1, 2, 3, 4, 5, 6]
    assert {"train/learning_rate", "train/grad_norm", "train/epoch", "train/tokens_per_s"} <= set(scalars)
    assert sorted(scalars["eval/loss"]) == [3, 6] and sorted(scalars["eval/rougeL"]) == [3, 6]
    texts = {v.tag: (e.step, v) for e in first for v in e.summary.value if v.tag.endswith("text_summary")}
    assert {"config/text_summary", "eval/generations/text_summary"} <= set(texts)
    table = texts["eval/generations/text_summary"][1].tensor.string_val[0].decode()
    assert table.count("\n| Write a recipe with these ingredients: ") == 2
    assert all(secret.encode() not in p.read_bytes() for p in (out / "runs").iterdir())

    # Resume from step 3 (the step-6 checkpoint gone), with a different learning rate: steps 4-6 again.
    shutil.rmtree(out / "checkpoint-6")
    assert train(TrainConfig.from_dict(values | {"learning_rate": 5e-4, "resume": "auto"})) == 0
    first_again, second = read_tensorboard_events(out / "runs")
    assert first_again == first  # the earlier file is left as it was: TensorBoard purges on reading
    starts = [e for e in second if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert [e.step for e in starts] == [4]  # step 3's point, from the first file, stays
    assert second.index(starts[0]) < min(i for i, e in enumerate(second) if e.summary.value)
    assert sorted(_scalars(second)["train/loss"]) == [4, 5, 6]

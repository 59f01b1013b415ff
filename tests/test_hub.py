"""push_to_hub: real tiny training runs (`trainer train` subprocesses) uploading to a local server that speaks
the Hub's upload protocol (tests/hub_server.py) with huggingface_hub itself, Discord on the local webhook
server: the files arrive whole, a dead or slow Hub costs the run nothing, a later run uploads what was left,
and the token appears in no log, file, message or upload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from discord_server import dead_webhook_url, discord_server, files_containing  # noqa: F401
from hub_server import USER, HubServer, free_port_url, hub_server, silent_endpoint  # noqa: F401
from huggingface_hub import ModelCard
from tiny_run import tiny_run_values

from trainer.checkpoint.hub import PENDING_DIR

REPO = "recipes"
REPO_ID = f"{USER}/{REPO}"
FAILED_LINE = "push_to_hub: uploading "
LEFT_LINE = (
    r"push_to_hub: (?P<what>.+) is not on the Hub "
    r"\(hub_upload_timeout (?P<timeout>\S+), waited (?P<waited>[\d.]+) s\)"
)
# What the end's wait says it waited may exceed its deadline by the time a loaded machine takes to schedule:
# generous, and far below what waiting for the upload would cost (retries 5 + 30 s, the slow Hub's 600 s).
WAIT_SLACK_S = 10.0


def _config(tmp_path: Path, model: Path, data: Path, name: str, **kw) -> tuple[Path, Path]:
    out = tmp_path / name
    hub = dict(push_to_hub=True, hub_model_id=REPO, run_name=name)
    run = dict(max_steps=4, save_steps=2, per_device_train_batch_size=8, eval_fraction=0.0)
    values = tiny_run_values(model, data, out, **run | hub | kw)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(values))
    return config, out


def _env(tmp_path: Path, endpoint: str, token: str, webhook: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DISCORD_", "WANDB_"))}
    env.pop("HUGGING_FACE_HUB_TOKEN", None)
    env.update(
        HF_ENDPOINT=endpoint,
        HF_TOKEN=token,
        HF_HOME=str(tmp_path / "hf-home"),  # no token stored by `hf auth login` is used
        HF_HUB_DISABLE_XET="1",  # the local Hub speaks git-lfs uploads, not Xet storage
        DISCORD_WEBHOOK_URL=webhook,
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _console(config: Path) -> Path:
    """Where `_train` writes the run's console as it prints (a test can watch it meanwhile)."""
    return config.with_suffix(".console")


def _train(config: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run `trainer train`: its exit code and console (stdout and stderr, as they interleave)."""
    console = _console(config)
    with console.open("w") as f:
        done = subprocess.run(
            [sys.executable, "-m", "trainer", "train", "--config", str(config)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    return done.returncode, console.read_text()


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _no_token_anywhere(token: str, out: Path, console: str, discord, hub: HubServer | None) -> None:  # noqa: F811
    assert token not in console, "the HF token is on the console"
    assert files_containing(out, [token]) == [], "the HF token is in the run's output directory"
    assert all(token not in json.dumps(p) for p in discord.payloads), "the HF token went to Discord"
    if hub is not None:
        for commit in hub.commits(REPO_ID):
            assert all(token.encode() not in data for data in commit.files.values()), "the token was uploaded"
        # It went where it belongs: the Hub's API. The presigned LFS storage URLs never see it.
        api = [r for r in hub.requests if r.path.startswith("/api/repos/create")]
        assert api and all(r.headers["authorization"] == f"Bearer {token}" for r in api)
        assert all("authorization" not in r.headers for r in hub.requests if r.method == "PUT")


def test_checkpoint_strategy_uploads_final_and_the_newest_checkpoint(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    hub_server,  # noqa: F811
    discord_server,  # noqa: F811
):
    """A Hub slower than the training: step 2's upload is still in flight when step 4's checkpoint and final/
    are saved, so they go in one commit at the end, which must still hold step 4's checkpoint."""
    config, out = _config(
        tmp_path, tiny_model_dir, sample_csv, "ckpt", hub_strategy="checkpoint", hub_private_repo=True
    )
    final_queued = "final/ (step 4) is queued"
    hub_server.script.hold_first_commit_until = lambda: final_queued in _console(config).read_text()
    code, console = _train(config, _env(tmp_path, hub_server.endpoint, hub_server.token, discord_server.url))
    assert code == 0, console

    assert hub_server.repos[REPO_ID].private
    commits = hub_server.commits(REPO_ID)
    assert commits[-1].summary == "End of training", [c.summary for c in commits]
    assert all(c.summary.startswith("Training in progress, step ") for c in commits[:-1])
    files = hub_server.files(REPO_ID)
    # The root is final/, byte for byte, but for the card, written for the Hub.
    final = _files(out / "final")
    assert {p: d for p, d in files.items() if "/" not in p and p != "README.md"} == {
        p: d for p, d in final.items() if p != "README.md"
    }
    # last-checkpoint/ is the newest checkpoint, whole: optimizer and loader state to resume from.
    checkpoint = _files(out / "checkpoint-4")
    assert {p.removeprefix("last-checkpoint/"): d for p, d in files.items() if "/" in p} == checkpoint
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers" and "recipe-generation" in card.data.tags
    assert f"hf download {REPO_ID} --local-dir {REPO}" in card.text
    assert f"from_pretrained({REPO_ID!r})" in card.text
    assert not (out / PENDING_DIR).exists() or not any((out / PENDING_DIR).iterdir())

    assert "Model pushed to the Hugging Face Hub" in discord_server.titles()
    assert "Hub upload failed" not in discord_server.titles()
    _no_token_anywhere(hub_server.token, out, console, discord_server, hub_server)


def test_a_lora_run_uploads_its_adapter_while_training_and_the_merged_model_at_the_end(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    hub_server,  # noqa: F811
    discord_server,  # noqa: F811
):
    lora = dict(adapter="lora", lora_r=4)
    config, out = _config(tmp_path, tiny_model_dir, sample_csv, "lora", hub_strategy="every_save", **lora)
    code, console = _train(config, _env(tmp_path, hub_server.endpoint, hub_server.token, discord_server.url))
    assert code == 0, console
    commits = hub_server.commits(REPO_ID)
    # While training, the root is the newest checkpoint's adapter in PEFT's format.
    during = commits[0].files
    assert {"adapter_config.json", "adapter_model.safetensors"} <= during.keys(), sorted(during)
    # At the end it is final/: the merged model, the adapter in adapter/, no adapter left at the root.
    files = hub_server.files(REPO_ID)
    assert {p: d for p, d in files.items() if p != "README.md"} == {
        p: d for p, d in _files(out / "final").items() if p != "README.md"
    }
    assert "adapter/adapter_config.json" in files and "adapter_config.json" not in files
    card = ModelCard(files["README.md"].decode())
    assert "lora" in card.data.tags and f"{REPO_ID!r}, subfolder='adapter'" in card.text


def test_a_dead_hub_costs_nothing_and_a_restart_uploads_what_was_left(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    discord_server,  # noqa: F811
):
    """A Hub that refuses connections: the run trains and finishes (exit 0), says the failure once in the log
    and once in Discord, and leaves its saves staged; resumed for more steps against a working Hub, it
    uploads them: every checkpoint is in the repository (all_checkpoints), step 2's too, which the second run
    never saved."""
    token = "hf_deadRunToken0123456789abcdef"
    config, out = _config(
        tmp_path, tiny_model_dir, sample_csv, "dead", hub_strategy="all_checkpoints", hub_upload_timeout=3
    )
    env = _env(tmp_path, free_port_url(), token, discord_server.url)
    code, console = _train(config, env)
    assert code == 0, console
    assert console.count(FAILED_LINE) == 1, console
    assert discord_server.titles().count("Hub upload failed") == 1, discord_server.titles()
    left = re.search(LEFT_LINE, console)
    assert left and left["what"] == "final/", console
    assert float(left["waited"]) <= 3 + WAIT_SLACK_S, left[0]
    assert f"hf upload {REPO} " in console  # how to finish by hand
    staged = [p for p in (out / PENDING_DIR).iterdir()]
    assert len(staged) == 1 and (staged[0] / "tree" / "checkpoint-4").is_dir(), staged
    _no_token_anywhere(token, out, console, discord_server, None)

    hub = HubServer()
    try:
        config, _ = _config(
            tmp_path, tiny_model_dir, sample_csv, "dead", hub_strategy="all_checkpoints", max_steps=6
        )
        code, console = _train(config, _env(tmp_path, hub.endpoint, hub.token, discord_server.url))
        assert code == 0, console
        assert "upload(s) an earlier run left unfinished go first: final/" in console
        files = hub.files(REPO_ID)
        assert {p.split("/")[0] for p in files if "/" in p} == {
            "checkpoint-2",
            "checkpoint-4",
            "checkpoint-6",
        }
        assert files["checkpoint-2/trainer_state.json"]  # saved and staged by the first run only
        assert hub.commits(REPO_ID)[-1].summary == "End of training"
        assert json.loads(files["checkpoint-6/trainer_state.json"])["step"] == 6
        assert not (out / PENDING_DIR).exists()
        _no_token_anywhere(hub.token, out, console, discord_server, hub)
    finally:
        hub.close()


@pytest.mark.slow
def test_a_slow_hub_never_holds_training_up_and_a_rerun_finishes_the_upload(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    hub_server,  # noqa: F811
    dead_webhook_url,  # noqa: F811
):
    """Every commit hangs: the run still trains every step and finishes while its first upload is in flight
    (had a step waited for it, the run would not have ended before the server answered), and the end waits
    hub_upload_timeout. Run again once the Hub answers, the finished run only uploads what is pending.
    Slow because two runs wait out the upload timeouts of a Hub that answers late."""
    hub_server.script.delay = 600.0
    config, out = _config(tmp_path, tiny_model_dir, sample_csv, "slow", save_steps=1, hub_upload_timeout=2)
    env = _env(tmp_path, hub_server.endpoint, hub_server.token, dead_webhook_url)
    code, console = _train(config, env)
    assert code == 0, console
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps[-1] == 4
    assert hub_server.commits(REPO_ID) == []  # nothing was answered while the run trained
    assert f"POST /api/models/{REPO_ID}/commit/main" in hub_server.arrivals  # the first upload's, in flight
    left = [m for m in re.finditer(LEFT_LINE, console)]
    assert left and all(float(m["waited"]) <= 2 + WAIT_SLACK_S for m in left), console

    hub_server.script.delay = 0.0
    code, console = _train(config, env)
    assert code == 0, console
    assert "this run is already finished" in console
    assert hub_server.wait_for_commits(REPO_ID, 1)
    files = hub_server.files(REPO_ID)
    final = _files(out / "final")
    assert {p: files[p] for p in final if p != "README.md"} == {
        p: d for p, d in final.items() if p != "README.md"
    }
    assert not (out / PENDING_DIR).exists()


@pytest.mark.slow
def test_a_hub_that_never_answers_is_said_during_the_run_and_the_end_stays_bounded(
    tmp_path,
    tiny_model_dir,
    sample_csv,
    discord_server,  # noqa: F811
):
    """A Hub that takes connections and never answers: each request gives up after hub_request_timeout, the
    upload is tried 3 times (hub_retry_waits apart), and the failure is in the log and in Discord while the
    run still trains (a 25 s time budget); the run finishes (exit 0) and its end waits hub_upload_timeout.
    Slow because the run trains on its time budget while the upload's three tries time out."""
    token = "hf_stalledRunToken0123456789abcdef"
    with silent_endpoint() as url:
        config, out = _config(
            tmp_path, tiny_model_dir, sample_csv, "stalled", max_steps=1_000_000, max_time="25s",
            save_steps=20, hub_request_timeout="1s", hub_retry_waits=["1s", "2s"], hub_upload_timeout=2,
        )  # fmt: skip
        code, console = _train(config, _env(tmp_path, url, token, discord_server.url))
    assert code == 0, console
    assert console.count(FAILED_LINE) == 1 and "ReadTimeout" in console, console
    assert console.index(FAILED_LINE) < console.index("time budget reached"), console  # said during the run
    titles = discord_server.titles()
    finished = next(i for i, t in enumerate(titles) if t and t.startswith("Training finished"))
    assert titles.index("Hub upload failed") < finished, titles
    left = re.search(LEFT_LINE, console)
    assert left and float(left["waited"]) <= 2 + WAIT_SLACK_S, console
    _no_token_anywhere(token, out, console, discord_server, None)


def test_push_to_hub_without_a_token_or_with_a_bad_name_is_one_line(tmp_path, tiny_model_dir, sample_csv):
    config, _ = _config(tmp_path, tiny_model_dir, sample_csv, "bad")
    env = _env(tmp_path, free_port_url(), "", "")
    del env["HF_TOKEN"]
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(config), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "push_to_hub needs a Hugging Face token" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(config), "--dry-run"]
        + ["--set", "hub_model_id=a/b/c"],
        env=_env(tmp_path, free_port_url(), "hf_someToken123456", ""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "'a/b/c' is not a Hub repository name" in done.stderr, done.stderr


@pytest.mark.parametrize("value", ["0", "soon"])
@pytest.mark.parametrize("key", ["hub_upload_timeout", "hub_request_timeout"])
def test_hub_timeouts_are_durations(key, value):
    from trainer.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=key):
        TrainConfig.load(None, [f"{key}={value}"])
    assert getattr(TrainConfig.load(None, [f"{key}=90m"]), f"{key}_s") == 5400


def test_hub_retry_waits_are_durations_one_per_retry():
    from trainer.config import ConfigError, TrainConfig

    assert TrainConfig.load(None, []).hub_retry_waits_s == [5, 30]
    assert TrainConfig.load(None, ["hub_retry_waits=[1m, 90]"]).hub_retry_waits_s == [60, 90]
    assert TrainConfig.load(None, ["hub_retry_waits=[]"]).hub_retry_waits_s == []
    for bad in ("[soon]", "[5s, 0]"):
        with pytest.raises(ConfigError, match="hub_retry_waits"):
            TrainConfig.load(None, [f"hub_retry_waits={bad}"])

"""`docker compose up` for real: the image built by a Docker engine from Dockerfile.training, and a user's
first days with it on the CPU (docker-compose.cpu.yml), through `docker compose` as the README gives it.

Run by `make container-test` (docker/test/run.sh starts an engine and builds the stand-in bases), not by
`make test`: every test here is marked `container`. Each scenario is a user's own folder (a `.env` from
`.env.example` with fake secrets, ./data, ./outputs, ./configs) with the repository's compose files and
docker/test/compose.test.yml (stand-in bases, the host's network, a 5 s health check). Slow by nature: one
cold build of the image (minutes: PyTorch's wheels and the Rust loader), and about fifteen containers that
each import PyTorch.

What is asserted, with real processes: the first day (demo data, training, evaluation, final/ that
transformers loads on the host, outputs owned by the user, /data read-only, the loader's index in outputs/);
`docker compose stop` writes a checkpoint through tini and `up` resumes it into the same W&B run; a trainer
killed inside the container is restarted and resumes; a config error repeats at each restart with one Discord
message; the health check; `--profile serve up serve` with its key; a uid without a passwd entry; one clear
line for each bad input with nothing under outputs/ lost; no secret in the image's layers, its config, the
logs or the outputs. The image's size by layer and the build and rebuild times go to the report that
`make container-test` prints.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from discord_server import DiscordServer

pytestmark = pytest.mark.container

REPO = Path(__file__).resolve().parents[1]
REPORT = Path(os.environ.get("CONTAINER_TEST_REPORT", "/tmp/recipe-t5-container-report.md"))
IMAGE = "recipe-t5-trainer:container-test"
PROJECT_PREFIX = "recipe-t5-test"
USER_UID = 1000  # the image's own user, as on most single-user hosts
NO_PASSWD_UID = 4242  # a uid the image has no /etc/passwd entry for
# Fake secrets: each must appear nowhere but in .env and the containers' environment.
SECRETS = {
    "WANDB_API_KEY": "wandbfake" + "0123456789abcdef" * 2,
    "HF_TOKEN": "hf_fake" + "Qx7Lm2Np9Rt4Vw6Yz8Ab3Cd5Ef1",
    "SERVE_API_KEY": "servefake-5b1f0e8c2d7a4936",
}
# The quickstart, shortened: the same tiny model and generated recipes, 16 steps instead of 250.
QUICK = {
    "model_name_or_path": "data/quickstart/tiny-flan-t5",
    "dtype": "float32",
    "train_files": ["data/quickstart/recipes.csv"],
    "make_demo_data": True,
    "demo_records": 400,
    "max_source_length": 128,
    "max_target_length": 128,
    "max_tokens": 2048,
    "eval_fraction": 0.05,
    "eval_max_batches": 2,
    "optimizer": "adamw",
    "learning_rate": 5e-3,
    "max_steps": 16,
    "logging_steps": 1,
    "eval_steps": 16,
    "save_steps": 8,
    "save_total_limit": 2,
    "eval_generation_records": 4,
    "num_eval_generations": 1,
    "generation_max_new_tokens": 48,
    "gradient_checkpointing": False,
    "output_dir": "outputs/quickstart",
    "report_to": "wandb",
    "discord_progress_minutes": -1,
}
LOGS: list[str] = []  # every `docker compose logs` read, for the secrets test


def _report(line: str) -> None:
    with REPORT.open("a") as f:
        f.write(line + "\n")


def _run(cmd: list[str], *, env: dict | None = None, timeout: float = 900, check: bool = True, **kw):
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root`: relative path -> (size, mtime in ns)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Path:
    """The build context: a copy of the repository's files (tracked, and new ones git does not ignore), so
    that the rebuild test can change one Python file without touching the checkout."""
    out = tmp_path_factory.mktemp("context")
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO).stdout.split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree
        dst = out / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return out


class Project:
    """A user's folder with the repository's compose files: `compose(...)` runs `docker compose` on it."""

    def __init__(self, root: Path, context: Path, name: str, uid: int = USER_UID, **env: str):
        self.root, self.context, self.uid = root, context, uid
        self.name = f"{PROJECT_PREFIX}-{name}"
        root.mkdir(parents=True)
        for sub in ("data", "outputs"):
            (root / sub).mkdir()
        shutil.copytree(context / "trainer" / "presets", root / "configs")
        self.write_config("quickstart-short.yaml", QUICK)
        self.write_env(**{"TRAIN_CONFIG": "configs/quickstart-short.yaml", **env})
        self.chown()

    def write_config(self, name: str, values: dict) -> None:
        (self.root / "configs" / name).write_text(yaml.safe_dump(values))

    def write_env(self, **values: str) -> None:
        """.env as a user makes it: .env.example with the keys filled in (fake ones), W&B offline."""
        text = (self.context / ".env.example").read_text()
        values = {
            "WANDB_API_KEY": SECRETS["WANDB_API_KEY"],
            "WANDB_MODE": "offline",
            "HF_TOKEN": SECRETS["HF_TOKEN"],
            "TRAINER_UID": str(self.uid),
            "TRAINER_GID": str(self.uid),
            **values,
        }
        for key, value in values.items():
            line = f"{key}={value}"
            text, n = re.subn(rf"^#? ?{key}=.*$", line, text, count=1, flags=re.M)
            if n == 0:
                text += line + "\n"
        # Nothing from the Hub: the model is local, and the network is not reachable from the test machines.
        text += "HF_HUB_OFFLINE=1\n"
        (self.root / ".env").write_text(text)

    def chown(self) -> None:
        for path in [self.root / "data", self.root / "outputs", *(self.root / "data").rglob("*")]:
            os.chown(path, self.uid, self.uid)

    def compose(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        files = [
            self.context / "docker-compose.training.yml",
            self.context / "docker-compose.cpu.yml",
            self.context / "docker" / "test" / "compose.test.yml",
        ]
        cmd = ["docker", "compose", "-p", self.name, "--project-directory", str(self.root)]
        for f in files:
            cmd += ["-f", str(f)]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG")}
        env["REPO"] = str(self.context)
        done = _run([*cmd, *args], env=env, timeout=timeout, check=False)
        if check and done.returncode != 0:
            logs = _run([*cmd, "logs", "--no-color"], env=env, check=False).stdout
            output = f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}\nlogs:\n{logs[-4000:]}"
            pytest.fail(f"docker compose {' '.join(args)} exited {done.returncode}:\n{output}")
        return done

    def logs(self, service: str = "trainer") -> str:
        text = self.compose("logs", "--no-color", "--no-log-prefix", service).stdout
        LOGS.append(text)
        return text

    def container(self, service: str = "trainer") -> str:
        ids = self.compose("ps", "-a", "-q", service).stdout.split()
        assert len(ids) == 1, f"expected one {service} container, got {ids}"
        return ids[0]

    def state(self, service: str = "trainer") -> dict:
        out = _run(["docker", "inspect", self.container(service)]).stdout
        info = json.loads(out)[0]
        return {**info["State"], "RestartCount": info["RestartCount"]}

    def wait_for_log(self, pattern: str, *, count: int = 1, service: str = "trainer", timeout: float = 900):
        """Wait until `pattern` is in the service's log `count` times; the log. `timeout` guards a hang."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.logs(service)
            if len(re.findall(pattern, log)) >= count:
                return log
            if time.monotonic() > deadline:
                pytest.fail(
                    f"no {pattern!r} (x{count}) in {service}'s log within {timeout} s:\n{log[-4000:]}"
                )
            time.sleep(1)

    def wait_for_exit(self, *, restarts: int = 0, timeout: float = 900) -> dict:
        """Wait until the trainer has exited for good after `restarts` restarts; its state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["Status"] == "exited" and state["RestartCount"] >= restarts:
                return state
            if time.monotonic() > deadline:
                pytest.fail(f"the trainer did not exit within {timeout} s: {state}\n{self.logs()[-4000:]}")
            time.sleep(1)

    def down(self) -> None:
        self.compose("--profile", "serve", "down", "--volumes", "--remove-orphans", check=False)


@pytest.fixture(scope="module")
def image(context) -> str:
    """The image, built by `docker compose build` from the context; its wall time goes to the report."""
    REPORT.write_text("# make container-test\n\n")
    project = Project(context.parent / "build-project", context, "build")
    started = time.monotonic()
    done = project.compose("build", "trainer", timeout=3600)
    seconds = time.monotonic() - started
    log = done.stdout + done.stderr
    ran = len(re.findall(r"^#\d+ DONE", log, re.M))
    cached = len(re.findall(r"^#\d+ CACHED", log, re.M))
    _report(f"- build (`docker compose build`): {seconds:.0f} s, {ran} steps run, {cached} from the cache")
    listed = _run(["docker", "history", "--no-trunc", "--format", "{{json .}}", IMAGE]).stdout
    history = [json.loads(line) for line in listed.splitlines()]
    size = json.loads(_run(["docker", "image", "inspect", IMAGE]).stdout)[0]["Size"]
    base = json.loads(_run(["docker", "image", "inspect", "recipe-t5-standin/cuda:13.0.2-base"]).stdout)[0][
        "Size"
    ]
    _report(f"- image: {size / 1e9:.2f} GB; its base (the stand-in) {base / 1e9:.2f} GB. Layers over 1 MB:")
    for layer in history:
        if layer["Size"].endswith("GB") or (layer["Size"].endswith("MB") and float(layer["Size"][:-2]) >= 1):
            step = re.sub(r"^(/bin/sh -c |RUN \|\d+ \S+ /bin/sh -c )", "", layer["CreatedBy"]).strip()
            _report(f"  - {layer['Size']:>8}  {step[:100] or '(the base image)'}")
    return IMAGE


def test_a_users_first_day_on_the_cpu(image, context, tmp_path_factory, request):
    """`up` with the CPU override: the demo data is written into ./data, the trainer trains, evaluates and
    saves final/, exit 0; every file under ./outputs is the user's; transformers loads final/ on the host."""
    project = Project(tmp_path_factory.mktemp("first-day") / "user", context, "first-day")
    request.addfinalizer(project.down)
    project.compose("up", "--detach")
    state = project.wait_for_exit()
    log = project.logs()
    assert state["ExitCode"] == 0 and state["RestartCount"] == 0, log[-4000:]
    assert "step 16/16" in log and "eval" in log, log[-4000:]
    final = project.root / "outputs" / "quickstart" / "final"
    assert (final / "config.json").exists() and (final / "recipe_template.json").exists()
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in (project.root / "outputs").rglob("*")}
    assert owners == {(USER_UID, USER_UID)}, owners
    demo = project.root / "data" / "quickstart"
    assert (demo / "recipes.csv").stat().st_uid == USER_UID and (
        demo / "tiny-flan-t5" / "config.json"
    ).exists()
    # /data stays read-only, and the loader's index of the recipes lands under outputs/ (docs/container.md).
    assert list((project.root / "outputs" / "cache" / "recipe-trainer").rglob("*")), "no loader index"
    before = _files(project.root / "data")
    tried = project.compose(
        "run",
        "--rm",
        "--no-deps",
        "--entrypoint",
        "python",
        "trainer",
        "-c",
        "open('/data/x', 'w')",
        check=False,
    )
    assert tried.returncode != 0 and "Read-only file system" in tried.stderr, tried.stderr[-2000:]
    assert _files(project.root / "data") == before
    # W&B offline, in the outputs: one run.
    assert len(list((project.root / "outputs" / "wandb").glob("offline-run-*"))) == 1
    loaded = _run(
        [
            sys.executable,
            "-c",
            "import sys; from transformers import AutoModelForSeq2SeqLM, AutoTokenizer; "
            "m = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1]); "
            "t = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "ids = m.generate(**t('Ingredients: 2 eggs', return_tensors='pt'), max_new_tokens=8); "
            "print(m.num_parameters(), len(ids[0]))",
            str(final),
        ]
    )
    assert int(loaded.stdout.split()[0]) > 100_000, loaded.stdout

    # The trained model behind the page and the API, with a key.
    port = _free_port()
    project.write_env(
        TRAIN_CONFIG="configs/quickstart-short.yaml",
        SERVE_MODEL="quickstart/final",
        SERVE_PORT=str(port),
        SERVE_API_KEY=SECRETS["SERVE_API_KEY"],
    )
    project.compose("--profile", "serve", "up", "--detach", "--no-deps", "serve")
    project.wait_for_log(r"serving .* on http://127\.0\.0\.1", service="serve", timeout=600)
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url + "/", timeout=30)
    assert refused.value.code == 401
    basic = "Basic " + base64.b64encode(f"me:{SECRETS['SERVE_API_KEY']}".encode()).decode()
    page = urllib.request.urlopen(
        urllib.request.Request(url + "/", headers={"Authorization": basic}), timeout=30
    )
    assert page.status == 200 and "<html" in page.read().decode().lower()
    body = json.dumps({"ingredients": ["2 eggs", "1 cup flour"], "max_new_tokens": 24}).encode()
    answer = urllib.request.urlopen(
        urllib.request.Request(
            url + "/generate", data=body, headers={"Authorization": f"Bearer {SECRETS['SERVE_API_KEY']}"}
        ),
        timeout=120,
    )
    assert answer.status == 200 and "title" in json.loads(answer.read())
    with pytest.raises(urllib.error.HTTPError) as unkeyed:
        urllib.request.urlopen(urllib.request.Request(url + "/generate", data=body), timeout=30)
    assert unkeyed.value.code == 401
    deadline = time.monotonic() + 300
    while project.state("serve").get("Health", {}).get("Status") != "healthy":
        assert time.monotonic() < deadline, project.state("serve")
        time.sleep(2)
    project.logs("serve")


def test_stop_resume_crash_and_health_as_a_uid_without_a_passwd_entry(
    image, context, tmp_path_factory, request
):
    """A long run as uid 4242: healthy while it trains; `docker compose stop` saves a checkpoint (SIGTERM
    through tini, exit 143 within the grace period); `up` resumes it in the same W&B run; the trainer killed
    with SIGKILL inside the container is restarted by the restart policy and resumes again."""
    project = Project(tmp_path_factory.mktemp("long") / "user", context, "long", uid=NO_PASSWD_UID)
    request.addfinalizer(project.down)
    project.write_config(
        "long.yaml", QUICK | {"max_steps": 100_000, "save_steps": 100_000, "eval_steps": 100_000}
    )
    project.write_env(TRAIN_CONFIG="configs/long.yaml")
    project.compose("up", "--detach")
    project.wait_for_log(r"step 3/100000")
    deadline = time.monotonic() + 300
    while project.state().get("Health", {}).get("Status") != "healthy":
        assert time.monotonic() < deadline, project.state()
        time.sleep(2)
    assert shutil.which("id") and _run(["getent", "passwd", str(NO_PASSWD_UID)], check=False).returncode != 0

    project.compose("stop", "trainer")
    state = project.state()
    log = project.logs()
    assert state["ExitCode"] == 143, (
        state,
        log[-3000:],
    )  # 128 + SIGTERM: the trainer's own exit, not a SIGKILL
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", log)
    assert stopped, log[-3000:]
    step = int(stopped[1])
    assert (project.root / "outputs" / "quickstart" / f"checkpoint-{step}").is_dir()

    project.compose("up", "--detach")
    log = project.wait_for_log(rf"resumed from step {step} ")
    runs = sorted(p.name for p in (project.root / "outputs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({name.rsplit("-", 1)[1] for name in runs}) == 1, runs  # one W&B run id
    project.wait_for_log(rf"step {step + 2}/100000")

    # SIGKILL to the trainer itself (tini's child), as the kernel's OOM killer would: no checkpoint on the way
    # out, so the restart resumes from the one the stop wrote.
    tini = project.state()["Pid"]
    (child,) = Path(f"/proc/{tini}/task/{tini}/children").read_text().split()
    assert "trainer" in Path(f"/proc/{child}/cmdline").read_text()
    os.kill(int(child), 9)
    deadline = time.monotonic() + 300
    while project.state()["RestartCount"] < 1:
        assert time.monotonic() < deadline, project.state()
        time.sleep(1)
    project.wait_for_log(rf"resumed from step {step} ", count=2)
    project.compose("stop", "trainer")
    owners = {p.lstat().st_uid for p in (project.root / "outputs").rglob("*")}
    assert owners == {NO_PASSWD_UID}, owners


def test_a_config_error_repeats_at_each_restart_with_one_discord_message(
    image, context, tmp_path_factory, request
):
    """Docker restarts a container that exits 2 as it restarts a crash: each restart says the same one line,
    and Discord hears of it once."""
    discord = DiscordServer()
    request.addfinalizer(discord.close)
    project = Project(
        tmp_path_factory.mktemp("bad-config") / "user",
        context,
        "bad-config",
        TRAIN_CONFIG="configs/missing.yaml",
        DISCORD_WEBHOOK_URL=discord.url,
    )
    request.addfinalizer(project.down)
    # --no-deps: without the CPU override's demo-data service, which would stop `up` at the same error.
    project.compose("up", "--detach", "--no-deps", "trainer")
    state = project.wait_for_exit(restarts=3)
    log = project.logs()
    assert state["ExitCode"] == 2
    line = "trainer: config error: cannot read config configs/missing.yaml: No such file or directory"
    assert log.count(line) == 4, log
    assert log.count("Discord was told then, not again") == 3, log
    assert len(discord.accepted) == 1 and "could not start" in (discord.titles()[0] or ""), discord.titles()
    assert discord.token not in log


def test_bad_input_is_one_clear_line_and_loses_nothing(image, context, tmp_path_factory, request):
    """A missing .env, ./data or ./outputs stops compose with a line naming it; a ./data without recipes stops
    the trainer with one line naming the pattern; what was under outputs/ stays."""
    root = tmp_path_factory.mktemp("bad-input")

    no_env = Project(root / "no-env", context, "no-env")
    (no_env.root / ".env").unlink()
    done = no_env.compose("up", "--detach", check=False)
    assert done.returncode != 0 and re.search(r"env file .*\.env not found", done.stderr), done.stderr

    for missing in ("data", "outputs"):
        project = Project(root / f"no-{missing}", context, f"no-{missing}")
        request.addfinalizer(project.down)
        shutil.rmtree(project.root / missing)
        done = project.compose("up", "--detach", check=False)
        assert done.returncode != 0, done.stdout + done.stderr
        assert re.search(
            rf"(bind source path does not exist|no such file or directory).*{missing}", done.stderr
        ), done.stderr

    project = Project(root / "no-recipes", context, "no-recipes")
    request.addfinalizer(project.down)
    # A run with a past: its outputs must come through the failed start untouched.
    kept = project.root / "outputs" / "earlier-run"
    kept.mkdir()
    (kept / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    project.chown()
    _run([sys.executable, "-m", "trainer", "tiny-model", "--out", str(project.root / "data" / "model")])
    project.chown()
    project.write_config(
        "own-data.yaml",
        QUICK | {"model_name_or_path": "data/model", "train_files": ["data/*.csv"], "make_demo_data": False},
    )
    project.write_env(TRAIN_CONFIG="configs/own-data.yaml")
    before = _files(project.root / "outputs")
    project.compose("up", "--detach", "--no-deps", "trainer")
    state = project.wait_for_exit(restarts=3)
    log = project.logs()
    assert state["ExitCode"] == 2, log
    lines = [line for line in log.splitlines() if line.startswith("trainer:")]
    assert lines and all("data/*.csv" in line for line in lines), log
    assert "Traceback" not in log
    after = _files(project.root / "outputs")
    assert {k: v for k, v in after.items() if k in before} == before


def test_no_secret_in_the_image_its_layers_the_logs_or_the_outputs(image, tmp_path_factory):
    """The .env values appear in no layer (`docker save`), not in `docker history` or `docker inspect` of the
    image, nor in any log read above or any file a run wrote."""
    needles = [v.encode() for v in SECRETS.values()]
    history = _run(["docker", "history", "--no-trunc", image]).stdout
    inspect = _run(["docker", "image", "inspect", image]).stdout
    for value in SECRETS.values():
        assert value not in history and value not in inspect
        assert all(value not in log for log in LOGS)
    # The saved image, streamed through a search that keeps a needle's length of overlap between chunks.
    longest = max(map(len, needles))
    saver = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    tail, found, total = b"", set(), 0
    while chunk := saver.stdout.read(1 << 24):
        total += len(chunk)
        window = tail + chunk
        found |= {n for n in needles if n in window}
        tail = window[-longest:]
    assert saver.wait() == 0
    assert total > 1e9 and not found, (total, found)
    for outputs in tmp_path_factory.getbasetemp().rglob("outputs"):
        for path in outputs.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert not any(n in data for n in needles), path


def test_a_python_only_change_rebuilds_without_compiling_again(image, context, tmp_path_factory):
    """One Python file changed: the pinned packages' layer comes from the cache and cargo compiles no
    dependency again (the cache mount), so the rebuild is a repackaging. Its wall time goes to the report."""
    cli = context / "trainer" / "cli.py"
    cli.write_text(cli.read_text() + "\n# a change\n")
    project = Project(tmp_path_factory.mktemp("rebuild") / "user", context, "rebuild")
    started = time.monotonic()
    done = project.compose("build", "trainer", timeout=3600)
    seconds = time.monotonic() - started
    log = done.stdout + done.stderr
    _report(f"- rebuild after a change to trainer/cli.py: {seconds:.0f} s")
    steps = dict(re.findall(r"^#(\d+) \[[^\]]*\] (.*)$", log, re.M))
    cached = set(re.findall(r"^#(\d+) CACHED$", log, re.M))
    (pinned,) = [n for n, title in steps.items() if "pip install --no-deps --requirement" in title]
    assert pinned in cached, log[-4000:]
    compiled = re.findall(r"Compiling (\S+)", log)
    assert set(compiled) <= {"rust_loader", "recipe_core", "recipe_sample"}, compiled

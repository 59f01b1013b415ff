"""The container files, checked without a Docker engine (`make container-test` builds the image and runs it:
tests/test_container_engine.py).

- Dockerfile.training: hadolint finds nothing; its ENTRYPOINT+CMD and HEALTHCHECK command lines run here;
  the runtime stage can build what Triton and torch.compile compile at run time, keeps their caches on a
  mount that outlives the container, works for a uid without a passwd entry, and pins the versions the
  README's GPU numbers were measured with (docker/requirements.in, bench/NOTES.md).
- docker-compose files: valid against the Compose specification's JSON schema (vendored by check-jsonschema),
  with the GPU reservation, env_file, volumes, grace period, a bounded restart policy, shm and memlock
  asserted, and no tty (the trainer's plain log lines); their command lines run here too (the multi-GPU
  override's torchrun line with two CPU processes).
- .dockerignore: evaluated with Docker's own matching rules against the repository's files.
- .env.example: documents every variable the compose files read.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
DOCKERFILE = REPO / "Dockerfile.training"
COMPOSE = REPO / "docker-compose.training.yml"
COMPOSE_MULTI = REPO / "docker-compose.multi-gpu.yml"
COMPOSE_CPU = REPO / "docker-compose.cpu.yml"
REQUIREMENTS_IN = REPO / "docker" / "requirements.in"
REQUIREMENTS_LOCK = REPO / "docker" / "requirements.txt"
SECRETS = ("WANDB_API_KEY", "DISCORD_WEBHOOK_URL", "DISCORD_WEBHOOK", "HF_TOKEN")


def _tool(name: str) -> str:
    path = VENV_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found in {VENV_BIN} or on PATH (dev extra: `make install`)")
    return found


# --- Dockerfile ---------------------------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _froms() -> list[str]:
    """The FROM lines, with the build arguments declared before the first FROM replaced by their defaults
    (what a build without --build-arg uses: the real base images)."""
    defaults, froms = {}, []
    for word, rest in _instructions(DOCKERFILE):
        if word == "ARG" and not froms and "=" in rest:
            name, value = rest.split("=", 1)
            defaults[name.strip()] = value.strip()
        if word == "FROM":
            froms.append(re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m[1] or m[2]], rest))
    return froms


def _final_stage() -> list[tuple[str, str]]:
    instructions = _instructions(DOCKERFILE)
    start = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[start:]


def _exec_form(instr: str) -> list[str]:
    """The JSON array of the last `instr` (ENTRYPOINT, CMD) in the final stage; the shell form is refused."""
    args = [rest for word, rest in _final_stage() if word == instr]
    assert args, f"Dockerfile.training has no {instr} in its final stage"
    # json.loads fails on the shell form, whose SIGTERM would go to /bin/sh rather than the trainer.
    value = json.loads(args[-1])
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args[-1]
    return value


def _healthcheck_cmd() -> list[str]:
    (rest,) = [rest for word, rest in _final_stage() if word == "HEALTHCHECK"]
    options, sep, cmd = rest.partition("CMD ")
    assert sep, rest
    assert "--start-period=" in options, (
        "no start period: weight download and loading would count as failures"
    )
    return json.loads(cmd)


def test_hadolint_finds_nothing_at_warning_level():
    result = subprocess.run(
        [_tool("hadolint"), "--format", "json", "--no-fail", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    findings = json.loads(result.stdout or "[]")
    serious = [f for f in findings if f["level"] in ("warning", "error")]
    assert serious == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in serious)


def test_dockerfile_stages_user_env_and_pins():
    instructions = _instructions(DOCKERFILE)
    froms = _froms()
    assert len(froms) >= 2, "expected a build stage and a runtime stage"
    assert re.match(r"rust:\d+\.\d+\.\d+-\w+ AS build$", froms[0]), froms[0]
    cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-[\w-]+-ubuntu\d+\.\d+$", froms[-1])
    assert cuda and (int(cuda[1]), int(cuda[2])) >= (12, 8), f"the RTX 5090 needs CUDA >= 12.8: {froms[-1]}"

    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "maturin build --release" in runs
    installs = []
    for run in (rest for word, rest in instructions if word == "RUN"):
        for command in run.split("&&"):
            words = command.split()
            if "pip" not in words or "install" not in words:
                continue
            installs.append(words)
            # --no-deps: nothing but what is listed (and pinned) gets in.
            assert "--no-deps" in words, f"pip may pull unpinned dependencies: {command.strip()}"
            args = words[words.index("install") + 1 :]
            for prev, word in zip(["install", *args[:-1]], args, strict=True):
                if word.startswith("-") or word.endswith(".whl"):
                    continue
                if prev in ("-r", "--requirement"):
                    assert _bind_target(DOCKERFILE, word) == "docker/requirements.txt", word
                    continue
                assert "==" in word, f"unpinned Python package in the image: {word}"
    assert any("--requirement" in w or "-r" in w for w in installs), "the image must install the pinned list"
    assert "pip check" in runs, "the build must fail on an inconsistent list"
    for line in _requirement_lines(REQUIREMENTS_LOCK):
        assert re.fullmatch(r"[A-Za-z0-9_.\[\],-]+==[^=\s]+", line), (
            f"docker/requirements.txt: not pinned: {line}"
        )

    final = _final_stage()
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the trainer must not run as root"
    env = " ".join(rest for word, rest in final if word == "ENV")
    for setting in (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "TOKENIZERS_PARALLELISM=false",
        "HF_HOME=/cache/huggingface",
        "PYTHONUNBUFFERED=1",
    ):
        assert setting in env, setting
    for word, rest in instructions:
        if word in ("ENV", "ARG"):
            assert not any(s in rest for s in SECRETS), f"a secret in the image: {word} {rest}"
        if word == "COPY":
            assert ".env" not in rest.split(), rest


def test_the_build_stage_has_every_workspace_manifest_before_fetching_crates():
    """`cargo fetch` reads the whole workspace: each member's Cargo.toml must be copied in, with a stub
    source, before it (a member added later and left out failed the first real build)."""
    listed = re.search(r"^members\s*=\s*\[(.*?)\]", (REPO / "Cargo.toml").read_text(), re.M | re.S)
    members = re.findall(r'"([^"]+)"', listed[1])
    instructions = _instructions(DOCKERFILE)
    fetch = next(i for i, (word, rest) in enumerate(instructions) if word == "RUN" and "cargo fetch" in rest)
    copied = {rest.split()[0] for word, rest in instructions[:fetch] if word == "COPY"}
    stubs = instructions[fetch][1]
    for member in members:
        assert f"{member}/Cargo.toml" in copied, f"{member}/Cargo.toml is not copied before cargo fetch"
        assert f"{member}/src/lib.rs" in stubs, f"no stub source for {member} before cargo fetch"
        # A [[bench]] target must exist for cargo to read its manifest (moving the benchmarks to benches/
        # failed the real build).
        manifest = (REPO / member / "Cargo.toml").read_text()
        for name in re.findall(r'^\[\[bench\]\]\s*\nname\s*=\s*"([^"]+)"', manifest, re.M):
            assert f"{member}/benches" in copied or f"{member}/benches/{name}.rs" in copied, (
                f"{member}'s bench {name} is not copied before cargo fetch"
            )


def _bind_target(dockerfile: Path, target: str) -> str | None:
    """The build-context source a RUN's `--mount=type=bind,...,target=TARGET` mounts there, if any."""
    for word, rest in _instructions(dockerfile):
        for mount in re.findall(r"--mount=(\S+)", rest) if word == "RUN" else []:
            opts = dict(o.split("=", 1) for o in mount.split(",") if "=" in o)
            if opts.get("type") == "bind" and opts.get("target") == target and "from" not in opts:
                return opts.get("source")
    return None


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def _pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line (names normalised as pip does)."""
    pins = {}
    for line in _requirement_lines(path):
        name, _, version = line.partition("==")
        pins[re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()] = version
    return pins


def _image_env() -> dict[str, str]:
    """KEY=VALUE pairs of the final stage's ENV instructions."""
    import shlex

    env = {}
    for word, rest in _final_stage():
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def _apt_packages() -> set[str]:
    packages = set()
    for word, rest in _final_stage():
        if word == "RUN" and "apt-get install" in rest:
            command = rest.split("apt-get install", 1)[1].split("&&")[0]
            packages |= {w for w in command.split() if not w.startswith("-")}
    return packages


def test_runtime_stage_can_build_what_triton_and_torch_compile_build():
    """Triton compiles a C launcher (`gcc -shared launcher.c -I<Python.h's folder>`) the first time it loads
    a kernel; torch.compile's Triton kernels need the same. Without a C compiler, libc's headers and crt files
    and Python's headers, the first training step fails."""
    packages = _apt_packages()
    assert packages & {"gcc", "build-essential", "clang"}, f"no C compiler in the runtime stage: {packages}"
    assert packages & {"libc6-dev", "build-essential"}, "gcc without libc6-dev cannot link a shared object"
    assert "python3-dev" in packages or any(re.fullmatch(r"libpython3\.\d+-dev", p) for p in packages), (
        "no Python.h: Triton's launcher includes it"
    )


def _persistent_mounts() -> list[str]:
    """Container paths that outlive the container: writable bind mounts and named volumes."""
    return [v["target"] for v in _service()["volumes"] if not v.get("read_only")]


def _on(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def test_compile_caches_and_tool_folders_outlive_the_container():
    """A restart must not compile again, and nothing may depend on a writable HOME: every folder the image
    points a tool at lies on a writable mount of the compose service."""
    env = _image_env()
    mounts = _persistent_mounts()
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert name in env, f"{name} unset: the cache would go under HOME or /tmp and die with the container"
    folders = {k: v for k, v in env.items() if k.endswith(("_DIR", "_HOME", "_CACHE_PATH")) and k != "HOME"}
    assert {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "WANDB_DIR"} <= set(folders)
    for name, folder in folders.items():
        assert _on(folder, mounts), f"{name}={folder} is not on a writable mount ({mounts})"
        assert not _on(folder, [env["HOME"]]), f"{name} is under HOME"
    # W&B's debug logs and staged tables default to ~/.cache and ~/.local/share.
    assert {"WANDB_CACHE_DIR", "WANDB_DATA_DIR"} <= set(folders)


def test_a_uid_without_a_passwd_entry_has_a_user_name():
    """compose's `user:` may be any uid. getpass.getuser() (torch.compile's default cache folder) reads USER
    and LOGNAME before /etc/passwd, where such a uid has no entry."""
    env = _image_env()
    assert env.get("USER") and env.get("LOGNAME"), "USER and LOGNAME must be set in the image"
    script = "import getpass; print(getpass.getuser())"
    probe = subprocess.run(
        [sys.executable, "-c", script],
        env={"USER": env["USER"], "LOGNAME": env["LOGNAME"]},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == env["USER"], probe.stderr


def test_image_pins_the_versions_the_gpu_numbers_were_measured_with():
    """One place holds the image's versions (docker/requirements.in); it must name the torch and transformers
    of bench/NOTES.md's measurements, the lock the Dockerfile installs must agree with it, the CUDA base image
    must be the wheel's CUDA, and docs/container.md must say which."""
    notes = (REPO / "bench" / "NOTES.md").read_text(encoding="utf-8")
    measured = re.search(r"\(torch (\d+\.\d+), transformers (\d+\.\d+)\)", notes)
    assert measured, "bench/NOTES.md no longer says which torch and transformers it measured with"
    direct, locked = _pins(REQUIREMENTS_IN), _pins(REQUIREMENTS_LOCK)
    for name, version in (("torch", measured[1]), ("transformers", measured[2])):
        assert direct[name].startswith(version + "."), (
            f"image pins {name}=={direct[name]}, measured {version}"
        )
    for name, version in direct.items():
        assert locked.get(name) == version, (
            f"docker/requirements.txt has {name}=={locked.get(name)}, .in {version}"
        )
    tomllib = pytest.importorskip("tomllib")
    needed = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    for requirement in needed:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ \[]", requirement)[0]).lower()
        assert name in direct, f"the trainer needs {name}; docker/requirements.in does not pin it"

    # PyPI's torch 2.11 is the CUDA 13.0 build: the base image's CUDA (and the driver) follow from it.
    cuda = re.match(r"(\d+)\.(\d+)\.", locked["cuda-toolkit"])
    base = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-base-ubuntu(\d+\.\d+)$", _froms()[-1])
    assert cuda and base and base.group(1, 2) == cuda.group(1, 2), (base and base[0], locked["cuda-toolkit"])
    python = {"24.04": "3.12", "22.04": "3.10"}[base[3]]
    header = REQUIREMENTS_LOCK.read_text(encoding="utf-8")
    assert f"--python-version {python}" in header, f"the lock was not resolved for Ubuntu {base[3]}'s Python"
    assert (int(cuda[1]), int(cuda[2])) >= (12, 8), "the RTX 5090 (sm_120) needs CUDA >= 12.8"

    docs = (REPO / "docs" / "container.md").read_text(encoding="utf-8")
    for name in ("torch", "transformers", "triton"):
        assert f"{name} {locked[name]}" in docs, f"docs/container.md does not state {name} {locked[name]}"
    assert f"CUDA {cuda[1]}.{cuda[2]}" in docs


def _dry_run_env(tmp_path: Path) -> dict[str, str]:
    """The environment the image runs with, minus network and secrets; the venv's `trainer` first on PATH."""
    bin_dir = VENV_BIN
    if not (VENV_BIN / "trainer").exists():  # package not installed as a script: the same entry point
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        shim = bin_dir / "trainer"
        shim.write_text(f"#!{sys.executable}\nfrom trainer.cli import main\nraise SystemExit(main())\n")
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def _host_paths(tmp_path: Path, sample_csv: Path, tiny_model_dir: Path) -> list[str]:
    """Overrides for what exists only inside the container: the data (/data), the outputs (/outputs) and the
    model download (the Hub is out of reach here; the tiny model has FLAN-T5's architecture and tokenizer)."""
    return [
        "--set",
        f"train_files=[{sample_csv}]",
        f"output_dir={tmp_path / 'outputs'}",
        f"model_name_or_path={tiny_model_dir}",
    ]


def test_console_script_is_the_entrypoint():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    entrypoint = _exec_form("ENTRYPOINT")
    assert entrypoint == ["trainer"] and scripts["trainer"] == "trainer.cli:main", (entrypoint, scripts)


def test_image_command_line_runs_here(tmp_path, sample_csv, tiny_model_dir):
    """ENTRYPOINT + CMD, verbatim, from the repo root (the image's WORKDIR holds configs/ the same way)."""
    argv = _exec_form("ENTRYPOINT") + _exec_form("CMD")
    assert argv[:2] == ["trainer", "train"], argv
    config = argv[argv.index("--config") + 1]
    assert (REPO / config).is_file(), f"the image's CMD names a config that does not exist: {config}"
    result = subprocess.run(
        [*argv, "--dry-run", *_host_paths(tmp_path, sample_csv, tiny_model_dir)],
        cwd=REPO,
        env=_dry_run_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{' '.join(argv)} --dry-run failed:\n{result.stdout}\n{result.stderr}"


def test_image_healthcheck_tells_fresh_from_stale(tmp_path):
    """The HEALTHCHECK line, verbatim, against a fresh, a stale and a missing heartbeat."""
    argv = _healthcheck_cmd()
    assert argv[:2] == ["trainer", "healthcheck"], argv
    _assert_healthcheck(argv, tmp_path)


def _assert_healthcheck(argv: list[str], tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    outputs.mkdir(exist_ok=True)
    heartbeat = outputs / "heartbeat"
    # Where the loop writes it for this config: <output_dir>/heartbeat, output_dir moved off /outputs.
    cmd = [*argv, "--set", f"output_dir={outputs}"]

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            cmd, cwd=REPO, env=_dry_run_env(tmp_path), capture_output=True, text=True, timeout=60
        )

    heartbeat.unlink(missing_ok=True)
    missing = run()
    assert missing.returncode == 1, missing.stdout + missing.stderr

    now = time.time()
    heartbeat.write_text(json.dumps({"step": 1200, "time": now - 5}))
    fresh = run()
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "1200" in fresh.stdout

    # Stale by its "time" although the file was just written (a loop stuck after its last beat is caught)...
    heartbeat.write_text(json.dumps({"step": 1200, "time": now - 3600}))
    stale = run()
    assert stale.returncode == 1, stale.stdout + stale.stderr
    assert "stale" in stale.stdout
    # ... and by its mtime when the content is unreadable.
    heartbeat.write_text("{half-written")
    os.utime(heartbeat, (now - 3600, now - 3600))
    assert run().returncode == 1
    os.utime(heartbeat, (now, now))
    assert run().returncode == 0


def test_healthcheck_module_reads_time_then_mtime(tmp_path):
    from trainer.infra.healthcheck import check_heartbeat, heartbeat_path

    path = heartbeat_path(tmp_path)
    assert path == tmp_path / "heartbeat"
    assert check_heartbeat(path, 900)[0] is False
    path.write_text(json.dumps({"step": 3, "time": 1000.0}))
    assert check_heartbeat(path, 900, now=1899.0)[0] is True
    assert check_heartbeat(path, 900, now=1901.0)[0] is False
    path.write_text("[]")  # valid JSON, no "time": the mtime counts
    mtime = path.stat().st_mtime
    assert check_heartbeat(path, 900, now=mtime + 10)[0] is True
    assert check_heartbeat(path, 900, now=mtime + 1000)[0] is False
    # A time that is NaN or far in the future cannot vouch for the loop: the mtime counts.
    for text in ('{"step": 5, "time": NaN}', '{"step": 5, "time": 99999999999}', "\udcff\x00garbage"):
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        mtime = path.stat().st_mtime
        assert check_heartbeat(path, 900, now=mtime + 1000)[0] is False, text
        assert check_heartbeat(path, 900, now=mtime + 10)[0] is True, text
    assert check_heartbeat(path, float("nan"))[0] is False


# --- Compose ------------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$\$")


def _interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and $$ in every string of a parsed compose file."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, str):
        return _VAR.sub(lambda m: "$" if m[0] == "$$" else (env.get(m[1]) or m[2] or ""), value)
    return value


def _compose_vars(path: Path) -> set[str]:
    """Variables the compose file interpolates (comments excluded)."""
    found: set[str] = set()
    _interpolate(yaml.safe_load(path.read_text(encoding="utf-8")), _Recorder(found))
    return found


class _Recorder(dict):
    """An environment that records which variables were looked up."""

    def __init__(self, seen: set[str]):
        super().__init__()
        self.seen = seen

    def get(self, key, default=None):
        self.seen.add(key)
        return default


def _service(path: Path = COMPOSE, env: dict[str, str] | None = None, name: str = "trainer") -> dict:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return _interpolate(doc, env or {})["services"][name]


def _seconds(duration: str) -> float:
    """Compose/Go durations such as 5m, 1m30s, 90s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_files_match_the_compose_schema(tmp_path):
    # With a misspelt copy alongside: the validator must reject that one (unknown service keys are errors).
    typo = tmp_path / "typo.yml"
    typo.write_text(COMPOSE.read_text(encoding="utf-8").replace("stop_grace_period:", "stop_grace_periods:"))
    result = subprocess.run(
        [
            _tool("check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            str(COMPOSE),
            str(COMPOSE_MULTI),
        ]
        + [str(typo)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 1 and "stop_grace_periods" in report, report
    errors = [line for line in report.splitlines() if "::$" in line]
    assert errors and all(line.strip().startswith(str(typo)) for line in errors), report


def _merged(tmp_path: Path, *files: Path, **env: str) -> dict:
    """The compose files merged by Docker Compose v2 itself (`docker-compose config`, no engine needed), for a
    project folder with a `.env` made from .env.example plus `env`."""
    (tmp_path / ".env").write_text(
        (REPO / ".env.example").read_text() + "".join(f"{k}={v}\n" for k, v in env.items())
    )
    cmd = [_tool("docker-compose"), "--project-directory", str(tmp_path)]
    for f in files:
        cmd += ["-f", str(f)]
    done = subprocess.run(
        [*cmd, "--profile", "serve", "config", "--format", "json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_cpu_override_asks_for_no_gpu_and_writes_the_demo_data_first(tmp_path):
    merged = _merged(tmp_path, COMPOSE, COMPOSE_CPU, TRAIN_CONFIG="configs/quickstart.yaml")
    services = merged["services"]
    gpu = _merged(tmp_path, COMPOSE)["services"]
    assert gpu["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "deploy" not in services["trainer"] and "deploy" not in services["serve"]
    demo, trainer = services["demo-data"], services["trainer"]
    assert trainer["depends_on"]["demo-data"]["condition"] == "service_completed_successfully"
    assert demo["command"] == ["data", "demo", "--config", "configs/quickstart.yaml"]
    assert trainer["command"] == ["train", "--config", "configs/quickstart.yaml"]
    mounts = {v["target"]: v for v in demo["volumes"]}
    assert not mounts["/data"].get("read_only") and mounts["/app/configs"]["read_only"]
    assert mounts["/data"]["source"] == {v["target"]: v for v in trainer["volumes"]}["/data"]["source"]
    assert {v["target"]: v for v in trainer["volumes"]}["/data"]["read_only"]
    assert demo["user"] == trainer["user"] and demo["image"] == trainer["image"]


def test_compose_service_is_set_up_for_a_long_gpu_run():
    svc = _service()
    assert svc["build"]["dockerfile"] == "Dockerfile.training"
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and "gpu" in d["capabilities"] and d.get("count") in ("all", 1)
        for d in devices
    ), devices
    env_file = svc["env_file"]
    assert ".env" in ([env_file] if isinstance(env_file, str) else env_file)
    assert svc["shm_size"] in ("16gb", "16g") or int(re.sub(r"\D", "", svc["shm_size"])) >= 8
    assert svc["ulimits"]["memlock"] == -1
    assert "stack" in svc["ulimits"]
    assert svc.get("init") is True, "tini forwards SIGTERM and reaps the W&B service process"

    mounts = {v["target"]: v for v in svc["volumes"]}
    data, outputs, cache = mounts["/data"], mounts["/outputs"], mounts["/cache/huggingface"]
    assert data["source"] == "./data" and data["type"] == "bind" and data["read_only"] is True
    assert outputs["source"] == "./outputs" and not outputs.get("read_only")
    assert cache["type"] == "volume" and cache["source"] in yaml.safe_load(COMPOSE.read_text())["volumes"]
    # .env picks the data folder and the config.
    chosen = _service(env={"RECIPES_DIR": "/srv/recipes", "TRAIN_CONFIG": "configs/other.yaml"})
    assert {v["target"]: v["source"] for v in chosen["volumes"]}["/data"] == "/srv/recipes"
    assert chosen["command"][-1] == "configs/other.yaml"


def test_restarts_are_bounded():
    """`restart: on-failure` alone restarts a container that crashes at start forever (a W&B run and a pair of
    Discord messages each time). docker compose (not swarm) maps `restart: on-failure:N` to the engine's
    MaximumRetryCount, and deploy.restart_policy's max_attempts likewise; one of them must bound it."""
    svc = _service()
    policy = svc.get("deploy", {}).get("restart_policy")
    if policy is not None:
        assert policy.get("condition") == "on-failure" and 1 <= int(policy["max_attempts"]) <= 10, policy
        return
    m = re.fullmatch(r"on-failure:(\d+)", str(svc.get("restart")))
    assert m and 1 <= int(m[1]) <= 10, f"restart: {svc.get('restart')!r} is unbounded"
    assert _service(COMPOSE_MULTI).get("restart") is None, "the multi-GPU file keeps the base file's policy"


def test_no_terminal_for_the_trainer():
    """Without a tty the trainer writes one plain, dated line per logging step; `tty: true` would bring back
    the progress bar's carriage returns in `docker compose logs`."""
    for path in (COMPOSE, COMPOSE_MULTI):
        svc = _service(path)
        assert not svc.get("tty") and not svc.get("stdin_open"), path.name
    assert _image_env().get("HF_HUB_DISABLE_PROGRESS_BARS") == "1", (
        "download and save bars would fill the log"
    )


def test_stop_grace_period_covers_a_checkpoint():
    """SIGTERM -> the trainer writes weights and optimizer state; Docker must not SIGKILL it half-way."""
    from trainer.config import TrainConfig
    from trainer.model.model_shape import KNOWN_CONFIGS, ModelShape
    from trainer.plan.memory_plan import optimizer_state_bytes

    argv = _exec_form("CMD")
    cfg = TrainConfig.load(REPO / argv[argv.index("--config") + 1])
    # The public config's shape, read without importing transformers; untied head: the larger count.
    shape = ModelShape.from_config(SimpleNamespace(**KNOWN_CONFIGS[cfg.model_name_or_path]))
    weight_bytes = shape.num_params() * (2 if cfg.dtype == "bfloat16" else 4)
    checkpoint = weight_bytes + optimizer_state_bytes(shape, cfg.optimizer, cfg.bf16_update, cfg.dtype)
    budget_s = checkpoint / 100e6  # written at 100 MB/s, a spinning disk's sustained rate
    assert _seconds(_service()["stop_grace_period"]) >= budget_s, f"{checkpoint / 1e9:.0f} GB checkpoint"


def test_compose_command_is_the_image_command():
    """With the defaults, compose runs exactly the CLI line the image test above runs."""
    svc = _service()
    assert "entrypoint" not in svc, "the single-GPU service uses the image's ENTRYPOINT"
    assert svc["command"] == _exec_form("CMD")
    health = svc["healthcheck"]
    assert health["test"][0] == "CMD" and health["test"][1:] == _healthcheck_cmd()
    assert _seconds(health["start_period"]) >= 15 * 60, "the download and load of FLAN-T5-XL takes a while"


def test_compose_healthcheck_follows_the_chosen_config(tmp_path):
    test = _service(env={"TRAIN_CONFIG": "configs/flan-t5-xl-rtx5090.yaml"})["healthcheck"]["test"]
    _assert_healthcheck(test[1:], tmp_path)


def test_multi_gpu_override_runs_torchrun_with_the_same_command():
    """torchrun's own parser reads the override's line; what it then runs is `python -m trainer <command>`,
    the image's command line, which the dry run above executes."""
    from torch.distributed.run import get_args_parser

    base, multi = _service(), _service(COMPOSE_MULTI, env={"NPROC_PER_NODE": "4"})
    assert set(multi) <= {"entrypoint", "environment"}, "the override changes only the program in front"
    entrypoint = multi["entrypoint"]
    assert entrypoint[0] == "torchrun", entrypoint
    args = get_args_parser().parse_args([*entrypoint[1:], *base["command"]])
    assert args.module and args.training_script == "trainer"
    assert args.training_script_args == _exec_form("CMD")
    assert args.nproc_per_node == "4" and args.standalone
    assert _service(COMPOSE_MULTI)["entrypoint"] == [*entrypoint[:3], "2", *entrypoint[4:]], "default: 2 GPUs"
    assert (REPO / "trainer" / "__main__.py").is_file(), "`-m trainer` needs trainer/__main__.py"
    # On `docker compose stop` torchrun waits for the ranks' checkpoint, but not past Docker's own SIGKILL.
    shutdown = int(multi["environment"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert 30 < shutdown < _seconds(base["stop_grace_period"])


def test_serve_service_is_opt_in_and_serves_the_final_model_on_this_machine(tmp_path):
    """The serve profile: not started by a plain `up`, the image the trainer builds, the final/ the default
    config writes, a GPU, the port on 127.0.0.1 only, and a health check of its own (the image's watches a
    training heartbeat, which a server never writes)."""
    from trainer.config import TrainConfig

    trainer, serve = _service(), _service(name="serve")
    assert serve["profiles"] == ["serve"], "plain `docker compose up` must start only the trainer"
    assert serve["image"] == trainer["image"] and serve["build"] == trainer["build"]
    assert serve["user"] == trainer["user"] and serve.get("init") is True
    argv = serve["command"]
    assert argv[0] == "serve" and argv[argv.index("--host") + 1] == "0.0.0.0"
    config = TrainConfig.load(REPO / _exec_form("CMD")[-1])
    assert argv[argv.index("--model") + 1] == config.output_dir + "/final"
    (outputs,) = serve["volumes"]
    assert (
        outputs["target"] == "/outputs" and outputs["source"] == "./outputs" and not outputs.get("read_only")
    )
    assert serve["ports"] == [f"127.0.0.1:8000:{argv[argv.index('--port') + 1]}"]
    assert _service(env={"SERVE_PORT": "9000"}, name="serve")["ports"] == ["127.0.0.1:9000:8000"]
    # the key for a shared page comes from .env, and only it: no W&B key or Hub token in the server. Not in
    # .env, it is not set at all (Docker Compose itself merges it here); set blank, the server refuses to
    # start.
    assert serve["environment"] == ["SERVE_API_KEY"] and "env_file" not in serve
    assert _merged(tmp_path, COMPOSE)["services"]["serve"]["environment"] == {"SERVE_API_KEY": None}
    given = _merged(tmp_path, COMPOSE, SERVE_API_KEY="k" * 32)["services"]["serve"]["environment"]
    assert given == {"SERVE_API_KEY": "k" * 32}
    devices = serve["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert serve["healthcheck"]["test"][:2] == ["CMD", "python"]
    assert re.fullmatch(r"on-failure:\d", serve["restart"])


def test_serve_service_command_and_healthcheck_run_here(tmp_path, tiny_model_dir):
    """The serve service's command line, its model and port moved off the container's paths, serves the
    tiny model; the service's health check passes while it serves and fails once it is stopped."""
    from trainer.config import TrainConfig
    from trainer.data.prompt import save_prompt_template

    model = tmp_path / "final"
    shutil.copytree(tiny_model_dir, model)
    save_prompt_template(model, TrainConfig(max_source_length=64, max_target_length=8))
    serve = _service(name="serve")
    argv = list(serve["command"])
    argv[argv.index("--model") + 1] = str(model)
    argv[argv.index("--port") + 1] = "0"
    argv[argv.index("--host") + 1] = "127.0.0.1"
    proc = subprocess.Popen(
        ["trainer", *argv],
        env=_dry_run_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if m := re.search(r"serving .* on http://127\.0\.0\.1:(\d+) ", line):
                port = m[1]
                break
        else:
            pytest.fail("trainer serve exited before serving")
        health = [w.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for w in serve["healthcheck"]["test"][1:]]
        assert health[0] == "python"
        assert subprocess.run([sys.executable, *health[1:]], timeout=60).returncode == 0
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + 15
        assert subprocess.run([sys.executable, *health[1:]], capture_output=True, timeout=60).returncode != 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_multi_gpu_override_command_line_runs_here(tmp_path, sample_csv, tiny_model_dir):
    """The override's torchrun line in front of the base file's command, verbatim, with two processes on the
    CPU (gloo), as a dry run: every rank checks the config, the model files and the data, and rank 0 says
    what predicts one GPU's memory for this many processes.
    Slow because torchrun starts two trainer processes, each importing torch and checking the data."""
    argv = [*_service(COMPOSE_MULTI)["entrypoint"], *_service()["command"]]
    env = dict(_dry_run_env(tmp_path), CUDA_VISIBLE_DEVICES="")
    env.update(_service(COMPOSE_MULTI)["environment"])
    result = subprocess.run(
        [_tool(argv[0]), *argv[1:], "--dry-run", *_host_paths(tmp_path, sample_csv, tiny_model_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{' '.join(argv)} --dry-run failed:\n{result.stdout}\n{result.stderr}"
    assert result.stderr.count("dry run: the config, the model files and the data are fine") == 1
    assert "trainer plan --config CONFIG --processes 2" in result.stderr


def test_env_example_documents_every_variable():
    text = (REPO / ".env.example").read_text(encoding="utf-8")
    lines = text.splitlines()
    documented = {}
    for i, line in enumerate(lines):
        m = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            assert i > 0 and lines[i - 1].startswith("#"), f".env.example: {m[1]} has no comment above it"
            documented[m[1]] = m[2]
    used = _compose_vars(COMPOSE) | _compose_vars(COMPOSE_MULTI)
    required = {
        "WANDB_API_KEY",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_MODE",
        "DISCORD_WEBHOOK_URL",
        "HF_TOKEN",
    }
    assert used | required <= set(documented), sorted(used | required - set(documented))
    assert documented["WANDB_API_KEY"] == "", "no real or fake key in the example"
    for name in ("DISCORD_WEBHOOK_URL", "HF_TOKEN"):
        assert re.search(rf"^# {name}=", text, re.M), f"{name} is optional: commented out, not set empty"
    # The defaults written in .env.example are the compose files' own defaults.
    parsed = json.dumps([yaml.safe_load(p.read_text(encoding="utf-8")) for p in (COMPOSE, COMPOSE_MULTI)])
    defaults = dict(re.findall(r"\$\{([A-Z_]+):-([^}]*)\}", parsed))
    for name, default in defaults.items():
        assert documented[name] == default, (
            f"{name}: .env.example says {documented[name]!r}, compose {default!r}"
        )


# --- .dockerignore, with Docker's matching rules (moby/patternmatcher) --------------------------------------


def _read_dockerignore(text: str) -> list[str]:
    """Patterns as Docker's ignorefile.ReadAll returns them: no comments, paths cleaned, no leading /."""
    patterns = []
    for line in text.lstrip("\ufeff").splitlines():
        if line.startswith("#"):
            continue
        pattern = line.strip()
        if not pattern:
            continue
        invert = pattern.startswith("!")
        if invert:
            pattern = pattern[1:].strip()
        if pattern:
            pattern = re.sub("^/+", "/", posixpath.normpath(pattern))  # Go's filepath.Clean
            if len(pattern) > 1 and pattern.startswith("/"):
                pattern = pattern[1:]
        patterns.append("!" + pattern if invert else pattern)
    return patterns


def _compile(pattern: str):
    """A predicate for one pattern, as patternmatcher's Pattern.compile/match builds it (on Linux)."""
    regex, kind, i, n = "^", "exact", 0, len(pattern)
    pos = 0
    while pos < n:
        ch = pattern[pos]
        pos += 1
        if ch == "*":
            if pos < n and pattern[pos] == "*":
                pos += 1
                if pos < n and pattern[pos] == "/":
                    pos += 1
                if pos == n:
                    if kind == "exact":
                        kind = "prefix"
                    else:
                        regex += ".*"
                        kind = "regexp"
                else:
                    regex += "(.*/)?"
                    kind = "regexp"
                if i == 0:
                    kind = "suffix"
            else:
                regex += "[^/]*"
                kind = "regexp"
        elif ch == "?":
            regex += "[^/]"
            kind = "regexp"
        elif ch in ".+()|{}$":
            regex += "\\" + ch
        elif ch == "\\":
            if pos < n:
                regex += "\\" + pattern[pos]
                pos += 1
                kind = "regexp"
            else:
                regex += "\\\\"
        elif ch in "[]":
            regex += ch
            kind = "regexp"
        else:
            regex += ch
        i += 1
    if kind == "exact":
        return lambda path: path == pattern
    if kind == "prefix":
        return lambda path: path.startswith(pattern[:-2])
    if kind == "suffix":
        suffix = pattern[2:]
        return lambda path: path.endswith(suffix) or (suffix.startswith("/") and path == suffix[1:])
    compiled = re.compile(regex + r"\Z")
    return lambda path: compiled.match(path) is not None


def _ignored(path: str, patterns: list[str]) -> bool:
    """patternmatcher.MatchesOrParentMatches: the last matching pattern wins; parent folders match too."""
    path = posixpath.normpath(path)
    parents = posixpath.dirname(path).split("/") if posixpath.dirname(path) else []
    matched = False
    for raw in patterns:
        exclusion = raw.startswith("!")
        if exclusion != matched:
            continue
        match = _compile(raw[1:] if exclusion else raw)
        hit = match(path) or any(match("/".join(parents[: k + 1])) for k in range(len(parents)))
        if hit:
            matched = not exclusion
    return matched


def test_dockerignore_matcher_follows_docker_not_gitignore():
    """Known Docker behaviour the matcher must reproduce (cases from moby's patternmatcher tests)."""
    assert _ignored("a/b/c.so", ["**/*.so"]) and _ignored("c.so", ["**/*.so"])
    assert not _ignored("trainer/c.so", ["*.so"]), "Docker anchors patterns at the context root"
    assert _ignored("data/x/y.csv", ["data"]), "a folder's pattern covers its contents"
    assert not _ignored("sub/data/y.csv", ["data"])
    assert _ignored("a/__pycache__/b.pyc", ["**/__pycache__"])
    assert not _ignored(".env.example", [".env.*", "!.env.example"])
    assert _ignored(".env.local", [".env.*", "!.env.example"])
    assert _read_dockerignore("# c\n /target/ \n!/keep\n") == ["target", "!keep"]


def test_dockerignore_keeps_secrets_data_outputs_and_artefacts_out():
    patterns = _read_dockerignore((REPO / ".dockerignore").read_text(encoding="utf-8"))
    for path in (
        ".env",
        "configs/.env",
        ".env.local",
        "data/full_dataset.csv",
        "data/foodcom/RAW_recipes.csv.zst",
        "recipes.jsonl",
        "outputs/flan-t5-xl-recipes/checkpoint-500/model.safetensors",
        "outputs/flan-t5-xl-recipes/final/config.json",
        "wandb/latest-run/files/config.yaml",
        "target/release/lib_loader.so",
        "dist/recipe_t5_trainer-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl",
        "trainer/_loader.abi3.so",
        "trainer/__pycache__/cli.cpython-311.pyc",
        ".venv/bin/python",
        ".git/config",
        ".pytest_cache/v/cache/nodeids",
        ".ruff_cache/CACHEDIR.TAG",
        "rust_loader/core/fuzz/target/x86_64-unknown-linux-gnu/release/read_file",
        "rust_loader/core/fuzz/corpus/read_file/seed-data.csv-00",
    ):
        assert _ignored(path, patterns), f"{path} would be sent into the image's build context"


def test_dockerignore_keeps_everything_the_dockerfile_copies():
    patterns = _read_dockerignore((REPO / ".dockerignore").read_text(encoding="utf-8"))
    sources = []
    for word, rest in _instructions(DOCKERFILE):
        if word == "COPY" and "--from=" not in rest:
            sources += rest.split()[:-1]
        for mount in re.findall(r"--mount=(\S+)", rest) if word == "RUN" else []:
            opts = dict(o.split("=", 1) for o in mount.split(",") if "=" in o)
            if opts.get("type") == "bind" and "from" not in opts:
                sources.append(opts["source"])
    expected = {
        "Cargo.lock",
        "pyproject.toml",
        "rust_loader",
        "trainer",
        "trainer/presets",
        "docker/requirements.txt",
    }
    assert expected <= set(sources), sources
    for source in sources:
        assert not _ignored(source, patterns), f"COPY {source} would find nothing"
        root = REPO / source
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for file in files:
            rel = file.relative_to(REPO).as_posix()
            artefact = file.suffix in (".so", ".pyc") or "__pycache__" in file.parts or "fuzz" in file.parts
            assert _ignored(rel, patterns) == artefact, f"{rel}: {'kept' if artefact else 'dropped'}"


def test_the_docs_say_what_was_built_here_and_what_only_a_gpu_checks():
    """Users must not read the container section as 'tested on a GPU': the engine test runs on the CPU, from
    stand-in bases."""
    text = (REPO / "docs" / "container.md").read_text(encoding="utf-8").replace("**", "")
    assert "make container-test" in text and "stand-in" in text
    assert "bench/container_env_check.py" in text  # what the GPU machine's emulation covers
    assert "docker compose -f docker-compose.training.yml up" in text

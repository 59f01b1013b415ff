"""The container files, checked without a Docker engine (none runs on these machines).

- Dockerfile.training: hadolint finds nothing; its ENTRYPOINT+CMD and HEALTHCHECK command lines run here.
- docker-compose files: valid against the Compose specification's JSON schema (vendored by check-jsonschema),
  with the GPU reservation, env_file, volumes, grace period, restart policy, shm and memlock asserted; their
  command lines run here too.
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
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert len(froms) >= 2, "expected a build stage and a runtime stage"
    assert re.match(r"rust:\d+\.\d+\.\d+-\w+ AS build$", froms[0]), froms[0]
    cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-[\w-]+-ubuntu\d+\.\d+$", froms[-1])
    assert cuda and (int(cuda[1]), int(cuda[2])) >= (12, 8), f"the RTX 5090 needs CUDA >= 12.8: {froms[-1]}"

    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "maturin build --release" in runs
    torch = re.search(r"--index-url https://download.pytorch.org/whl/cu(\d+) torch==(\d+)\.(\d+)\.\d+", runs)
    assert torch, "PyTorch must come pinned from the cu12x index"
    assert int(torch[1]) >= 128 and (int(torch[2]), int(torch[3])) >= (2, 7), (
        "sm_120 needs torch >= 2.7 cu128"
    )
    for run in (rest for word, rest in instructions if word == "RUN"):
        for command in run.split("&&"):
            words = command.split()
            if "pip" not in words or "install" not in words:
                continue
            args = words[words.index("install") + 1 :]
            for prev, word in zip(["install", *args[:-1]], args, strict=True):
                if word.startswith("-") or prev == "--index-url" or word.endswith(".whl"):
                    continue
                assert "==" in word, f"unpinned Python package in the image: {word}"

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
    from trainer.healthcheck import check_heartbeat, heartbeat_path

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


def _service(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return _interpolate(doc, env or {})["services"]["trainer"]


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
    assert svc["restart"] == "on-failure"
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


def test_stop_grace_period_covers_a_checkpoint():
    """SIGTERM -> the trainer writes weights and optimizer state; Docker must not SIGKILL it half-way."""
    from trainer.config import TrainConfig
    from trainer.memory_plan import KNOWN_CONFIGS, ModelShape, optimizer_state_bytes

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
    ):
        assert _ignored(path, patterns), f"{path} would be sent into the image's build context"


def test_dockerignore_keeps_everything_the_dockerfile_copies():
    patterns = _read_dockerignore((REPO / ".dockerignore").read_text(encoding="utf-8"))
    sources = []
    for word, rest in _instructions(DOCKERFILE):
        if word == "COPY" and "--from=" not in rest:
            sources += rest.split()[:-1]
    assert {"Cargo.lock", "pyproject.toml", "rust_loader", "trainer", "configs"} <= set(sources), sources
    for source in sources:
        assert not _ignored(source, patterns), f"COPY {source} would find nothing"
        root = REPO / source
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for file in files:
            rel = file.relative_to(REPO).as_posix()
            artefact = file.suffix in (".so", ".pyc") or "__pycache__" in file.parts
            assert _ignored(rel, patterns) == artefact, f"{rel}: {'kept' if artefact else 'dropped'}"


def test_readme_says_what_was_and_was_not_built_here():
    """Users must not read the container section as 'tested on a GPU': no engine or GPU runs here."""
    docs = [p for p in (REPO / "README.md", REPO / "docs" / "container.md") if p.is_file()]
    text = "\n".join(p.read_text(encoding="utf-8") for p in docs)
    assert "The image has not been built and the compose file has not been run" in text.replace("**", "")
    assert "docker compose -f docker-compose.training.yml up" in text

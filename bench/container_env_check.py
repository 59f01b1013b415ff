"""Run the trainer the way the training image runs it, without Docker, and check what the image relies on.

    python3 bench/container_env_check.py          # GPU machine, as root: 2-4 minutes on an H100 (estimate)
    python3 bench/container_env_check.py --cpu    # no GPU: the same environment around a CPU training

What it reproduces from the image (docker compose -f docker-compose.training.yml up):
- the ENV of Dockerfile.training's final stage, read from the file so that it cannot drift; the container's
  paths (/outputs, /cache/huggingface, /home/trainer) are mapped under a fresh temporary root;
- a HOME the run cannot write (mode 0555): it must still be empty afterwards;
- the working directory /app, not writable, holding configs/;
- a uid with no /etc/passwd entry (12345:12345, no supplementary groups), as a compose `user:` override. That
  needs root and a python the uid may run; otherwise the runs stay the current user (said so), as root without
  the capabilities that would let it write into HOME anyway (setpriv);
- a PATH with python, `trainer` and the system's programs but no C++ or CUDA compiler (g++, c++, clang, nvcc
  hidden): the image installs gcc only;
- stdout and stderr are pipes, as under `docker compose up` (no tty).

It runs `trainer train` twice on the same outputs folder: run 1 starts with empty compile caches, run 2 must
find every Triton kernel, launcher and compiled graph there (a container restart). On the GPU the model is a
small T5 with FLAN-T5's head size (64), random weights, trained in bf16 through the trainer's default path:
Triton attention, the fused Triton ops, the compiled Adafactor update. Prints PASS/FAIL/SKIP per check and
exits 1 on any FAIL. Needs the trainer installed (its wheel) or importable from this repository; no network.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile.training"
UID = GID = 12345
MAX_STEPS = 4
# Compilers the image does not have: with them out of reach, a run that needs one fails here as in the image.
HIDDEN = re.compile(r"(^|-)(g\+\+|c\+\+|clang|clang\+\+|nvcc|icpx|icx)(-[0-9.]+)?$")
# System folders whose programs the run may use (the image's PATH has them too; not /usr/local/cuda/bin).
SYSTEM_BIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
# Settings the image gets from its base (nvidia/cuda sets LD_LIBRARY_PATH to the driver's folder) or from the
# GPU runtime: passed through from this shell as they are.
PASSED_THROUGH = re.compile(
    r"^(LD_LIBRARY_PATH|CUDA_VISIBLE_DEVICES|NVIDIA_.*|NCCL_.*|NVSHMEM_.*|TORCH_SYMM_.*)$"
)
# Without these, root writes wherever it likes: the runs would not notice an unwritable HOME.
NO_OVERRIDE = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


def image_env(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """KEY=VALUE pairs of every ENV instruction in the Dockerfile's final stage, in order."""
    lines, buf = [], ""
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        if buf.strip():
            lines.append(buf.strip())
        buf = ""
    final = max(i for i, line in enumerate(lines) if line.split()[0].upper() == "FROM")
    env: dict[str, str] = {}
    for line in lines[final:]:
        word, _, rest = line.partition(" ")
        if word.upper() == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                if not sep:
                    raise SystemExit(
                        f"{dockerfile}: ENV {rest!r}: only the KEY=VALUE form is understood here"
                    )
                env[key] = value
    return env


def mapped(value: str, root: Path) -> str:
    """A container path under the temporary root (/outputs/x -> ROOT/outputs/x); anything else unchanged."""
    if value.startswith(("/outputs", "/cache", "/home", "/app", "/data")):
        return str(root) + value
    return value


def make_path_dir(bin_dir: Path) -> list[str]:
    """bin_dir with python, trainer and the system's programs but not the compilers the image lacks; returns
    the names left out."""
    bin_dir.mkdir(parents=True)
    hidden = []
    for folder in SYSTEM_BIN:
        if not os.path.isdir(folder) or os.path.realpath(folder) != folder:
            continue  # /bin and /sbin are links to /usr/bin and /usr/sbin on merged-/usr systems
        for name in sorted(os.listdir(folder)):
            target = os.path.join(folder, name)
            if (bin_dir / name).exists() or not (os.path.isfile(target) and os.access(target, os.X_OK)):
                continue
            if HIDDEN.search(name):
                hidden.append(name)
                continue
            (bin_dir / name).symlink_to(target)
    # Wrappers, not links: a virtual environment's python finds its packages from the path it was started as.
    for name in ("python", "python3"):
        (bin_dir / name).unlink(missing_ok=True)
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "trainer").write_text(
        f"#!{sys.executable}\nfrom trainer.cli import main\nraise SystemExit(main())\n"
    )
    for name in ("python", "python3", "trainer"):
        (bin_dir / name).chmod(0o755)
    return hidden


def write_model_dir(out: Path, tokenizer_dir: Path, vocab_size: int, gpu: bool) -> None:
    """config.json of a small T5 with FLAN-T5's head size (64) and gated-GELU, and the tokenizer."""
    from trainer.model.tiny_model import flan_t5_config

    config = flan_t5_config("tiny", vocab_size=vocab_size)
    # d_ff = d_model: fewer weight shapes, so fewer compiled optimizer updates (a shorter check).
    width = dict(d_model=512, num_heads=8, d_ff=512) if gpu else dict(d_model=128, num_heads=2, d_ff=128)
    config.update(dict(d_kv=64, num_layers=2, num_decoder_layers=2, **width))
    out.mkdir(parents=True)
    config.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def train_config(root: Path, gpu: bool, report_to: str) -> dict:
    return {
        "model_name_or_path": str(root / "model"),
        "random_init": True,
        "dtype": "bfloat16" if gpu else "float32",
        "train_files": [str(root / "data" / "recipes.csv")],
        "max_source_length": 256,
        "max_target_length": 256,
        "max_tokens": 8192 if gpu else 1024,
        "optimizer": "adafactor",
        "learning_rate": 1.0e-3,
        "lr_scheduler_type": "constant",
        "max_steps": MAX_STEPS,
        "logging_steps": 1,
        "eval_fraction": 0.05,
        "eval_steps": MAX_STEPS,
        "eval_max_batches": 1,
        "num_eval_generations": 1,
        "generation_max_new_tokens": 16,
        "save_steps": MAX_STEPS,
        "save_total_limit": 1,
        "output_dir": str(root / "outputs" / "run"),  # each run sets its own with --set
        "report_to": report_to,
        "run_name": "container-env-check",
        "discord_progress_minutes": -1,
    }


def cache_counts(triton_dir: Path, inductor_dir: Path) -> dict[str, int]:
    """Compiled kernels (Triton's metadata files), built launchers (.so) and inductor's cached graphs."""

    def files(folder: Path, pattern: str) -> list[Path]:
        return [p for p in folder.rglob(pattern) if p.is_file()] if folder.exists() else []

    return {
        "kernels": len([p for p in files(triton_dir, "*.json") if not p.name.startswith("__grp__")]),
        "launchers": len(files(triton_dir, "*.so")),
        "graphs": len(files(inductor_dir / "fxgraph", "*")),
    }


def all_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, status: str, name: str, detail: str) -> None:
        self.rows.append((status, name, detail))
        print(f"[{status}] {name}: {detail}", flush=True)

    def check(self, ok: bool, name: str, detail: str) -> None:
        self.add("PASS" if ok else "FAIL", name, detail)

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for status, _, _ in self.rows)


class Launcher:
    """How the runs start: as UID without a passwd entry, or as this user (root without DAC capabilities)."""

    def __init__(self, as_uid: bool, prefix: list[str], who: str):
        self.as_uid, self.prefix, self.who = as_uid, prefix, who

    def run(self, argv: list[str], env: dict, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
        ids = dict(user=UID, group=GID, extra_groups=[]) if self.as_uid else {}
        return subprocess.run(
            [*self.prefix, *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL, **ids, **kwargs
        )


def choose_launcher(env: dict[str, str], cwd: Path, gpu: bool, report: Report) -> Launcher:
    """UID if this is root and UID can start this python (and reach the GPU); else this user, without the
    power to ignore file permissions where setpriv can take it away."""
    # Exit 3: torch imports but sees no GPU (device files the uid may not open on this machine).
    needs_gpu = "not torch.cuda.is_available()" if gpu else "False"
    probe = f"import torch, trainer; raise SystemExit(3 if {needs_gpu} else 0)"
    why = None
    if os.geteuid() != 0:
        why = "not root"
    else:
        try:
            pwd.getpwuid(UID)
            why = f"uid {UID} has a passwd entry on this machine"
        except KeyError:
            run = Launcher(True, [], "").run(
                ["python3", "-c", probe], env, cwd, capture_output=True, text=True
            )
            if run.returncode == 0:
                return Launcher(True, [], f"uid {UID}, gid {GID}, no passwd entry")
            last = (run.stderr.strip().splitlines() or ["?"])[-1]
            why = (
                f"uid {UID} sees no GPU here"
                if run.returncode == 3
                else f"uid {UID} cannot run {sys.executable}: {last}"
            )
    report.add("SKIP", "uid without a passwd entry", f"{why}: the runs stay uid {os.geteuid()}")
    if os.geteuid() == 0 and shutil.which("setpriv"):
        dropped = Launcher(False, NO_OVERRIDE, "root without CAP_DAC_OVERRIDE (setpriv)")
        if dropped.run(["python3", "-c", probe], env, cwd, capture_output=True).returncode == 0:
            return dropped
    return Launcher(False, [], f"uid {os.geteuid()}")


def first_step_seconds(output_dir: Path, start: float) -> float:
    """Seconds from the process start to the first optimizer step in train_log.jsonl."""
    first = (output_dir / "train_log.jsonl").read_text().splitlines()[0]
    return json.loads(first)["time"] - start


def versions(gpu: bool) -> dict[str, str]:
    import torch
    import transformers

    found = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = "not installed"
    if gpu:
        major, minor = torch.cuda.get_device_capability()
        found["gpu"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    return found


def image_pins() -> dict[str, str]:
    """Exact versions in docker/requirements.txt, the list the image installs."""
    pins = {}
    for line in (REPO / "docker" / "requirements.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[m[1].lower()] = m[2]
    return pins


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu", action="store_true", help="train on the CPU (no GPU here): checks the script"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder and print its path")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per training run")
    args = parser.parse_args()

    try:
        import trainer
    except ImportError:
        sys.path.insert(0, str(REPO))
        import trainer
    import torch

    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        print("no CUDA GPU here: run with --cpu for the CPU variant", file=sys.stderr)
        return 2
    report = Report()
    found = versions(gpu)
    report.add("INFO", "versions", ", ".join(f"{k} {v}" for k, v in found.items()))
    if gpu:
        pins = image_pins()
        names = ("torch", "transformers", "triton")
        report.check(
            all(found[k].split("+")[0] == pins[k] for k in names),
            "the image's pins",
            ", ".join(f"{k} {pins[k]}" for k in names) + " in docker/requirements.txt, this machine's above",
        )
        arches = torch.cuda.get_arch_list()
        report.check("sm_120" in arches, "RTX 5090 kernels in this torch", f"arch list: {' '.join(arches)}")

    root = Path(tempfile.mkdtemp(prefix="container-env-"))
    root.chmod(0o755)
    try:
        check(root, gpu, args.timeout, report, Path(trainer.__file__).parent)
    finally:
        if args.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| check | result | detail |\n|---|---|---|")
    for status, name, detail in report.rows:
        print(f"| {name} | {status} | {detail} |")
    print("\nFAIL" if report.failed else "\nPASS")
    return 1 if report.failed else 0


def check(root: Path, gpu: bool, timeout: float, report: Report, package: Path) -> None:
    env_image = image_env()
    home = Path(mapped(env_image["HOME"], root))
    outputs, app, hf_home = root / "outputs", root / "app", root / "cache" / "huggingface"
    for folder in (outputs, hf_home, root / "data", app / "configs", home):
        folder.mkdir(parents=True, exist_ok=True)

    # The trainer as the image holds it: an installed package, readable by every user.
    site = root / "site"
    shutil.copytree(package, site / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    hidden = make_path_dir(root / "bin")
    gcc = shutil.which("gcc", path=str(root / "bin"))
    report.add("INFO", "PATH", f"gcc: {gcc or 'none'}; out of reach: {', '.join(hidden) or 'none here'}")

    # Data, tokenizer and model directory, written beforehand like the user's ./data.
    setup_env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    for argv in (
        ["data", "sample", "--out", str(root / "data" / "recipes.csv"), "--n", "600"],
        ["tiny-model", "--out", str(root / "tokenizer")],
    ):
        subprocess.run(
            [sys.executable, "-m", "trainer", *argv], env=setup_env, check=True, capture_output=True
        )
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(root / "tokenizer"))
    write_model_dir(root / "model", root / "tokenizer", vocab, gpu)
    try:
        import wandb  # noqa: F401

        report_to = "wandb"  # offline: W&B's own files must land in the outputs, not in HOME
    except ImportError:
        report_to = "none"
    (app / "configs" / "env-check.yaml").write_text(yaml.safe_dump(train_config(root, gpu, report_to)))
    for path in [root, *root.rglob("*")]:  # readable by the run's user
        if path.is_symlink():  # the PATH folder's links: never touch the system's programs
            continue
        path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
    for folder in (home, app, app / "configs"):
        folder.chmod(0o555)
    hf_home.chmod(0o1777)  # as in the image: any uid may download into it

    # The container's environment: the image's ENV (paths mapped), offline switches (no network on these
    # machines; .env would say online), the host's GPU settings. Nothing else from this shell.
    env = {k: v for k, v in os.environ.items() if PASSED_THROUGH.match(k)}
    for key, value in env_image.items():
        if key != "VIRTUAL_ENV":  # the image's venv is this python
            env[key] = str(root / "bin") if key == "PATH" else mapped(value, root)
    env.update(PYTHONPATH=str(site), HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    report.add("INFO", "image ENV", " ".join(f"{k}={env[k]}" for k in env_image if k in env))

    launcher = choose_launcher(env, app, gpu, report)
    if launcher.as_uid:
        os.chown(outputs, UID, GID)  # the host folder belongs to the user the container runs as
        probe = ["python3", "-c", "import getpass; print(getpass.getuser())"]
        bare = {k: v for k, v in env.items() if k not in ("USER", "LOGNAME")}
        without = launcher.run(probe, bare, app, capture_output=True, text=True)
        with_env = launcher.run(probe, env, app, capture_output=True, text=True)
        report.check(
            without.returncode != 0 and with_env.returncode == 0,
            "user name for a uid without a passwd entry",
            f"getpass.getuser() as uid {UID} without USER/LOGNAME: "
            f"{'fails' if without.returncode else 'works'}; with the image's ENV: "
            f"{with_env.stdout.strip() or with_env.stderr.strip()[-200:]!r}",
        )
    report.add("INFO", "runs as", launcher.who)

    triton_dir, inductor_dir = Path(env["TRITON_CACHE_DIR"]), Path(env["TORCHINDUCTOR_CACHE_DIR"])
    counts, first = [], []
    for run in (1, 2):
        output_dir = outputs / f"run{run}"
        argv = ["trainer", "train", "--config", "configs/env-check.yaml", "--set", f"output_dir={output_dir}"]
        log_path = root / f"run{run}.log"
        start = time.time()
        with open(log_path, "wb") as log:
            try:
                rc = launcher.run(
                    argv, env, app, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        out = log_path.read_bytes().decode("utf-8", "replace")
        train_log = output_dir / "train_log.jsonl"
        rows = [json.loads(line) for line in train_log.read_text().splitlines()] if train_log.exists() else []
        steps = sum("loss" in row for row in rows)  # the log's other rows are evaluations
        ok = rc == 0 and steps == MAX_STEPS
        report.check(
            ok, f"run {run}", f"`{' '.join(argv[:4])}`: exit {rc}, {steps}/{MAX_STEPS} optimizer steps"
        )
        # The data folder is read-only in the image: the loader's index cache must go to a writable place, or
        # every start indexes the data again (minutes on millions of recipes).
        report.check(
            "could not write the index cache" not in out,
            f"run {run}: data index cache written",
            "the loader's cache under XDG_CACHE_HOME" if "could not write" not in out else "not writable",
        )
        if not ok:
            print(f"--- run {run}, last lines ---\n" + "\n".join(out.splitlines()[-40:]), flush=True)
            return
        counts.append(cache_counts(triton_dir, inductor_dir))
        first.append(first_step_seconds(output_dir, start))
        if run == 1:
            returns = out.count("\r")
            report.check(
                returns == 0,
                "log without a terminal",
                f"{len(out.splitlines())} lines, no carriage return"
                if not returns
                else f"{returns} carriage returns (a progress bar redrawn, kept by `docker compose logs`)",
            )
            print("    " + "\n    ".join(out.splitlines()[-4:]))

    timing = f"start to first step: {first[0]:.1f} s cold, {first[1]:.1f} s warm"
    if gpu:
        c1, c2 = counts
        report.check(
            # Compiled graphs come only with `torch_compile: true` (the Triton kernels are the trainer's own).
            c1["kernels"] > 0 and c1["launchers"] > 0,
            "compile caches filled",
            f"run 1 left {c1['kernels']} Triton kernels, {c1['launchers']} launchers (built with gcc) and "
            f"{c1['graphs']} compiled-graph files under outputs/compile-cache",
        )
        added = {k: c2[k] - c1[k] for k in c1}
        report.check(
            not any(added.values()),
            "compile caches reused",
            f"run 2 added {added['kernels']} kernels, {added['launchers']} launchers, "
            f"{added['graphs']} graph files; {timing}",
        )
    else:
        report.add("SKIP", "compile caches", f"CPU: the trainer compiles nothing without a GPU; {timing}")

    written = all_files(home)
    report.check(not written, "HOME not written", "empty" if not written else f"{written[:6]}")
    in_app = all_files(app)
    expected = ["configs", "configs/env-check.yaml"]
    report.check(
        in_app == expected,
        "working directory not written",
        "unchanged" if in_app == expected else str(in_app),
    )
    if launcher.as_uid:
        foreign = [str(p) for p in outputs.rglob("*") if p.stat().st_uid != UID]
        report.check(
            not foreign, "outputs owned by the run's uid", "all" if not foreign else str(foreign[:5])
        )


if __name__ == "__main__":
    raise SystemExit(main())

"""Shared fixtures: generated sample recipes and a tiny offline FLAN-T5, built once per test session."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

# Triton kernels (trainer.kernels) run in Triton's interpreter on CPU
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist runs a worker per core, and the tests' trainings are tiny: one thread for each process's
# matmuls (this one's and its subprocesses'), so that the workers do not fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from trainer.data.sample import write_sample
from trainer.model.tiny_model import build_tiny_model

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def subprocess_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TMPDIR for the processes the tests start (torchrun leaves a torchelastic_* directory in it each time),
    inside pytest's own temporary directory, so that the system's is left as it was."""
    path = tmp_path_factory.mktemp("tmpdir")
    os.environ["TMPDIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random FLAN-T5 and its T5-style tokenizer (`tokenizer.json` inside), built with seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_model_without_dropout(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with dropout off: a step's loss is a function of weights and data alone (the same in 1
    and in 2 processes, packed and unpacked)."""
    out = tmp_path_factory.mktemp("tiny-no-dropout") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"dropout_rate": 0.0}))
    return out


@pytest.fixture(scope="session")
def sample_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RecipeNLG `full_dataset.csv` layout, 500 recipes."""
    path = tmp_path_factory.mktemp("samples") / "full_dataset.csv"
    write_sample(path, 500, seed=1, fmt="recipenlg-csv")
    return path


@pytest.fixture(scope="session")
def sample_foodcom(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Food.com `RAW_recipes.csv` layout, 300 recipes."""
    path = tmp_path_factory.mktemp("samples") / "RAW_recipes.csv"
    write_sample(path, 300, seed=2, fmt="foodcom-csv")
    return path


@pytest.fixture(scope="session")
def sample_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSONL with title, ingredients, directions and NER, 300 recipes."""
    path = tmp_path_factory.mktemp("samples") / "recipes.jsonl"
    write_sample(path, 300, seed=3, fmt="jsonl")
    return path


# A test that takes longer than this on a 2-core machine without the `slow` mark is named at the run's end.
SLOW_TEST_S = 20.0
SLOW_REASON = "Slow because"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every `slow` test says why in its docstring, and runs first: pytest-xdist hands tests out in this
    order, so the long ones start early while the short ones fill the other workers, rather than ending the
    run alone on one."""
    for item in items:
        doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
        if item.get_closest_marker("slow") and SLOW_REASON not in doc:
            raise pytest.UsageError(
                f"{item.nodeid} is marked slow without a reason: its docstring says '{SLOW_REASON} ...'"
            )
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Names the tests that became slow without saying so, so that the suite's time does not creep back."""
    unmarked = [
        report
        for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
        if report.when == "call"
        and report.duration > SLOW_TEST_S
        and not {"slow", "container"} & set(report.keywords)  # the container test is a run of its own
    ]
    if unmarked:
        terminalreporter.section(f"over {SLOW_TEST_S:.0f} s without @pytest.mark.slow")
        for report in sorted(unmarked, key=lambda r: -r.duration):
            terminalreporter.line(f"{report.duration:6.1f}s {report.nodeid}")
        terminalreporter.line(
            f"Make them faster, or mark them slow with '{SLOW_REASON} ...' in the docstring (bench/NOTES.md "
            "keeps the suite's budget)."
        )

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

import pytest

from trainer.data.sample import write_sample
from trainer.model.tiny_model import build_tiny_model


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

"""Hugging Face datasets as training data: save_to_disk directories and Hub ids (from a local Hub cache built
here, offline: nothing comes from the Hub), converted once to Parquet and read like files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from epoch_rows import rows

from trainer.config import DataSource, TrainConfig
from trainer.data.loader import RecipeFileError, RecipeStream, stream_for

RECORDS = [
    {
        "title": f"Dish {i}",
        "ingredients": [f"{i % 5 + 1} cups item{j}" for j in range(1 + i % 4)],
        "directions": [f"Stir for {i} minutes.", "Serve."],
        "ner": [f"item{j}" for j in range(1 + i % 4)],
        "source": "Gathered",
    }
    for i in range(60)
]


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """The loader's cache root (where converted datasets go) inside the test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "recipe-trainer"


def want_rows(tmp_path: Path, tiny_model_dir: Path, records: list[dict]) -> list:
    path = tmp_path / "want.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    return rows(RecipeStream(path, tiny_model_dir, batch_size=8, cache_dir=tmp_path / "c"))


def test_a_saved_dataset_is_converted_once_and_read_like_files(tmp_path, tiny_model_dir, cache_home):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(saved))
    cfg = TrainConfig(
        train_files=[str(saved)], per_device_train_batch_size=8, eval_fraction=0.0, shuffle=False
    )
    stream = stream_for(cfg, tiny_model_dir / "tokenizer.json", "train")
    assert rows(stream) == want_rows(tmp_path, tiny_model_dir, RECORDS)
    (converted,) = (cache_home / "datasets").glob("*.parquet")
    fingerprint = datasets.load_from_disk(str(saved))._fingerprint
    assert converted.name == f"{fingerprint}.parquet"
    written = converted.stat().st_mtime_ns
    stream_for(cfg, tiny_model_dir / "tokenizer.json", "train")
    assert converted.stat().st_mtime_ns == written  # reused, not converted again


def test_a_saved_dataset_dict_gives_the_split_asked_for(tmp_path, tiny_model_dir, cache_home):
    saved = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS[:40]), "test": datasets.Dataset.from_list(RECORDS[40:])}
    ).save_to_disk(str(saved))
    cfg = TrainConfig(
        train_files=[DataSource(str(saved), split="test")],
        per_device_train_batch_size=8,
        eval_fraction=0.0,
        shuffle=False,
    )
    stream = stream_for(cfg, tiny_model_dir / "tokenizer.json", "all")
    assert rows(stream) == want_rows(tmp_path, tiny_model_dir, RECORDS[40:])
    wrong = TrainConfig(
        train_files=[DataSource(str(saved), split="validation")], per_device_train_batch_size=8
    )
    with pytest.raises(RecipeFileError, match=f"^{saved}: no split 'validation'; it has train, test$"):
        stream_for(wrong, tiny_model_dir / "tokenizer.json", "all")


def hub_cache(root: Path, repo: str, records: list[dict]) -> Path:
    """The layout `hf download --repo-type dataset REPO` leaves in the Hub cache: refs/main names a snapshot
    holding the repository's files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"datasets--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    data = repo_dir / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records), data / "train-00000-of-00001.parquet")
    return root


def inspect(tmp_path: Path, tiny_model_dir: Path, target: str, env: dict[str, str]):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\nper_device_train_batch_size: 8\n")
    return subprocess.run(
        [sys.executable, "-m", "trainer", "data", "inspect", target, "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=os.environ | env,
    )


def test_offline_a_hub_dataset_comes_from_the_local_cache_and_a_missing_one_is_one_line(
    tmp_path, tiny_model_dir
):
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub_cache(tmp_path / "hub", "cooks/recipes", RECORDS)),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
    }
    proc = inspect(tmp_path, tiny_model_dir, "hf://datasets/cooks/recipes", env)
    assert proc.returncode == 0, proc.stderr
    assert "records: 60 usable, 0 skipped" in proc.stdout
    assert len(list((tmp_path / "xdg" / "recipe-trainer" / "datasets").glob("*.parquet"))) == 1
    proc = inspect(tmp_path, tiny_model_dir, "hf://datasets/cooks/missing", env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "trainer: data error: hf://datasets/cooks/missing: not in the local Hugging Face cache "
        "(HF_HUB_OFFLINE=1); load it once with network access, or fetch it with "
        "`hf download --repo-type dataset cooks/missing`"
    )


def test_without_the_datasets_package_the_error_names_the_install_command(tmp_path):
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "from trainer.data.hf_datasets import load\n"
        "try:\n    load('hf://datasets/cooks/recipes')\n"
        "except OSError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == (
        "hf://datasets/cooks/recipes: reading a Hugging Face dataset needs the datasets package: "
        "pip install 'recipe-t5-trainer[datasets]' (or pip install datasets)"
    )


def test_generate_and_evaluate_read_hugging_face_datasets_as_training_does(tmp_path, tiny_model_dir):
    """`trainer generate --input` and `trainer evaluate --data` take a save_to_disk directory and a Hub
    dataset (here from the local Hub cache, offline), as train_files does."""
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(RECORDS[:6]).save_to_disk(str(saved))
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub_cache(tmp_path / "hub", "cooks/recipes", RECORDS[:5])),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
    }

    def trainer(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "trainer", *args, "--model", str(tiny_model_dir), "--device", "cpu"]
        return subprocess.run([*argv, "--max_new_tokens", "3"], capture_output=True, text=True, env=env)

    out = tmp_path / "generated.jsonl"
    done = trainer("generate", "--input", str(saved), "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 6
    done = trainer("evaluate", "--data", "hf://datasets/cooks/recipes")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^records\s+5$", done.stdout, re.M), done.stdout

"""The typed config: presets load, unknown keys and wrong types are clear errors before anything loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.config import ConfigError, TrainConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["quickstart.yaml", "flan-t5-xl-rtx5090.yaml"])
def test_presets_load(name):
    cfg = TrainConfig.load(CONFIGS / name)
    assert cfg.train_files and cfg.output_dir


def test_xl_preset_is_bf16_with_compensated_updates():
    cfg = TrainConfig.load(CONFIGS / "flan-t5-xl-rtx5090.yaml")
    assert cfg.model_name_or_path == "google/flan-t5-xl"
    assert (cfg.dtype, cfg.bf16_update, cfg.gradient_checkpointing) == ("bfloat16", "kahan", True)


def test_overrides_are_typed():
    cfg = TrainConfig.load(CONFIGS / "quickstart.yaml", ["learning_rate=3e-4", "max_steps=7", "resume=never"])
    assert (cfg.learning_rate, cfg.max_steps, cfg.resume) == (3e-4, 7, "never")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learning_rte=1e-4", "unknown config key 'learning_rte' (did you mean 'learning_rate'?)"),
        ("max_steps=ten", "max_steps must be int"),
        ("optimizer=sgd", "optimizer must be one of"),
        ("gradient_accumulation_steps=0", "gradient_accumulation_steps must be >= 1"),
        ("max_steps", "not of the form key=value"),
        ("max_tokens=0", "max_tokens must be >= 1 or null, got 0"),  # the quickstart batches by token budget
        ("max_source_length=0", "max_source_length must be >= 1, got 0"),
        ("warmup_steps=-5", "warmup_steps must be >= 0"),
        ("learning_rate=-1", "learning_rate must be a positive number"),
        ("learning_rate=.nan", "learning_rate must be a positive number"),
        ("max_grad_norm=-1", "max_grad_norm must be >= 0 (0: no clipping"),
        ("learning_rate=[1", "override 'learning_rate=[1': the value is not valid YAML"),
    ],
)
def test_bad_overrides_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.load(CONFIGS / "quickstart.yaml", [override])


def test_bad_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        TrainConfig.load(bad)


def test_every_set_counts_and_paths_expand_the_home_directory(tmp_path):
    from trainer.cli import _build_parser

    args = _build_parser().parse_args(
        ["train", "--config", "c.yaml", "--set", "max_steps=3", "--set", "seed=1"]
    )
    assert args.set == ["max_steps=3", "seed=1"]
    cfg = TrainConfig.load(None, ["output_dir=~/runs/a", "train_files=[~/data/r.csv]", "resume=~/runs/a/ck"])
    home = str(Path.home())
    assert cfg.output_dir == f"{home}/runs/a" and cfg.train_files == [f"{home}/data/r.csv"]
    assert cfg.resume == f"{home}/runs/a/ck"
    with pytest.raises(ConfigError, match="set max_steps > 0 or num_train_epochs > 0"):
        TrainConfig.load(None, ["max_steps=-1", "num_train_epochs=0"])

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

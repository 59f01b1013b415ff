"""The presets shipped in the package: `trainer presets` lists them, `trainer init` writes one as a local
config with the user's paths (what a user who installed the wheel, without the repository, starts from)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trainer.cli import main as cli_main
from trainer.config import TrainConfig
from trainer.plan.presets import presets

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_the_repositorys_configs_are_the_packages_presets():
    """One set of files: configs/ (compose mounts it, the docs name it) is the package's trainer/presets."""
    shipped = {p.file_name for p in presets()}
    assert shipped == {p.name for p in REPO_CONFIGS.glob("*.yaml")}
    assert REPO_CONFIGS.resolve() == (Path(__file__).resolve().parent.parent / "trainer" / "presets")
    for preset in presets():
        if preset.name != "quickstart":  # every other preset is for a card its file name ends with
            assert preset.card is not None, f"{preset.file_name} does not end with a known card"
        for key in ("train_files", "output_dir"):  # what `trainer init` rewrites
            assert re.search(rf"^{key}:", preset.text, re.M), f"{preset.file_name} has no top-level {key}"


def test_presets_lists_each_with_its_card_model_and_the_speed_trainer_plan_predicts(capsys):
    assert cli_main(["presets"]) == 0
    table = capsys.readouterr().out
    for preset in presets():
        assert re.search(rf"^{re.escape(preset.name)} ", table, re.M), table
    line = next(row for row in table.splitlines() if row.startswith("xl-rtx4090 "))
    assert "RTX 4090 (24 GB)" in line and "google/flan-t5-xl" in line and "every weight" in line
    listed = re.search(r"([\d,]+) real tok/s", line).group(1)
    lora = next(row for row in table.splitlines() if row.startswith("xl-lora-rtx4080 "))
    assert "LoRA r 16" in lora and "RTX 4080 (16 GB)" in lora
    # The same number `trainer plan` gives for the preset on its card without data (typical recipes).
    assert (
        cli_main(["plan", "--config", str(REPO_CONFIGS / "flan-t5-xl-rtx4090.yaml"), "--gpu-memory", "24GiB"])
        == 0
    )
    planned = re.search(r"RTX 4090 \(.*?\): ([\d,]+) real tokens/s", capsys.readouterr().out).group(1)
    assert listed == planned

    # A preset of several cards: its card count, and the speed of all of them at FSDP2's measured MFU, as
    # `trainer plan --processes 2` predicts it.
    line = next(row for row in table.splitlines() if row.startswith("xxl-fsdp-2x-rtx6000ada "))
    assert "2 x RTX 6000 Ada (48 GB each)" in line and "google/flan-t5-xxl" in line
    listed = re.search(r"([\d,]+) real tok/s", line).group(1)
    config = str(REPO_CONFIGS / "flan-t5-xxl-fsdp-2x-rtx6000ada.yaml")
    assert cli_main(["plan", "--config", config, "--processes", "2", "--gpu-memory", "48GiB"]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs under fsdp, each at FSDP2's measured MFU" in out
    assert re.search(r"RTX 6000 Ada \(.*?\): ([\d,]+) real tokens/s", out).group(1) == listed


def test_init_writes_the_preset_with_the_users_paths_and_nothing_else_changed(
    tmp_path, monkeypatch, sample_csv, capsys
):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["init", "--preset", "rtx4090", "--data", str(sample_csv), "--output", "runs/xl"]) == 0
    said = capsys.readouterr().out
    written = tmp_path / "flan-t5-xl-rtx4090.yaml"
    assert f"wrote {written.name}" in said and f"trainer train --config {written.name} --dry-run" in said
    assert "matches no file" not in said
    cfg = TrainConfig.load(written)
    assert cfg.train_files == [str(sample_csv)] and cfg.output_dir == "runs/xl"
    shipped = next(p for p in presets() if p.name == "xl-rtx4090")
    for field in dataclasses.fields(TrainConfig):
        if field.name not in ("train_files", "output_dir"):
            assert getattr(cfg, field.name) == getattr(shipped.config, field.name), field.name
    text = written.read_text()
    assert shipped.text.splitlines()[0] in text  # the preset's comments come along
    assert text.startswith("# Written by `trainer init --preset xl-rtx4090`")
    # The file plans on the user's data, as any config does.
    assert cli_main(["plan", "--config", str(written), "--gpu-memory", "24GiB"]) == 0


def test_init_maps_the_containers_paths_under_the_working_directory_and_says_what_is_missing(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["init", "--preset", "flan-t5-xl-rtx5090.yaml", "--to", "configs/mine.yaml"]) == 0
    said = capsys.readouterr().out
    cfg = TrainConfig.load(tmp_path / "configs" / "mine.yaml")
    assert cfg.train_files == ["data/*.csv"] and cfg.output_dir == "outputs/flan-t5-xl-recipes"
    assert "data/*.csv matches no file" in said and "give --data" in said


def test_the_quickstart_preset_written_by_init_passes_the_dry_run_it_suggests(tmp_path, monkeypatch, capsys):
    """`trainer init --preset quickstart` says `trainer train --config quickstart.yaml --dry-run` next: that
    passes without the demo data the run will make, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["init", "--preset", "quickstart"]) == 0
    assert "trainer train --config quickstart.yaml --dry-run" in capsys.readouterr().out
    assert cli_main(["train", "--config", "quickstart.yaml", "--dry-run"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quickstart.yaml"]


def test_the_quickstart_preset_with_the_users_data_checks_that_data(tmp_path, monkeypatch, capsys):
    """The demo preset writes its own recipes only under data/quickstart/: given other data, init notes what
    matches no file, and the dry run it suggests fails on it, in one line, as the real run would."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["init", "--preset", "quickstart", "--data", "nowhere/*.csv"]) == 0
    said = capsys.readouterr().out
    assert "note: nowhere/*.csv matches no file" in said, said
    assert cli_main(["train", "--config", "quickstart.yaml", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "nowhere/*.csv matches no file" in err and len(err.strip().splitlines()) == 1, err


def test_init_to_a_directory_writes_the_preset_inside_it(tmp_path, monkeypatch, capsys):
    """`--to configs/` as `cp`: the preset's file name inside it; `--force` replaces that file, never the
    directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    assert cli_main(["init", "--preset", "quickstart", "--to", "configs"]) == 0
    assert TrainConfig.load(tmp_path / "configs" / "quickstart.yaml").max_steps == 250
    assert cli_main(["init", "--preset", "quickstart", "--to", "configs"]) == 2
    assert "configs/quickstart.yaml exists" in capsys.readouterr().err
    assert cli_main(["init", "--preset", "quickstart", "--to", "configs", "--force"]) == 0
    (tmp_path / "configs" / "quickstart.yaml").unlink()
    (tmp_path / "configs" / "quickstart.yaml").mkdir()
    assert cli_main(["init", "--preset", "quickstart", "--to", "configs", "--force"]) == 2
    err = capsys.readouterr().err
    assert "is a directory; give --to a file name" in err and len(err.strip().splitlines()) == 1, err


def test_init_refuses_to_replace_a_file_or_to_guess_a_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "flan-t5-xl-rtx4090.yaml"
    mine.write_text("learning_rate: 1.0e-4\n")
    assert cli_main(["init", "--preset", "xl-rtx4090"]) == 2
    assert "flan-t5-xl-rtx4090.yaml exists; give another --to, or --force" in capsys.readouterr().err
    assert mine.read_text() == "learning_rate: 1.0e-4\n"
    assert cli_main(["init", "--preset", "xl-rtx4090", "--force"]) == 0
    assert TrainConfig.load(mine).optimizer == "adafactor"
    capsys.readouterr()

    assert cli_main(["init", "--preset", "rtx5090"]) == 2  # the XL, XXL LoRA and 4-card XXL presets end so
    err = capsys.readouterr().err
    assert "names 3 presets: xl-rtx5090" in err and "xxl-lora-rtx5090" in err and "xxl-fsdp-4x-rtx5090" in err
    assert cli_main(["init", "--preset", "rtx6000"]) == 2
    assert "no preset 'rtx6000'; the presets: " in capsys.readouterr().err


@pytest.mark.parametrize("data", [["hf://datasets/someone/recipes"], ["a.csv", "b/*.jsonl"]])
def test_init_takes_every_form_train_files_takes(tmp_path, monkeypatch, data, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["init", "--preset", "quickstart", "--data", *data]) == 0
    assert TrainConfig.load(tmp_path / "quickstart.yaml").train_files == data

"""The `trainer` command line as a user meets it: arguments, --help, the console of a run in a container."""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import yaml

from trainer.cli import build_parser, one_override_per_set
from trainer.cli import main as cli_main


def test_set_takes_one_value_so_the_paths_after_it_stay_paths(sample_csv, tiny_model_dir, capsys):
    # `--set` used to take every word after it, the file included: "the following arguments are required".
    code = cli_main(
        ["data", "inspect", "--set", f"model_name_or_path={tiny_model_dir}", "--set", "max_source_length=64"]
        + [str(sample_csv)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "source tokens (max 64)" in out  # both overrides count
    # Several KEY=VALUE words after one --set still count, each of them; the first other word is a path.
    argv = ["data", "inspect", "--set=c=3", "a=1", "--set", "b=[x, y]", "d=", "x.csv", "y.csv"]
    args = build_parser().parse_args(one_override_per_set(argv))
    assert args.paths == ["x.csv", "y.csv"] and args.set == ["c=3", "a=1", "b=[x, y]", "d="]


def test_help_speaks_to_users():
    text = build_parser().format_help()
    # The description comes right after the usage lines, however wide the terminal wraps them.
    assert "\n\nFine-tune FLAN-T5 on recipe files" in text
    assert "library code" not in text and "decided here" not in text
    assert "`trainer presets`" in text and "trainer init --preset NAME" in text  # works from the wheel alone


def _console_run(tmp_path, tiny_model_dir, sample_csv, terminal: bool = False, **values) -> str:
    """A short real run through `python -m trainer`, its output captured as `docker compose logs` would, or
    as a terminal (a pseudo-terminal of 120 columns) shows it."""
    config = tmp_path / "run.yaml"
    values = {
        "model_name_or_path": str(tiny_model_dir),
        "dtype": "float32",
        "train_files": [str(sample_csv)],
        "max_source_length": 64,
        "max_target_length": 96,
        "per_device_train_batch_size": 8,
        "eval_fraction": 0.05,
        "eval_max_batches": 1,
        "max_steps": 4,
        "logging_steps": 2,
        "eval_steps": 4,
        "save_steps": 4,
        "num_eval_generations": 1,
        "generation_max_new_tokens": 8,
        "gradient_checkpointing": False,
        "output_dir": str(tmp_path / "out"),
        "report_to": "none",
        "discord_progress_minutes": -1,
        **values,
    }
    config.write_text(yaml.safe_dump(values))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISCORD_", "WANDB_"))}
    env = dict(env, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "trainer", "train", "--config", str(config)]
    if terminal:
        code, console = _on_a_terminal(cmd, env)
        assert code == 0, console
        return console
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _on_a_terminal(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `cmd` with a pseudo-terminal of 40 x 120 as its stdin, stdout and stderr: its exit code and all
    it wrote there."""
    controller, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, env=env, stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(controller, 1 << 16)
        except OSError:  # EIO: the last process holding the terminal closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(controller)
    return proc.wait(timeout=600), b"".join(chunks).decode(errors="replace")


def test_console_outside_a_terminal_is_dated_log_lines_a_person_can_read(
    tmp_path, tiny_model_dir, sample_csv
):
    console = _console_run(tmp_path, tiny_model_dir, sample_csv)
    # No carriage-return progress bar (one endless line in `docker compose logs`), ours or transformers'.
    assert "\r" not in console
    lines = console.splitlines()
    stamp = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} (INFO|WARNING) ")
    logged = [line for line in lines if stamp.match(line)]
    assert len(logged) >= 8, console
    # Every line is a log line, except the generated recipe printed under its own log line.
    recipe_at = next(i for i, line in enumerate(lines) if "generated for a held-out record" in line)
    assert [line for line in lines if not stamp.match(line)] == lines[recipe_at + 1 : recipe_at + 3], console
    # One progress line per logged step: step/total, loss, lr, tokens/s, ETA; no memory on a CPU.
    progress = [line for line in lines if re.search(r" step \d+/4: loss ", line)]
    assert len(progress) == 2, console
    assert re.search(r"step 2/4: loss \d+\.\d{4}, lr \d\.\d\de-\d\d, [\d,]+ tokens/s, ETA \d+s$", progress[0])
    assert all("memory" not in line and "mem=" not in line for line in progress)
    # Numbers are rounded for a person; what concerns a GPU is not said on a CPU.
    assert re.search(r"finished: 4 steps in \d+ s, final loss \d+\.\d{4}; the model is in ", console), console
    for developer_note in ("0 decoder blocks", "0 gated-GELU", "allocator: n/a", "empty_cache: never"):
        assert developer_note not in console


def test_on_a_terminal_log_lines_go_above_the_bar_and_each_logged_step_stays(
    tmp_path, tiny_model_dir, sample_csv
):
    """On a terminal: a progress bar, the log lines above it (never glued onto the bar's line), one line per
    logged step kept in the scrollback, and no warning from the trainer's own calls into libraries
    (gradient checkpointing on, whose old name transformers deprecates)."""
    console = _console_run(tmp_path, tiny_model_dir, sample_csv, terminal=True, gradient_checkpointing=True)
    assert re.search(r"train: +\d+%\|", console), console  # tqdm's bar
    segments = re.split(r"[\r\n]|\x1b\[\d*[A-D]", console)  # line ends and cursor moves (tqdm's nested bars)
    stamp = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} (INFO|WARNING)"
    glued = [seg for seg in segments if re.search(r"\S" + stamp, seg)]
    assert glued == [], glued
    progress = [seg for seg in segments if re.match(stamp + r" .* step \d+/4: loss ", seg)]
    assert len(progress) == 2, console
    assert "Warning" not in console and "deprecated" not in console, console
    assert re.search(r"finished: 4 steps in \d+ s, final loss", console), console


def test_the_profiler_stops_when_the_run_ends_inside_its_window(tmp_path, tiny_model_dir, sample_csv):
    import torch

    from trainer.config import TrainConfig
    from trainer.run.train import train

    values = yaml.safe_load(
        f"""
model_name_or_path: {tiny_model_dir}
dtype: float32
train_files: [{sample_csv}]
max_source_length: 64
max_target_length: 96
per_device_train_batch_size: 8
eval_fraction: 0
max_steps: 2
save_steps: 100
output_dir: {tmp_path / "out"}
report_to: none
progress_bar: false
discord_progress_minutes: -1
profile_start_step: 1
profile_steps: 5
"""
    )
    assert train(TrainConfig.from_dict(values)) == 0
    # The window (steps 2-6) was cut short by the end of the run: the profiler is off again, no report.
    assert not torch.autograd.profiler._is_profiler_enabled
    assert not (tmp_path / "out" / "profile" / "kernels.txt").exists()


ROOT = Path(__file__).resolve().parent.parent


def _trainer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        env=dict(os.environ, COLUMNS="100"),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_train_help_lists_every_key_with_its_type_default_and_meaning():
    import dataclasses

    from trainer.config import TrainConfig
    from trainer.optim import OPTIMIZERS

    done = _trainer("train", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # as wrapped for the terminal
    for f in dataclasses.fields(TrainConfig):
        assert f" {f.name}: " in text and " ".join(f.metadata["help"].split()) in text, f.name
    assert "learning_rate: float = 0.0001 The peak learning rate." in text
    assert f"optimizer: {' | '.join(OPTIMIZERS)} = adamw" in text  # each trainer.optim module's name
    assert "optim: taken as optimizer (adamw_torch," in text  # Hugging Face's names, with what they become
    # `trainer config` prints the same list (--markdown: docs/config.md).
    config = _trainer("config")
    assert config.returncode == 0 and " ".join(config.stdout.split()) in text


def test_docs_config_md_is_generated_from_the_config():
    import dataclasses

    from trainer.cli import CONFIG_DOC_COMMAND, config_keys_markdown
    from trainer.config import TrainConfig

    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert doc == config_keys_markdown(), f"docs/config.md is out of date: run `{CONFIG_DOC_COMMAND}`"
    assert CONFIG_DOC_COMMAND in doc.splitlines()[2]  # named at the top
    for f in dataclasses.fields(TrainConfig):
        assert f"| `{f.name}` |" in doc, f"{f.name} is not in docs/config.md"


def test_every_option_of_every_command_says_what_it_does():
    def options(parser: argparse.ArgumentParser, command: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, f"{command} {name}")
            elif not isinstance(action, argparse._HelpAction):
                yield command, action

    found = list(options(build_parser(), "trainer"))
    assert len(found) > 40
    assert [f"{cmd} {'/'.join(a.option_strings) or a.dest}" for cmd, a in found if not a.help] == []


def test_version_is_the_package_version():
    done = _trainer("--version")
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert done.returncode == 0 and done.stdout.strip() == f"trainer {version}", done.stdout + done.stderr


def test_hugging_face_style_flags_are_config_overrides(capsys):
    """`--learning_rate 1e-4`, `--num-train-epochs=2` and `--bf16` alone, as HfArgumentParser users type
    them, after `trainer train` or `trainer plan`: overrides like --set; other commands' options untouched."""
    from trainer.cli import config_flags_as_overrides

    argv = [
        "train",
        "--config",
        "c.yaml",
        "--learning_rate",
        "1e-4",
        "--bf16",
        "--num-train-epochs=2",
        "--dry-run",
    ]
    assert config_flags_as_overrides(argv) == [
        "train", "--config", "c.yaml", "--set", "learning_rate=1e-4", "--set", "bf16=true",
        "--set", "num_train_epochs=2", "--dry-run",
    ]  # fmt: skip
    verbose = ["--verbose", "train", "--config", "c.yaml", "--seed", "3"]  # the program's own option first
    assert config_flags_as_overrides(verbose) == [
        "--verbose",
        "train",
        "--config",
        "c.yaml",
        "--set",
        "seed=3",
    ]
    several = ["train", "--config", "c.yaml", "--report_to", "wandb", "tensorboard", "--max_steps", "-1"]
    assert config_flags_as_overrides(several) == [
        "train", "--config", "c.yaml", "--set", 'report_to=["wandb", "tensorboard"]', "--set", "max_steps=-1",
    ]  # fmt: skip
    expanded = ["train", "--train_files", "a.csv", "*.jsonl", "--eval_fraction", "0.1", "0.2", "--dry-run"]
    assert config_flags_as_overrides(expanded) == [
        "train", "--set", 'train_files=["a.csv", "*.jsonl"]', "--set", "eval_fraction=[0.1, 0.2]",
        "--dry-run",
    ]  # fmt: skip
    generate = ["generate", "--model", "m", "--num_beams", "4"]
    assert config_flags_as_overrides(generate) == generate
    preset = "configs/flan-t5-xl-rtx5090.yaml"
    assert (
        cli_main(["plan", "--config", preset, "--max_tokens", "4096", "--bf16", "--gpu-memory", "32GiB"]) == 0
    )
    assert "token budget 4096" in capsys.readouterr().out
    hf = ["--report_to", "wandb", "tensorboard", "--save_strategy", "steps", "--eval_strategy", "epoch"]
    assert cli_main(["plan", "--config", preset, *hf, "--gpu-memory", "32GiB"]) == 0
    capsys.readouterr()
    assert cli_main(["plan", "--config", preset, "--lerning_rate", "1e-4"]) == 2
    err = capsys.readouterr().err
    assert "--set lerning_rate=1e-4: unknown config key 'lerning_rate' (did you mean 'learning_rate'?)" in err


def test_the_config_is_given_as_axolotl_and_hugging_face_scripts_take_it_or_not_at_all(capsys):
    """`trainer plan CONFIG` (axolotl's `axolotl train config.yml`), with `--key value` on either side of it
    (a flag alone before it is true, not the file); only keys (Hugging Face's scripts without a file: the
    defaults for the rest); nothing, or two configs: one line saying what to give."""
    from trainer.cli import config_flags_as_overrides

    preset = "configs/flan-t5-xl-rtx5090.yaml"
    assert config_flags_as_overrides(["train", "--bf16", preset]) == ["train", "--set", "bf16=true", preset]
    assert cli_main(["plan", "--max_tokens", "4096", preset, "--gpu-memory", "32GiB"]) == 0
    assert "token budget 4096" in capsys.readouterr().out
    assert cli_main(["plan", "--max_tokens", "2048", "--model_name_or_path", "google/flan-t5-base"]) == 0
    out = capsys.readouterr().out
    assert "token budget 2048" in out and "flan-t5-base" in out
    assert cli_main(["plan"]) == 2
    assert "config error: no config: `trainer plan CONFIG.yaml`" in capsys.readouterr().err
    assert cli_main(["train", preset, "--config", "configs/quickstart.yaml", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"two configs given, {preset} and --config configs/quickstart.yaml: give one" in err


def test_the_commands_own_options_are_known_to_the_flag_reader():
    from trainer.cli import CONFIG_COMMANDS

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, own in CONFIG_COMMANDS.items():
        options = {s for action in commands.choices[name]._actions for s in action.option_strings}
        assert options == own, name


def test_inspect_without_a_config_offline_says_to_give_one(sample_csv, tmp_path, monkeypatch, capsys):
    """Without --config, `data inspect` counts tokens with FLAN-T5-XL's tokenizer; offline and not cached,
    the one line says how to use the training config's instead."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli_main(["data", "inspect", str(sample_csv)]) == 2
    err = capsys.readouterr().err
    assert "--config configs/quickstart.yaml" in err and len(err.strip().splitlines()) == 1, err

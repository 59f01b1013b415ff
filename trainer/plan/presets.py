"""The presets shipped in the package (trainer/presets/*.yaml; `configs/` in the repository is the same
directory): `trainer presets` lists them with their card, model and predicted speed, and `trainer init`
writes one as a local config with the user's paths.

A preset's file name ends with its card (`flan-t5-xl-rtx4090.yaml`: an RTX 4090, trainer.plan.gpu_specs),
after the number of them for a preset of several GPUs (`flan-t5-xxl-fsdp-2x-l40s.yaml`: two L40S, one process
each under torchrun); its name is the file name without `flan-t5-` and `.yaml` (`xl-rtx4090`). The presets'
paths are the container's (`/data`, `/outputs`); `trainer init` maps them to `data/` and `outputs/` under the
working directory unless `--data` and `--output` say otherwise.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError, TrainConfig, source_path
from trainer.data import hf_datasets
from trainer.data.sample import is_plain_path, is_quickstart_path
from trainer.model.model_shape import LoraShape, load_shape
from trainer.plan.gpu_specs import GPUS, GpuSpec, flops_per_real_token, predicted_tokens_per_s
from trainer.plan.memory_plan import TYPICAL_SOURCE, TYPICAL_TARGET
from trainer.plan.plan_report import MEASURED_FSDP_MFU, MEASURED_MFU, measured_mfu, unmatched_files
from trainer.report.step_meter import format_duration

PREFIX = "flan-t5-"
RECIPES = 1_000_000  # the time `trainer presets` gives: one epoch of this many typical recipes
CONTAINER_PATHS = (("/data/", "data/"), ("/outputs/", "outputs/"))  # the image's mounts -> local directories


@dataclass(frozen=True)
class Preset:
    name: str  # `xl-rtx4090`
    file_name: str  # `flan-t5-xl-rtx4090.yaml`
    text: str  # the YAML as shipped, comments included
    config: TrainConfig
    card: GpuSpec | None  # None: a CPU preset (quickstart)
    processes: int = 1  # GPUs (torchrun's --nproc_per_node)

    def trains(self) -> str:
        """What the preset trains, in words: `every weight` or `LoRA r 16, merged at the end`."""
        if self.config.adapter == "lora":
            return f"LoRA r {self.config.lora_r}, merged at the end"
        return "every weight"

    def card_text(self) -> str:
        if self.card is None:
            return "CPU"
        if self.processes > 1:
            return f"{self.processes} x {self.card.name} ({self.card.memory_gb:g} GB each)"
        return f"{self.card.name} ({self.card.memory_gb:g} GB)"

    def predicted(self) -> tuple[float, float] | None:
        """Real tokens/s on the preset's cards and the seconds of one epoch of RECIPES typical recipes (what
        `trainer plan` predicts without data: the measured MFU on the cards' bf16 rate); None for a CPU
        preset or a model whose shape cannot be had without loading it."""
        if self.card is None:
            return None
        try:
            shape = load_shape(self.config.model_name_or_path)
        except ValueError:
            return None
        src = min(self.config.max_source_length, TYPICAL_SOURCE)
        tgt = min(self.config.max_target_length, TYPICAL_TARGET)
        per_token = flops_per_real_token(shape, src, tgt, LoraShape.of(self.config))
        mfu = measured_mfu(self.config.distributed_strategy, self.processes).mfu
        tokens_per_s = self.processes * predicted_tokens_per_s(self.card, mfu, per_token)
        return tokens_per_s, RECIPES * (src + tgt) / tokens_per_s


def presets() -> list[Preset]:
    """Every preset shipped in the package, by name."""
    found = []
    for entry in sorted(importlib.resources.files("trainer").joinpath("presets").iterdir(), key=str):
        if not entry.name.endswith(".yaml"):
            continue
        stem = entry.name.removesuffix(".yaml")
        card = GPUS.get(stem.rsplit("-", 1)[-1])
        several = re.search(r"-(\d+)x-[a-z0-9]+$", stem)
        text = entry.read_text(encoding="utf-8")
        with importlib.resources.as_file(entry) as path:
            config = TrainConfig.load(path)
        processes = int(several.group(1)) if several else 1
        found.append(Preset(stem.removeprefix(PREFIX), entry.name, text, config, card, processes))
    return found


def find_preset(name: str) -> Preset:
    """The preset called `name`: its name (`xl-rtx4090`), its file's (`flan-t5-xl-rtx4090.yaml`, with or
    without `.yaml`), or the end of one name alone (`rtx4090`). Raises ConfigError naming the candidates."""
    known = presets()
    wanted = name.strip().removesuffix(".yaml").removeprefix(PREFIX)
    exact = [p for p in known if p.name == wanted]
    matches = exact or [p for p in known if p.name.endswith("-" + wanted)]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(
        f"{p.name} ({p.config.model_name_or_path}, {p.trains()}, {p.card_text()})" for p in matches
    )
    if matches:
        raise ConfigError(f"--preset {name} names {len(matches)} presets: {listed}; give the whole name")
    names = ", ".join(p.name for p in known)
    raise ConfigError(f"no preset {name!r}; the presets: {names} (`trainer presets` describes each)")


def presets_table() -> str:
    """`trainer presets`: one line per preset, its card, model, what it trains and its predicted speed."""
    rows = [("preset", "card", "model", "trains", f"predicted on the card (1 epoch of {RECIPES:,} recipes)")]
    for preset in presets():
        predicted = preset.predicted()
        speed = (
            f"{predicted[0]:,.0f} real tok/s, {format_duration(predicted[1])}"
            if predicted
            else "(a tiny model)"
        )
        rows.append(
            (preset.name, preset.card_text(), preset.config.model_name_or_path, preset.trains(), speed)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines += [
        "",
        "Predicted as `trainer plan --config PRESET --gpu-memory <card>` does without data: "
        f"{MEASURED_MFU.mfu:.1%} MFU (measured with {MEASURED_MFU.how}) on the card's bf16 rate, records of "
        f"{TYPICAL_SOURCE} + {TYPICAL_TARGET} tokens; several GPUs under fsdp at {MEASURED_FSDP_MFU.mfu:.1%} "
        f"each (measured with {MEASURED_FSDP_MFU.how}).",
        "A local config from one: trainer init --preset NAME --data 'recipes/*.csv' --output outputs/NAME",
    ]
    return "\n".join(lines)


def _local(path: str) -> str:
    """A container path of a preset as the directory under the working directory that stands for it."""
    for container, local in CONTAINER_PATHS:
        if path.startswith(container):
            return local + path.removeprefix(container)
    return path


def _replace_line(text: str, key: str, value: str, file_name: str) -> str:
    new, count = re.subn(rf"^{key}:.*$", f"{key}: {value}", text, count=1, flags=re.M)
    if count != 1:  # every shipped preset names both keys (a test checks it)
        raise ConfigError(f"preset {file_name} has no top-level {key}: line")
    return new


def write_config(preset: Preset, to: Path, data: list[str] | None, output: str | None, force: bool) -> str:
    """Write `preset` to `to` as a local config: train_files from `data` (else the preset's, a container path
    under data/), output_dir from `output` (else the preset's under outputs/), the rest as shipped, comments
    included. Returns what to say to the user. Raises ConfigError for an existing `to` without `force`."""
    if to.is_dir():  # as `cp`: the preset's file name inside it
        to = to / preset.file_name
    if to.is_dir():
        raise ConfigError(f"{to} is a directory; give --to a file name, e.g. {to / preset.file_name}")
    if to.exists() and not force:
        raise ConfigError(f"{to} exists; give another --to, or --force to replace it")
    train_files = data or [_local(source_path(e)) for e in preset.config.train_files]
    output_dir = output or _local(preset.config.output_dir)
    text = _replace_line(preset.text, "train_files", json.dumps(train_files), preset.file_name)
    text = _replace_line(text, "output_dir", json.dumps(output_dir), preset.file_name)
    header = (
        f"# Written by `trainer init --preset {preset.name}` from the preset {preset.file_name} shipped with "
        "the trainer.\n# Every key, its default and meaning: `trainer config`. Check it: "
        f"`trainer train --config {to} --dry-run`.\n"
    )
    to.parent.mkdir(parents=True, exist_ok=True)
    to.write_text(header + text, encoding="utf-8")
    TrainConfig.load(to)  # what was written loads: a bad --data or --output is said now, naming the file
    said = [
        f"wrote {to}: the preset {preset.name} ({preset.config.model_name_or_path}, {preset.trains()}, "
        f"{preset.card_text()}) with train_files {', '.join(train_files)} and output_dir {output_dir}"
    ]
    # A demo preset writes its own recipes where they are missing, as plain files under data/quickstart/ only.
    written_by_demo = [
        f for f in train_files if preset.config.make_demo_data and is_plain_path(f) and is_quickstart_path(f)
    ]
    missing = unmatched_files(
        [f for f in train_files if f not in written_by_demo and not hf_datasets.is_dataset(f)]
    )
    if missing:
        said.append(f"note: {missing}; put the recipes there or give --data")
    said.append(f"next: trainer train --config {to} --dry-run")
    return "\n".join(said)

"""Realistic generated recipes in the real dumps' formats: RecipeNLG CSV, Food.com CSV, JSONL, Parquet, Arrow.

The generator lives in Rust (the `recipe_sample` crate, beside the loader) so benchmarks can write millions of
recipes in minutes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from trainer import _loader
from trainer.config import ConfigError, TrainConfig, source_path
from trainer.data.hf_datasets import is_hub_dataset
from trainer.model.tiny_model import build_tiny_model

log = logging.getLogger(__name__)


def write_sample(out: str | Path, n: int, seed: int = 0, fmt: str | None = None) -> str:
    """Write `n` recipes generated from `seed` to `out` in the format its name says (`.csv`: RecipeNLG CSV,
    `.jsonl`, `.parquet`, `.arrow`; a `.gz`/`.zst` suffix compresses); `fmt`, if given, must agree with the
    name ("foodcom-csv" picks Food.com's layout for a `.csv`). Returns the format written.

    The same `(n, seed, format)` always gives the same bytes, and a given seed gives the same recipes in every
    format. Raises ValueError for an unknown format or file name, or a negative count, and OSError when `out`
    cannot be written.
    """
    if n < 0 or seed < 0:
        raise ValueError(f"n and seed must be >= 0, got n={n} seed={seed}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = _loader.write_sample(str(out), n, seed, fmt)
    log.debug("wrote %d %s recipes (seed %d) to %s", n, written, seed, out)
    return written


# make_demo_data writes only here (relative to the working directory, as configs/quickstart.yaml names it):
# a typo in a real config's data path must fail as a missing file, not train on generated recipes.
QUICKSTART_DIR = Path("data/quickstart")


def is_quickstart_path(path: str | Path) -> bool:
    """True for a path inside data/quickstart/ of the working directory."""
    p = Path(os.path.normpath(Path(path).expanduser().absolute()))
    base = Path(os.path.normpath(QUICKSTART_DIR.absolute()))
    return p == base or base in p.parents


def is_plain_path(train_file: str) -> bool:
    """A train_files entry naming one file: not a glob, not a Hub dataset (make_demo_data can write it)."""
    return not any(ch in train_file for ch in "*?[") and not is_hub_dataset(train_file)


def missing_demo_paths(train_files: list[str], model_dir: str) -> list[Path]:
    """The data files (plain paths, not globs or Hub datasets) and the model directory that do not exist:
    what make_demo_data would write, where they are inside data/quickstart/."""
    missing = [Path(f) for f in train_files if is_plain_path(f) and not Path(f).exists()]
    if not (Path(model_dir) / "config.json").exists():
        missing.append(Path(model_dir))
    return missing


def ensure_demo_data(
    train_files: list[str], model_dir: str, *, n: int, fmt: str | None, dry_run: bool = False
) -> list[Path]:
    """make_demo_data: write the quickstart's missing sample recipes and tiny model, only inside
    data/quickstart/ (other missing paths are left to fail as missing, with a warning saying why nothing was
    written there). A dry run writes nothing and logs what a run would write. Returns those paths."""
    written = []
    for path in missing_demo_paths(train_files, model_dir):
        what = "the tiny FLAN-T5" if path == Path(model_dir) else f"{n} sample recipes"
        if not is_quickstart_path(path):
            log.warning(
                "make_demo_data: not writing %s to %s: demo data is written only under %s/",
                what,
                path,
                QUICKSTART_DIR,
            )
            continue
        written.append(path)
        if dry_run:
            log.info("dry run: make_demo_data would write %s to %s", what, path)
            continue
        try:
            if path == Path(model_dir):
                log.info("make_demo_data: building the tiny FLAN-T5 in %s", path)
                build_tiny_model(path, seed=0)
            else:
                log.info("make_demo_data: writing %d sample recipes to %s", n, path)
                write_sample(path, n, seed=0, fmt=fmt)
        except OSError as e:  # a read-only data folder (Docker mounts ./data read-only), a full disk
            raise ConfigError(
                f"make_demo_data: cannot write {what} to {path}: {e.strerror or e}"
                + (f" ({e.filename})" if e.filename and str(e.filename) != str(path) else "")
                + "; in Docker, the CPU "
                "override's demo-data service writes them (docker-compose.cpu.yml), or `trainer data demo "
                "--config CONFIG` where the folder is writable",
                key="make_demo_data",
            ) from e
    return written


def demo_data(cfg: TrainConfig, dry_run: bool = False) -> tuple[list[Path], list[Path]]:
    """What a `make_demo_data` config trains on and is missing, and what of it was written (or, on a dry run,
    would be): `ensure_demo_data` over the config's train_files and model."""
    files = [source_path(f) for f in cfg.train_files]
    missing = missing_demo_paths(files, cfg.model_name_or_path)
    made = ensure_demo_data(
        files, cfg.model_name_or_path, n=cfg.demo_records, fmt=cfg.data_format, dry_run=dry_run
    )
    return missing, made

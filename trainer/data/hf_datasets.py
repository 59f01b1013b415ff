"""Hugging Face datasets as training data: a Hub dataset (`hf://datasets/OWNER/NAME[@REVISION]`) or a
`datasets.save_to_disk` directory, converted once to Parquet in the loader's cache directory (keyed by the
dataset's fingerprint) and read from there by the Rust loader like any Parquet file. Arrow files (`.arrow`, as
`datasets` writes them) need no conversion: the loader reads them directly.

Needs the `datasets` package (`pip install 'recipe-t5-trainer[datasets]'`), imported only when such an entry
is given. Offline (HF_HUB_OFFLINE=1, or no network), a Hub dataset is taken from the local Hugging Face cache:
the one `datasets.load_dataset` prepared, else the files `hf download --repo-type dataset` fetched."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from trainer._loader import RecipeFileError

log = logging.getLogger(__name__)

HUB_PREFIX = "hf://datasets/"
INSTALL = "pip install 'recipe-t5-trainer[datasets]' (or pip install datasets)"


def is_hub_dataset(path: str) -> bool:
    return path.startswith(HUB_PREFIX)


def is_saved_dataset(path: str) -> bool:
    """Whether `path` is a directory `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    p = Path(path)
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def is_dataset(path: str) -> bool:
    """Whether a train_files/eval_files path names a dataset to convert (rather than files to read)."""
    return is_hub_dataset(path) or is_saved_dataset(path)


def _datasets(path: str):
    try:
        import datasets
    except ImportError:
        raise RecipeFileError(
            f"{path}: reading a Hugging Face dataset needs the datasets package: {INSTALL}"
        ) from None
    return datasets


def _hub_id(path: str) -> tuple[str, str | None]:
    repo, _, revision = path.removeprefix(HUB_PREFIX).partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise RecipeFileError(f"{path}: a Hub dataset is hf://datasets/OWNER/NAME, optionally @REVISION")
    return repo, revision or None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _load_hub(path: str, split: str, name: str | None) -> Any:
    """The split of a Hub dataset: through `datasets.load_dataset` (online, or its prepared cache offline),
    else offline from the files of the Hub cache."""
    datasets = _datasets(path)
    repo, revision = _hub_id(path)
    try:
        return datasets.load_dataset(repo, name=name, split=split, revision=revision)
    except ConnectionError as unreachable:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            snapshot = snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True)
        except LocalEntryNotFoundError:
            why = "HF_HUB_OFFLINE=1" if _offline() else f"the Hub is unreachable: {unreachable}"
            raise RecipeFileError(
                f"{path}: not in the local Hugging Face cache ({why}); load it once with network access, or "
                f"fetch it with `hf download --repo-type dataset {repo}`"
            ) from None
        log.info("%s: the Hub is not reachable; using the copy in the Hugging Face cache, %s", path, snapshot)
        return datasets.load_dataset(snapshot, name=name, split=split)


def _load_saved(path: str, split: str | None) -> Any:
    """The dataset a save_to_disk directory holds: its `split` when it holds several (default train)."""
    datasets = _datasets(path)
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        split = split or "train"
        if split not in loaded:
            raise RecipeFileError(f"{path}: no split {split!r}; it has {', '.join(loaded)}")
        return loaded[split]
    if split is not None and loaded.split is not None and str(loaded.split) != split:
        raise RecipeFileError(f"{path}: holds the {loaded.split} split, not {split!r}")
    return loaded


def load(path: str, split: str | None = None, name: str | None = None) -> Any:
    """The `datasets.Dataset` a Hub id or save_to_disk directory names; one RecipeFileError line when it
    cannot be had (missing, offline and not cached, unknown split, no `datasets`)."""
    try:
        if is_hub_dataset(path):
            return _load_hub(path, split or "train", name)
        return _load_saved(path, split)
    except RecipeFileError:
        raise
    # An unknown split or subset (ValueError), a dataset that does not exist or has no data (datasets' errors
    # derive from FileNotFoundError), an unreadable directory.
    except (ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecipeFileError(f"{path}: {first}") from None


def to_parquet(path: str, split: str | None, name: str | None, cache_root: str | os.PathLike[str]) -> Path:
    """The Parquet file the loader reads for this dataset: `<cache_root>/datasets/<fingerprint>.parquet`,
    written (whole or not at all) the first time, reused while the dataset's fingerprint is the same."""
    dataset = load(path, split, name)
    dest = Path(cache_root) / "datasets" / f"{dataset._fingerprint}.parquet"
    if dest.is_file():
        log.debug("%s: reusing %s", path, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: converting %d records to Parquet once: %s", path, len(dataset), dest)
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    try:
        dataset.to_parquet(str(tmp))
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest

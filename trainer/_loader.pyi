"""Type stub of the Rust extension `trainer._loader` (see trainer/data/loader.py for the documented API).

`RecipeLoader`'s keyword options are declared once, in Rust (`recipe_core::options`); the binding exports them
as `LOADER_OPTIONS`, and tests/test_loader_api.py checks this stub against that table and the real signatures.
"""

from os import PathLike
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

class RecipeLoaderError(Exception):
    """Base class of every error the recipe loader raises."""

class RecipeFileError(RecipeLoaderError, OSError):
    """A missing, empty, unreadable or corrupt file (or tokenizer); names the path. `errno` is set when an I/O
    error caused it."""

class RecipeDataError(RecipeLoaderError, ValueError):
    """A bad record (strict mode), a bad template or bad settings; names file:line where there is one."""

class RecipeConfigError(RecipeDataError):
    """Bad loader settings or a resume state from other data or settings."""

class RecipeInternalError(RecipeLoaderError, RuntimeError):
    """A bug in the loader (a worker thread panicked), reported instead of crashing."""

class LoaderOption(TypedDict):
    name: str
    type: str
    default: Any
    doc: str

LOADER_OPTIONS: list[LoaderOption]

class RecipeLoader:
    def __init__(
        self,
        paths: list[str],
        tokenizer: str | PathLike[str],
        *,
        task: str = "ingredients-to-recipe",
        source_template: str | None = None,
        target_template: str | None = None,
        max_source_length: int = 512,
        max_target_length: int = 512,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        packing: bool = False,
        packed_source_length: int | None = None,
        packed_target_length: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        split: str = "all",
        eval_fraction: float = 0.0,
        strict: bool = False,
        dedup: bool = False,
        data_format: str | None = None,
        columns: dict[str, str] | None = None,
        weights: list[float] | None = None,
        num_threads: int | None = None,
        prefetch: int = 8,
        cache_dir: str | PathLike[str] | None = None,
    ) -> None: ...
    def next_batch(self) -> dict[str, npt.NDArray[np.int64]] | None: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    @property
    def epoch(self) -> int: ...
    def state(self) -> tuple[int, int, str]: ...
    def load_state(self, epoch: int, batches_consumed: int, fingerprint: str) -> None: ...
    def stats_json(self) -> str: ...
    def lengths(self) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.uint16]]: ...
    def sample_records(self, n: int, seed: int) -> list[dict[str, Any]]: ...

def write_sample(path: str | PathLike[str], n: int, seed: int = 0, fmt: str | None = None) -> str: ...
def cache_root(cache_dir: str | PathLike[str] | None = None) -> str: ...

class RecipeRenderer:
    """The training loader's rendering (and, with a tokenizer, tokenization) of prompts and references."""

    def __init__(
        self,
        *,
        task: str = "ingredients-to-recipe",
        source_template: str | None = None,
        target_template: str | None = None,
        tokenizer: str | PathLike[str] | None = None,
        max_source_length: int = 512,
        max_target_length: int = 512,
    ) -> None: ...
    @property
    def source_template(self) -> str: ...
    @property
    def target_template(self) -> str: ...
    def render(
        self,
        *,
        id: str = "cli:1",
        title: str = "",
        ingredients: list[str] = ...,
        directions: list[str] = ...,
        ner: list[str] | None = None,
    ) -> dict[str, Any]: ...
    def read(
        self,
        paths: list[str],
        *,
        data_format: str | None = None,
        split: str = "all",
        eval_fraction: float = 0.0,
        columns: dict[str, str] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, int], list[str]]: ...

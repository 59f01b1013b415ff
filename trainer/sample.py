"""Realistic generated recipes in the real dumps' formats (RecipeNLG CSV, Food.com CSV, JSONL).

The generator lives in Rust (`recipe_core::sample`) so benchmarks can write millions of recipes in minutes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trainer import _loader
from trainer.config import DATA_FORMATS

log = logging.getLogger(__name__)


def write_sample(out: str | Path, n: int, seed: int = 0, fmt: str = DATA_FORMATS[0]) -> None:
    """Write `n` recipes generated from `seed` to `out` in `fmt`; a `.gz`/`.zst` suffix compresses.

    The same `(n, seed, fmt)` always gives the same bytes, and a given seed gives the same recipes in every
    format. Raises ValueError for an unknown format or a negative count, OSError when `out` cannot be written.
    """
    if fmt not in DATA_FORMATS:
        raise ValueError(f"unknown sample format {fmt!r}; expected one of {', '.join(DATA_FORMATS)}")
    if n < 0 or seed < 0:
        raise ValueError(f"n and seed must be >= 0, got n={n} seed={seed}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _loader.write_sample(str(out), n, seed, fmt)
    log.debug("wrote %d %s recipes (seed %d) to %s", n, fmt, seed, out)

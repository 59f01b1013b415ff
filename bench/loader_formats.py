"""Benchmark: the loader's index pass and a shuffled epoch on the same recipes as CSV, JSONL, Parquet, Arrow.

The recipes are written once per format by `trainer data sample` with the same seed (the same records: the
loader's tests check that every format yields the same token ids). Each measurement runs in its own process
with its own cache directory (the first open indexes, and for Parquet decodes the copy; the second open reuses
the cached index), formats alternate within each repeat, and the table shows the median of the repeats with
their spread (min-max), which is the noise of this machine.

usage: python bench/loader_formats.py --tokenizer DIR_OR_TOKENIZER_JSON [--n 100000] [--repeats 3]
    [--formats csv,parquet] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUFFIX = {"csv": ".csv", "jsonl": ".jsonl", "parquet": ".parquet", "arrow": ".arrow"}


def measure(path: str, tokenizer: str, batch_size: int, cache: str) -> dict[str, float]:
    """Index pass (first open), one shuffled epoch, and a second open with the cached index."""
    from trainer.data.loader import RecipeStream

    options = {"batch_size": batch_size, "shuffle": True, "seed": 0, "cache_dir": cache}
    t0 = time.perf_counter()
    stream = RecipeStream(path, tokenizer, **options)
    index_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    records = sum(len(b["input_ids"]) for b in stream)
    epoch_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    RecipeStream(path, tokenizer, **options)
    cached_s = time.perf_counter() - t2
    return {
        "records": records,
        "index_s": index_s,
        "epoch_s": epoch_s,
        "cached_open_s": cached_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="csv,parquet")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--one", nargs=2, metavar=("DATA", "CACHE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:  # one measurement in its own process, so peak RSS is its own
        print(json.dumps(measure(a.one[0], a.tokenizer, a.batch_size, a.one[1])))
        return
    from trainer.data.sample import write_sample

    formats = a.formats.split(",")
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in formats}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for f in formats:
            files[f] = Path(tmp) / f"recipes{SUFFIX[f]}"
            write_sample(files[f], a.n, seed=0)
        for r in range(a.repeats):
            for f in formats:
                cache = Path(tmp) / f"cache-{f}-{r}"
                cmd = [
                    sys.executable,
                    __file__,
                    "--tokenizer",
                    a.tokenizer,
                    "--batch-size",
                    str(a.batch_size),
                ]
                cmd += ["--one", str(files[f]), str(cache)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[f].append(json.loads(out))
                # The index cache of an uncompressed file is written beside it: removed for the next repeat.
                for idx in Path(tmp).glob(".recipes*.rlidx"):
                    idx.unlink()
        sizes = {f: files[f].stat().st_size / 2**20 for f in formats}
    print(
        f"data: {a.n} generated recipes (trainer data sample --seed 0), batch size {a.batch_size}, shuffled; "
        f"{a.repeats} runs per format, formats alternating; median (min-max)"
    )
    print(
        f"{'format':8} {'file MiB':>9} {'index pass s':>20} {'index recipes/s':>16} {'epoch s':>20} "
        f"{'epoch recipes/s':>16} {'cached open s':>14} {'peak RSS MiB':>13}"
    )
    for f in formats:
        rs = runs[f]
        n = rs[0]["records"]
        print(
            f"{f:8} {sizes[f]:>9.1f} {spread([r['index_s'] for r in rs], '.2f'):>20} "
            f"{statistics.median(n / r['index_s'] for r in rs):>16.0f} "
            f"{spread([r['epoch_s'] for r in rs], '.2f'):>20} "
            f"{statistics.median(n / r['epoch_s'] for r in rs):>16.0f} "
            f"{statistics.median(r['cached_open_s'] for r in rs):>14.2f} "
            f"{max(r['peak_rss_mib'] for r in rs):>13.0f}"
        )


if __name__ == "__main__":
    main()

"""Benchmark: the Rust RecipeStream against the Python pipeline a user would write.

The peer reads the CSV with csv.DictReader, renders the same texts, calls the HF fast tokenizer on batches and
pads to the longest row like DataCollatorForSeq2Seq. Same data, same tokenizer, same batch size, one run each.

usage: python bench/loader.py --tokenizer DIR_OR_TOKENIZER_JSON [--n 100000] [--batch-size 8] [--data PATH]
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def peer(path: Path, tokenizer: str, batch_size: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    tok_dir = tokenizer if Path(tokenizer).is_dir() else str(Path(tokenizer).parent)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    records = batches = 0

    def flush(buf: list[dict]) -> None:
        src = [
            f"Write a recipe with these ingredients: {'; '.join(json.loads(r['ingredients']))}" for r in buf
        ]
        tgt = [
            f"title: {r['title']} | ingredients: {'; '.join(json.loads(r['ingredients']))} | directions: "
            + " ".join(f"{i}. {s}" for i, s in enumerate(json.loads(r["directions"]), 1))
            for r in buf
        ]
        enc = tok(src, truncation=True, max_length=512)["input_ids"]
        lab = tok(tgt, truncation=True, max_length=512)["input_ids"]
        ls, lt = max(map(len, enc)), max(map(len, lab))
        ids = np.zeros((len(buf), ls), np.int64)
        mask = np.zeros((len(buf), ls), np.int64)
        labels = np.full((len(buf), lt), -100, np.int64)
        for i, (e, t) in enumerate(zip(enc, lab, strict=True)):
            ids[i, : len(e)] = e
            mask[i, : len(e)] = 1
            labels[i, : len(t)] = t

    with open(path, newline="", encoding="utf-8") as f:
        buf: list[dict] = []
        for row in csv.DictReader(f):
            buf.append(row)
            if len(buf) == batch_size:
                flush(buf)
                records += len(buf)
                batches += 1
                buf = []
        if buf:
            flush(buf)
            records += len(buf)
            batches += 1
    dt = time.perf_counter() - t0
    return {"records": records, "batches": batches, "seconds": dt}


def ours(path: Path, tokenizer: str, batch_size: int, cache: str) -> dict[str, float]:
    from trainer.data.loader import RecipeStream

    t0 = time.perf_counter()
    s = RecipeStream(path, tokenizer, batch_size=batch_size, cache_dir=cache)
    t_index = time.perf_counter() - t0
    t1 = time.perf_counter()
    records = batches = 0
    for b in s:
        records += len(b["input_ids"])
        batches += 1
    dt = time.perf_counter() - t1
    t2 = time.perf_counter()
    RecipeStream(path, tokenizer, batch_size=batch_size, cache_dir=cache)
    t_cached = time.perf_counter() - t2
    return {
        "records": records,
        "batches": batches,
        "seconds": dt,
        "index_s": t_index,
        "cached_open_s": t_cached,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--data")
    ap.add_argument("--which", choices=["ours", "peer"])
    ap.add_argument("--cache")
    a = ap.parse_args()
    if a.which:  # one side in its own process, so peak RSS is its own
        fn = ours if a.which == "ours" else peer
        args = (Path(a.data), a.tokenizer, a.batch_size) + ((a.cache,) if a.which == "ours" else ())
        res = fn(*args)
        res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(a.data) if a.data else Path(tmp) / "recipes.csv"
        if not a.data:
            from trainer.data.sample import write_sample

            write_sample(data, a.n, seed=0, fmt="recipenlg-csv")
        out = {}
        for which in ["peer", "ours"]:
            cmd = [
                sys.executable,
                __file__,
                "--which",
                which,
                "--tokenizer",
                a.tokenizer,
                "--data",
                str(data),
            ]
            cmd += ["--batch-size", str(a.batch_size), "--cache", str(Path(tmp) / "cache")]
            out[which] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    p, o = out["peer"], out["ours"]
    print(f"data: {p['records']} recipes (RecipeNLG CSV), batch size {a.batch_size}, longest padding")
    print(f"{'':30} {'recipes/s':>10} {'batches/s':>10} {'peak RSS MiB':>13}")
    first = dict(o, seconds=o["seconds"] + o["index_s"])
    rows = [("python (HF fast tok)", p), ("rust_loader, epoch", o), ("rust_loader, 1st epoch+index", first)]
    for name, r in rows:
        print(
            f"{name:30} {r['records'] / r['seconds']:>10.0f} {r['batches'] / r['seconds']:>10.0f} "
            f"{r['peak_rss_mib']:>13.0f}"
        )
    rate = p["records"] / p["seconds"]
    print(
        f"ratio (ours / python): {o['records'] / o['seconds'] / rate:.2f}x per epoch, "
        f"{first['records'] / first['seconds'] / rate:.2f}x for a first epoch including the index pass"
    )
    print(
        f"our first-pass index: {o['index_s']:.1f} s ({o['records'] / o['index_s']:.0f} recipes/s); "
        f"reopen with cached index: {o['cached_open_s']:.2f} s"
    )


if __name__ == "__main__":
    main()

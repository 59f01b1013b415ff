"""Real-token share of the loader's batching modes on generated recipes: random batches of 8 rows (what
Seq2SeqTrainer does), `max_tokens` length bucketing, and packed rows (`packing=True`), with the packed shape
and the time to open the stream and plan one epoch. CPU only.

usage: python bench/packing_share.py --tokenizer DIR_OR_TOKENIZER_JSON [--n 200000] [--max-tokens 16384 32768]
       [--max-source-length 512] [--max-target-length 512] [--data PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--max-source-length", type=int, default=512)
    ap.add_argument("--max-target-length", type=int, default=512)
    ap.add_argument("--data", help="recipe file to use instead of generated ones")
    a = ap.parse_args()

    from trainer.data.loader import RecipeStream
    from trainer.data.sample import write_sample

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(a.data) if a.data else Path(tmp) / "recipes.csv"
        if not a.data:
            write_sample(data, a.n, seed=0)
        common = dict(
            shuffle=True,
            max_source_length=a.max_source_length,
            max_target_length=a.max_target_length,
            cache_dir=Path(tmp) / "cache",
        )

        def report(label: str, **kw) -> None:
            t = time.perf_counter()
            st = RecipeStream(data, a.tokenizer, **common, **kw).stats()  # stats() plans the epoch
            shape = st["packed_shape"]
            shown = f"{shape['rows']} rows x ({shape['source_len']} + {shape['target_len']})" if shape else ""
            print(
                f"{label:<28} {st['real_token_share']:>8.4f} {st['batches_per_epoch']:>9} "
                f"{time.perf_counter() - t:>7.1f}  {shown}"
            )

        print(f"{data.name}: max lengths {a.max_source_length}/{a.max_target_length}")
        print(f"{'batching':<28} {'share':>8} {'batches':>9} {'open s':>7}  packed shape")
        report("batch_size=8 (random)", batch_size=8)
        for m in a.max_tokens:
            report(f"max_tokens={m} (bucketed)", max_tokens=m)
            report(f"max_tokens={m} packing", max_tokens=m, packing=True)


if __name__ == "__main__":
    main()

"""What one train-log row costs to append, with and without an fsync per row (CPU, any filesystem).

    python3 bench/log_append.py [--dir /path/on/the/output/disk] [--rows 300]

Prints microseconds per row for `trainer.infra.jsonl.append_jsonl_row` alone and followed by `fsync_file`. The
trainer appends one row per optimizer step and syncs the log only when it saves a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.infra.jsonl import append_jsonl_row, fsync_file  # noqa: E402

ROW = {
    "step": 1,
    "epoch": 0.001,
    "loss": 2.3456,
    "learning_rate": 1e-4,
    "grad_norm": 0.75,
    "time": 1.7e9,
    "samples": 160,
    "source_tokens": 30000,
    "target_tokens": 30000,
    "padded_tokens": 65536,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)"
    )
    parser.add_argument("--rows", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        for fsync in (False, True):
            path = Path(where) / f"log-{fsync}.jsonl"
            start = time.perf_counter()
            for step in range(args.rows):
                append_jsonl_row(path, dict(ROW, step=step))
                if fsync:
                    fsync_file(path)
            per_row = (time.perf_counter() - start) / args.rows
            print(f"{'append + fsync' if fsync else 'append'}: {per_row * 1e6:,.1f} us per row in {where}")


if __name__ == "__main__":
    main()

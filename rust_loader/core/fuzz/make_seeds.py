"""Writes the fuzz targets' seed inputs (one small valid file of each format and compression) into corpus/.

Run once from this directory with the project's environment: `../../../.venv/bin/python make_seeds.py`. The
corpus committed beside it is these seeds and what `cargo fuzz run` then added, minimised by cargo fuzz cmin.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import zstandard

HERE = Path(__file__).parent
NAMES = [
    "data.csv",
    "data.jsonl",
    "data.parquet",
    "data.arrow",
    "data.csv.gz",
    "data.jsonl.gz",
    "data.csv.zst",
    "data.jsonl.zst",
    "data.parquet.gz",
    "data.arrow.zst",
]  # the first entries of harness.rs's FILE_NAMES

RECIPES = [
    {
        "title": "Toast",
        "ingredients": '["bread", "butter"]',
        "directions": '["Toast the bread.", "Butter it."]',
        "NER": '["bread", "butter"]',
    },
    {
        "title": "Tea \u00e9t\u00e9",
        "ingredients": '["tea", "water"]',
        "directions": '["Boil, then steep."]',
        "NER": '["tea"]',
    },
    {"title": "", "ingredients": "[]", "directions": '["Nothing."]', "NER": "[]"},
]
FOODCOM = [
    {
        "name": "Soup",
        "id": "1",
        "minutes": "5",
        "steps": "['heat it']",
        "ingredients": "['stock']",
        "description": "warm",
    }
]
PAIRS = [{"question": "What is 2+2?", "answer": "4"}, {"source": "translate: hi", "target": "salut"}]


def csv_bytes(rows: list[dict]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def table_bytes(rows: list[dict], kind: str) -> bytes:
    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO()
    if kind == "parquet":
        pq.write_table(table, sink)
    elif kind == "feather":
        feather.write_feather(table, sink, compression="uncompressed")
    else:  # an IPC stream, as `datasets` writes it
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    return sink.getvalue()


def main() -> None:
    seeds = {
        ("data.csv", 0): csv_bytes(RECIPES),
        ("data.csv", 0x80): csv_bytes(FOODCOM),
        ("data.csv", 1): csv_bytes(PAIRS[:1]),
        ("data.jsonl", 0): jsonl_bytes(RECIPES),
        ("data.jsonl", 1): jsonl_bytes(PAIRS),
        ("data.parquet", 0): table_bytes(RECIPES, "parquet"),
        ("data.parquet", 1): table_bytes(PAIRS[:1], "parquet"),
        ("data.arrow", 0): table_bytes(RECIPES, "feather"),
        ("data.arrow", 2): table_bytes(FOODCOM, "stream"),
        ("data.csv.gz", 0): gzip.compress(csv_bytes(RECIPES)),
        ("data.jsonl.gz", 0): gzip.compress(jsonl_bytes(RECIPES)),
        ("data.csv.zst", 0): zstandard.compress(csv_bytes(RECIPES)),
        ("data.jsonl.zst", 1): zstandard.compress(jsonl_bytes(PAIRS)),
        ("data.parquet.gz", 0): gzip.compress(table_bytes(RECIPES, "parquet")),
        ("data.arrow.zst", 0): zstandard.compress(table_bytes(RECIPES, "stream")),
    }
    out = HERE / "corpus" / "read_file"
    out.mkdir(parents=True, exist_ok=True)
    for (name, flags), body in seeds.items():
        choice = NAMES.index(name) | (flags & 0x80) | ((flags & 0x7F) << 4)
        (out / f"seed-{name}-{flags:02x}").write_bytes(bytes([choice]) + body)


if __name__ == "__main__":
    main()

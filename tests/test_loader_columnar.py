"""Parquet and Arrow files, column mapping and mixing weights through the Python API, with files written by
pyarrow (as pandas, polars and `datasets` users have them), and the training config that names them."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from epoch_rows import rows

from trainer.config import ConfigError, DataSource, TrainConfig
from trainer.data.loader import RecipeConfigError, RecipeDataError, RecipeStream, mixture_summary, stream_for
from trainer.data.sample import write_sample


def csv_records(path: Path) -> list[dict]:
    """A RecipeNLG CSV's records as a user's script reads them: list columns are JSON in strings."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def table(records: list[dict], lists: bool = True) -> pa.Table:
    """The records as pyarrow holds them: lists as list<string> (`lists`), or kept as JSON strings (a CSV read
    with pandas and saved to Parquet)."""
    cols = {"title": [r["title"] for r in records]}
    for name in ("ingredients", "directions", "NER"):
        cols[name] = [json.loads(r[name]) if lists else r[name] for r in records]
    cols["source"] = [r["source"] for r in records]  # RecipeNLG's: where the recipe was gathered
    return pa.table(cols)


@pytest.fixture(scope="module")
def recipenlg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("columnar") / "recipes.csv"
    write_sample(path, 400, seed=11)
    return path


def test_parquet_and_arrow_read_as_the_csv_records(tmp_path, tiny_model_dir, recipenlg):
    records = csv_records(recipenlg)
    want = rows(RecipeStream(recipenlg, tiny_model_dir, batch_size=16, cache_dir=tmp_path / "c"))
    assert len(want) == 400
    lists = tmp_path / "lists.parquet"
    pq.write_table(table(records), lists, row_group_size=128)
    strings = tmp_path / "strings.parquet"
    pq.write_table(table(records, lists=False), strings, compression="zstd")
    feathered = tmp_path / "recipes.feather"  # Feather v2: an Arrow IPC file, LZ4-compressed by default
    feather.write_feather(table(records), feathered)
    stream_file = tmp_path / "stream.arrow"  # an Arrow IPC stream, as datasets writes its cache files
    t = table(records)
    with pa.ipc.new_stream(stream_file, t.schema) as w:
        for batch in t.to_batches(max_chunksize=100):
            w.write_batch(batch)
    for path in (lists, strings, feathered, stream_file):
        got = rows(RecipeStream(path, tiny_model_dir, batch_size=16, cache_dir=tmp_path / "c"))
        assert got == want, path.name


def test_parquet_resumes_exactly_and_ranks_partition_it(tmp_path, tiny_model_dir, recipenlg):
    path = tmp_path / "r.parquet"
    pq.write_table(table(csv_records(recipenlg)), path, row_group_size=100)
    opts = {"max_tokens": 1200, "shuffle": True, "seed": 5, "cache_dir": tmp_path / "c"}
    full = list(RecipeStream(path, tiny_model_dir, **opts))
    stream = RecipeStream(path, tiny_model_dir, **opts)
    it = iter(stream)
    for _ in range(len(full) // 2):
        next(it)
    state = stream.state_dict()
    resumed = RecipeStream(path, tiny_model_dir, **opts)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - len(full) // 2
    for a, b in zip(rest, full[len(full) // 2 :], strict=True):
        assert all((a[k] == b[k]).all() for k in a)
    seen: list[tuple] = []
    for rank in range(3):
        shard = RecipeStream(path, tiny_model_dir, **opts, rank=rank, world_size=3)
        seen += [tuple(map(tuple, r)) for r in rows(shard)]
    assert len(seen) == len(set(seen))  # no record on two ranks
    everything = {tuple(map(tuple, r)) for r in rows(RecipeStream(path, tiny_model_dir, batch_size=8))}
    assert set(seen) <= everything and len(everything) - len(seen) < 3 * 40


def test_a_changed_parquet_file_is_read_again_and_its_old_position_refused(
    tmp_path, tiny_model_dir, recipenlg
):
    records = csv_records(recipenlg)
    path = tmp_path / "r.parquet"
    pq.write_table(table(records[:200]), path)
    old = RecipeStream(path, tiny_model_dir, batch_size=8, cache_dir=tmp_path / "c")
    state = old.state_dict()
    pq.write_table(table(records[200:]), path)
    new = RecipeStream(path, tiny_model_dir, batch_size=8, cache_dir=tmp_path / "c")
    assert new.stats()["index_cached"] == [False]
    fresh = tmp_path / "fresh.parquet"
    pq.write_table(table(records[200:]), fresh)
    assert rows(new) == rows(RecipeStream(fresh, tiny_model_dir, batch_size=8, cache_dir=tmp_path / "c"))
    with pytest.raises(RecipeConfigError, match="cannot resume"):
        new.load_state_dict(state)


def test_a_bad_row_is_counted_or_named(tmp_path, tiny_model_dir, recipenlg):
    records = csv_records(recipenlg)[:30]
    t = table(records)
    ingredients = t.column("ingredients").to_pylist()
    ingredients[4] = None
    t = t.set_column(1, "ingredients", pa.array(ingredients))
    path = tmp_path / "bad.parquet"
    pq.write_table(t, path)
    stream = RecipeStream(path, tiny_model_dir, batch_size=8)
    st = stream.stats()
    assert st["records"] == 29 and st["skipped"] == {"missing_field": 1}
    assert st["examples"] == [f"{path}:row 4: missing_field (`ingredients` is null)"]
    with pytest.raises(RecipeDataError) as e:
        RecipeStream(path, tiny_model_dir, batch_size=8, strict=True)
    assert str(e.value) == f"{path}:row 4: missing_field (`ingredients` is null)"


def test_pairs_in_a_csv_are_read_as_the_same_pairs_in_jsonl(tmp_path, tiny_model_dir):
    """A summarization-style CSV (Hugging Face's text_column/summary_column as `columns`), and one whose
    header says input/output: the same batches as the pairs in JSONL; a record with an empty target is
    counted."""
    pairs = [
        {"article": f"Write a recipe with: {i} eggs, flour", "summary": f"Mix {i} eggs. Bake."}
        for i in range(40)
    ]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"source": p["article"], "target": p["summary"]}) + "\n" for p in pairs)
    )
    want = rows(RecipeStream(jsonl, tiny_model_dir, batch_size=8, cache_dir=tmp_path / "c"))
    mapped = tmp_path / "articles.csv"
    with mapped.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["article", "summary"])
        writer.writeheader()
        writer.writerows(pairs)
    columns = {"source": "article", "target": "summary"}
    stream = RecipeStream(mapped, tiny_model_dir, batch_size=8, columns=columns, cache_dir=tmp_path / "c")
    assert rows(stream) == want
    by_header = tmp_path / "io.csv"
    with by_header.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["input", "output"])
        writer.writerows([(p["article"], p["summary"]) for p in pairs] + [("no target", "")])
    stream = RecipeStream(by_header, tiny_model_dir, batch_size=8, cache_dir=tmp_path / "c")
    assert rows(stream) == want and stream.stats()["skipped"] == {"empty_target": 1}


def test_columns_map_fields_and_a_missing_one_is_one_line(tmp_path, tiny_model_dir, recipenlg):
    records = csv_records(recipenlg)[:50]
    want = rows(RecipeStream(recipenlg, tiny_model_dir, batch_size=8, cache_dir=tmp_path / "c"))[:50]
    t = table(records).rename_columns(["name", "ingr", "steps", "tags", "source"])
    path = tmp_path / "renamed.parquet"
    pq.write_table(t, path)
    jsonl = tmp_path / "renamed.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in t.to_pylist()))
    mapping = {"title": "name", "ingredients": "ingr", "directions": "steps", "ner": "tags"}
    for p in (path, jsonl):
        got = rows(RecipeStream(p, tiny_model_dir, batch_size=8, columns=mapping, cache_dir=tmp_path / "c"))
        assert got == want, p.name
    # Through the config key, as `trainer data inspect` reads it: a missing column is one line.
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ncolumns: {{ingredients: ingredient_list}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "data", "inspect", str(path), "--config", str(cfg)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"trainer: data error: {path}: missing column `ingredient_list` (ingredients, from `columns`); "
        "the file has: `name`, `ingr`, `steps`, `tags`, `source`"
    )


def test_train_files_entries_and_their_checks():
    cfg = TrainConfig.from_dict(
        {"train_files": ["a.csv", {"path": "b.parquet", "weight": 3}], "columns": {"title": "name"}}
    )
    assert cfg.train_files == ["a.csv", DataSource("b.parquet", weight=3.0)]
    assert cfg.columns == {"title": "name"}
    assert str(cfg.train_files[1]) == "b.parquet (weight 3)"
    with pytest.raises(ConfigError, match=r"unknown key 'wieght'.*\(keys: path, weight, split, name\)"):
        TrainConfig.from_dict({"train_files": [{"path": "b.parquet", "wieght": 3}]})
    with pytest.raises(ConfigError, match="needs 'path'"):
        TrainConfig.from_dict({"train_files": [{"weight": 3}]})
    with pytest.raises(ConfigError, match="weight of b.parquet must be a number >= 0"):
        TrainConfig.from_dict({"train_files": [{"path": "b.parquet", "weight": -1}]})
    with pytest.raises(ConfigError, match="evaluated once each"):
        TrainConfig.from_dict({"eval_files": [{"path": "e.csv", "weight": 2}]})


def write_parts(tmp_path: Path, recipenlg: Path) -> tuple[Path, Path]:
    records = csv_records(recipenlg)
    big = tmp_path / "big.csv"
    with open(big, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records[:300])
    small = tmp_path / "small.parquet"
    pq.write_table(table(records[300:]), small)
    return big, small


def test_weights_draw_each_source_in_proportion_on_any_number_of_ranks(tmp_path, tiny_model_dir, recipenlg):
    big, small = write_parts(tmp_path, recipenlg)
    cfg = TrainConfig(
        model_name_or_path=str(tiny_model_dir),
        train_files=[str(big), DataSource(str(small), weight=2.5)],
        per_device_train_batch_size=4,
        eval_fraction=0.1,
        seed=3,
    )
    tok = tiny_model_dir / "tokenizer.json"
    train = stream_for(cfg, tok, "train")
    st = train.stats()
    held_out = stream_for(cfg, tok, "eval").stats()
    counts = [(s["path"], s["weight"], s["records"], s["drawn"]) for s in st["sources"]]
    n_big, n_small = counts[0][2], counts[1][2]
    assert n_big + n_small + held_out["records"] == 400
    assert counts == [(str(big), 1.0, n_big, n_big), (str(small), 2.5, n_small, round(2.5 * n_small))]
    assert st["epoch_records"] == n_big + round(2.5 * n_small)
    assert mixture_summary(st).startswith(f"each epoch draws {st['epoch_records']:,} records: {big} ")
    # The plan's and the report's token lengths are the mixture's.
    assert len(train.lengths()[0]) == st["epoch_records"]
    epoch = list(train)
    assert sum(len(b["input_ids"]) for b in epoch) == st["epoch_records"]
    # The same draw for any world size: rank r reads batches r, r + W, ... of the one-process epoch.
    for w in (2, 3):
        for rank in range(w):
            mine = list(stream_for(cfg, tok, "train", rank=rank, world_size=w))
            assert len(mine) == len(epoch) // w
            for k, b in enumerate(mine):
                assert (b["labels"] == epoch[rank + w * k]["labels"]).all()
    # Resume mid-epoch is exact.
    s = stream_for(cfg, tok, "train")
    it = iter(s)
    for _ in range(7):
        next(it)
    resumed = stream_for(cfg, tok, "train")
    resumed.load_state_dict(s.state_dict())
    assert (next(iter(resumed))["labels"] == epoch[7]["labels"]).all()


def test_a_dry_run_logs_what_each_source_contributes(tmp_path, tiny_model_dir, recipenlg):
    big, small = write_parts(tmp_path, recipenlg)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model_name_or_path: {tiny_model_dir}\n"
        f"train_files: [{big}, {{path: {small}, weight: 0.5}}]\n"
        "per_device_train_batch_size: 4\neval_fraction: 0.0\n"
        f"output_dir: {tmp_path / 'out'}\nreport_to: none\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(cfg), "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        f"data: each epoch draws 350 records: {big} 300 of 300 records (weight 1, 85.7%); {small} 50 of 100 "
        "records (weight 0.5, 14.3%)"
    ) in proc.stderr
    assert "(1.00 epochs of 88 loader batches, 350 records each)" in proc.stderr

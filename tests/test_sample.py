"""`trainer data sample`: generated recipes in the real dumps' formats, read back with standard parsers."""

from __future__ import annotations

import ast
import csv
import gzip
import io
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from trainer.data.loader import RecipeStream
from trainer.data.sample import write_sample

RECIPENLG_HEADER = ["", "title", "ingredients", "directions", "link", "source", "NER"]
FOODCOM_HEADER = [
    "name",
    "id",
    "minutes",
    "contributor_id",
    "submitted",
    "tags",
    "nutrition",
    "n_steps",
    "steps",
    "description",
    "ingredients",
    "n_ingredients",
]
QUANTITY = re.compile(r"^(\d|[½⅓⅔¼¾⅛])")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "data", "sample", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def read_text(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    elif path.suffix == ".zst":
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    return raw.decode("utf-8")


def recipes_from(path: Path, fmt: str) -> list[dict]:
    """Parse a sample file the way a user of the real dump would, into title/ingredients/directions."""
    text = read_text(path)
    if fmt == "jsonl":
        return [json.loads(line) for line in text.splitlines()]
    rows = list(csv.reader(io.StringIO(text, newline="")))
    header, body = rows[0], rows[1:]
    if fmt == "recipenlg-csv":
        assert header == RECIPENLG_HEADER
        out = []
        for i, row in enumerate(body):
            assert len(row) == len(header)
            assert row[0] == str(i)
            assert row[5] in ("Gathered", "Recipes1M")
            out.append(
                {
                    "title": row[1],
                    "ingredients": json.loads(row[2]),
                    "directions": json.loads(row[3]),
                    "NER": json.loads(row[6]),
                }
            )
        return out
    assert header == FOODCOM_HEADER
    out = []
    for row in body:
        rec = dict(zip(header, row, strict=True))
        steps = ast.literal_eval(rec["steps"])
        ingredients = ast.literal_eval(rec["ingredients"])
        assert len(steps) == int(rec["n_steps"])
        assert len(ingredients) == int(rec["n_ingredients"])
        assert all(isinstance(t, str) for t in ast.literal_eval(rec["tags"]))
        nutrition = ast.literal_eval(rec["nutrition"])
        assert len(nutrition) == 7 and all(isinstance(x, float) for x in nutrition)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", rec["submitted"])
        assert int(rec["id"]) > 0 and int(rec["minutes"]) > 0 and int(rec["contributor_id"]) > 0
        out.append({"title": rec["name"], "ingredients": ingredients, "directions": steps})
    return out


@pytest.mark.parametrize(
    ("fmt", "name"),
    [
        ("recipenlg-csv", "full_dataset.csv"),
        ("foodcom-csv", "RAW_recipes.csv"),
        ("jsonl", "recipes.jsonl"),
        ("recipenlg-csv", "full_dataset.csv.gz"),
        ("foodcom-csv", "RAW_recipes.csv.zst"),
        ("jsonl", "recipes.jsonl.gz"),
        ("jsonl", "recipes.jsonl.zst"),
    ],
)
def test_cli_writes_each_format_readable_by_standard_parsers(tmp_path: Path, fmt: str, name: str) -> None:
    out = tmp_path / "nested" / "dir" / name
    proc = run_cli("--out", str(out), "--n", "200", "--seed", "4", "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 200 recipes" in proc.stdout
    recipes = recipes_from(out, fmt)
    assert len(recipes) == 200
    for r in recipes:
        assert r["title"].strip()
        assert 5 <= len(r["ingredients"]) <= 20
        assert len(r["directions"]) >= 3
        assert all(isinstance(x, str) and x for x in r["ingredients"] + r["directions"])
    # Compressed and plain files hold the same text.
    if out.suffix in (".gz", ".zst"):
        plain = tmp_path / out.stem
        write_sample(plain, 200, seed=4, fmt=fmt)
        assert read_text(out) == plain.read_bytes().decode("utf-8")


def test_same_seed_same_bytes_other_seed_other_recipes(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "c.csv"
    write_sample(a, 300, seed=9)
    write_sample(b, 300, seed=9)
    write_sample(c, 300, seed=10)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_a_seed_gives_the_same_recipes_in_every_format(tmp_path: Path) -> None:
    write_sample(tmp_path / "r.csv", 50, seed=5, fmt="recipenlg-csv")
    write_sample(tmp_path / "r.jsonl", 50, seed=5, fmt="jsonl")
    write_sample(tmp_path / "f.csv", 50, seed=5, fmt="foodcom-csv")
    nlg = recipes_from(tmp_path / "r.csv", "recipenlg-csv")
    jl = recipes_from(tmp_path / "r.jsonl", "jsonl")
    food = recipes_from(tmp_path / "f.csv", "foodcom-csv")
    assert nlg == jl
    # Food.com keeps the same recipe as bare ingredient names (RecipeNLG's NER) and lower-case steps.
    assert [f["ingredients"] for f in food] == [r["NER"] for r in nlg]
    assert [len(f["directions"]) for f in food] == [len(r["directions"]) for r in nlg]


def test_content_looks_like_recipes(sample_jsonl: Path, sample_csv: Path) -> None:
    recipes = recipes_from(sample_csv, "recipenlg-csv") + recipes_from(sample_jsonl, "jsonl")
    lines = [line for r in recipes for line in r["ingredients"]]
    text = "\n".join(r["title"] + "\n" + "\n".join(r["ingredients"] + r["directions"]) for r in recipes)
    # Most ingredient lines start with a quantity; unicode and ASCII fractions, units and °F all occur.
    assert sum(bool(QUANTITY.match(line)) for line in lines) > 0.8 * len(lines)
    for needle in ["½", "1/2", " cup", "teaspoon", "°F", "Preheat oven", "minutes"]:
        assert needle in text, needle
    for r in recipes:
        # NER holds the bare names of the ingredient lines, one each.
        assert len(r["NER"]) == len(r["ingredients"])
        assert all(name in line for name, line in zip(r["NER"], r["ingredients"], strict=True))
    steps = [len(r["directions"]) for r in recipes]
    assert min(steps) >= 3 and 5 <= statistics.median(steps) <= 10
    assert 8 <= statistics.median(len(r["ingredients"]) for r in recipes) <= 13
    words = {w.lower() for w in re.findall(r"[A-Za-zÀ-ÿ]+", text)}
    assert len(words) > 1000


def test_long_outliers_and_vocabulary_tail(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    write_sample(path, 5000, seed=0, fmt="jsonl")
    recipes = recipes_from(path, "jsonl")
    long = sum(len(r["directions"]) > 15 for r in recipes)
    assert 10 <= long <= 150  # about 1%
    assert all(len(r["directions"]) <= 60 for r in recipes)
    counts: dict[str, int] = {}
    for r in recipes:
        for w in re.findall(r"[a-zà-ÿ]+", " ".join(r["ingredients"] + r["directions"]).lower()):
            counts[w] = counts.get(w, 0) + 1
    # A few thousand distinct words, with a long tail of rare ones (Zipf-like).
    assert len(counts) > 2000
    assert sum(c <= 3 for c in counts.values()) > 300


def test_foodcom_lists_are_python_literals_with_apostrophe_items_double_quoted(sample_foodcom: Path) -> None:
    with open(sample_foodcom, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 300
    seen = 0
    for row in rows:
        for column in ("ingredients", "steps"):
            for item in ast.literal_eval(row[column]):
                if "'" in item:
                    seen += 1
                    assert f'"{item}"' in row[column]
                else:
                    assert f"'{item}'" in row[column]
        # Food.com ingredients carry no quantities.
        assert not any(QUANTITY.match(i) for i in ast.literal_eval(row["ingredients"]))
    assert seen > 0


def test_bad_format_and_unwritable_path_give_clear_errors(tmp_path: Path) -> None:
    proc = run_cli("--out", str(tmp_path / "x.csv"), "--format", "xml")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    with pytest.raises(ValueError, match="xml"):
        write_sample(tmp_path / "x.csv", 5, fmt="xml")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="file"):
        write_sample(blocker / "x.csv", 5)
    # A directory where the file should go.
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(OSError):
        write_sample(tmp_path / "dir.csv", 5)


@pytest.mark.parametrize(
    ("name", "fmt"),
    [("recipes.jsonl.zst", "jsonl"), ("recipes.csv.gz", "recipenlg-csv"), ("recipes.parquet", "parquet")],
)
def test_the_file_name_says_the_format_and_the_loader_reads_every_record(
    tmp_path: Path, tiny_model_dir: Path, name: str, fmt: str
) -> None:
    out = tmp_path / name
    proc = run_cli("--out", str(out), "--n", "120", "--seed", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote 120 recipes ({fmt}) to {out}"
    stream = RecipeStream(out, tiny_model_dir, batch_size=16, cache_dir=tmp_path / "cache")
    st = stream.stats()
    assert (st["records"], st["skipped"]) == (120, {})
    if fmt == "jsonl":  # what a user's own JSON reader sees
        assert recipes_from(out, "jsonl")[0]["title"]


def test_a_name_that_says_no_format_or_another_one_is_one_line(tmp_path: Path) -> None:
    proc = run_cli("--out", str(tmp_path / "recipes.txt"), "--n", "5")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"trainer data sample: {tmp_path / 'recipes.txt'}: the file name says no format; end it in .csv, "
        ".jsonl, .json, .ndjson, .parquet, .arrow or .feather, optionally .gz/.zst"
    )
    assert not (tmp_path / "recipes.txt").exists()
    proc = run_cli("--out", str(tmp_path / "r.jsonl.zst"), "--format", "recipenlg-csv")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"trainer data sample: {tmp_path / 'r.jsonl.zst'}: format recipenlg-csv does not match the file "
        "name, which says jsonl; rename the file or drop the format"
    )

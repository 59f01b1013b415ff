"""The Rust loader through its Python API: tokenizer parity, formats, bad input, padding, memory."""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from epoch_rows import rows
from transformers import AutoTokenizer

from trainer.data.loader import RecipeDataError, RecipeFileError, RecipeStream
from trainer.data.sample import write_sample


def render(rec: dict) -> tuple[str, str]:
    """The documented rendering rules of the default task, written independently of the Rust code."""

    def items(v: str | list[str]) -> list[str]:
        return [v.strip()] if isinstance(v, str) else [s.strip() for s in v if s.strip()]

    ingredients = "; ".join(items(rec["ingredients"]))
    d = rec["directions"]
    directions = d.strip() if isinstance(d, str) else " ".join(f"{i}. {s}" for i, s in enumerate(items(d), 1))
    source = f"Write a recipe with these ingredients: {ingredients}"
    target = f"title: {rec['title'].strip()} | ingredients: {ingredients} | directions: {directions}"
    return source, target


AWKWARD = [
    "½ cup sugar",
    "¾ tsp salt, ⅓ cup milk",
    "crème brûlée, jalapeño, Gruyère",
    "🍰 cake  and 🍓 berries",
    "豆腐 200g, 醤油 大さじ1",
    "lots     of   spaces",
    "tabs\tbetween\twords",
    "non\u00a0breaking space",
    "quotes \"double\" and 'single', commas, semi;colons",
    "ﬁ ligature and ＦＵＬＬＷＩＤＴＨ",
    "back\\slash and {braces}",
    # Where words meet: the per-word cache must give the ids of the whole text.
    "combining \u0301accent after a space, e\u0301 decomposed",
    "ideographic\u3000space, zero\u200bwidth, thin\u2009space",
    "literal </s> and <extra_id_0> and <pad> in the text",
    "  leading and trailing spaces  ",
    "line\nbreak and\r\ncrlf inside",
    "shouting!!! ... ??? (parens) [brackets] 1/2-inch 350°F",
]


def awkward_jsonl(path: Path, n: int) -> list[dict]:
    recs = []
    for i in range(n):
        a = AWKWARD[i % len(AWKWARD)]
        b = AWKWARD[(i * 7 + 3) % len(AWKWARD)]
        long = i % 5 == 0  # longer than both limits: truncation must match
        recs.append(
            {
                "title": f"  {a} dish {i} ",
                "ingredients": [a, b, f"{i} g flour"] * (20 if long else 1),
                "directions": [f"Mix {b}.", f"Bake {i} min at 180°C."] * (30 if long else 1),
            }
        )
    path.write_text("".join(json.dumps(r, ensure_ascii=i % 2 == 0) + "\n" for i, r in enumerate(recs)))
    return recs


@pytest.mark.parametrize("max_len", [(48, 64), (512, 512)])
def test_ids_match_transformers(tmp_path, tiny_model_dir, max_len):
    gen = tmp_path / "gen.jsonl"
    write_sample(gen, 3000, seed=11, fmt="jsonl")
    recs = [json.loads(line) for line in gen.read_text().splitlines()]
    recs += awkward_jsonl(tmp_path / "awkward.jsonl", 300)
    ms, mt = max_len
    stream = RecipeStream(
        [gen, tmp_path / "awkward.jsonl"],
        tiny_model_dir,
        batch_size=64,
        max_source_length=ms,
        max_target_length=mt,
        cache_dir=tmp_path / "cache",
    )
    got = rows(stream)
    assert stream.stats()["skipped"] == {}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [render(r) for r in recs]
    want_src = tok([s for s, _ in texts], truncation=True, max_length=ms)["input_ids"]
    want_tgt = tok([t for _, t in texts], truncation=True, max_length=mt)["input_ids"]
    assert len(got) == len(recs) == 3300
    mismatches = [
        i for i, (g, ws, wt) in enumerate(zip(got, want_src, want_tgt, strict=True)) if g != (ws, wt)
    ]
    assert mismatches == [], f"{len(mismatches)} rows differ, first {mismatches[:5]}"
    assert all(g[0][-1] == 1 and g[1][-1] == 1 for g in got)  # </s> kept after truncation


def test_formats_agree(tmp_path, tiny_model_dir, sample_csv, sample_foodcom, sample_jsonl):
    for path, n in [(sample_csv, 500), (sample_foodcom, 300), (sample_jsonl, 300)]:
        s = RecipeStream(path, tiny_model_dir, batch_size=16, cache_dir=tmp_path)
        assert sum(len(b["input_ids"]) for b in s) == n
        assert s.stats()["yielded"] == n
    # The same recipes compressed give the same batches.
    for suffix in [".gz", ".zst"]:
        comp = tmp_path / f"full_dataset.csv{suffix}"
        write_sample(comp, 500, seed=1, fmt="recipenlg-csv")
        a = rows(RecipeStream(comp, tiny_model_dir, batch_size=16, cache_dir=tmp_path / "c"))
        b = rows(RecipeStream(sample_csv, tiny_model_dir, batch_size=16, cache_dir=tmp_path))
        assert a == b


def test_batches_are_padded(tmp_path, tiny_model_dir, sample_csv):
    s = RecipeStream(sample_csv, tiny_model_dir, batch_size=7, pad_to_multiple_of=8, max_source_length=40)
    n = 0
    for b in s:
        ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
        assert ids.dtype == mask.dtype == labels.dtype == np.int64
        # Handed over without copying: numpy views memory owned by the Rust buffers.
        for a in (ids, mask, labels):
            assert a.flags.c_contiguous and not a.flags.owndata
            assert type(a.base.base).__name__ == "PySliceContainer"
        assert ids.shape == mask.shape and ids.shape[0] == labels.shape[0] <= 7
        assert ids.shape[1] % 8 == 0 and labels.shape[1] % 8 == 0
        assert (ids[mask == 0] == 0).all() and (ids[mask == 1] != 0).all()
        # Padding is only at the end of a row, and the longest row is within 8 of the padded width.
        assert (np.diff(mask, axis=1) <= 0).all()
        assert ids.shape[1] - mask.sum(1).max() < 8
        real = labels != -100
        assert (np.diff(real.astype(int), axis=1) <= 0).all()
        assert labels.shape[1] - real.sum(1).max() < 8
        assert mask.sum(1).max() <= 40
        n += len(ids)
    assert n == 500


def write_bad_csv(path: Path) -> None:
    good = '"[""1 cup flour""]","[""Mix.""]"'
    path.write_text(
        "\ufeff,title,ingredients,directions,link,source,NER\r\n"
        f'0,Good one,{good},l,s,"[]"\r\n'
        f'1,"Multi\nline, ""quoted""",{good},l,s,"[]"\r\n'
        '2,Bad list,not json,"[""x""]",l,s,"[]"\r\n'
        f'3,,{good},l,s,"[]"\r\n'
        "4,Too few\r\n"
        '5,No steps,"[""a""]","[]",l,s,"[]"\r\n'
        f'6,Mom\'s pie,{good},l,s,"[]"\r\n'
        f"7,No NER,{good},l,s,\r\n"  # an empty cell is an empty list: NER is not rendered, the record kept
        '8,Blank steps,"[""a""]", ,l,s,"[]"\r\n',
        newline="",
    )


def test_lenient_counts_and_examples(tmp_path, tiny_model_dir):
    p = tmp_path / "bad.csv"
    write_bad_csv(p)
    s = RecipeStream(p, tiny_model_dir, batch_size=4)
    assert sum(len(b["input_ids"]) for b in s) == 4
    st = s.stats()
    assert st["yielded"] == 4
    assert st["skipped"] == {"malformed_csv": 2, "empty_title": 1, "empty_directions": 2}
    ex = "\n".join(st["examples"])
    for line, reason in [
        (5, "malformed_csv"),
        (6, "empty_title"),
        (7, "malformed_csv"),
        (8, "empty_directions"),
        (11, "empty_directions"),
    ]:
        assert f"bad.csv:{line}: {reason}" in ex, ex

    j = tmp_path / "bad.jsonl"
    j.write_bytes(
        b'{"title":"A","ingredients":["x"],"directions":["y"]}\n{oops\n{"title":"B","directions":["y"]}\n'
        b'{"title":"\xff\xfe","ingredients":["x"],"directions":["y"]}\n'
        b'{"title":"A","ingredients":["x"],"directions":["y"]}\n'
    )
    s = RecipeStream(j, tiny_model_dir, batch_size=4, dedup=True)
    assert sum(len(b["input_ids"]) for b in s) == 1
    st = s.stats()
    assert st["skipped"] == {"malformed_json": 1, "missing_field": 1, "invalid_utf8": 1, "duplicate": 1}
    ex = "\n".join(st["examples"])
    assert "bad.jsonl:2: malformed_json" in ex and "bad.jsonl:3: missing_field" in ex
    assert "bad.jsonl:4: invalid_utf8" in ex and "bad.jsonl:5: duplicate (same text as" in ex


def test_strict_raises_with_file_and_line(tmp_path, tiny_model_dir):
    p = tmp_path / "bad.csv"
    write_bad_csv(p)
    with pytest.raises(RecipeDataError, match=r"bad\.csv:5: malformed_csv"):
        RecipeStream(p, tiny_model_dir, batch_size=4, strict=True)
    # Also when the index comes from the cache of an earlier lenient run.
    RecipeStream(p, tiny_model_dir, batch_size=4)
    with pytest.raises(RecipeDataError, match=r"bad\.csv:5"):
        RecipeStream(p, tiny_model_dir, batch_size=4, strict=True)


def test_file_errors_name_the_path(tmp_path, tiny_model_dir, sample_csv):
    def raises(paths, tokenizer=tiny_model_dir, match=None):
        with pytest.raises(RecipeFileError, match=match) as e:
            RecipeStream(paths, tokenizer, batch_size=4, cache_dir=tmp_path / "cache")
        assert isinstance(e.value, OSError)
        return str(e.value)

    raises(tmp_path / "missing.csv", match="missing.csv: no such file")
    raises(str(tmp_path / "nothing-*.jsonl"), match="glob matches no file")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    raises(tmp_path / "empty.jsonl", match="empty.jsonl: empty file")
    (tmp_path / "blank.jsonl").write_bytes(b"\n\n")
    raises(tmp_path / "blank.jsonl", match="blank.jsonl: empty file")
    for suffix in [".gz", ".zst"]:
        full = tmp_path / f"r.csv{suffix}"
        write_sample(full, 400, seed=5)
        cut = tmp_path / f"cut.csv{suffix}"
        cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
        raises(cut, match=f"cut.csv{suffix}: corrupt or truncated")
    (tmp_path / "junk.csv.gz").write_bytes(b"this is not gzip at all")
    raises(tmp_path / "junk.csv.gz", match="junk.csv.gz")
    (tmp_path / "tok.json").write_text("{not a tokenizer")
    raises(sample_csv, tokenizer=tmp_path / "tok.json", match="tok.json")
    raises(sample_csv, tokenizer=tmp_path / "no-such-dir", match="no-such-dir")


def test_path_errors_say_what_is_wrong(tmp_path, tiny_model_dir, monkeypatch):
    def error(paths):
        with pytest.raises(RecipeFileError) as e:
            RecipeStream(paths, tiny_model_dir, batch_size=4, cache_dir=tmp_path / "cache")
        return e.value

    (tmp_path / "loop_a.csv").symlink_to(tmp_path / "loop_b.csv")
    (tmp_path / "loop_b.csv").symlink_to(tmp_path / "loop_a.csv")
    e = error(tmp_path / "loop_a.csv")
    assert "loop_a.csv: symlink loop" in str(e) and e.errno == errno.ELOOP
    (tmp_path / "dangling.csv").symlink_to(tmp_path / "gone.csv")
    e = error(tmp_path / "dangling.csv")
    assert f"dangling.csv: broken symlink: it points to {tmp_path / 'gone.csv'}" in str(e)
    assert e.errno == errno.ENOENT
    # A glob does not skip such a file silently.
    (tmp_path / "globbed").mkdir()
    write_sample(tmp_path / "globbed" / "a.csv", 10)
    (tmp_path / "globbed" / "b.csv").symlink_to(tmp_path / "gone.csv")
    assert "b.csv: broken symlink" in str(error(str(tmp_path / "globbed" / "*.csv")))
    # A relative path names the directory it was resolved against.
    monkeypatch.chdir(tmp_path)
    e = error("data/x.csv")
    assert str(e) == f"data/x.csv (resolved against {tmp_path}): no such file" and e.errno == errno.ENOENT
    assert str(error("data/*.csv")) == f"data/*.csv (resolved against {tmp_path}): glob matches no file"


def test_bad_settings(tmp_path, tiny_model_dir, sample_csv):
    with pytest.raises(RecipeDataError, match=r"\{titel\}"):
        RecipeStream(sample_csv, tiny_model_dir, batch_size=4, source_template="{titel}")
    with pytest.raises(RecipeDataError, match="not both"):
        RecipeStream(sample_csv, tiny_model_dir, batch_size=4, max_tokens=100)
    with pytest.raises(RecipeDataError):
        RecipeStream(sample_csv, tiny_model_dir, batch_size=4, rank=2, world_size=2)
    with pytest.raises(RecipeDataError, match=r"full_dataset.csv:1: missing column `name`"):
        RecipeStream(sample_csv, tiny_model_dir, batch_size=4, data_format="foodcom-csv")
    # A spreadsheet's export separated by semicolons: one line saying so, with the way to rewrite it.
    semicolons = tmp_path / "export.csv"
    semicolons.write_text('title;ingredients;directions\nPie;"[""1 egg""]";"[""Mix.""]"\n')
    with pytest.raises(RecipeDataError, match=r"export.csv:1: .* looks separated by `;`, and only commas"):
        RecipeStream(semicolons, tiny_model_dir, batch_size=4, cache_dir=tmp_path / "cache")


def test_read_only_data_dir_uses_cache_dir(tmp_path, tiny_model_dir):
    data = tmp_path / "ro"
    data.mkdir()
    write_sample(data / "r.jsonl", 50, seed=9, fmt="jsonl")
    data.chmod(0o555)
    try:
        s = RecipeStream(data / "r.jsonl", tiny_model_dir, batch_size=8, cache_dir=tmp_path / "cache")
        assert sum(len(b["input_ids"]) for b in s) == 50
        again = RecipeStream(data / "r.jsonl", tiny_model_dir, batch_size=8, cache_dir=tmp_path / "cache")
        if os.geteuid() != 0:  # root writes anywhere
            assert list((tmp_path / "cache").glob("*.rlidx"))
        assert again.stats()["index_cached"] == [True]
    finally:
        data.chmod(0o755)


def test_memory_does_not_grow(tmp_path, tiny_model_dir, sample_csv):
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    s = RecipeStream(sample_csv, tiny_model_dir, batch_size=8, shuffle=True)
    rss = []
    for _ in range(40):
        for _b in s:
            pass
        rss.append(proc.memory_info().rss)
    assert s.stats()["yielded"] == 40 * 500
    growth = rss[-1] - rss[4]
    assert growth < 16 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 35 epochs"


def test_gzip_uncompressed_equivalence_file_line(tmp_path, tiny_model_dir):
    # Line numbers in examples refer to the decompressed text and the original (compressed) file name.
    p = tmp_path / "bad.csv"
    write_bad_csv(p)
    gz = tmp_path / "bad2.csv.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    st = RecipeStream(gz, tiny_model_dir, batch_size=4, cache_dir=tmp_path / "c").stats()
    assert any("bad2.csv.gz:5: malformed_csv" in e for e in st["examples"]), st["examples"]


def test_batches_as_tensors_on_the_cpu_share_the_loaders_memory(tiny_model_dir, sample_jsonl):
    import torch

    from trainer.data.loader import to_device

    want = list(RecipeStream(sample_jsonl, tiny_model_dir, batch_size=32))
    got = [
        to_device(b, torch.device("cpu")) for b in RecipeStream(sample_jsonl, tiny_model_dir, batch_size=32)
    ]
    assert len(got) == len(want) == 10
    for g, w in zip(got, want, strict=True):
        assert set(g) == {"input_ids", "attention_mask", "labels"}
        for k in g:
            assert g[k].dtype == torch.int64 and g[k].device.type == "cpu"
            assert torch.equal(g[k], torch.from_numpy(w[k]))

"""Order, token-budget batching, sharding and exact resume of RecipeStream."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from trainer.data.loader import RecipeDataError, RecipeStream
from trainer.data.sample import write_sample


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("plan") / "recipes.jsonl"
    write_sample(p, 3000, seed=21, fmt="jsonl")
    return p


def make(data, tok, **kw):
    kw.setdefault("max_tokens", 2048)
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 7)
    return RecipeStream(data, tok, max_source_length=128, max_target_length=256, **kw)


def keys(batch) -> list[tuple]:
    """One hashable key per row: its unpadded source and target ids."""
    out = []
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"], strict=True):
        out.append((tuple(ids[mask == 1]), tuple(labels[labels != -100])))
    return out


def epoch_rows(stream) -> list[list[tuple]]:
    return [keys(b) for b in stream]


def test_order_is_deterministic_per_seed_and_epoch(data, tiny_model_dir):
    a = make(data, tiny_model_dir)
    e0, e1 = epoch_rows(a), epoch_rows(a)  # the stream moves on to epoch 1 by itself
    assert a.epoch == 2
    b = make(data, tiny_model_dir)
    assert epoch_rows(b) == e0
    b.set_epoch(1)
    assert epoch_rows(b) == e1
    assert e0 != e1
    assert sorted(r for bt in e0 for r in bt) == sorted(r for bt in e1 for r in bt)
    assert epoch_rows(make(data, tiny_model_dir, seed=8)) != e0
    # Whole-dataset shuffle: the first batches draw from all over the file, not from its head.
    nat = [
        r
        for bt in epoch_rows(make(data, tiny_model_dir, shuffle=False, max_tokens=None, batch_size=8))
        for r in bt
    ]
    pos = {r: i for i, r in enumerate(nat)}
    first = [pos[r] for bt in e0[:20] for r in bt]
    assert max(first) > 2000 and min(first) < 1000


def test_max_tokens_bound_and_real_token_share(data, tiny_model_dir):
    for budget, mult in [(1024, None), (4096, 8)]:
        s = make(data, tiny_model_dir, max_tokens=budget, pad_to_multiple_of=mult)
        real = total = rows = 0
        for b in s:
            n, sl = b["input_ids"].shape
            tl = b["labels"].shape[1]
            assert n * (sl + tl) <= budget or n == 1
            real += int(b["attention_mask"].sum() + (b["labels"] != -100).sum())
            total += n * (sl + tl)
            rows += n
        st = s.stats()
        assert rows == st["yielded"] == 3000
        assert real / total >= 0.95, real / total
        assert st["real_token_share"] == pytest.approx(real / total)


def test_over_budget_record_gets_its_own_batch(tmp_path, tiny_model_dir):
    p = tmp_path / "r.jsonl"
    recs = [{"title": f"T{i}", "ingredients": ["egg"], "directions": ["Boil."]} for i in range(20)]
    recs[5]["directions"] = ["Stir the pot slowly for a very long time."] * 40
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = RecipeStream(p, tiny_model_dir, max_tokens=200, max_target_length=512, shuffle=True)
    batches = list(s)
    big = [b for b in batches if b["labels"].shape[1] > 150]
    assert len(big) == 1 and big[0]["labels"].shape[0] == 1
    assert s.stats()["oversize_batches"] == 1
    assert sum(len(b["labels"]) for b in batches) == 20


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batching", [{"max_tokens": 2048}, {"batch_size": 7, "max_tokens": None}])
def test_sharding(data, tiny_model_dir, world_size, batching):
    per_rank = []
    for rank in range(world_size):
        s = make(data, tiny_model_dir, rank=rank, world_size=world_size, **batching)
        planned = len(s)  # of epoch 0: after it the stream is in epoch 1, whose budget packing may differ
        got = epoch_rows(s)
        assert len(got) == planned
        per_rank.append(got)
    assert len({len(g) for g in per_rank}) == 1  # every rank the same number of batches
    seen = [r for g in per_rank for bt in g for r in bt]
    assert len(seen) == len(set(seen))  # each record at most once per epoch
    biggest = max(len(bt) for g in per_rank for bt in g)
    assert 3000 - len(seen) < world_size * biggest  # up to a remainder smaller than a batch per rank


@pytest.mark.parametrize("stop", [0, 1, 17, "last", "boundary", "boundary+2"])
def test_exact_resume(data, tiny_model_dir, stop):
    ref = make(data, tiny_model_dir)
    n = len(ref)
    stream = [keys(b) for _ in range(2) for b in ref]  # two epochs, uninterrupted
    at = {"last": n - 1, "boundary": n, "boundary+2": n + 2}.get(stop, stop)
    a = make(data, tiny_model_dir)
    it = iter(a)
    for _ in range(at):
        try:
            next(it)
        except StopIteration:
            it = iter(a)
            next(it)
    state = json.loads(json.dumps(a.state_dict()))
    b = make(data, tiny_model_dir)
    b.load_state_dict(state)
    resumed = epoch_rows(b) + epoch_rows(b)  # the rest of this epoch, then the next one
    assert resumed[:5] == stream[at : at + 5]


def test_resume_refuses_other_settings(data, tiny_model_dir):
    a = make(data, tiny_model_dir)
    next(iter(a))
    with pytest.raises(RecipeDataError, match="other data or loader settings"):
        make(data, tiny_model_dir, seed=99).load_state_dict(a.state_dict())
    with pytest.raises(RecipeDataError):
        make(data, tiny_model_dir).load_state_dict({"epoch": 0})


def test_eval_split_is_disjoint_and_deterministic(data, tiny_model_dir):
    def all_rows(split):
        s = make(
            data, tiny_model_dir, split=split, eval_fraction=0.1, shuffle=False, max_tokens=None, batch_size=8
        )
        return {r for b in s for r in keys(b)}

    train, ev = all_rows("train"), all_rows("eval")
    assert not train & ev
    assert 200 < len(ev) < 400 and len(train) + len(ev) == 3000
    assert all_rows("eval") == ev


def test_len_matches_batches(data, tiny_model_dir):
    s = make(data, tiny_model_dir, max_tokens=None, batch_size=64, shuffle=False)
    assert len(s) == int(np.ceil(3000 / 64)) == len(list(s))


def test_index_cache_reused_until_the_file_changes(tmp_path, tiny_model_dir):
    p = tmp_path / "r.jsonl"
    write_sample(p, 200, seed=4, fmt="jsonl")

    def opened():
        s = RecipeStream(p, tiny_model_dir, batch_size=16)
        return s.stats()["index_cached"], s.stats()["records"]

    assert opened() == ([False], 200)
    assert opened() == ([True], 200)  # a restart reads the cached index
    assert list(tmp_path.glob(".r.jsonl.*.rlidx"))  # beside the data
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert opened() == ([False], 200)  # same size, new mtime: rebuilt
    with open(p, "a") as f:
        f.write(json.dumps({"title": "New", "ingredients": ["egg"], "directions": ["Boil."]}) + "\n")
    assert opened() == ([False], 201)


@pytest.mark.parametrize("name", ["r.jsonl", "r.jsonl.gz"])
def test_content_rewritten_with_size_and_mtime_kept_is_detected(tmp_path, tiny_model_dir, caplog, name):
    """`cp -p` / `rsync -t` of new text over old: same size, same mtime, other content."""
    import gzip
    import time

    p = tmp_path / name

    def put(records):
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        # Stored (level 0) gzip with a fixed header time: the same text length gives the same file size.
        p.write_bytes(gzip.compress(text, compresslevel=0, mtime=0) if name.endswith(".gz") else text)

    recs = [{"title": f"Dish {i:03d}", "ingredients": ["egg"], "directions": ["Boil."]} for i in range(40)]
    put(recs)
    old = RecipeStream(p, tiny_model_dir, batch_size=4, shuffle=True, cache_dir=tmp_path / "cache")
    next(iter(old))
    state = old.state_dict()
    st = p.stat()
    time.sleep(0.02)
    put([dict(r, title=r["title"].replace("Dish", "Soup")) for r in recs])
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (p.stat().st_size, p.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)

    with caplog.at_level("WARNING", logger="trainer.data"):
        new = RecipeStream(p, tiny_model_dir, batch_size=4, shuffle=True, cache_dir=tmp_path / "cache")
    assert new.stats()["index_cached"] == [False]
    assert any("changed since it was indexed" in r.getMessage() for r in caplog.records)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [tok.decode(row[row != -100], skip_special_tokens=True) for b in new for row in b["labels"]]
    assert sorted(t.split()[1:3] for t in texts) == [["Soup", f"{i:03d}"] for i in range(40)]
    with pytest.raises(RecipeDataError, match="cannot resume"):
        new.load_state_dict(state)

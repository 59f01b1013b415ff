"""Packed batches (`packing=True`): the layout of the packed-batch contract, the same records and ids as the
unpacked loader, real-token share, determinism, resume, shards, and what `trainer data inspect` shows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.config import TrainConfig
from trainer.data.loader import RecipeConfigError, RecipeStream, inspect_report
from trainer.data.sample import write_sample

KEYS = {
    "input_ids",
    "attention_mask",
    "labels",
    "encoder_segment_ids",
    "decoder_segment_ids",
    "encoder_positions",
    "decoder_positions",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("pack") / "recipes.jsonl"
    write_sample(p, 4000, seed=11, fmt="jsonl")
    return p


def packed(data, tok, **kw):
    kw.setdefault("max_tokens", 16384)
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 5)
    return RecipeStream(data, tok, packing=True, **kw)


def segments(ids: np.ndarray, seg: np.ndarray, pos: np.ndarray, pad: int) -> list[tuple[int, ...]]:
    """The records of one side of a row, checking the layout: segments 1, 2, ... contiguous from the left,
    positions from 0 in each, padding (segment 0, position 0, the pad value) only after them."""
    n = int((seg > 0).sum())
    assert (seg[n:] == 0).all() and (pos[n:] == 0).all() and (ids[n:] == pad).all()
    assert (ids[:n] != pad).all()
    if n == 0:
        return []
    assert seg[0] == 1 and (np.diff(seg[:n]) >= 0).all() and (np.diff(seg[:n]) <= 1).all()
    out = []
    for s in range(1, int(seg[n - 1]) + 1):
        at = np.flatnonzero(seg == s)
        assert (pos[at] == np.arange(len(at))).all()
        out.append(tuple(ids[at].tolist()))
    return out


def records(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    assert set(batch) == KEYS
    assert all(v.dtype == np.int64 for v in batch.values())
    out = []
    for r in range(len(batch["input_ids"])):
        src = segments(
            batch["input_ids"][r], batch["encoder_segment_ids"][r], batch["encoder_positions"][r], 0
        )
        tgt = segments(
            batch["labels"][r], batch["decoder_segment_ids"][r], batch["decoder_positions"][r], -100
        )
        assert len(src) == len(tgt)  # a record's source and target under the same segment id
        assert (batch["attention_mask"][r] == (batch["encoder_segment_ids"][r] > 0)).all()
        out += zip(src, tgt, strict=True)
    return out


def test_packed_batches_hold_the_unpacked_records_once(data, tiny_model_dir):
    plain = RecipeStream(data, tiny_model_dir, batch_size=64)
    want = sorted(
        (tuple(ids[mask == 1].tolist()), tuple(labels[labels != -100].tolist()))
        for b in plain
        for ids, mask, labels in zip(b["input_ids"], b["attention_mask"], b["labels"], strict=True)
    )
    s = packed(data, tiny_model_dir)
    shape = s.stats()["packed_shape"]
    assert shape["source_len"] >= 512 and shape["target_len"] >= 512
    assert shape["rows"] == 16384 // (shape["source_len"] + shape["target_len"])
    got = []
    batches = list(s)
    for b in batches:
        assert b["input_ids"].shape == b["encoder_segment_ids"].shape == (shape["rows"], shape["source_len"])
        assert b["labels"].shape == b["decoder_positions"].shape == (shape["rows"], shape["target_len"])
        got += records(b)
    assert sorted(got) == want
    assert len(batches) == len(s)


def test_real_token_share_on_sample_recipes(data, tiny_model_dir):
    s = packed(data, tiny_model_dir)
    real = total = 0
    for b in s:
        real += int((b["encoder_segment_ids"] > 0).sum() + (b["decoder_segment_ids"] > 0).sum())
        total += b["input_ids"].size + b["labels"].size
    assert real / total >= 0.99, real / total
    assert s.stats()["real_token_share"] == pytest.approx(real / total)


def test_packed_order_resume_and_shards(data, tiny_model_dir):
    a = packed(data, tiny_model_dir)
    e0, e1 = [records(b) for b in a], [records(b) for b in a]
    assert e0 != e1 and sorted(r for b in e0 for r in b) == sorted(r for b in e1 for r in b)
    assert [records(b) for b in packed(data, tiny_model_dir)] == e0
    assert [records(b) for b in packed(data, tiny_model_dir, seed=6)] != e0
    # Resume mid-epoch: the same remaining batches.
    b = packed(data, tiny_model_dir)
    it = iter(b)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(b.state_dict()))
    c = packed(data, tiny_model_dir)
    c.load_state_dict(state)
    assert [records(x) for x in c] == e0[7:]
    with pytest.raises(RecipeConfigError, match="cannot resume"):
        packed(data, tiny_model_dir, packed_target_length=1024).load_state_dict(state)
    with pytest.raises(RecipeConfigError, match="cannot resume"):
        RecipeStream(data, tiny_model_dir, max_tokens=16384, shuffle=True, seed=5).load_state_dict(state)
    # Shards: disjoint, as many batches each, every record but those of the batches left out.
    n = len(e0)
    for w in (2, 3):
        per_rank = [
            [records(x) for x in packed(data, tiny_model_dir, rank=r, world_size=w)] for r in range(w)
        ]
        assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == n // w
        seen = [rec for p in per_rank for bt in p for rec in bt]
        assert len(seen) == len(set(seen))
        assert 4000 - len(seen) <= (n % w) * max(len(bt) for bt in e0)


def test_packing_settings_are_checked(data, tiny_model_dir):
    with pytest.raises(
        RecipeConfigError, match="packed_source_length 100 is shorter than max_source_length 512"
    ):
        packed(data, tiny_model_dir, packed_source_length=100)
    with pytest.raises(RecipeConfigError, match="smaller than one packed row"):
        packed(data, tiny_model_dir, max_tokens=800)
    s = packed(
        data,
        tiny_model_dir,
        max_tokens=None,
        batch_size=3,
        packed_source_length=640,
        packed_target_length=1600,
    )
    assert s.stats()["packed_shape"] == {"rows": 3, "source_len": 640, "target_len": 1600}


def test_inspect_shows_the_packed_shape(data, tiny_model_dir):
    cfg = TrainConfig.load(None, [f"model_name_or_path={tiny_model_dir}", "packing=true", "max_tokens=16384"])
    report = inspect_report([str(data)], cfg).splitlines()
    last, efficiency = report[-2], report[-1]
    stats = packed(data, tiny_model_dir).stats()
    shape = stats["packed_shape"]
    assert last.startswith(
        f"packing {shape['rows']} rows x ({shape['source_len']} + {shape['target_len']}) tokens "
        "(max_tokens=16384, row lengths chosen from the data): "
    )
    assert "real-token share 99." in last
    records_per_row = stats["records"] / (stats["batches_per_epoch"] * shape["rows"])
    assert efficiency.startswith("packing efficiency: 99.")
    assert efficiency.endswith(f"{records_per_row:.1f} records per row")

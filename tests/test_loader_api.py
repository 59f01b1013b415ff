"""The loader's Python surface: options declared once, the stub checked against the binding, typed errors,
warnings through logging, one rule for compression suffixes."""

from __future__ import annotations

import ast
import dataclasses
import errno
import inspect
import logging
from pathlib import Path

import pytest

from trainer import _loader
from trainer.config import TrainConfig
from trainer.data.loader import (
    LOADER_OPTIONS,
    RecipeConfigError,
    RecipeDataError,
    RecipeFileError,
    RecipeInternalError,
    RecipeLoaderError,
    RecipeStream,
    loader_options,
)
from trainer.data.sample import write_sample

ROOT = Path(__file__).resolve().parent.parent
STUB = ast.parse((ROOT / "trainer" / "_loader.pyi").read_text())


def stub_functions() -> dict[str, ast.FunctionDef]:
    """Every function of the stub by qualified name (`write_sample`, `RecipeLoader.next_batch`, ...)."""
    out = {}
    for node in STUB.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out |= {f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)}
    return out


def test_stub_options_are_the_binding_options():
    init = stub_functions()["RecipeLoader.__init__"]
    declared = [
        {"name": a.arg, "type": ast.unparse(a.annotation), "default": ast.literal_eval(d)}
        for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True)
    ]
    table = [{k: o[k] for k in ("name", "type", "default")} for o in LOADER_OPTIONS]
    assert declared == table
    assert all(o["doc"] for o in LOADER_OPTIONS)
    # The positional parameters are the binding's own.
    real = inspect.signature(_loader.RecipeLoader)
    assert [a.arg for a in init.args.args[1:]] == [
        p.name for p in real.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
    ]


def test_stub_signatures_match_the_binding():
    """Every function and method of the stub has the binding's parameter names and defaults."""
    checked = 0
    for qualname, fn in stub_functions().items():
        if qualname == "RecipeLoader.__init__" or any(
            isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list
        ):
            continue
        obj = _loader
        for part in qualname.split("."):
            obj = obj if part == "__init__" else getattr(obj, part)  # a class: its constructor
        real = inspect.signature(obj)
        params = [p for p in real.parameters.values() if p.name != "self"]
        args = fn.args.args[1:] if "." in qualname else fn.args.args
        defaults = [ast.literal_eval(d) for d in fn.args.defaults]
        defaults = [None] * (len(args) - len(defaults)) + defaults
        kw_defaults = [None if d is None else ast.literal_eval(d) for d in fn.args.kw_defaults]
        declared = [(a.arg, d, False) for a, d in zip(args, defaults, strict=True)]
        declared += [(a.arg, d, True) for a, d in zip(fn.args.kwonlyargs, kw_defaults, strict=True)]
        assert declared == [
            (p.name, None if p.default is p.empty else p.default, p.kind is p.KEYWORD_ONLY) for p in params
        ], qualname
        checked += 1
    assert checked == 13
    # And every public name of the binding is in the stub, and the other way round.
    stub_names = {getattr(n, "name", None) for n in STUB.body} | {
        t.id for n in STUB.body if isinstance(n, ast.AnnAssign) for t in [n.target] if isinstance(t, ast.Name)
    }
    public = {n for n in dir(_loader) if not n.startswith("_")}
    assert public <= stub_names and stub_names - {None, "LoaderOption"} <= public


def test_stub_exception_bases_are_the_real_ones():
    for node in STUB.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
            real = getattr(_loader, node.name)
            assert [ast.unparse(b) for b in node.bases] == [b.__name__ for b in real.__bases__], node.name


def test_docs_list_every_option():
    docs = (ROOT / "docs" / "loader.md").read_text()
    missing = [o["name"] for o in LOADER_OPTIONS if f"| `{o['name']}` |" not in docs]
    assert not missing, f"docs/loader.md's option table lacks {missing}"


def test_config_fields_reach_the_loader():
    cfg = TrainConfig(per_device_train_batch_size=3, strict_data=True, loader_threads=2, max_source_length=77)
    opts = loader_options(cfg)
    assert opts["batch_size"] == 3 and opts["strict"] is True and opts["num_threads"] == 2
    assert opts["max_source_length"] == 77
    # What the config does not set is set per stream (split, rank, ...) or left to the loader's default. A new
    # loader option with a config field of another name fails here until it is mapped.
    not_from_config = {o["name"] for o in LOADER_OPTIONS} - set(opts)
    # weights come from train_files' entries (trainer.data.loader.stream_for).
    assert not_from_config == {"epoch", "rank", "world_size", "split", "prefetch", "cache_dir", "weights"}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(opts) - fields == {"batch_size", "strict", "num_threads"}


def test_errors_share_one_base_and_keep_the_builtin_ones(tmp_path, tiny_model_dir, sample_csv):
    for cls, builtin in [
        (RecipeFileError, OSError),
        (RecipeDataError, ValueError),
        (RecipeConfigError, RecipeDataError),
        (RecipeInternalError, RuntimeError),
    ]:
        assert issubclass(cls, RecipeLoaderError) and issubclass(cls, builtin), cls
        assert cls.__module__ == "trainer._loader"

    with pytest.raises(
        RecipeConfigError, match='unknown loader option "batch_sise" .did you mean "batch_size"?'
    ):
        RecipeStream(sample_csv, tiny_model_dir, batch_sise=4)
    with pytest.raises(RecipeConfigError, match="max_tokens must be an integer >= 0 or None, got 1.5"):
        RecipeStream(sample_csv, tiny_model_dir, max_tokens=1.5)
    with pytest.raises(RecipeConfigError, match="seed must be an integer >= 0, got -1"):
        RecipeStream(sample_csv, tiny_model_dir, batch_size=4, seed=-1)
    with pytest.raises(RecipeConfigError, match="prefetch must be >= 1"):
        RecipeStream(sample_csv, tiny_model_dir, batch_size=4, prefetch=0)
    s = RecipeStream(sample_csv, tiny_model_dir, batch_size=4, cache_dir=tmp_path / "c")  # a PathLike option
    with pytest.raises(RecipeConfigError, match="epoch must be >= 0"):
        s.set_epoch(-1)
    # An I/O error keeps its errno; the message stays "path: reason".
    with pytest.raises(RecipeFileError) as e:
        RecipeStream(sample_csv, tmp_path / "no-tokenizer.json", batch_size=4)
    assert e.value.errno == errno.ENOENT
    assert str(e.value).startswith(f"{tmp_path / 'no-tokenizer.json'}: cannot read tokenizer")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "A"}\n')
    with pytest.raises(RecipeDataError, match=r"bad\.jsonl:1: missing_field") as e:
        RecipeStream(bad, tiny_model_dir, batch_size=4, strict=True)
    assert not isinstance(e.value, RecipeConfigError)


def test_warnings_reach_python_logging(tmp_path, tiny_model_dir, caplog):
    # A file name so long that no index cache can be named after it, beside it or in the cache directory.
    data = tmp_path / ("r" * 240 + ".jsonl")
    write_sample(data, 20, seed=1, fmt="jsonl")
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        s = RecipeStream(data, tiny_model_dir, batch_size=4, cache_dir=tmp_path / "cache")
    assert s.stats()["records"] == 20
    [record] = [r for r in caplog.records if r.name == "trainer.data"]
    assert record.levelno == logging.WARNING
    assert "could not write the index cache of" in record.getMessage() and "rrrr.jsonl" in record.getMessage()


@pytest.mark.parametrize(
    ("name", "magic"),
    [
        ("a.csv.zstd", b"\x28\xb5\x2f\xfd"),
        ("B.CSV.GZ", b"\x1f\x8b"),
        ("c.csv.ZST", b"\x28\xb5\x2f\xfd"),
        ("d.csv.gz", b"\x1f\x8b"),
    ],
)
def test_writer_and_reader_agree_on_compression_suffixes(tmp_path, tiny_model_dir, sample_csv, name, magic):
    def rows(path):
        s = RecipeStream(path, tiny_model_dir, batch_size=50, cache_dir=tmp_path / "cache")
        return [(b["input_ids"].tolist(), b["labels"].tolist()) for b in s]

    plain = tmp_path / "plain.csv"
    write_sample(plain, 200, seed=3)
    out = tmp_path / name
    write_sample(out, 200, seed=3)
    assert out.read_bytes()[: len(magic)] == magic  # compressed as the name says
    assert rows(out) == rows(plain)  # and read back as such


def test_sampled_records_are_held_out_records_as_the_renderer_reads_them(
    tmp_path, tiny_model_dir, sample_csv
):
    """What the evaluation generates for: a seeded draw of the split's records, the same on every rank, read
    at their indexed offsets and equal to what reading the whole file through the renderer gives."""
    tokenizer = tiny_model_dir / "tokenizer.json"
    split = dict(split="eval", eval_fraction=0.2, batch_size=4, cache_dir=str(tmp_path / "cache"))
    rank0 = RecipeStream([sample_csv], tokenizer, **split, rank=0, world_size=2)
    rank1 = RecipeStream([sample_csv], tokenizer, **split, rank=1, world_size=2)
    chosen = rank0.sample_records(6, seed=3)
    held_out, _, _ = _loader.RecipeRenderer(tokenizer=str(tokenizer)).read(
        [str(sample_csv)], split="eval", eval_fraction=0.2
    )
    assert len(chosen) == 6
    assert all(record in held_out for record in chosen)
    assert rank1.sample_records(6, seed=3) == chosen
    assert rank0.sample_records(6, seed=4) != chosen
    assert rank0.sample_records(10**6, seed=3) == held_out

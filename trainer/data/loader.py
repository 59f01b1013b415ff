"""Recipe data for training: a thin typed wrapper over the Rust loader (`trainer._loader`).

The Rust side reads recipe dumps (RecipeNLG CSV, Food.com CSV, JSONL, Parquet, Arrow; optionally .gz/.zst),
renders each recipe into a source and a target text, tokenizes both with the model's `tokenizer.json` (ids
identical to `transformers.AutoTokenizer(text, truncation=True, max_length=N)`), and hands over padded int64
batches. Hugging Face datasets (Hub ids, save_to_disk directories) come in as Parquet
(trainer.data.hf_datasets).

Rendering rules (T5's tokenizer turns newlines into spaces, so none are used):

- `ingredients-to-recipe` (default): source ``"Write a recipe with these ingredients: {ingredients}"``,
  target ``"title: {title} | ingredients: {ingredients} | directions: {directions}"``.
- `title-to-recipe`: source ``"Write a recipe for: {title}"``, same target.
- Lists: ingredients joined with ``"; "``; directions numbered ``"1. Mix. 2. Bake."``; NER joined with
  ``", "``. Custom templates may use ``{title}``, ``{ingredients}``, ``{directions}``, ``{ner}``;
  ``{{``/``}}`` are literal braces; an unknown placeholder raises `RecipeDataError` when the stream is built.
- JSONL lines with ``source``/``target`` (or ``input``/``output``) are used verbatim.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer._loader import (
    LOADER_OPTIONS,
    RecipeConfigError,
    RecipeDataError,
    RecipeFileError,
    RecipeInternalError,
    RecipeLoader,
    RecipeLoaderError,
    cache_root,
)
from trainer.config import DataSource
from trainer.data import hf_datasets
from trainer.model.model_files import resolve_tokenizer_file

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainConfig

__all__ = [
    "LOADER_OPTIONS",
    "RecipeConfigError",
    "RecipeDataError",
    "RecipeFileError",
    "RecipeInternalError",
    "RecipeLoaderError",
    "RecipeStream",
    "loader_options",
    "inspect_report",
    "mixture_summary",
    "records_in",
    "resolve_sources",
    "stream_for",
    "to_device",
]

log = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


def _as_list(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


class RecipeStream:
    """Iterable of padded batches (dicts of int64 numpy arrays: input_ids, attention_mask, labels), or with
    `packing=True` packed ones (also encoder/decoder_segment_ids and encoder/decoder_positions).

    One pass over the stream is one epoch; afterwards the stream moves on to the next epoch (a new order when
    shuffling). The keyword options (`batch_size` or `max_tokens`, `max_source_length`, `shuffle`, `seed`,
    ...) are `LOADER_OPTIONS` (name, type, default, doc; docs/loader.md lists them); the Rust loader checks
    them and raises `RecipeConfigError` for an unknown option or a bad value. Bad records are skipped and
    counted (see `stats()`), or raise `RecipeDataError` with `strict=True`. Missing/empty/corrupt files raise
    `RecipeFileError` (an OSError). All of them derive from `RecipeLoaderError`.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        tokenizer: str | os.PathLike[str],
        **options: Any,
    ) -> None:
        self._inner = RecipeLoader(_as_list(paths), os.fspath(tokenizer), **options)

    def __iter__(self) -> Iterator[Batch]:
        """Yields the remaining batches of the current epoch (all of them unless resumed mid-epoch)."""
        while (batch := self._inner.next_batch()) is not None:
            yield batch

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        return len(self._inner)

    @property
    def epoch(self) -> int:
        return self._inner.epoch

    def set_epoch(self, epoch: int) -> None:
        """Starts `epoch` from its first batch (as torch's DistributedSampler.set_epoch)."""
        self._inner.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: epoch, batches consumed in it, and a fingerprint of data + settings."""
        epoch, consumed, fingerprint = self._inner.state()
        return {"epoch": epoch, "batches_consumed": consumed, "fingerprint": fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues exactly where `state` was taken; refuses a state from other data or settings."""
        try:
            epoch, consumed, fingerprint = (
                int(state["epoch"]),
                int(state["batches_consumed"]),
                str(state["fingerprint"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RecipeConfigError(f"not a RecipeStream state: {state!r}") from e
        self._inner.load_state(epoch, consumed, fingerprint)

    def stats(self) -> dict[str, Any]:
        """yielded (records), skipped (reason -> count), examples (file:line), real_token_share, and more."""
        return json.loads(self._inner.stats_json())

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Token lengths (source, target) of the records in this split, after truncation."""
        return self._inner.lengths()

    def sample_records(self, n: int, seed: int) -> list[dict]:
        """`n` of this split's records (all when fewer), drawn with `seed` (the same on every rank), in file
        order, as the batches render and tokenize them: dicts with `id` (file:line), `source`, `reference`,
        `source_ids` and `target_ids`. Only these records are read."""
        return self._inner.sample_records(n, seed)


def to_device(batch: Batch | dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch as torch tensors on `device`: on CUDA pinned and copied with non_blocking=True; on the CPU the
    numpy memory is shared, not copied."""
    import torch

    out = {}
    for k, v in batch.items():
        t = torch.as_tensor(v)
        if device.type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        elif device.type != "cpu":
            t = t.to(device)
        out[k] = t
    return out


def split_batch(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split a batch's rows into `parts` consecutive pieces (fewer if it has fewer rows), same data order.

    Columns that are padding in every row of a piece are trimmed so a half batch is also half the tokens. A
    packed batch (with `encoder_segment_ids`) is split by rows only, every key alike: its rows keep their
    fixed lengths, and a record never spans two rows.
    """
    if parts <= 1:
        return [batch]
    rows = len(batch["input_ids"])
    parts = min(parts, rows)
    bounds = [rows * i // parts for i in range(parts + 1)]
    pieces = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        piece = {k: v[lo:hi] for k, v in batch.items()}
        if "encoder_segment_ids" in batch:
            pieces.append(piece)
            continue
        src_len = int(piece["attention_mask"].sum(1).max())
        tgt_len = int((piece["labels"] != -100).sum(1).max())
        piece["input_ids"] = piece["input_ids"][:, :src_len]
        piece["attention_mask"] = piece["attention_mask"][:, :src_len]
        piece["labels"] = piece["labels"][:, :tgt_len]
        pieces.append(piece)
    return pieces


# Loader options whose config field has another name (Seq2SeqTrainingArguments' where it has one). Every
# other loader option is read from the config field of the same name when there is one.
_CONFIG_FIELD = {
    "batch_size": "per_device_train_batch_size",
    "strict": "strict_data",
    "num_threads": "loader_threads",
}


def loader_options(cfg: TrainConfig) -> dict[str, Any]:
    """The loader options a config sets: each option of `LOADER_OPTIONS` that has a config field."""
    names = (o["name"] for o in LOADER_OPTIONS)
    fields = {name: _CONFIG_FIELD.get(name, name) for name in names}
    return {name: getattr(cfg, field) for name, field in fields.items() if hasattr(cfg, field)}


def records_in(batch: Batch | dict[str, Any]) -> int:
    """Records in a batch: its rows, or in a packed batch the segments of all rows (the last segment id of a
    row is its number of records)."""
    segments = batch.get("encoder_segment_ids")
    if segments is None:
        return len(batch["input_ids"])
    return int(segments.max(1).sum()) if len(segments) else 0


def resolve_sources(entries: Sequence[str | DataSource]) -> tuple[list[str], list[float]]:
    """The paths (or globs) the loader reads for train_files/eval_files entries, and their weights: a Hugging
    Face dataset (hf://datasets/..., a save_to_disk directory) becomes its Parquet copy in the loader's cache
    directory (trainer.data.hf_datasets), anything else is read as given."""
    paths, weights = [], []
    for entry in entries:
        source = entry if isinstance(entry, DataSource) else DataSource(os.fspath(entry))
        path = source.path
        if hf_datasets.is_dataset(path):
            path = os.fspath(hf_datasets.to_parquet(path, source.split, source.name, cache_root()))
        elif source.split is not None or source.name is not None:
            raise RecipeConfigError(f"{source}: split and name are for Hugging Face datasets, not files")
        paths.append(path)
        weights.append(source.weight)
    return paths, weights


def packed_records(batch: Batch | dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (source ids, target ids) records of a packed batch, in row and segment order."""
    records = []
    for r in range(len(batch["input_ids"])):
        src_segments, tgt_segments = (
            np.asarray(batch["encoder_segment_ids"][r]),
            np.asarray(batch["decoder_segment_ids"][r]),
        )
        for seg in range(1, int(src_segments.max()) + 1):
            records.append(
                (
                    np.asarray(batch["input_ids"][r])[src_segments == seg],
                    np.asarray(batch["labels"][r])[tgt_segments == seg],
                )
            )
    return records


def padded_batch(records: Sequence[tuple[np.ndarray, np.ndarray]], pad_to_multiple_of: int = 1) -> Batch:
    """`records` as an unpacked batch, one record per row, right-padded (ids 0, labels -100) to the longest
    source and target rounded up to `pad_to_multiple_of`, as the loader pads."""

    def length(n: int) -> int:
        return -(-n // pad_to_multiple_of) * pad_to_multiple_of

    src_len = length(max(len(s) for s, _ in records))
    tgt_len = length(max(len(t) for _, t in records))
    batch = {
        "input_ids": np.zeros((len(records), src_len), dtype=np.int64),
        "attention_mask": np.zeros((len(records), src_len), dtype=np.int64),
        "labels": np.full((len(records), tgt_len), -100, dtype=np.int64),
    }
    for i, (s, t) in enumerate(records):
        batch["input_ids"][i, : len(s)] = s
        batch["attention_mask"][i, : len(s)] = 1
        batch["labels"][i, : len(t)] = t
    return batch


def stream_for(
    cfg: TrainConfig,
    tokenizer_file: str | os.PathLike[str],
    split: str = "all",
    *,
    paths: Sequence[str | DataSource] | None = None,
    batch_size: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> RecipeStream:
    """The RecipeStream a config describes: its files (or `paths`) with their mixing weights, task, lengths,
    batching and data options.

    split "train" shuffles (when cfg.shuffle); "eval" is the held-out share, each record once (no weights);
    with cfg.eval_fraction 0 both read everything. `batch_size` replaces cfg.per_device_train_batch_size (data
    inspect's default)."""
    files, weights = resolve_sources(paths if paths is not None else cfg.train_files)
    options = loader_options(cfg) | {
        "batch_size": batch_size or cfg.per_device_train_batch_size,
        "shuffle": cfg.shuffle and split in ("train", "all"),
        "split": split if cfg.eval_fraction > 0 else "all",
        "rank": rank,
        "world_size": world_size,
        "weights": weights if split != "eval" and any(w != 1 for w in weights) else None,
    }
    if split == "eval":  # held-out batches are unpacked: a row is one record, to generate from and score
        options |= {"packing": False, "packed_source_length": None, "packed_target_length": None}
    return RecipeStream(files, tokenizer_file, **options)


def mixture_summary(stats: dict[str, Any], names: Sequence[str] | None = None) -> str | None:
    """One line on what each source contributes to an epoch (records drawn, of how many, at which weight),
    or None for a single source read once. `names`: the sources as the user named them (a dataset's id
    rather than its Parquet copy), in order."""
    sources = stats["sources"]
    if len(sources) < 2 and all(s["weight"] == 1 for s in sources):
        return None
    total = max(stats["epoch_records"], 1)
    names = names or [s["path"] for s in sources]
    parts = [
        f"{name} {s['drawn']:,} of {s['records']:,} records (weight {s['weight']:g}, "
        f"{100 * s['drawn'] / total:.1f}%)"
        for name, s in zip(names, sources, strict=True)
    ]
    return f"each epoch draws {stats['epoch_records']:,} records: " + "; ".join(parts)


def skipped_summary(
    stats: dict[str, Any], usable: int, *, examples: int = 3, training: bool = True
) -> str | None:
    """One line on the records the lenient reader skipped (counts by reason, the first few `file:line`), or
    None when nothing was skipped. `stats` is `RecipeStream.stats()` (or {"skipped", "examples"}); `usable`:
    records kept, all splits; `training`: end with where to see more and how to stop at the first."""
    skipped = stats["skipped"]
    n = sum(skipped.values())
    if n == 0:
        return None
    read = n + usable
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(skipped.items()))
    line = f"skipped {n} of {read} records ({100 * n / read:.1f}%): {reasons}"
    if stats["examples"]:
        line += "; first: " + "; ".join(stats["examples"][:examples])
    if training:
        line += " (`trainer data inspect` lists more; strict_data: true stops at the first)"
    return line


def _percentiles(a: np.ndarray) -> str:
    if a.size == 0:
        return "-"
    q = np.percentile(a, [50, 90, 99, 100]).astype(int)
    return f"p50 {q[0]}  p90 {q[1]}  p99 {q[2]}  max {q[3]}"


def inspect_report(paths: list[str], cfg: TrainConfig) -> str:
    """Text report for `trainer data inspect`: records, skips with examples, token lengths, padding waste."""
    # Without a batching setting, show what HF's default (8 rows, random order) would waste.
    batch_size = cfg.per_device_train_batch_size or (None if cfg.max_tokens else 8)
    tokenizer_file = resolve_tokenizer_file(cfg.model_name_or_path)
    stream = stream_for(cfg, tokenizer_file, paths=paths, batch_size=batch_size)
    st = stream.stats()
    src, tgt = stream.lengths()
    n_src_cut = int((src >= cfg.max_source_length).sum())
    n_tgt_cut = int((tgt >= cfg.max_target_length).sum())
    share = st["real_token_share"]
    batching = f"max_tokens={cfg.max_tokens}" if cfg.max_tokens else f"batch_size={batch_size}"
    if st["packed_shape"]:
        shape = st["packed_shape"]
        chosen = "set" if cfg.packed_source_length and cfg.packed_target_length else "chosen from the data"
        batching = (
            f"packing {shape['rows']} rows x ({shape['source_len']} + {shape['target_len']}) tokens "
            f"({batching}, row lengths {chosen})"
        )
    lines = [
        f"files: {len(st['files'])} ({', '.join(st['files'])})",
        f"records: {st['records']} usable, {sum(st['skipped'].values())} skipped",
    ]
    for reason, n in sorted(st["skipped"].items()):
        lines.append(f"  {reason}: {n}")
    if st["examples"]:
        lines.append("examples:")
        lines.extend(f"  {e}" for e in st["examples"][:20])
    if mixture := mixture_summary(st, paths):
        lines.append(f"mixture: {mixture}")
    lines += [
        f"source tokens (max {cfg.max_source_length}): {_percentiles(src)}",
        f"target tokens (max {cfg.max_target_length}): {_percentiles(tgt)}",
        f"truncated: source {n_src_cut}, target {n_tgt_cut}",
        f"{'' if st['packed_shape'] else 'batching '}{batching}: {len(stream)} batches/epoch, padding wastes "
        f"{100 * (1 - share):.1f}% of tokens (real-token share {100 * share:.1f}%)",
    ]
    if st["packed_shape"]:
        shape = st["packed_shape"]
        rows = st["batches_per_epoch"] * shape["rows"]
        lines.append(
            f"packing efficiency: {100 * share:.1f}% of the row capacity is real tokens, "
            f"{st['records'] / max(rows, 1):.1f} records per row"
        )
    if st["oversize_batches"]:
        lines.append(f"records over the max_tokens budget (own batch each): {st['oversize_batches']}")
    return "\n".join(lines)

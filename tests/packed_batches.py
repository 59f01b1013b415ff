"""Test-only: packed batches built in Python from unpacked records, to the loader's packed-batch contract
(keys and meaning as in trainer/model/packed_t5.py), so the model side can be tested before and apart from the
loader. Records go in order, each into the current row while both its source and target still fit."""

from __future__ import annotations

import torch

PAD_ID = 0


def pack(records: list[tuple[list[int], list[int]]], rows: int, source_len: int, target_len: int) -> dict:
    """(source ids, target ids) records -> a packed batch of `rows` rows of capacities source_len and
    target_len: dict of int64 tensors (input_ids, attention_mask, labels, encoder/decoder_segment_ids,
    encoder/decoder_positions). Unused rows are all padding."""
    batch = {
        "input_ids": torch.full((rows, source_len), PAD_ID),
        "labels": torch.full((rows, target_len), -100),
        "encoder_segment_ids": torch.zeros(rows, source_len, dtype=torch.int64),
        "decoder_segment_ids": torch.zeros(rows, target_len, dtype=torch.int64),
        "encoder_positions": torch.zeros(rows, source_len, dtype=torch.int64),
        "decoder_positions": torch.zeros(rows, target_len, dtype=torch.int64),
    }
    row, used_src, used_tgt, segment = 0, 0, 0, 0
    for src, tgt in records:
        if not 0 < len(src) <= source_len or not 0 < len(tgt) <= target_len:
            raise ValueError(f"record of lengths {len(src)}, {len(tgt)} does not fit a row")
        if used_src + len(src) > source_len or used_tgt + len(tgt) > target_len:
            row, used_src, used_tgt, segment = row + 1, 0, 0, 0
        if row >= rows:
            raise ValueError(f"{len(records)} records do not fit {rows} rows")
        segment += 1
        for ids, used, ids_key, seg_key, pos_key in (
            (src, used_src, "input_ids", "encoder_segment_ids", "encoder_positions"),
            (tgt, used_tgt, "labels", "decoder_segment_ids", "decoder_positions"),
        ):
            span = slice(used, used + len(ids))
            batch[ids_key][row, span] = torch.tensor(ids)
            batch[seg_key][row, span] = segment
            batch[pos_key][row, span] = torch.arange(len(ids))
        used_src, used_tgt = used_src + len(src), used_tgt + len(tgt)
    batch["attention_mask"] = (batch["encoder_segment_ids"] > 0).long()
    return batch


def segments(lengths: list[int], length: int) -> torch.Tensor:
    """One row's segment ids: segments of `lengths` back to back, then padding up to `length`."""
    ids = torch.zeros(length, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lengths):
        ids[start : start + n] = i + 1
        start += n
    if start > length:
        raise ValueError(f"segments of {sum(lengths)} tokens exceed the row's {length}")
    return ids

"""What a stream yields, record by record, for comparing streams: each row's source ids and target ids."""

from __future__ import annotations

from trainer.data.loader import RecipeStream


def rows(stream: RecipeStream) -> list[tuple[list[int], list[int]]]:
    """Every record of the stream's (remaining) epoch, in order: its source ids and its target ids."""
    out = []
    for b in stream:
        for ids, mask, labels in zip(b["input_ids"], b["attention_mask"], b["labels"], strict=True):
            out.append((ids[mask == 1].tolist(), labels[labels != -100].tolist()))
    return out

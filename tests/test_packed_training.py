"""Packing in the training path: `packing: true` trains on the loader's packed rows, and a packed step's loss
is the loss of the same records unpacked (same weights), through the trainer's own step and OOM split."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tiny_run import tiny_run_values
from transformers import T5ForConditionalGeneration

from trainer.config import TrainConfig
from trainer.data.loader import (
    packed_records,
    padded_batch,
    records_in,
    split_batch,
    stream_for,
    to_device,
)
from trainer.kernels.projections import accumulate_weight_grads_in_place
from trainer.model.load import load_model
from trainer.model.loss import token_loss_sum
from trainer.model.model_files import resolve_tokenizer_file
from trainer.optim import build_optimizer
from trainer.report.step_meter import TRAIN_LOG
from trainer.run.schedule import build_scheduler
from trainer.run.step import accumulate_gradients, optimizer_step
from trainer.run.train import train

ACCUMULATION = 2


def _cfg(model_dir, sample_csv, out, **kw) -> TrainConfig:
    values = dict(
        per_device_train_batch_size=3,  # packed: rows per micro-batch
        packing=True,
        gradient_accumulation_steps=ACCUMULATION,
        warmup_steps=0,
        max_steps=3,
        eval_steps=1000,
        save_steps=1000,
        save_final=False,
    )
    return TrainConfig.from_dict(tiny_run_values(model_dir, sample_csv, out, **values | kw))


def unpacked(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The records of a packed batch as an unpacked batch."""
    return to_device(padded_batch(packed_records(batch)), torch.device("cpu"))


def test_a_packed_step_has_the_loss_of_its_records_unpacked(tiny_model_without_dropout, sample_csv, tmp_path):
    cfg = _cfg(tiny_model_without_dropout, sample_csv, tmp_path / "out")
    assert train(cfg) == 0
    logged = [json.loads(line) for line in (tmp_path / "out" / TRAIN_LOG).read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in logged if "loss" in r}
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())

    # Step 1 with the initial weights: the run's first loader batches, packed, and their records unpacked.
    stream = stream_for(cfg, resolve_tokenizer_file(cfg.model_name_or_path), "train")
    group = [b for b, _ in zip(stream, range(ACCUMULATION), strict=False)]
    assert "encoder_segment_ids" in group[0]
    assert sum(records_in(b) for b in group) > sum(len(b["input_ids"]) for b in group)  # rows hold several
    model = T5ForConditionalGeneration.from_pretrained(tiny_model_without_dropout, dtype=torch.float32)
    with torch.no_grad():
        packed_sum = sum(token_loss_sum(model, to_device(b, torch.device("cpu"))) for b in group)
        unpacked_sum = sum(token_loss_sum(model, unpacked(b)) for b in group)
        # The OOM back-off's halves: the same rows, every key sliced alike, the same loss.
        halves_sum = sum(
            token_loss_sum(model, to_device(half, torch.device("cpu")))
            for b in group
            for half in split_batch(b, 2)
        )
    n_target = sum(int((b["labels"] != -100).sum()) for b in group)
    torch.testing.assert_close(packed_sum, unpacked_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(halves_sum, packed_sum, rtol=1e-5, atol=1e-5)
    assert losses[1] == pytest.approx(float(unpacked_sum) / n_target, rel=1e-4)


def test_split_batch_slices_packed_rows_without_trimming():
    rows, src, tgt = 5, 16, 24
    batch = {
        "input_ids": np.arange(rows * src).reshape(rows, src),
        "attention_mask": np.ones((rows, src), dtype=np.int64),
        "labels": np.full((rows, tgt), -100),
        "encoder_segment_ids": np.zeros((rows, src), dtype=np.int64),
        "decoder_segment_ids": np.zeros((rows, tgt), dtype=np.int64),
        "encoder_positions": np.zeros((rows, src), dtype=np.int64),
        "decoder_positions": np.zeros((rows, tgt), dtype=np.int64),
    }
    batch["encoder_segment_ids"][:, :4] = 1  # every row's tail is padding: an unpacked batch would be trimmed
    batch["attention_mask"][:, 4:] = 0
    batch["labels"][:, :3] = 7
    batch["decoder_segment_ids"][:, :3] = 1
    pieces = split_batch(batch, 2)
    assert [len(p["input_ids"]) for p in pieces] == [2, 3]
    for p, lo in zip(pieces, (0, 2), strict=True):
        assert set(p) == set(batch)
        for key, value in p.items():
            np.testing.assert_array_equal(value, batch[key][lo : lo + len(value)])  # same columns, same rows


@pytest.mark.parametrize("optimizer", ["adafactor", "adamw"])
def test_packed_and_padded_rows_of_the_same_records_make_the_same_update(
    optimizer, tiny_model_without_dropout, sample_csv, tmp_path
):
    """Packing is exact: one optimizer step over the same records, packed as the loader packs them or padded
    one record per row (split into micro-batches otherwise), through the trainer's own model, accumulation
    and update, leaves the same weights (fp32, dropout off)."""
    cfg = _cfg(tiny_model_without_dropout, sample_csv, tmp_path / "out", optimizer=optimizer)
    stream = stream_for(cfg, resolve_tokenizer_file(cfg.model_name_or_path), "train")
    packed_group = [
        to_device(b, torch.device("cpu")) for b, _ in zip(stream, range(ACCUMULATION), strict=False)
    ]
    records = [r for b in packed_group for r in packed_records(b)]
    records.sort(key=lambda r: (len(r[1]), len(r[0])))  # as length bucketing would group them
    thirds = [records[i::3] for i in range(3)]  # three padded micro-batches of other records than the rows
    padded_group = [to_device(padded_batch(part), torch.device("cpu")) for part in thirds]

    def one_step(group: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = load_model(cfg, torch.device("cpu"))
        accumulate_weight_grads_in_place(model)  # as one process trains
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        schedule = build_scheduler(opt, cfg, total_steps=10)
        loss_sum, n_target = accumulate_gradients(model, group, split=1)
        optimizer_step(model, opt, schedule, loss_sum, n_target, max_grad_norm=cfg.max_grad_norm)
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        return before, after

    before, after_packed = one_step(packed_group)
    _, after_padded = one_step(padded_group)
    for name, w in after_padded.items():
        update_padded, update_packed = w - before[name], after_packed[name] - before[name]
        assert update_padded.norm() > 0, name  # every weight learns from these records
        # The weights agree to ~1e-7 of their size; the step's update itself to ~1e-5 of its size.
        assert (after_packed[name] - w).norm() <= 1e-6 * w.norm(), name
        assert (update_packed - update_padded).norm() <= 1e-4 * update_padded.norm(), name

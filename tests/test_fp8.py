"""FP8 matmuls (`fp8: true`): the casts, one projection's forward and backward against fp32 math, the shared
input cast, and a training run of the tiny model that learns and saves a plain bf16-compatible T5."""

from __future__ import annotations

import json

import torch
from tiny_run import tiny_run_values
from transformers import T5ForConditionalGeneration

from trainer import fp8
from trainer.config import TrainConfig
from trainer.train import TRAIN_LOG, train


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().float() - want.detach().float()).norm() / want.detach().float().norm())


def test_cast_keeps_each_value_to_fp8_precision_in_both_layouts_with_zero_padding_rows():
    torch.manual_seed(0)
    x = torch.randn(37, 48, dtype=torch.bfloat16) * 3
    x[5, 7] = -200.0  # the absolute maximum sets the scale
    c = fp8.cast(x, fp8.E4M3)
    assert c.rows.shape == (48, 48) and c.cols.shape == (48, 48)  # 37 rows padded to 48
    assert torch.equal(c.cols, c.rows.t().contiguous())
    assert not c.rows[37:].float().any()
    back = c.rows[:37].float() * c.inverse_scale
    assert back[5, 7] == -200.0  # the maximum maps to e4m3's largest value exactly
    big = x.float().abs() > 1  # e4m3 keeps 3 mantissa bits: within 2**-4 relative, normal numbers
    assert ((back - x.float()).abs()[big] <= x.float().abs()[big] * 2**-4).all()


def test_projection_forward_and_backward_match_fp32_within_fp8_error_and_bf16_without_gradients():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    layer = fp8.Fp8Linear(linear, fp8.InputCasts())
    x = torch.randn(3, 10, 64, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(3, 10, 96, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(grad)
    x32, w32 = x.detach().float().requires_grad_(), linear.weight.detach().float().requires_grad_()
    y32 = x32 @ w32.t()
    y32.backward(grad.float())
    assert y.shape == (3, 10, 96) and y.dtype == torch.bfloat16
    assert _relative_error(y, y32) < 0.05
    assert _relative_error(x.grad, x32.grad) < 0.1  # gradients in e5m2: 2 mantissa bits
    assert _relative_error(linear.weight.grad, w32.grad) < 0.1
    with torch.no_grad():  # evaluation and generation: the bf16 linear itself
        assert torch.equal(layer(x), torch.nn.functional.linear(x, linear.weight))


def test_projections_of_one_input_share_its_cast_until_it_changes():
    casts = fp8.InputCasts()
    x = torch.randn(8, 32)
    first = casts.get(x)
    assert casts.get(x) is first  # q, k and v
    assert casts.get(x.clone()) is not first  # another tensor
    x.mul_(2)  # changed in place: cast again
    assert casts.get(x) is not first


def test_training_with_fp8_learns_and_saves_the_same_t5(tiny_model_dir, sample_csv, tmp_path, caplog):
    caplog.set_level("INFO")
    values = tiny_run_values(
        tiny_model_dir,
        sample_csv,
        tmp_path / "out",
        dtype="bfloat16",
        fp8=True,
        gradient_checkpointing=True,
        per_device_train_batch_size=8,
        max_steps=30,
        learning_rate=3e-3,
        eval_steps=1000,
        save_steps=1000,
    )
    train(TrainConfig.from_dict(values))
    assert "fp8: 36 linear layers of the blocks" in caplog.text  # 2 x (4 + 3) + 2 x (4 + 4 + 3)
    rows = [json.loads(line) for line in (tmp_path / "out" / TRAIN_LOG).read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 30 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    saved = T5ForConditionalGeneration.from_pretrained(tmp_path / "out" / "final")
    original = T5ForConditionalGeneration.from_pretrained(tiny_model_dir)
    assert saved.state_dict().keys() == original.state_dict().keys()

"""trainer.plan.gpu_specs: the FLOPs count behind MFU, and tokens/s and epoch time predicted from an MFU."""

from __future__ import annotations

import pytest

from trainer.model.tiny_model import flan_t5_config
from trainer.plan.gpu_specs import (
    GPUS,
    flops_per_real_token,
    flops_per_token,
    gpu_spec,
    predicted_epoch_seconds,
    predicted_tokens_per_s,
)

XL = flan_t5_config("xl", vocab_size=32128)


def test_flops_per_token_of_flan_t5_xl_are_the_documented_ones():
    # bench/NOTES.md: 8.15 GFLOP per source token and 8.55 per target token for FLAN-T5-XL.
    per_source, per_target = flops_per_token(XL)
    assert per_source == pytest.approx(8.153e9, rel=1e-3)
    assert per_target == pytest.approx(8.549e9, rel=1e-3)


def test_a_target_token_costs_the_lm_head_and_a_source_token_does_not():
    _, per_target = flops_per_token(XL)
    bigger_vocab = flan_t5_config("xl", vocab_size=32128 + 1000)
    per_source_big, per_target_big = flops_per_token(bigger_vocab)
    assert per_source_big == flops_per_token(XL)[0]
    assert per_target_big - per_target == pytest.approx(6 * 1000 * XL.d_model)


def test_mfu_of_the_readme_gives_back_its_tokens_per_second():
    # README: 34,901 real tokens/s at 29.8% MFU of 989 TFLOP/s on an H100, records of mean length 101 + 278.
    per_real_token = flops_per_real_token(XL, 101, 278)
    assert per_real_token == pytest.approx(8.44e9, rel=2e-3)
    assert predicted_tokens_per_s("H100", 0.298, per_real_token) == pytest.approx(34_901, rel=0.01)


def test_geforce_cards_are_predicted_at_their_fp32_accumulate_rate():
    per_real_token = flops_per_real_token(XL, 101, 278)
    rtx5090 = predicted_tokens_per_s("RTX 5090", 0.3, per_real_token)
    rtx4090 = predicted_tokens_per_s("RTX 4090", 0.3, per_real_token)
    h100 = predicted_tokens_per_s("H100", 0.3, per_real_token)
    assert rtx5090 / h100 == pytest.approx(209.5 / 989)
    assert rtx4090 / rtx5090 == pytest.approx(165.2 / 209.5)
    for spec in GPUS.values():  # the rate training uses is never above the spec sheet's headline
        assert spec.bf16_tflops <= spec.spec_sheet_tflops


def test_epoch_time_is_the_work_over_the_rate():
    per_source, per_target = flops_per_token(XL)
    seconds = predicted_epoch_seconds("h200", 0.25, XL, source_tokens=10**9, target_tokens=3 * 10**9)
    assert seconds == pytest.approx((per_source * 1e9 + per_target * 3e9) / (0.25 * 989e12))
    # the same data at twice the MFU takes half the time
    assert predicted_epoch_seconds("h200", 0.5, XL, 10**9, 3 * 10**9) == pytest.approx(seconds / 2)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("RTX 5090", "RTX 5090"),
        ("rtx5090", "RTX 5090"),
        ("5090", "RTX 5090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
    ],
)
def test_gpu_names_as_users_and_torch_write_them(name, expected):
    assert gpu_spec(name).name == expected


@pytest.mark.parametrize("name", ["H100 PCIe", "RTX 2080", ""])
def test_an_unknown_gpu_is_one_clear_error(name):
    with pytest.raises(
        ValueError,
        match="unknown GPU .*known: RTX 5090, RTX 4090, RTX 4080, RTX 3090, L40S, RTX 6000 Ada, A100",
    ):
        gpu_spec(name)


def test_mfu_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="mfu must be a fraction"):
        predicted_tokens_per_s("H100", 29.8, 8.44e9)  # a percentage, not a fraction

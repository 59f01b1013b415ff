"""bf16 weights with Kahan-compensated updates track an fp32 run; naive bf16 updates do not."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from trainer import optim
from trainer.optim import Adafactor, build_optimizer, lr_lambda

STEPS = 25


@pytest.fixture(scope="module")
def small_t5():
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 128, (8, 16), generator=g)
    y = torch.randint(3, 128, (8, 16), generator=g)
    return model, x, y


def _final_loss(small_t5, dtype, optimizer, update, lr):
    base, x, y = small_t5
    model = copy.deepcopy(base).to(dtype)
    cfg = SimpleNamespace(
        optimizer=optimizer,
        bf16_update=update,
        learning_rate=lr,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
    )
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    for _ in range(STEPS):
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return model.float()(input_ids=x, labels=y).loss.item()


# Learning rates so small that most updates fall below bf16 resolution of the weights, as in fine-tuning.
@pytest.mark.parametrize(("optimizer", "lr"), [("adamw", 2e-5), ("adafactor", 1e-4)])
def test_kahan_bf16_matches_fp32_and_naive_does_not(small_t5, optimizer, lr, record_property):
    start = small_t5[0](input_ids=small_t5[1], labels=small_t5[2]).loss.item()
    ref = _final_loss(small_t5, torch.float32, optimizer, "kahan", lr)
    kahan = _final_loss(small_t5, torch.bfloat16, optimizer, "kahan", lr)
    naive = _final_loss(small_t5, torch.bfloat16, optimizer, "naive", lr)
    report = (
        f"{optimizer}: start {start:.4f}, fp32 {ref:.4f}, bf16+Kahan {kahan:.4f} "
        f"({100 * (kahan - ref) / ref:+.2f}%), naive bf16 {naive:.4f} ({100 * (naive - ref) / ref:+.2f}%)"
    )
    print(report)
    record_property("precision", report)
    assert ref < start - 0.4, report  # the reference did learn, so the comparison means something
    assert abs(kahan - ref) <= 0.02 * ref, report
    # Naive bf16 loses a visible part of the progress that fp32 and Kahan make.
    assert abs(naive - ref) > abs(kahan - ref), report


# Weights of one shape are updated as stacks of at most STACK_BYTES: one weight per stack (1), stacks that
# split a shape group with a remainder (5000: four 32x32 fp32 weights, then the rest), and the default.
@pytest.mark.parametrize("stack_bytes", [1, 5000, optim.STACK_BYTES])
def test_adafactor_matches_transformers_in_fp32(small_t5, stack_bytes, monkeypatch):
    from transformers.optimization import Adafactor as HFAdafactor

    monkeypatch.setattr(optim, "STACK_BYTES", stack_bytes)
    base, x, y = small_t5
    models = []
    for cls, kwargs in [
        (HFAdafactor, dict(scale_parameter=False, relative_step=False, warmup_init=False)),
        (Adafactor, {}),
    ]:
        model = copy.deepcopy(base)
        opt = cls(model.parameters(), lr=1e-3, **kwargs)
        for _ in range(3):
            model(input_ids=x, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    ref, ours = (dict(m.named_parameters()) for m in models)
    for name, w in ref.items():
        moved = (w - base.get_parameter(name)).norm()
        assert (ours[name] - w).norm() <= 1e-4 * moved, name


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_compiled_adafactor_keeps_the_kahan_buffer(device):
    """The compiled update (what CUDA runs) equals the eager one on bf16 weights, Kahan buffer included.
    Inductor keeps intermediates in fp32: a bf16 round trip written as casts was skipped and the buffer
    stayed zero, i.e. plain bf16 updates."""
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 16), (24, 16), (16, 40), (16,)]
    weights = [(torch.randn(s, generator=g) * 0.02).bfloat16().to(device) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 1e-3).bfloat16().to(device) for s in shapes] for _ in range(3)]
    results = []
    for compile in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = Adafactor(params, lr=1e-4, kahan=True, compile=compile)
        for step_grads in grads:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad
            opt.step()
        results.append([p.float() + opt.state[p]["kahan_comp"].float() for p in params])
        comps = [opt.state[p]["kahan_comp"] for p in params]
        assert all(c.abs().max() > 0 for c in comps), f"compile={compile}: a Kahan buffer is all zero"
    for w0, eager, compiled in zip(weights, *results, strict=True):
        moved = (eager - w0.float()).norm()
        assert (compiled - eager).norm() <= 1e-3 * moved


def test_round_to_bf16_matches_the_cast():
    g = torch.Generator().manual_seed(0)
    scales = 10.0 ** torch.randint(-30, 30, (100_000,), generator=g)
    # Halfway cases round to even; the largest finite values; infinity and signed zeros.
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38, float("inf"), 0.0, -0.0])
    x = torch.cat([torch.randn(100_000, generator=g) * scales, ties])
    assert torch.equal(optim.round_to_bf16(x), x.bfloat16().float())


def test_schedules():
    kw = dict(warmup_steps=10, total_steps=110)
    assert lr_lambda(0, kind="linear", **kw) == pytest.approx(0.1)
    assert lr_lambda(9, kind="linear", **kw) == pytest.approx(1.0)
    assert lr_lambda(60, kind="linear", **kw) == pytest.approx(0.5)
    assert lr_lambda(110, kind="linear", **kw) == 0.0
    assert lr_lambda(60, kind="cosine", **kw) == pytest.approx(0.5)
    assert lr_lambda(10, kind="cosine", **kw) == pytest.approx(1.0)
    assert lr_lambda(0, kind="constant", **kw) == 1.0
    assert lr_lambda(0, kind="constant_with_warmup", **kw) == pytest.approx(0.1)
    assert lr_lambda(100, kind="constant_with_warmup", **kw) == 1.0

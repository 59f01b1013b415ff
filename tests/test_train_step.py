"""The step: token-normalised gradient accumulation, OOM halving with retry, the allocator environment."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from trainer.config import TrainConfig
from trainer.data.loader import split_batch
from trainer.infra import memory
from trainer.plan.memory_plan import plan_run
from trainer.run.run_state import OomBackoff
from trainer.run.step import accumulate_gradients, accumulate_with_oom_backoff, probe_memory


def _model():
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=100,
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
    return T5ForConditionalGeneration(config).double()


def _batch(rows, src, tgt, seed):
    """Right-padded rows of different lengths, labels padded with -100, like the loader's batches."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (rows, src), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(3, 100, (rows, tgt), generator=g)
    for r in range(rows):
        s = int(torch.randint(2, src + 1, (1,), generator=g))
        t = int(torch.randint(1, tgt + 1, (1,), generator=g))
        ids[r, s:], mask[r, s:], labels[r, t:] = 0, 0, -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _pad_cat(batches):
    src = max(b["input_ids"].shape[1] for b in batches)
    tgt = max(b["labels"].shape[1] for b in batches)

    def pad(t, n, v):
        return torch.nn.functional.pad(t, (0, n - t.shape[1]), value=v)

    return {
        "input_ids": torch.cat([pad(b["input_ids"], src, 0) for b in batches]),
        "attention_mask": torch.cat([pad(b["attention_mask"], src, 0) for b in batches]),
        "labels": torch.cat([pad(b["labels"], tgt, -100) for b in batches]),
    }


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_accumulated_micro_batches_give_the_gradient_of_one_big_batch():
    # Different row counts and target lengths: a per-micro-batch mean would weight tokens unequally.
    group = [_batch(2, 7, 5, 1), _batch(4, 9, 11, 2), _batch(3, 5, 3, 3)]
    model = _model()
    loss_k, n_k = accumulate_gradients(model, group, split=1)
    grads_k = _grads(model)
    model.zero_grad()
    loss_1, n_1 = accumulate_gradients(model, [_pad_cat(group)], split=1)
    grads_1 = _grads(model)
    assert n_k == n_1 == sum(int((b["labels"] != -100).sum()) for b in group)
    assert float(loss_k) == pytest.approx(float(loss_1), rel=1e-10)
    for a, b in zip(grads_k, grads_1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # ... and the same as splitting every batch in halves (what an OOM back-off does).
    model.zero_grad()
    accumulate_gradients(model, group, split=2)
    for a, b in zip(_grads(model), grads_1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_split_batch_keeps_rows_in_order_and_trims_padding():
    batch = _batch(5, 8, 6, 4)
    pieces = split_batch(batch, 2)
    assert [len(p["input_ids"]) for p in pieces] == [2, 3]
    for p, lo in zip(pieces, (0, 2), strict=True):
        n = len(p["input_ids"])
        w = p["input_ids"].shape[1]
        assert torch.equal(p["input_ids"], batch["input_ids"][lo : lo + n, :w])
        assert p["attention_mask"][:, -1].any()  # no all-padding column left at the end
    assert len(split_batch(batch, 16)) == 5  # never an empty piece


class _OomOnce:
    """A forward pre-hook raising a real torch.OutOfMemoryError for micro-batches of more than `rows` rows."""

    def __init__(self, rows):
        self.rows, self.raised, self.seen = rows, 0, []

    def __call__(self, module, args, kwargs):
        n = (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[0]
        self.seen.append(n)
        if n > self.rows:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected for a batch of {n} rows)")


class _Reporter:
    def __init__(self):
        self.calls = []

    def oom_backoff(self, **kw):
        self.calls.append(kw)


def test_oom_halves_the_micro_batch_and_retries_the_same_data():
    group = [_batch(8, 9, 7, 5), _batch(8, 6, 10, 6)]
    reference = _model()
    accumulate_gradients(reference, group, split=1)
    model = _model()
    hook = _OomOnce(rows=2)  # only micro-batches of <= 2 rows fit: two halvings (8 -> 4 -> 2)
    model.encoder.register_forward_pre_hook(hook, with_kwargs=True)  # the first module a step runs
    cfg = TrainConfig(gradient_accumulation_steps=2, per_device_train_batch_size=8, max_oom_halvings=4)
    oom = OomBackoff()
    reporter = _Reporter()
    loss, n = accumulate_with_oom_backoff(model, group, oom, cfg, plan_run(cfg), reporter, step=3)
    assert oom == OomBackoff(split=4, halvings=2)
    assert [c["micro_batch"] for c in reporter.calls] == ["4 rows", "2 rows"]
    assert [c["accumulation"] for c in reporter.calls] == [4, 8]  # effective batch unchanged
    assert hook.seen[-8:] == [2] * 8
    # The retried step computed exactly the gradient of the whole group: no partial step leaked in.
    for a, b in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_oom_gives_up_after_max_halvings_with_a_memory_summary():
    model = _model()
    model.encoder.register_forward_pre_hook(_OomOnce(rows=0), with_kwargs=True)
    cfg = TrainConfig(max_tokens=4096, max_oom_halvings=2)
    with pytest.raises(RuntimeError, match=r"after 2 halvings[\s\S]*memory summary"):
        accumulate_with_oom_backoff(
            model, [_batch(8, 5, 5, 7)], OomBackoff(), cfg, plan_run(cfg), None, step=0
        )


def test_stop_request_interrupts_at_a_micro_batch_boundary():
    class Stop:
        def __bool__(self):
            return True

    assert accumulate_gradients(_model(), [_batch(2, 4, 4, 8)], split=1, stop=Stop()) is None


@pytest.mark.parametrize("user_value", [None, "max_split_size_mb:64"])
def test_allocator_env_is_set_before_cuda_and_a_user_value_wins(user_value):
    env = {k: v for k, v in os.environ.items() if k not in memory.ALLOC_ENV_VARS}
    if user_value:
        env["PYTORCH_CUDA_ALLOC_CONF"] = user_value
    code = (
        "import logging, os; logging.basicConfig(level=logging.INFO)\n"
        "from trainer.infra import memory\n"
        "v = memory.set_alloc_conf('expandable_segments:True')\n"
        "print(v, os.environ['PYTORCH_CUDA_ALLOC_CONF'], memory.alloc_conf_in_force())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = user_value or "expandable_segments:True"
    assert out.stdout.split()[:2] == [expected, expected]
    assert f"PYTORCH_CUDA_ALLOC_CONF={expected}" in out.stdout


def test_empty_cache_schedule_runs_only_every_n_steps():
    sched = memory.EmptyCacheSchedule(3)
    assert [sched.after_step(s) for s in range(1, 8)] == [False, False, True, False, False, True, False]
    assert not any(memory.EmptyCacheSchedule(0).after_step(s) for s in range(1, 5))


def test_the_cache_is_also_cleared_after_each_evaluation_unless_never():
    sched = memory.EmptyCacheSchedule(100)
    assert sched.after_evaluation() and sched.after_evaluation() and sched.calls == 2
    never = memory.EmptyCacheSchedule(0)
    assert not never.after_evaluation() and never.calls == 0


def test_oom_probe_halves_the_budget_before_training():
    model = _model()
    hook = _OomOnce(rows=3)  # micro-batches of more than 3 rows do not fit
    model.encoder.register_forward_pre_hook(hook, with_kwargs=True)
    cfg = TrainConfig(per_device_train_batch_size=8, max_source_length=6, max_target_length=5, oom_probe=True)
    oom = OomBackoff()
    probe_memory(model, cfg, plan_run(cfg), oom, torch.device("cpu"))
    assert oom == OomBackoff(split=4, halvings=2)  # 8 rows -> 4 -> 2: training starts with what fits
    assert hook.seen == [8, 4, 2, 2, 2, 2]  # each failure retries the same rows, halved
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind


@pytest.mark.skipif(torch.cuda.is_available(), reason="the plan without a GPU to plan for")
def test_no_batch_setting_starts_from_the_memory_plan():
    cfg = TrainConfig(max_source_length=64, max_target_length=96)
    plan = plan_run(cfg)
    assert plan.max_tokens == 2 * (64 + 96)  # no GPU here: two maximal rows
    assert plan.decoder_blocks_without_checkpointing == 0  # and every block checkpointed
    assert cfg.max_tokens is None and cfg.decoder_blocks_without_checkpointing is None  # the config is kept


def test_max_grad_norm_zero_measures_the_norm_without_clipping():
    from trainer.infra.distributed import grad_norm
    from trainer.run.schedule import clip_coefficient

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = grad_norm([p])
    assert norm.item() == 5.0
    assert clip_coefficient(norm, 0.0) is None
    assert clip_coefficient(norm, 1.0).item() == pytest.approx(0.2, rel=1e-5)
    assert clip_coefficient(norm, 10.0).item() == 1.0  # never scaled up


def test_cuda_graphs_without_a_gpu_run_the_micro_steps_eagerly(caplog):
    from trainer.config import TrainConfig
    from trainer.run.setup import micro_step_graph

    cfg = TrainConfig(train_files=["recipes.jsonl"], packing=True, cuda_graphs=True)
    with caplog.at_level(logging.WARNING):
        assert micro_step_graph(cfg, torch.device("cpu"), model=None, train_module=None) is None
    assert "cuda_graphs: no CUDA GPU here; the micro-steps run eagerly" in caplog.text

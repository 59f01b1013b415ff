"""cuda_graphs (trainer.run.cuda_graphs): replayed micro-steps against eager ones on the tiny FLAN-T5 with the
packed Triton kernels, and under torchrun on two GPUs against one process. Needs a CUDA GPU (two for the
last; skipped elsewhere); on CPU the trainer runs such a config eagerly (test_train_step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from packed_batches import pack
from tiny_run import tiny_run_values

from trainer.config import TrainConfig
from trainer.model.loss import Seq2SeqLMLoss
from trainer.report.step_meter import TRAIN_LOG
from trainer.run.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

SHAPE = (2, 64, 96)  # rows, source and target capacity: every micro-batch of a run has one shape
LENGTHS = [(7, 9), (20, 30), (12, 1), (5, 14), (30, 40), (2, 6)]


def micro_batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        recs = [
            (
                torch.randint(3, 500, (s,), generator=g).tolist(),
                torch.randint(3, 500, (t,), generator=g).tolist(),
            )
            for s, t in LENGTHS
        ]
        out.append({k: v.cuda() for k, v in pack(recs, *SHAPE).items()})
    return out


def load(model_dir, **config):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.kernels.projections import accumulate_weight_grads_in_place
    from trainer.model.fused_t5 import use_triton_attention
    from trainer.model.load import skip_checkpointing
    from trainer.model.swaps import use_fused_t5_ops

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, attn_implementation="eager", **config)
    model = model.to("cuda", torch.bfloat16).train()
    use_fused_t5_ops(model)
    use_triton_attention(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    skip_checkpointing(model, 1, 1)  # the trainer's mix: checkpointed blocks and blocks that keep all
    accumulate_weight_grads_in_place(model)  # as the trainer runs one process
    return model


def grads_of(model) -> dict:
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, tol: float):
    assert got.keys() == want.keys()
    for name in want:
        err = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30))
        assert err < tol, (name, err)


def test_replayed_micro_steps_accumulate_the_eager_gradients(tiny_model_dir):
    from trainer.run.cuda_graphs import WARMUP, MicroStepGraph

    model = load(tiny_model_dir, dropout_rate=0.0)
    loss_module = Seq2SeqLMLoss(model)
    batches = micro_batches(WARMUP + 3)
    scale = 1.0 / 1000

    def eager() -> list[float]:
        model.zero_grad(set_to_none=True)
        losses = []
        for b in batches:
            loss = loss_module(**b)
            (loss * scale).backward()
            losses.append(float(loss.detach()))
        return losses  # and no autograd graph left alive: capture needs its nodes on the capture's stream

    want_losses = eager()
    want = grads_of(model)

    params = [p for p in model.parameters() if p.requires_grad]
    graph = MicroStepGraph(lambda **b: loss_module(**b), params)
    model.zero_grad(set_to_none=True)
    losses = [float(graph.run(b, scale)) for b in batches]
    assert graph.captures == 1  # warm-up micro-steps, then one capture replayed for the rest
    assert losses == pytest.approx(want_losses, rel=1e-3)
    assert_grads_close(grads_of(model), want, 2e-2)

    # Zeroed in place (the update's zero_grad), the gradients keep their addresses: the same graph replays.
    model.zero_grad(set_to_none=False)
    graph.run(batches[0], scale)
    assert graph.captures == 1
    # Freed (e.g. after running out of memory), they are new tensors: captured again, still right.
    model.zero_grad(set_to_none=True)
    for b in batches:
        graph.run(b, scale)
    assert graph.captures == 2
    assert_grads_close(grads_of(model), want, 2e-2)


def test_checkpointed_blocks_replay_their_dropout_in_the_recompute(tiny_model_dir):
    # Dropout everywhere (attention included): a checkpointed block's recompute inside the graph must draw
    # the random numbers its forward drew, so that from the same seed the gradients equal a graph's without
    # checkpointing.
    from trainer.run.cuda_graphs import WARMUP, MicroStepGraph

    model = load(tiny_model_dir, dropout_rate=0.1)
    loss_module = Seq2SeqLMLoss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = micro_batches(1)[0]

    def captured():
        graph = MicroStepGraph(lambda **b: loss_module(**b), params)
        for _ in range(WARMUP + 1):
            graph.run(batch, 1.0)
        assert graph.captures == 1
        return graph

    def replayed(graph, seed: int) -> tuple[float, dict]:
        model.zero_grad(set_to_none=False)
        torch.cuda.manual_seed(seed)
        loss = float(graph.run(batch, 1.0))
        return loss, grads_of(model)

    checkpointed = replayed(captured(), 5)
    model.gradient_checkpointing_disable()
    graph = captured()
    plain = replayed(graph, 5)
    assert checkpointed[0] == plain[0]
    assert_grads_close(checkpointed[1], plain[1], 1e-5)
    # Each replay draws new numbers from the generator: another seed drops other probabilities.
    other = replayed(graph, 6)
    assert other[0] != plain[0]


def test_dropping_the_graphs_waits_for_a_replay_still_running(tiny_model_dir):
    """reset() (before an evaluation, after running out of memory) gives the graphs' memory pool back to the
    device: a replay still queued on the GPU would then run on unmapped memory (an illegal memory access,
    at random). It waits for the GPU first."""
    from trainer.run.cuda_graphs import WARMUP, MicroStepGraph

    model = load(tiny_model_dir, dropout_rate=0.0)
    loss_module = Seq2SeqLMLoss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    graph = MicroStepGraph(lambda **b: loss_module(**b), params)
    for b in micro_batches(WARMUP + 2):
        graph.run(b, 1.0 / 1000)
    assert graph.captures == 1
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the last replay
    graph.run(micro_batches(1)[0], 1.0 / 1000)
    assert not torch.cuda.current_stream().query()  # the replay is still queued
    graph.reset()
    assert torch.cuda.current_stream().query()  # it finished before the pool went back
    assert graph.graph is None


def test_the_optimizer_update_replays_as_a_graph_exactly_like_an_eager_step(tiny_model_dir):
    """Adafactor's update captured in the micro-step graph's pool: after a few steps (the host advancing the
    step counts, whose scalars the graph reads), one replayed update from given gradients writes the weights
    and Kahan buffers an eager step writes from the same state, bit for bit."""
    from trainer.optim.adafactor_optimizer import Adafactor
    from trainer.run.cuda_graphs import MicroStepGraph

    model = load(tiny_model_dir, dropout_rate=0.0)
    loss_module = Seq2SeqLMLoss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = Adafactor(params, lr=1e-3)
    graph = MicroStepGraph(lambda **b: loss_module(**b), params)
    batches = micro_batches(4)
    for _ in range(3):
        for b in batches:
            graph.run(b, 1.0 / 1000)
        graph.update(opt, opt.advance())
        opt.zero_grad(set_to_none=False)
    # Once more after the first (eager) update, at once: a warm shape runs no eager micro-step again.
    assert graph.update_graph is not None and graph.captures == 2
    assert {s["step"] for s in opt.state.values()} == {3}

    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(p.shape, generator=g, device="cuda").to(p.dtype) * 1e-3 for p in params]
    saved = [p.detach().clone() for p in params]
    saved_states = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params
    ]

    def step(replayed: bool) -> list[torch.Tensor]:
        for p, w, grad, st in zip(params, saved, grads, saved_states, strict=True):
            p.data.copy_(w)
            p.grad.copy_(grad)
            for k, v in st.items():
                if torch.is_tensor(v):
                    opt.state[p][k].copy_(v)
                else:
                    opt.state[p][k] = v
        if replayed:
            graph.update(opt, opt.advance())
        else:
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in params] + [opt.state[p]["kahan_comp"].clone() for p in params]

    replayed, eager = step(replayed=True), step(replayed=False)
    assert graph.captures == 2  # the same update graph
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager, strict=True))
    assert not all(torch.equal(a, w) for a, w in zip(replayed, saved, strict=False))  # it did update


# A short bf16 run of packed rows replayed as CUDA graphs (warm-up micro-steps, the capture, then replays).
GRAPHS_RUN = dict(
    dtype="bfloat16",
    packing=True,
    cuda_graphs=True,
    optimizer="adafactor",
    max_tokens=1024,
    save_final=False,
)


def _losses(out) -> list[float]:
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _one_process(model, sample_csv, out, **values) -> list[float]:
    """The losses of the run in this process with accumulation 2: what 2 ranks with accumulation 1 train."""
    cfg = tiny_run_values(model, sample_csv, out, **values, gradient_accumulation_steps=2)
    assert train(TrainConfig.from_dict(cfg)) == 0
    return _losses(out)


def _two_ranks(values: dict, config: Path) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 -m trainer train` on `values`, written to `config`."""
    config.write_text(yaml.safe_dump(values))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "trainer", "train", "--config", str(config)]
    run = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    return run


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks of ddp need two GPUs")
def test_two_ranks_replay_their_micro_steps_and_train_as_one_process(
    tiny_model_without_dropout, sample_csv, tmp_path
):
    """cuda_graphs under torchrun (ddp, NCCL): each rank captures and replays its micro-steps and the update,
    the gradients summed between them; the losses are one process's on the same global batches (bf16)."""
    values = dict(GRAPHS_RUN, max_steps=6, eval_fraction=0.0, save_steps=10**6)
    model = tiny_model_without_dropout
    one = _one_process(model, sample_csv, tmp_path / "one", **values)
    two = tmp_path / "two"
    run = _two_ranks(tiny_run_values(model, sample_csv, two, **values), tmp_path / "two.yaml")
    assert "cuda_graphs: micro-step captured" in run.stderr
    assert "cuda_graphs: optimizer update captured" in run.stderr
    assert _losses(two) == pytest.approx(one, rel=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks of FSDP2 need two GPUs")
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp_ranks_replay_their_collectives_and_train_as_one_process(
    tiny_model_without_dropout, sample_csv, tmp_path, reshard_after_forward
):
    """cuda_graphs under FSDP2 (NCCL): each rank captures its micro-step with FSDP2's all-gathers and
    reduce-scatters in it and replays it; an evaluation and a checkpoint at step 4 (the graph dropped, FSDP2
    eager, then captured again); the losses are one process's on the same global batches (bf16), and the
    run resumes from its checkpoint."""
    values = dict(
        GRAPHS_RUN,
        max_steps=8,
        eval_fraction=0.05,
        eval_steps=4,
        eval_max_batches=2,
        generation_max_new_tokens=8,
        save_steps=4,
    )
    model = tiny_model_without_dropout
    one = _one_process(model, sample_csv, tmp_path / "one", **values)
    two = tmp_path / "two"
    fsdp = dict(values, distributed_strategy="fsdp", fsdp_reshard_after_forward=reshard_after_forward)
    run = _two_ranks(tiny_run_values(model, sample_csv, two, **fsdp), tmp_path / "two.yaml")
    assert "capture 2" in run.stderr  # again after the evaluation
    assert _losses(two) == pytest.approx(one, rel=2e-2)
    resumed = tmp_path / "resumed"
    checkpoint = str(two / "checkpoint-4")
    run = _two_ranks(
        tiny_run_values(model, sample_csv, resumed, **fsdp, resume=checkpoint), tmp_path / "resumed.yaml"
    )
    assert "cuda_graphs: micro-step captured" in run.stderr
    assert _losses(resumed) == pytest.approx(_losses(two)[4:], rel=2e-2)

"""LoRA (`adapter: lora`, trainer.model.lora) on the tiny FLAN-T5: the fast path computes what PEFT's own
modules compute, a step changes the adapters alone, a run checkpoints them alone, resumes exactly and ends
with one merged model (and its adapter in PEFT's format).

The float32 tests run on the GPU where there is one, else in Triton's interpreter on CPU (conftest); the tests
marked for CUDA run the bf16 kernels, CUDA graphs included, and are skipped elsewhere.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_run import tiny_run_values

from trainer.checkpoint.store import list_checkpoints
from trainer.config import ConfigError, TrainConfig
from trainer.infra.disk import directory_bytes
from trainer.kernels.projections import GroupedLinear, LowRank, ProjectionGroup
from trainer.model.loss import token_loss_sum
from trainer.report.step_meter import TRAIN_LOG
from trainer.run.train import train

TARGETS = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # Triton's kernels run on the GPU, or in the interpreter without one


def _lora(r: int = 4, dropout: float = 0.0, targets=TARGETS):
    """What trainer.model.lora reads of a config."""
    return SimpleNamespace(
        lora_r=r,
        lora_alpha=8.0,
        lora_dropout=dropout,
        lora_target_modules=list(targets),
        model_name_or_path="m",
    )


def _batch(device=DEVICE):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 11), generator=g)
    labels = torch.randint(3, 100, (3, 9), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    return {k: v.to(device) for k, v in batch.items()}


def _peft_and_fused(model_dir, device=DEVICE, dtype=torch.float32, checkpointing=False, targets=TARGETS):
    """The same LoRA model twice: PEFT's own modules on the plain HF model, and the trainer's fast path (the
    fused ops, grouped projections, trainer.model.lora's layers); lora_B random (PEFT starts it at zero),
    equal."""
    from peft import get_peft_model
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.fused_t5 import use_fused_gated_gelu, use_fused_residual_dropout
    from trainer.model.lora import add_adapters, lora_config
    from trainer.model.swaps import use_fused_t5_ops

    def load():
        model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, attn_implementation="eager")
        model = model.to(device, dtype).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    cfg = _lora(targets=targets)
    torch.manual_seed(0)
    peft = get_peft_model(load(), lora_config(cfg))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    model = load()
    use_fused_gated_gelu(model)  # on CPU too (the interpreter): wo's adapter inside the fused function
    use_fused_residual_dropout(model)
    use_fused_t5_ops(model)
    fused = add_adapters(model, cfg)
    assert not fused.load_state_dict(peft.state_dict()).unexpected_keys
    return peft, fused


def _step_loss(model, device=DEVICE) -> float:
    """The loss of `_batch`, its gradients left in `model`."""
    loss = token_loss_sum(model, _batch(device))
    loss.backward()
    return float(loss.detach())


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():  # fp32: the same sums in another order
        assert float((got[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_fused_path_gives_the_loss_and_adapter_gradients_of_peft_modules(
    tiny_model_without_dropout, checkpointing
):
    peft, fused = _peft_and_fused(tiny_model_without_dropout, checkpointing=checkpointing)
    assert _step_loss(fused) == pytest.approx(_step_loss(peft), rel=1e-6)
    got = _adapter_grads(fused)
    # A and B on each of an encoder block's 7 projections and a decoder block's 11
    assert len(got) == 2 * (7 * len(fused.encoder.block) + 11 * len(fused.decoder.block))
    _assert_same_grads(got, _adapter_grads(peft))
    # The frozen base gets no gradient at all: nothing computes it.
    assert [n for n, p in fused.named_parameters() if not p.requires_grad and p.grad is not None] == []


def test_adapters_on_some_projections_of_a_group_leave_the_others_plain(tiny_model_without_dropout):
    peft, fused = _peft_and_fused(tiny_model_without_dropout, targets=["q", "v", "wo"])  # LoRA paper's q, v
    assert _step_loss(fused) == pytest.approx(_step_loss(peft), rel=1e-6)
    got = _adapter_grads(fused)
    # q and v in every attention (one per encoder block, two per decoder block), wo in every block
    encoder, decoder = len(fused.encoder.block), len(fused.decoder.block)
    assert len(got) == 2 * (3 * encoder + 5 * decoder)
    _assert_same_grads(got, _adapter_grads(peft))


def test_the_adapters_dropout_backward_is_autograds_through_the_same_mask():
    # Three projections of one input, two of them adapted, dropout p on the adapters' shared input.
    torch.manual_seed(0)
    n, d, r, p = 40, 16, 3, 0.3
    x = torch.randn(n, d, device=DEVICE, requires_grad=True)
    linears = [torch.nn.Linear(d, out, bias=False, device=DEVICE) for out in (8, 12, 8)]
    for linear in linears:
        linear.weight.requires_grad_(False)  # LoRA's frozen base
    a = [torch.randn(r, d, device=DEVICE, requires_grad=True) for _ in range(2)]
    b = [torch.randn(out, r, device=DEVICE, requires_grad=True) for out in (8, 8)]
    group = ProjectionGroup()
    members = [GroupedLinear(linear, group) for linear in linears]
    group.low_rank = [lambda: LowRank(a[0], b[0], 2.0, p), None, lambda: LowRank(a[1], b[1], 0.5, p)]
    upstream = [torch.randn(n, out, device=DEVICE) for out in (8, 12, 8)]

    torch.manual_seed(1)
    outputs = [m(x) for m in members]
    sum((o * g).sum() for o, g in zip(outputs, upstream, strict=True)).backward()
    got = [t.grad.clone() for t in (x, *a, *b)]

    for t in (x, *a, *b):
        t.grad = None
    # the same draw: the mask is made as trainer.kernels.projections.low_rank_forward makes it
    torch.manual_seed(1)
    keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p)
    dropped = x * keep / (1 - p)
    want_out = [
        linears[0](x) + 2.0 * (dropped @ a[0].t()) @ b[0].t(),
        linears[1](x),
        linears[2](x) + 0.5 * (dropped @ a[1].t()) @ b[1].t(),
    ]
    for o, w in zip(outputs, want_out, strict=True):
        torch.testing.assert_close(o, w)
    sum((o * g).sum() for o, g in zip(want_out, upstream, strict=True)).backward()
    for mine, autograds in zip(got, (x.grad, *(t.grad for t in a), *(t.grad for t in b)), strict=True):
        torch.testing.assert_close(mine, autograds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_a_step_changes_only_the_adapters_over_a_frozen_bf16_base(tiny_model_dir, tmp_path, optimizer):
    from trainer.model.load import load_model
    from trainer.model.lora import add_adapters
    from trainer.optim import build_optimizer

    cfg = TrainConfig.from_dict(
        tiny_run_values(
            tiny_model_dir, tmp_path, tmp_path, dtype="bfloat16", adapter="lora", optimizer=optimizer
        )
    )
    model = add_adapters(load_model(cfg, torch.device("cpu")), cfg)
    model.train()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # the adapters
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}  # the base
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):  # lora_B starts at zero: lora_A's gradient is zero until B has moved
        token_loss_sum(model, _batch("cpu")).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {k for k in before if "lora_" in k}
    # Optimizer states for the adapters alone, without Kahan buffers (fp32 needs none).
    held = {id(p) for p in opt.state}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    assert not any("kahan_comp" in state for state in opt.state.values())


def _run(model_dir, data, out, steps, **kw) -> dict[int, float]:
    values = dict(
        adapter="lora",
        lora_r=4,
        optimizer="adamw",
        lr_scheduler_type="constant",  # the same rates whatever max_steps says: runs of 3 and 6 steps agree
        per_device_train_batch_size=8,
        eval_fraction=0.05,
        eval_max_batches=2,
        eval_steps=1000,
        save_steps=3,
        num_eval_generations=1,
        generation_max_new_tokens=8,
        max_steps=steps,
    )
    assert train(TrainConfig.from_dict(tiny_run_values(model_dir, data, out, **values | kw))) == 0
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_lora_run_checkpoints_its_adapters_resumes_exactly_and_ends_with_one_merged_model(
    tiny_model_dir, sample_csv, tmp_path, capsys
):
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForSeq2SeqLM

    from trainer.cli import main as cli_main

    straight = _run(tiny_model_dir, sample_csv, tmp_path / "straight", 6)
    out = tmp_path / "stopped"
    _run(tiny_model_dir, sample_csv, out, 3)
    resumed = _run(tiny_model_dir, sample_csv, out, 6)  # from checkpoint-3
    assert sorted(resumed) == list(range(1, 7))
    assert [resumed[s] for s in range(1, 7)] == [straight[s] for s in range(1, 7)]  # CPU, fp32: bit for bit

    # A checkpoint: the adapter in PEFT's format, the adapters and their optimizer states in dcp/, no model.
    checkpoint = out / "checkpoint-3"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "config.json").exists()
    keys = FileSystemReader(checkpoint / "dcp").read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    assert all("lora_" in k for k in keys if k.startswith("optim.state."))

    # final/: the merged model, loadable as any; final/adapter/: PEFT's adapter naming its base.
    final = out / "final"
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir)
    assert (adapter["r"], adapter["peft_type"]) == (4, "LORA")
    merged = AutoModelForSeq2SeqLM.from_pretrained(final).eval()
    base = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    with_adapter = PeftModel.from_pretrained(base, final / "adapter").eval()
    batch = _batch("cpu")
    with torch.no_grad():
        logits = merged(**batch).logits
        want = with_adapter(**batch).logits
        plain = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir).eval()(**batch).logits
    assert not torch.allclose(want, plain, atol=1e-3)  # the adapter moved the model
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)  # merged = base + adapter
    card = (final / "README.md").read_text()
    assert "LoRA: r 4, alpha 32, dropout 0 on `q`, `k`, `v`, `o`, `wi_0`, `wi_1`, `wo`" in card

    # A config that would not fit the checkpoint's tensors is one line naming the keys, before any loading.
    with pytest.raises(
        ConfigError, match=r"checkpoint-6 was written with lora_r 4, .* changes to 8: its tensors"
    ):
        _run(tiny_model_dir, sample_csv, out, 8, lora_r=8)

    # Both generate: final/ as any model, a checkpoint through its adapter merged into the base it names.
    for model_dir in (final, out / "checkpoint-6"):
        assert cli_main(["generate", "--model", str(model_dir), "--ingredients", "2 eggs; 1 cup flour"]) == 0
    assert capsys.readouterr().out.count("title") >= 2


def test_load_best_model_at_end_merges_the_best_checkpoints_adapter(tiny_model_dir, sample_csv, tmp_path):
    from safetensors.torch import load_file

    from trainer.report.step_meter import SUMMARY

    out = tmp_path / "best"
    # The highest eval loss is the best: the first evaluation's (the loss falls), not the last step's.
    best = dict(eval_steps=2, save_steps=2, load_best_model_at_end=True, greater_is_better=True)
    _run(tiny_model_dir, sample_csv, out, 4, learning_rate=1e-2, eval_generation_records=2, **best)
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["final_model_step"] == summary["best_global_step"] == 2
    final, kept = (
        load_file(d / "adapter_model.safetensors") for d in (out / "final/adapter", out / "checkpoint-2")
    )
    last = load_file(out / "checkpoint-4" / "adapter_model.safetensors")
    assert final.keys() == kept.keys() and all(torch.equal(final[k], kept[k]) for k in final)
    assert not all(torch.equal(final[k], last[k]) for k in final)


def test_a_lora_checkpoint_is_tens_of_times_smaller_than_a_full_one(tiny_model_dir, sample_csv, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _run(tiny_model_dir, sample_csv, tmp_path / "lora", 3, lora_r=2, save_final=False, eval_fraction=0.0)
    _run(tiny_model_dir, sample_csv, tmp_path / "full", 3, adapter=None, save_final=False, eval_fraction=0.0)
    lora, full = (list_checkpoints(tmp_path / run)[-1][1] for run in ("lora", "full"))

    def tensor_bytes(checkpoint: Path) -> int:
        """The weights and optimizer states a checkpoint holds (its safetensors and dcp/'s tensors): what
        grows with the model, where DCP's per-tensor file overhead and the tokenizer do not."""
        metadata = FileSystemReader(checkpoint / "dcp").read_metadata().state_dict_metadata
        dcp = sum(
            m.size.numel() * m.properties.dtype.itemsize
            for m in metadata.values()
            if isinstance(m, TensorStorageMetadata)
        )
        return dcp + sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))

    assert tensor_bytes(full) > 30 * tensor_bytes(lora)
    assert directory_bytes(full) > 5 * directory_bytes(lora)  # the tiny model's: tokenizer and overheads


def test_lora_config_errors_name_their_keys(tmp_path, caplog):
    config = tmp_path / "c.yaml"
    config.write_text("adapter: lora\ndistributed_strategy: fsdp\n")
    both = r"c.yaml:\d \(adapter\) and .*c.yaml:\d \(distributed_strategy\)"
    with pytest.raises(
        ConfigError, match=both + r": adapter: lora trains with one process or .*ddp, not fsdp"
    ):
        TrainConfig.load(config)
    with pytest.raises(
        ConfigError, match=r"--set lora_target_modules=\[q, lm_head\]: .*'lm_head' cannot take"
    ):
        TrainConfig.load(None, ["adapter=lora", "lora_target_modules=[q, lm_head]"])
    with pytest.raises(ConfigError, match="lora_dropout must be in"):
        TrainConfig.load(None, ["adapter=lora", "lora_dropout=1"])
    caplog.set_level(logging.WARNING)
    cfg = TrainConfig.load(None, ["lora_r=8"])  # without adapter: lora, a full fine-tuning run, said so
    assert cfg.adapter is None
    assert "lora_r (--set lora_r=8) set, but adapter is null" in caplog.text


def test_trainer_plan_counts_the_frozen_base_and_the_adapters(tmp_path, capsys):
    from trainer.cli import main as cli_main

    config = tmp_path / "xxl.yaml"
    config.write_text(
        "model_name_or_path: google/flan-t5-xxl\nadapter: lora\noptimizer: adamw\npacking: true\n"
        "max_tokens: 8192\n"
    )
    assert cli_main(["plan", "--config", str(config), "--gpu-memory", "32GiB"]) == 0
    out = capsys.readouterr().out
    assert (
        "adapter: LoRA r 16, alpha 32, dropout 0 on q, k, v, o, wi_0, wi_1, wo: 70.8M fp32 parameters" in out
    )
    weights = float(next(line.split()[-1] for line in out.splitlines() if line.startswith("weights")))
    gradients = float(next(line.split()[-1] for line in out.splitlines() if line.startswith("gradients")))
    assert weights == pytest.approx(
        (11.0037e9 * 2 + 70.78e6 * 4) / 2**30, abs=0.01
    )  # bf16 base, fp32 adapters
    assert gradients == pytest.approx(70.78e6 * 4 / 2**30, abs=0.01)  # the adapters' alone


# -- on a GPU: the bf16 kernels and CUDA graphs ------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_fused_path_with_triton_attention_gives_peft_modules_loss_and_gradients(
    tiny_model_without_dropout,
):
    from trainer.model.fused_t5 import use_triton_attention

    reference, _ = _peft_and_fused(tiny_model_without_dropout, "cuda", torch.float32, checkpointing=True)
    _step_loss(reference, "cuda")
    truth = _adapter_grads(reference)
    peft, fused = _peft_and_fused(tiny_model_without_dropout, "cuda", torch.bfloat16, checkpointing=True)
    use_triton_attention(fused.get_base_model())
    assert _step_loss(fused, "cuda") == pytest.approx(_step_loss(peft, "cuda"), rel=2e-2)
    want, got = _adapter_grads(peft), _adapter_grads(fused)

    def error(grads: dict, name: str) -> float:
        exact = truth[name].double()
        return float((grads[name].double() - exact).norm() / exact.norm().clamp_min(1e-30))

    # bf16 rounds both: the fast path is as close to the float32 gradients as PEFT's own bf16 modules are.
    for name in truth:
        assert error(got, name) <= 2 * error(want, name) + 1e-2, (name, error(got, name), error(want, name))
    assert [n for n, p in fused.named_parameters() if not p.requires_grad and p.grad is not None] == []


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_adapters_gradients_and_update(tiny_model_without_dropout):
    from packed_batches import pack

    from trainer.model.fused_t5 import use_triton_attention
    from trainer.model.loss import Seq2SeqLMLoss
    from trainer.optim.adafactor_optimizer import Adafactor
    from trainer.run.cuda_graphs import WARMUP, MicroStepGraph

    _, fused = _peft_and_fused(tiny_model_without_dropout, "cuda", torch.bfloat16, checkpointing=True)
    use_triton_attention(fused.get_base_model())
    loss_module = Seq2SeqLMLoss(fused)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(WARMUP + 2):
        records = [
            (
                torch.randint(3, 500, (s,), generator=g).tolist(),
                torch.randint(3, 500, (t,), generator=g).tolist(),
            )
            for s, t in [(7, 9), (20, 30), (12, 4)]
        ]
        batches.append({k: v.cuda() for k, v in pack(records, 2, 64, 96).items()})
    params = [p for p in fused.parameters() if p.requires_grad]
    want_losses = []
    for b in batches:
        loss = loss_module(**b)
        (loss / 1000).backward()
        want_losses.append(float(loss.detach()))
    del loss  # its autograd nodes (made on the default stream) would stay alive into the capture
    want = [p.grad.clone() for p in params]
    fused.zero_grad(set_to_none=True)
    graph = MicroStepGraph(lambda **b: loss_module(**b), params)
    losses = [float(graph.run(b, 1 / 1000)) for b in batches]
    assert graph.captures == 1
    assert losses == pytest.approx(want_losses, rel=1e-3)
    for p, grad in zip(params, want, strict=True):
        assert float((p.grad - grad).norm() / grad.norm().clamp_min(1e-30)) < 2e-2
    # The update of the adapters alone, captured in the micro-step's pool after its first, eager run.
    opt = Adafactor(params, lr=1e-3)
    before = [p.detach().clone() for p in params]
    graph.update(opt, opt.advance())
    opt.zero_grad(set_to_none=False)
    for b in batches:
        graph.run(b, 1 / 1000)
    graph.update(opt, opt.advance())
    assert graph.update_graph is not None
    assert all(not torch.equal(p, w) for p, w in zip(params, before, strict=True))

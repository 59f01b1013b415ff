"""The memory plan against real tensors: exact bytes for weights, gradients and optimizer states after a real
step (in one process, and in each rank's FSDP2 shards on 2 gloo ranks), and the activation terms against the
live tensor bytes of a real checkpointed T5 training micro-step; `trainer plan` for one GPU of several."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from live_tensors import LiveTensorBytes
from packed_batches import pack
from transformers import T5Config, T5ForConditionalGeneration
from transformers.optimization import Adafactor

from trainer.cli import main as cli_main
from trainer.config import TrainConfig
from trainer.infra.memory import GIB
from trainer.model.load import skip_checkpointing
from trainer.model.loss import token_loss_sum
from trainer.model.model_shape import KNOWN_CONFIGS, LoraShape, ModelShape, load_shape
from trainer.model.swaps import use_fused_t5_ops
from trainer.plan.memory_plan import (
    SAFETY_MARGIN,
    budget_peak,
    choose_max_tokens,
    largest_batch_size,
    largest_token_budget,
    optimizer_state_bytes,
    plan_memory,
    plan_packed_rows,
    plan_run,
    probe_shapes,
    sharded_state,
)
from trainer.plan.plan_report import parse_size


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny bf16 models run faster on one thread, and much faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(**kw) -> T5Config:
    values = dict(
        d_model=64,
        d_ff=160,
        d_kv=16,
        num_heads=4,
        num_layers=2,
        num_decoder_layers=2,
        vocab_size=512,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        attn_implementation="eager",
        use_cache=False,
    )
    values.update(kw)
    return T5Config(**values)


def build_bf16(config: T5Config, checkpointing: bool = True) -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = T5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def batch(config: T5Config, rows: int, src: int, tgt: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, config.vocab_size, (rows, src), generator=gen)
    labels = torch.randint(2, config.vocab_size, (rows, tgt), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # longest-padding batches have padding: masks take their real shapes
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_weights_gradients_and_states_are_exact_after_a_real_step(optimizer):
    import optimi

    config = tiny_config()
    model = build_bf16(config, checkpointing=False)
    if optimizer == "adamw":
        opt = optimi.AdamW(model.parameters(), lr=1e-3, kahan_sum=True)
    else:
        opt = Adafactor(
            model.parameters(), lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False
        )
    model(**batch(config, 2, 8, 8)).loss.backward()
    opt.step()

    shape = ModelShape.from_config(config)
    plan = plan_memory(shape, optimizer=optimizer, rows=2, src_len=8, tgt_len=8)
    params = list(model.parameters())
    assert shape.num_params() == sum(p.numel() for p in params)
    assert plan.weights == tensor_bytes(params)
    assert plan.gradients == tensor_bytes(p.grad for p in params)
    states = [v for st in opt.state.values() for v in st.values()]
    update = "kahan" if optimizer == "adamw" else "naive"  # transformers' Adafactor has no Kahan buffer
    assert optimizer_state_bytes(shape, optimizer, update) == tensor_bytes(states)


def measured_activation_peak(
    config: T5Config,
    rows: int,
    src: int,
    tgt: int,
    checkpointing: bool = True,
    unchecked: int = 0,
    inputs: dict | None = None,
) -> int:
    """Peak live tensor bytes of one accumulated micro-step of the trainer's step (fused T5 ops, chunked
    cross-entropy) above weights + gradients + optimizer states; `unchecked`: the last decoder blocks without
    checkpointing; `inputs`: the batch (default: `batch(config, rows, src, tgt)`)."""
    import optimi

    model = build_bf16(config, checkpointing)
    assert skip_checkpointing(model, unchecked) == (unchecked, 0)
    use_fused_t5_ops(model)
    opt = optimi.AdamW(model.parameters(), lr=1e-4, kahan_sum=True)
    return micro_step_peak(model, opt, inputs if inputs is not None else batch(config, rows, src, tgt))


def micro_step_peak(model, opt, inputs: dict) -> int:
    """Peak live tensor bytes of `model`'s second micro-step on `inputs` above its weights, gradients and
    `opt`'s states (made by a first micro-step and an update)."""
    token_loss_sum(model, inputs).backward()
    opt.step()  # states now exist; the gradients stay, as between accumulated micro-batches
    fixed = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    fixed += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    with LiveTensorBytes(fixed) as tracker:
        base = tracker.live()
        token_loss_sum(model, inputs).backward()
    return tracker.peak - base


@pytest.mark.parametrize(
    "rows,src,tgt,vocab,moment",
    [
        (8, 64, 128, 512, "decoder block backward"),  # long targets: the decoder's recompute is the peak
        (4, 32, 200, 2000, "loss"),  # a large vocabulary: the chunked loss's logits and head gradient
        (8, 100, 40, 300, "encoder block backward"),  # long sources, short targets
        (2, 128, 128, 256, "decoder block backward"),  # few long rows: attention scores dominate
    ],
)
def test_activation_terms_match_live_tensor_bytes_of_a_real_checkpointed_step(rows, src, tgt, vocab, moment):
    config = tiny_config(vocab_size=vocab)
    measured = measured_activation_peak(config, rows, src, tgt)
    # On CPU dropout keeps its mask in the compute dtype and RMSNorm is a composite: the plan is told so
    # (device="cpu"). The encoder-bound case is over-predicted by ~14% on CPU (cause not pinned down); on the
    # GPU the plan is within +1..2% of five measured configs (bench/train_throughput.py, README).
    plan = plan_memory(ModelShape.from_config(config), rows=rows, src_len=src, tgt_len=tgt, device="cpu")
    predicted = plan.activations + plan.logits
    assert plan.peak_moment == moment
    assert predicted == pytest.approx(measured, rel=0.15)


LORA = LoraShape(4, ("q", "k", "v", "o", "wi_0", "wi_1", "wo"))


def build_lora(config: T5Config, lora: LoraShape = LORA, checkpointing: bool = True):
    """The tiny bf16 model with the trainer's fused ops and LoRA adapters (trainer.model.lora) on them."""
    from types import SimpleNamespace

    from trainer.model.lora import add_adapters

    model = build_bf16(config, checkpointing)
    use_fused_t5_ops(model)
    settings = dict(lora_r=lora.r, lora_alpha=2.0 * lora.r, lora_dropout=lora.dropout)
    cfg = SimpleNamespace(**settings, lora_target_modules=list(lora.targets), model_name_or_path="tiny")
    model = add_adapters(model, cfg)
    model.train()
    return model


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_lora_weights_gradients_and_states_are_exact_after_a_real_step(optimizer):
    from trainer.optim.adafactor_optimizer import Adafactor

    config = tiny_config()
    model = build_lora(config, checkpointing=False)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3) if optimizer == "adamw" else Adafactor(trained, lr=1e-3)
    token_loss_sum(model, batch(config, 2, 8, 8)).backward()
    opt.step()

    shape = ModelShape.from_config(config)
    plan = plan_memory(shape, optimizer=optimizer, rows=2, src_len=8, tgt_len=8, lora=LORA)
    assert shape.lora_num_params(LORA) == sum(p.numel() for p in trained)
    assert plan.weights == tensor_bytes(model.parameters())  # the bf16 base and the fp32 adapters
    assert plan.gradients == tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    # AdamW's 0-d step counters aside (4 bytes per adapter matrix)
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    assert plan.optimizer_states == tensor_bytes(states)


def measured_lora_activation_peak(config: T5Config, inputs: dict, lora: LoraShape = LORA) -> int:
    """`measured_activation_peak` for the LoRA model (`build_lora`), AdamW over its adapters."""
    model = build_lora(config, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return micro_step_peak(model, opt, inputs)


@pytest.mark.parametrize(
    "rows,src,tgt,vocab,dropout",
    [
        (8, 64, 128, 512, 0.0),  # the decoder's recompute
        (4, 32, 200, 2000, 0.0),  # a large vocabulary: the chunked loss, without the head's gradient
        (8, 64, 128, 512, 0.1),  # lora_dropout: a mask per adapted group
    ],
)
def test_lora_activation_terms_match_live_tensor_bytes_of_a_real_step(rows, src, tgt, vocab, dropout):
    config = tiny_config(vocab_size=vocab)
    lora = dataclasses.replace(LORA, dropout=dropout)
    measured = measured_lora_activation_peak(config, batch(config, rows, src, tgt), lora)
    shape = ModelShape.from_config(config)
    kw = dict(rows=rows, src_len=src, tgt_len=tgt, device="cpu")
    plan = plan_memory(shape, lora=lora, **kw)
    # Within what the plan achieves for full fine-tuning at these shapes on CPU (eager attention, composite
    # norms): +7% at the decoder's recompute, -1% at the loss.
    assert plan.activations + plan.logits == pytest.approx(measured, rel=0.1)
    # Less than full fine-tuning needs at the same moment (no head gradient, no bias gradients), measured too.
    full = plan_memory(shape, **kw)
    if plan.peak_moment == "loss":
        assert plan.logits < full.logits
        assert measured < measured_activation_peak(config, rows, src, tgt)


def test_lora_activation_terms_of_packed_rows_match_live_tensor_bytes():
    config = tiny_config(vocab_size=256)
    rows, src, tgt = 2, 128, 256
    measured = measured_lora_activation_peak(config, packed_rows(config, rows, src, tgt))
    shape = ModelShape.from_config(config)
    plan = plan_memory(shape, rows=rows, src_len=src, tgt_len=tgt, device="cpu", packed=True, lora=LORA)
    assert plan.activations + plan.logits == pytest.approx(measured, rel=0.05)


def test_lora_fits_xl_on_16_gib_and_xxl_on_32_gib_where_full_fine_tuning_does_not():
    xl, xxl = load_shape("google/flan-t5-xl"), load_shape("google/flan-t5-xxl")
    lora = LoraShape(16, LORA.targets)
    kw = dict(src_cap=512, tgt_cap=512, attn_implementation="triton", packed=True)
    for shape, gib in ((xl, 16), (xxl, 32)):
        assert largest_token_budget(shape, gib * GIB, optimizer="adafactor", **kw) == 0
        assert largest_token_budget(shape, gib * GIB, optimizer="adamw", lora=lora, **kw) >= 8192
    # XXL's base is 20.5 GiB in bf16; its adapters 0.26 GiB in fp32, their gradients and AdamW states 0.8.
    kw = dict(rows=8, src_len=512, tgt_len=512, attn_implementation="triton", packed=True)
    plan = plan_memory(xxl, optimizer="adamw", lora=lora, **kw)
    assert 20.7 * GIB < plan.weights < 20.8 * GIB
    assert 0.75 * GIB < plan.gradients + plan.optimizer_states < 0.8 * GIB


def packed_rows(config: T5Config, rows: int, src: int, tgt: int) -> dict:
    """A packed batch (trainer.model.packed_t5's keys) of `rows` rows, each holding three records of uneven
    lengths that leave a short tail of padding, as the loader's packed rows do."""
    gen = torch.Generator().manual_seed(2)
    records = []
    for _ in range(rows):
        for share in (0.5, 0.3, 0.17):
            s, t = max(1, int(src * share)), max(1, int(tgt * share))
            ids = torch.randint(2, config.vocab_size, (s + t,), generator=gen).tolist()
            records.append((ids[:s], ids[s:]))
    return pack(records, rows, src, tgt)


@pytest.mark.parametrize(
    "rows,src,tgt,vocab",
    [(2, 128, 256, 256), (2, 96, 224, 512), (3, 128, 192, 1024)],  # recipe-like rows: targets ~2x sources
)
def test_activation_terms_of_packed_rows_match_live_tensor_bytes(rows, src, tgt, vocab):
    config = tiny_config(vocab_size=vocab)
    inputs = packed_rows(config, rows, src, tgt)
    measured = measured_activation_peak(config, rows, src, tgt, inputs=inputs)
    shape = ModelShape.from_config(config)
    plan = plan_memory(shape, rows=rows, src_len=src, tgt_len=tgt, device="cpu", packed=True)
    assert plan.activations + plan.logits == pytest.approx(measured, rel=0.05)
    # With the Triton kernels no (T, S) bias or mask tensor exists, for packed rows or padded ones (one record
    # each): the same shape needs the same memory; eager attention's masks and biases need more.
    triton = dict(rows=rows, src_len=src, tgt_len=tgt, attn_implementation="triton")
    assert plan_memory(shape, packed=True, **triton).activations == plan_memory(shape, **triton).activations
    eager = plan_memory(shape, rows=rows, src_len=src, tgt_len=tgt, attn_implementation="eager")
    assert plan_memory(shape, **triton).activations < eager.activations


def test_a_packed_budget_is_planned_as_its_one_row_shape():
    xl = load_shape("google/flan-t5-xl")
    kw = dict(optimizer="adafactor", attn_implementation="triton")
    packed = budget_peak(xl, 16384, src_cap=512, tgt_cap=256, packed=True, **kw)
    # Every packed batch is 16384 // (512 + 256) = 21 rows of 512 + 256, however long its records are.
    assert packed == plan_memory(xl, rows=21, src_len=512, tgt_len=256, packed=True, **kw)


def test_decoder_blocks_without_checkpointing_keep_their_activations():
    config = tiny_config(num_decoder_layers=6)
    shape = ModelShape.from_config(config)
    plans = [
        plan_memory(
            shape, rows=8, src_len=64, tgt_len=128, device="cpu", decoder_blocks_without_checkpointing=k
        )
        for k in (0, 1, 3, 6)
    ]
    for k, plan in zip((1, 3, 6), plans[1:], strict=True):
        measured = measured_activation_peak(config, 8, 64, 128, unchecked=k)
        # Never under; over by no more than 5% with every block kept (a kept block's input is the kept
        # block before it's output: counted once, or the plan drifts up by a hidden state per block)
        assert 0 <= (plan.activations + plan.logits) / measured - 1 < 0.05, k
    peaks = [p.activations + p.logits for p in plans]
    assert peaks[0] < peaks[1] < peaks[2] < peaks[3]  # each block kept costs memory
    # More than the decoder has: all of them (the plan clamps the same way).
    blocks = config.num_decoder_layers
    assert skip_checkpointing(build_bf16(config), blocks + 1, 1) == (blocks, 1)


@pytest.mark.parametrize(
    "name,card_gib",
    [
        ("flan-t5-xl-rtx5090.yaml", 32),
        ("flan-t5-xl-rtx4090.yaml", 24),
        ("flan-t5-xl-lora-rtx4080.yaml", 16),
        ("flan-t5-xxl-lora-rtx5090.yaml", 32),
    ],
)
def test_each_preset_fits_the_card_it_is_for(name, card_gib):
    from trainer.plan.memory_plan import planned_peak_bytes

    cfg = TrainConfig.load(Path(__file__).parents[1] / "configs" / name)
    plan = plan_run(cfg, card_gib * GIB)  # the loader's longest rows, as before any data is read
    assert planned_peak_bytes(cfg, plan) <= SAFETY_MARGIN * card_gib * GIB
    assert (cfg.adapter == "lora") == ("lora" in name)


def test_the_trainer_skips_checkpointing_only_where_the_plan_has_room():
    from trainer.plan.memory_plan import choose_blocks_without_checkpointing as choose

    cfg = TrainConfig.load(Path(__file__).parents[1] / "configs" / "flan-t5-xl-rtx5090.yaml")
    # The preset's settings on padded rows of 32k-token micro-batches (its packed rows: the next test).
    cfg = dataclasses.replace(
        cfg, packing=False, cuda_graphs=False, max_tokens=32768, gradient_accumulation_steps=2
    )
    assert choose(cfg, 32 * GIB) == (5, 0)  # (decoder, encoder) on a 32 GB card
    assert choose(cfg, 24 * GIB) == (1, 0)  # room for one
    assert choose(cfg, 80 * GIB) == (24, 24)  # every block keeps its activations on an 80 GB card
    off = dataclasses.replace(cfg, gradient_checkpointing=False)
    assert choose(off, 80 * GIB) == (0, 0)
    # Encoder blocks only once every decoder block keeps its activations; a number the config sets is kept.
    assert choose(dataclasses.replace(cfg, decoder_blocks_without_checkpointing=2), 80 * GIB) == (2, 0)
    decoder, encoder = choose(dataclasses.replace(cfg, encoder_blocks_without_checkpointing=8), 32 * GIB)
    assert encoder == 8 and decoder < 5  # the encoder's blocks take room from the decoder's


def test_activation_terms_without_checkpointing():
    config = tiny_config()
    measured = measured_activation_peak(config, 4, 24, 40, checkpointing=False)
    plan = plan_memory(
        ModelShape.from_config(config),
        rows=4,
        src_len=24,
        tgt_len=40,
        device="cpu",
        gradient_checkpointing=False,
    )
    assert plan.activations + plan.logits == pytest.approx(measured, rel=0.10)
    with_ckpt = plan_memory(ModelShape.from_config(config), rows=4, src_len=24, tgt_len=40, device="cpu")
    assert with_ckpt.activations + with_ckpt.logits < plan.activations + plan.logits


@pytest.mark.parametrize("name", ["google/flan-t5-small", "google/flan-t5-base", "google/flan-t5-xl"])
def test_known_models_count_the_parameters_the_real_model_has(name):
    shape = load_shape(name)  # offline: the built-in table through the installed T5Config
    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(**KNOWN_CONFIGS[name]))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    if name == "google/flan-t5-xl":
        assert (shape.d_model, shape.d_ff, shape.num_heads, shape.num_layers, shape.vocab_size) == (
            2048, 5120, 32, 24, 32128
        )  # fmt: skip
        assert shape.gated and shape.dropout_rate == 0.1


def test_load_shape_reads_a_local_model_dir(tmp_path):
    config = tiny_config(d_model=96, num_layers=3, num_decoder_layers=1, feed_forward_proj="relu")
    config.save_pretrained(tmp_path)
    shape = load_shape(str(tmp_path))
    assert (shape.d_model, shape.num_layers, shape.num_decoder_layers, shape.gated) == (96, 3, 1, False)
    with pytest.raises(ValueError, match="no config for"):
        load_shape(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "text,expected",
    [
        ("32GiB", 32 * GIB),
        ("24GB", 24 * 10**9),
        ("80G", 80 * GIB),
        ("1.5 TiB", int(1.5 * 1024**4)),
        ("512MiB", 2**29),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["32", "lots", "32XB", "", "0GiB", "0.0000001KB"])
def test_parse_size_rejects_unclear_sizes(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_largest_token_budget_is_the_edge_of_what_fits():
    xl = load_shape("google/flan-t5-xl")
    card = 32 * GIB
    for optimizer in ("adamw", "adafactor"):
        tokens = largest_token_budget(xl, card, optimizer=optimizer)
        assert tokens > 0 and tokens % 256 == 0
        assert budget_peak(xl, tokens, optimizer=optimizer).peak <= SAFETY_MARGIN * card
        assert budget_peak(xl, tokens + 256, optimizer=optimizer).peak > SAFETY_MARGIN * card
    adamw = largest_token_budget(xl, card, optimizer="adamw")
    adafactor = largest_token_budget(xl, card, optimizer="adafactor")
    assert adafactor > adamw  # Adafactor's states are ~3x smaller
    assert largest_token_budget(xl, 80 * GIB, optimizer="adamw") > adamw
    # Typical recipe lengths pack more tokens than the worst case of maximal rows.
    assert largest_token_budget(xl, card, optimizer="adafactor", worst_case=False) >= adafactor
    # A card too small for the weights, gradients and states fits nothing.
    assert largest_token_budget(xl, 16 * GIB, optimizer="adamw") == 0


def test_largest_batch_size():
    xl = load_shape("google/flan-t5-xl")
    rows = largest_batch_size(xl, 32 * GIB, src_len=512, tgt_len=512, optimizer="adafactor")
    assert rows >= 1
    peak = plan_memory(xl, optimizer="adafactor", rows=rows, src_len=512, tgt_len=512).peak
    assert peak <= SAFETY_MARGIN * 32 * GIB
    assert (
        plan_memory(xl, optimizer="adafactor", rows=rows + 1, src_len=512, tgt_len=512).peak
        > SAFETY_MARGIN * 32 * GIB
    )


def test_choose_max_tokens_for_the_loop():
    cfg = TrainConfig(model_name_or_path="google/flan-t5-xl", optimizer="adafactor")
    tokens = choose_max_tokens(cfg, 32 * GIB)
    assert tokens >= cfg.max_source_length + cfg.max_target_length
    assert tokens == largest_token_budget(
        load_shape("google/flan-t5-xl"), 32 * GIB, optimizer="adafactor", attn_implementation="triton"
    )
    # The default attention (Triton kernels) keeps no B x H x T x S tensors: more tokens fit than with eager.
    eager = TrainConfig(
        model_name_or_path="google/flan-t5-xl", optimizer="adafactor", attn_implementation="eager"
    )
    assert choose_max_tokens(eager, 32 * GIB) < tokens


def write_config(tmp_path, text: str):
    path = tmp_path / "plan.yaml"
    path.write_text("model_name_or_path: google/flan-t5-xl\nreport_to: none\n" + text)
    return str(path)


def test_trainer_plan_prints_components_and_fits(tmp_path, capsys):
    code = cli_main(["plan", "--config", write_config(tmp_path, "optimizer: adafactor\nmax_tokens: 4096\n")])
    out = capsys.readouterr().out
    assert code == 0, out
    for line in ("weights", "gradients", "optimizer states", "activations", "allocator slack", "headroom"):
        assert line in out
    assert "largest max_tokens that fits" in out
    assert "32.00" in out  # the card
    # a checkpoint's copy in host memory: the trained weights (as large as their gradients) and the states
    table = dict(re.findall(r"^(gradients|optimizer states)\s+([\d.]+)$", out, re.M))
    staged = float(table["gradients"]) + float(table["optimizer states"])
    said = re.search(r"^checkpoints: ([\d.]+) GiB of host memory", out, re.M)
    assert said and abs(float(said[1]) - staged) <= 0.011, out


def test_trainer_plan_fails_with_a_suggestion_when_the_batch_does_not_fit(tmp_path, capsys):
    config = write_config(tmp_path, "optimizer: adamw\nper_device_train_batch_size: 64\n")
    code = cli_main(["plan", "--config", config, "--gpu-memory", "24GB"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does not fit" in out and "max_tokens" in out


def test_trainer_plan_says_when_not_even_one_row_fits(tmp_path, capsys):
    code = cli_main(
        ["plan", "--config", write_config(tmp_path, "optimizer: adamw\n"), "--gpu-memory", "6GiB"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "no micro-batch fits, not even one row" in out and "max_tokens: 0" not in out, out


def test_trainer_plan_rejects_a_bad_card_size_or_model(tmp_path, capsys):
    assert cli_main(["plan", "--config", write_config(tmp_path, ""), "--gpu-memory", "big"]) == 2
    assert "cannot read memory size 'big'" in capsys.readouterr().err
    missing = str(tmp_path / "no-model")
    assert (
        cli_main(["plan", "--config", write_config(tmp_path, ""), "--set", f"model_name_or_path={missing}"])
        == 2
    )
    assert "no config for" in capsys.readouterr().err


def _data_config(tmp_path, tiny_model_dir, sample_csv) -> str:
    path = tmp_path / "data.yaml"
    path.write_text(
        f"model_name_or_path: {tiny_model_dir}\ntrain_files: [{sample_csv}]\nreport_to: none\n"
        "max_source_length: 64\nmax_target_length: 96\nper_device_train_batch_size: 8\n"
        "eval_fraction: 0.05\nnum_train_epochs: 2\n"
    )
    return str(path)


def test_trainer_plan_predicts_the_time_on_named_gpus_and_what_hours_cover(
    tmp_path, capsys, tiny_model_dir, sample_csv
):
    from trainer.data.loader import stream_for
    from trainer.model.model_files import resolve_tokenizer_file

    config = _data_config(tmp_path, tiny_model_dir, sample_csv)
    assert cli_main(["plan", "--config", config, "--hours", "10"]) == 0
    out = capsys.readouterr().out
    cfg = TrainConfig.load(config)
    train_split = stream_for(plan_run(cfg).applied_to(cfg), resolve_tokenizer_file(tiny_model_dir), "train")
    records = len(train_split.lengths()[0])
    assert f"one epoch: {records:,} records, {len(train_split):,} optimizer steps" in out, out
    assert "(2.00 epochs)" in out  # num_train_epochs
    for name in ("RTX 5090", "RTX 4090", "A100 80GB SXM", "H100 SXM", "H200 SXM"):
        (line,) = [line for line in out.splitlines() if line.startswith(f"  {name} (")]
        assert re.search(
            r"TFLOP/s.*: [\d,]+ real tokens/s; one epoch .+; this run .+; 10 h cover [\d,]+ records", line
        )
    assert "fp32 accumulation" in out  # GeForce cards state the rate training gets


def test_the_hours_of_an_epoch_cover_one_epoch(tmp_path, tiny_model_dir, sample_csv):
    from trainer.plan.gpu_specs import GPUS, predicted_epoch_seconds
    from trainer.plan.plan_report import MEASURED_MFU, epoch_data, time_report

    cfg = TrainConfig.load(_data_config(tmp_path, tiny_model_dir, sample_csv))
    plan, shape = plan_run(cfg), load_shape(str(tiny_model_dir))
    epoch = epoch_data(cfg, plan)
    seconds = predicted_epoch_seconds(
        GPUS["h100"], MEASURED_MFU.mfu, shape, epoch.source_tokens, epoch.target_tokens
    )
    hours = seconds / 3600
    (line,) = [
        line for line in time_report(cfg, plan, shape, 0, epoch, hours) if line.startswith("  H100 SXM")
    ]
    assert f"cover {epoch.records:,} records (1 epochs, {epoch.steps:,.0f} optimizer steps)" in line, line


def test_trainer_plan_rejects_hours_that_are_not_a_positive_number(tmp_path, capsys):
    assert cli_main(["plan", "--config", write_config(tmp_path, ""), "--hours", "0"]) == 2
    assert "--hours must be a positive number, got 0" in capsys.readouterr().err


def test_the_loaders_packed_rows_decide_how_many_blocks_keep_their_activations(caplog):
    """The budget is planned before the data is read, on rows of the maximum lengths; the loader then chooses
    rows from the data (recipes: target-heavy). The blocks are chosen again on those, so the run's peak is the
    plan's."""
    from trainer.plan.memory_plan import choose_blocks_without_checkpointing, micro_batch_peak

    cfg = TrainConfig.load(Path(__file__).parents[1] / "configs" / "flan-t5-xl-rtx5090.yaml")
    cfg = dataclasses.replace(
        cfg, packing=True, max_tokens=8192, gradient_accumulation_steps=8, cuda_graphs=True
    )
    xl, card = load_shape(cfg.model_name_or_path), 27 * GIB
    assumed = plan_run(cfg, card)
    assert probe_shapes(cfg, assumed) == [(8, 512, 512)]
    loader_rows = {"rows": 4, "source_len": 560, "target_len": 1488}  # what it chooses for recipes at 8k
    plan = plan_packed_rows(assumed, cfg, loader_rows, card)
    assert plan.packed_rows == (4, 560, 1488) and probe_shapes(cfg, plan) == [(4, 560, 1488)]
    blocks = plan.blocks_without_checkpointing
    # Longer decoder rows: fewer blocks fit (every decoder block and some encoder blocks on the assumed rows).
    assert assumed.blocks_without_checkpointing[0] == 24 and assumed.blocks_without_checkpointing[1] > 0
    assert 0 < blocks[0] < 24 and blocks[1] == 0
    assert blocks == choose_blocks_without_checkpointing(cfg, card, 8192, plan.packed_rows)
    fits = [
        micro_batch_peak(xl, cfg, 8192, (k, 0), plan.packed_rows).peak <= SAFETY_MARGIN * card
        for k in (blocks[0], blocks[0] + 1)
    ]
    assert fits == [True, False]
    # On the card the preset is for, every block of both stacks keeps its activations.
    assert plan_packed_rows(
        plan_run(cfg, 32 * GIB), cfg, loader_rows, 32 * GIB
    ).blocks_without_checkpointing == (
        24,
        24,
    )
    # Rows that do not fit even with every block checkpointed: said, with what to do.
    with caplog.at_level(logging.WARNING, logger="trainer.plan.memory_plan"):
        assert plan_packed_rows(assumed, cfg, loader_rows, 16 * GIB).blocks_without_checkpointing == (0, 0)
    assert "set max_tokens lower" in caplog.text
    # A config that sets the numbers keeps them.
    fixed = dataclasses.replace(
        cfg, decoder_blocks_without_checkpointing=24, encoder_blocks_without_checkpointing=2
    )
    assert plan_packed_rows(plan_run(fixed, card), fixed, loader_rows, card).blocks_without_checkpointing == (
        24,
        2,
    )


def test_trainer_plan_plans_the_packed_rows_the_loader_chooses(tmp_path, capsys, tiny_model_dir, sample_csv):
    from trainer.data.loader import stream_for
    from trainer.model.model_files import resolve_tokenizer_file

    config = _data_config(tmp_path, tiny_model_dir, sample_csv)
    assert cli_main(["plan", "--config", config, "--set", "packing=true"]) == 0
    out = capsys.readouterr().out
    cfg = dataclasses.replace(TrainConfig.load(config), packing=True)
    shape = stream_for(cfg, resolve_tokenizer_file(tiny_model_dir), "train").stats()["packed_shape"]
    assert shape["target_len"] != 96  # chosen from the data, not the maximum length
    rows = f"{shape['rows']} rows x ({shape['source_len']} + {shape['target_len']}) tokens (packed rows"
    assert f"micro-batch: {rows}" in out, out


def test_trainer_plan_without_the_hub_or_the_data_says_what_it_assumed_in_one_line(tmp_path, sample_csv):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on: the Hub cannot be reached
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=endpoint)
    preset = Path(__file__).resolve().parent.parent / "configs" / "flan-t5-xl-rtx5090.yaml"

    def plan(train_files: str) -> tuple[str, str]:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer",
                "plan",
                "--config",
                str(preset),
                "--set",
                f"train_files=[{train_files}]",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        # The assumption and its reason in one line; nothing else said (no Hub retries, no warning twice).
        assert done.stderr.strip() == "", done.stderr
        (data,) = [line for line in done.stdout.splitlines() if line.startswith("  data: ")]
        assert "assuming 1,000,000 records of 96 + 256 tokens (typical recipes)" in data, data
        return data, done.stdout

    missing = tmp_path / "data" / "*.csv"
    data, _ = plan(str(missing))
    assert f"({missing} matches no file ({tmp_path / 'data'} does not exist))" in data, data
    data, _ = plan(str(sample_csv))  # the data is there, but the model's tokenizer is not
    assert "google/flan-t5-xl: its tokenizer.json is not in the Hugging Face cache" in data, data


def test_trainer_plan_is_one_gpu_of_several_processes(tmp_path, capsys):
    """FLAN-T5-XL with fp32 weights and AdamW: no 32 GiB card holds it, nor does each of 2 under ddp (every
    GPU holds the whole); under fsdp each of 2 holds half of the weights, gradients and states, and fits."""
    config = write_config(tmp_path, "optimizer: adamw\ndtype: float32\nmax_tokens: 4096\n")

    def plan(*args: str) -> tuple[int, str, dict[str, float]]:
        code = cli_main(["plan", "--config", config, *args])
        out = capsys.readouterr().out
        gib = {m[1].strip(): float(m[2]) for m in re.finditer(r"^([a-z +()]+?)\s+(-?[\d.]+)$", out, re.M)}
        return code, out, gib

    one, _, one_gib = plan()
    ddp, ddp_out, ddp_gib = plan("--processes", "2")
    fsdp, fsdp_out, fsdp_gib = plan("--processes", "2", "--set", "distributed_strategy=fsdp")
    assert (one, ddp, fsdp) == (1, 1, 0)
    assert "processes: 2, ddp: every GPU holds what one process does" in ddp_out
    assert ddp_gib["total (predicted peak)"] == one_gib["total (predicted peak)"]
    assert "processes: 2, fsdp: weights, gradients and optimizer states split 2 ways" in fsdp_out
    assert fsdp_gib["optimizer states"] == pytest.approx(one_gib["optimizer states"] / 2, abs=0.01)
    # Half of the weights, and the bf16 weights of the root and two blocks, gathered for the compute.
    xl = load_shape("google/flan-t5-xl")
    gathered = 2 * (xl.root_params() + 2 * xl.block_params(decoder=True)) / GIB
    assert fsdp_gib["weights"] == pytest.approx(one_gib["weights"] / 2 + gathered, abs=0.01)
    assert cli_main(["plan", "--config", config, "--processes", "0"]) == 2
    assert "--processes must be at least 1" in capsys.readouterr().err


# Under torchrun (2 gloo ranks): one training step of a small bf16 T5 under FSDP2
# (trainer.run.parallel.wrap) with the trainer's Adafactor (Kahan), then rank 0's bytes of weights,
# gradients and optimizer states.
_FSDP_STEP = """
import json, sys, torch
from test_memory_plan import batch, build_bf16, tiny_config
from trainer.infra import distributed
from trainer.run import parallel
from trainer.config import TrainConfig
from trainer.optim.adafactor_optimizer import Adafactor
from trainer.model.loss import token_loss_sum


def storage_bytes(tensors):
    storages = {}
    for t in tensors:
        storage = t.to_local().untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


distributed.init(torch.device("cpu"), 300)
config = tiny_config(dropout_rate=0.0)
model = build_bf16(config, checkpointing=False)
module = parallel.wrap(model, TrainConfig(distributed_strategy="fsdp"), torch.device("cpu"))
opt = Adafactor(list(model.parameters()), lr=1e-3)
token_loss_sum(module, batch(config, 2, 8, 8)).backward()
opt.step()
params = list(model.parameters())
states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
measured = dict(
    weights=storage_bytes(params),
    gradients=storage_bytes(p.grad for p in params),
    states=storage_bytes(states),
    tensors=len(params),
)
if distributed.rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(measured, f)
distributed.destroy()
"""


def test_fsdp_shards_are_the_bytes_a_real_fsdp_step_keeps(tmp_path):
    """Each rank of 2 keeps half of every weight and gradient (FSDP2's padded shards), its half of the Kahan
    buffers and vector states, and Adafactor's factored statistics whole: the plan's sharded terms, exactly.
    (The plan counts transformers' Adafactor, which keeps a 4-byte RMS per weight the trainer's does not.)"""
    script, out = tmp_path / "fsdp_step.py", tmp_path / "bytes.json"
    script.write_text(_FSDP_STEP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([*cmd, str(script), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    measured = json.loads(out.read_text())

    shape = ModelShape.from_config(tiny_config())
    weights, _, gradients, _, _, states = sharded_state(
        shape, "bfloat16", "adafactor", "kahan", 2, True, True
    )
    assert measured["weights"] == weights == 2 * shape.num_params() // 2  # half of the model's bf16 bytes
    assert measured["gradients"] == gradients
    assert measured["states"] == states - 4 * measured["tensors"]

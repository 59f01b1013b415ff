"""The decoding engine (trainer.eval.decoding) against Hugging Face's `generate`, and its attention kernel
(trainer.kernels.decode_attention) against the plain math.

In fp32 the engine must write exactly the tokens `model.generate` writes, with every logits processor it
implements, whatever the number of slots (rows join and leave between steps). On a machine without a GPU
the Triton kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); on a GPU the same tests
run it for real, and the engine's step as a CUDA graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from trainer.eval.decoding import Decoding, DecodingEngine, decode
from trainer.eval.generate import generate_ids, hf_generate_ids, load_for_generation, open_model_dir
from trainer.kernels.decode_attention import decode_attention
from trainer.model.t5_decoding import decode_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's arithmetic is numpy's: fp16 and fp32 there; bf16 on a GPU.
DTYPES = (torch.bfloat16, torch.float32) if torch.cuda.is_available() else (torch.float16, torch.float32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize(("with_bias", "with_new"), [(False, False), (True, True), (True, False)])
def test_the_kernel_attends_to_each_rows_own_prefix(dtype, head_dim, with_bias, with_new) -> None:
    g = torch.Generator().manual_seed(head_dim)
    rows, heads, length = 5, 3, 150

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    # caches with two rows more than the query (idle slots past the bucket), lengths across block edges
    q, k, v = (
        randn(rows, heads, head_dim),
        randn(rows + 2, heads, length, head_dim),
        randn(rows + 2, heads, length, head_dim),
    )
    lengths = torch.tensor([1, 64, 65, 150, 37], dtype=torch.int32, device=DEVICE)
    bias = randn(heads, length) if with_bias else None
    # the self-attention's step: each row's newest key and value, stored by the kernel at lengths - 1
    new = (randn(rows, heads, head_dim), randn(rows, heads, head_dim)) if with_new else None
    k_ref, v_ref = k.double(), v.double()
    ref = decode_attention_reference(
        q.double(),
        k_ref,
        v_ref,
        lengths,
        None if bias is None else bias.double(),
        None if new is None else (new[0].double(), new[1].double()),
    )
    out = decode_attention(q, k, v, lengths, bias, new)
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(k.double(), k_ref.to(dtype).double()) and torch.equal(
        v.double(), v_ref.to(dtype).double()
    )
    # Keys past a row's length, and rows past the query's, are never read: NaN there changes nothing (the
    # new keys are in the caches now).
    unused = (
        torch.arange(length, device=DEVICE)[None, :] >= torch.cat([lengths, lengths.new_zeros(2)])[:, None]
    )
    k.masked_fill_(unused[:, None, :, None], float("nan"))
    v.masked_fill_(unused[:, None, :, None], float("nan"))
    again = decode_attention(q, k, v, lengths, bias)
    assert torch.isfinite(again).all() and rel_err(again, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    """The tiny model as `trainer generate` loads it on the CPU (fp32), with its generation_config."""
    return load_for_generation(open_model_dir(tiny_model_dir), "cpu")


def prompts(model, n: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return [
        torch.randint(2, vocab, (int(k),), generator=g).tolist()
        for k in torch.randint(3, 40, (n,), generator=g)
    ]


@pytest.mark.parametrize(
    "options",
    [
        {"max_new_tokens": 30, "no_repeat_ngram_size": 0},
        {"max_new_tokens": 30},  # the tiny model's generation_config: no_repeat_ngram_size 3
        {"max_new_tokens": 30, "repetition_penalty": 1.3, "no_repeat_ngram_size": 0},
        {"max_new_tokens": 25, "no_repeat_ngram_size": 2, "repetition_penalty": 0.8},
        {"max_new_tokens": 20, "min_new_tokens": 18},
        {"max_length": 12},
    ],
)
@pytest.mark.parametrize("budget", [60, 100_000])  # one slot at a time (refilled as rows end); all at once
def test_greedy_writes_exactly_what_hugging_face_generate_writes(model, options, budget) -> None:
    given = prompts(model)
    assert isinstance(Decoding.of(model, options), Decoding)
    ours = generate_ids(model, given, max_batch_tokens=budget, **options)
    theirs = hf_generate_ids(model, given, 0, 10**6, None, options)  # one padded batch, as HF runs it
    assert ours == theirs


def test_rows_that_end_early_free_their_slot_for_the_next_prompt(model) -> None:
    """A second end-of-sequence token, one the model writes often: rows end after different numbers of
    tokens, and with 2 slots for 12 prompts each freed slot takes the next prompt at once."""
    import copy

    given = prompts(model)
    plain = generate_ids(model, given, max_batch_tokens=100_000, max_new_tokens=30, no_repeat_ngram_size=0)
    common = torch.tensor([t for ids in plain for t in ids[2:]]).bincount().argmax().item()
    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = [1, common]
    options = {"max_new_tokens": 30, "no_repeat_ngram_size": 0}
    ours = generate_ids(stopping, given, max_batch_tokens=2 * (40 + 31), **options)
    assert ours == hf_generate_ids(stopping, given, 0, 10**6, None, options)
    assert len({len(ids) for ids in ours}) >= 3 and all(
        ids[-1] in (1, common) or len(ids) == 30 for ids in ours
    )


def test_sampling_is_reproducible_and_follows_its_options(model) -> None:
    given = prompts(model, 16)
    options = {"max_new_tokens": 20, "do_sample": True, "top_k": 10, "top_p": 0.9, "temperature": 0.7}
    torch.manual_seed(1)
    first = generate_ids(model, given, max_batch_tokens=10_000, **options)
    torch.manual_seed(1)
    assert generate_ids(model, given, max_batch_tokens=10_000, **options) == first
    torch.manual_seed(2)
    assert generate_ids(model, given, max_batch_tokens=10_000, **options) != first
    # top_k 1 keeps only the likeliest token: sampling is then greedy decoding
    greedy = generate_ids(model, given, max_batch_tokens=10_000, max_new_tokens=20)
    assert (
        generate_ids(model, given, max_batch_tokens=10_000, max_new_tokens=20, do_sample=True, top_k=1)
        == greedy
    )


def test_a_draw_follows_the_models_distribution(model) -> None:
    """The first sampled token of one prompt, drawn 4,000 times (4,000 slots of one step), against softmax of
    the first step's logits at temperature 2: the Gumbel-max draw samples the distribution."""
    (prompt,) = prompts(model, 1)
    draws = 4000
    engine = DecodingEngine(model, slots=draws, max_source_tokens=len(prompt), max_new_tokens=1)
    decoding = Decoding(max_new_tokens=1, do_sample=True, temperature=2.0)
    torch.manual_seed(0)
    engine.start(range(draws), [prompt] * draws, [decoding] * draws)
    engine.step()
    tokens = engine.history[:, 1]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([[0]]))
    probs = torch.softmax(out.logits[0, -1].double() / 2.0, -1)
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    likely = probs > 0.01
    expected = probs[likely] * draws
    # every likely token within 5 standard deviations of its binomial count; nothing unlikely often
    assert ((counts[likely] - expected).abs() <= 5 * (expected * (1 - probs[likely])).sqrt() + 1).all()
    assert counts[~likely].sum() <= 5 * max(1.0, float(probs[~likely].sum() * draws))


def test_packed_projections_change_no_weight_and_no_token(tiny_model_dir: Path) -> None:
    """`trainer generate` packs the decoder's q, k and v into one matmul: the state dict is the same tensors,
    and the engine writes what it writes with the projections apart."""
    from trainer.model.t5_decoding import T5DecodingParts

    packed = load_for_generation(open_model_dir(tiny_model_dir), "cpu")
    apart = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir).eval()
    assert all(p is not None for p in T5DecodingParts(packed).packed)
    assert all(p is None for p in T5DecodingParts(apart).packed)
    ours, theirs = packed.state_dict(), apart.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    given = prompts(packed)
    assert generate_ids(packed, given, max_new_tokens=20) == generate_ids(apart, given, max_new_tokens=20)


def test_beam_search_and_unknown_options_go_to_hugging_face(model, caplog) -> None:
    given = prompts(model, 4)
    assert Decoding.of(model, {"num_beams": 3}) == "num_beams=3"
    assert Decoding.of(model, {"bad_words_ids": [[5]]}) == "bad_words_ids=[[5]]"
    assert Decoding.of(model, {"synced_gpus": True}).startswith("synced_gpus")
    caplog.set_level("INFO")
    ours = generate_ids(model, given, max_batch_tokens=10_000, max_new_tokens=8, num_beams=3)
    assert "decoding with Hugging Face's generate (num_beams=3)" in caplog.text
    assert ours == hf_generate_ids(model, given, 0, 10**6, None, {"max_new_tokens": 8, "num_beams": 3})


def test_rows_join_and_leave_between_steps(model) -> None:
    """Slots reused: a prompt that joins a slot another row has just left decodes as if it were alone, and
    rows with different options share steps."""
    given = prompts(model, 6)
    new_tokens = (3, 9, 5, 9, 7, 4)
    alone = [
        hf_generate_ids(model, [p], 0, 10**6, None, {"max_new_tokens": n, "repetition_penalty": 1.2})[0]
        for p, n in zip(given, new_tokens, strict=True)
    ]
    engine = DecodingEngine(model, slots=3, max_source_tokens=40, max_new_tokens=9)
    out: dict[int, list[int]] = {}
    waiting = list(range(6))
    held: dict[int, int] = {}
    while waiting or held:
        free = engine.free_slots()
        joining = [waiting.pop(0) for _ in range(min(len(free), len(waiting)))]
        decodings = [
            Decoding(max_new_tokens=new_tokens[i], repetition_penalty=1.2, no_repeat_ngram_size=3)
            for i in joining
        ]
        engine.start(free[: len(joining)], [given[i] for i in joining], decodings)
        held.update(zip(free, joining, strict=False))
        engine.step()
        for slot in engine.finished():
            out[held.pop(slot)] = engine.take(slot)
    assert [out[i] for i in range(6)] == alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel's own path needs a GPU")
def test_on_the_gpu_the_graphs_write_what_the_eager_steps_write(tiny_model_dir: Path) -> None:
    cuda = load_for_generation(open_model_dir(tiny_model_dir), "cuda")
    given = prompts(cuda, 24)
    decoding = Decoding(max_new_tokens=24)
    with torch.no_grad():
        graphed, engine = decode(cuda, given, decoding, max_batch_tokens=400, graphs=True)
        eager, _ = decode(cuda, given, decoding, max_batch_tokens=400, graphs=False)
    assert engine.captures >= 1 and graphed == eager


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the graph test runs the kernel itself")
def test_the_cpu_engine_with_the_triton_kernel_writes_the_same(model) -> None:
    """The engine's step through the kernel (interpreted on a CPU): the caches' layout and strides as the
    kernel reads them."""
    given = prompts(model, 4)
    decoding = Decoding(max_new_tokens=6)
    plain, _ = decode(model, given, decoding, max_batch_tokens=10_000)
    engine = DecodingEngine(model, slots=4, max_source_tokens=40, max_new_tokens=6)
    engine.parts.attention = decode_attention
    engine.start(range(4), given, [decoding] * 4)
    for _ in range(6):
        engine.step()
    assert [engine.take(slot) for slot in range(4)] == plain

"""The attention kernels' dropout numbers, and T5 with the Triton attention against eager attention: padded
batches go through the segment kernels (trainer.kernels.packed_attention, each row one record), Hugging Face's
`generate` through SDPA with T5's dense bias.

On a machine without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1). The
interpreter's tl.dot mishandles bfloat16, so CPU runs use float16: the kernels' code paths are the same.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from trainer.kernels.dropout import dropout_keep, dropout_resolution, uniform16
from trainer.model.fused_t5 import use_triton_attention

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16
# Error bounds below are fp16's; bf16 keeps 3 fewer mantissa bits (its rounding errors are ~8x larger).
TOL = 4 if torch.cuda.is_available() else 1  # bf16 there
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


@triton.jit
def _uniform16_kernel(Seed, Out, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + index, uniform16(tl.load(Seed), index).to(tl.int32))


def random_numbers(seed: int, n: int = 1 << 16) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _uniform16_kernel[(n // 4096,)](torch.tensor([seed], device=DEVICE), out, BLOCK=4096)
    return out.cpu().double()


def test_the_torch_reference_draws_the_kernels_numbers():
    # The optimizers' torch path (the CPU's) rounds bf16 weights stochastically with uniform16_reference's
    # numbers, the kernels with uniform16's: equal, so that both paths (and every FSDP2 split) round alike.
    from trainer.kernels.dropout import uniform16_reference

    for seed in (0, 12345, 2**24 - 1, 2**31 - 2):
        index = torch.arange(1 << 16, dtype=torch.int64)
        assert torch.equal(uniform16_reference(seed, index).double(), random_numbers(seed))


@triton.jit
def _keep_kernel(Seed, Out, dropout_p, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + index, dropout_keep(tl.load(Seed), index, dropout_p).to(tl.int32))


@pytest.mark.parametrize("p", [0.1, dropout_resolution(0.1), 0.5, 1 / 65536, 0.0])
def test_dropout_keeps_the_elements_whose_number_reaches_p(p):
    # Every dropout in the kernels keeps u >= p * 2**16, so that the keep rate is exactly 1 - p for the
    # rounded p they get; and for any other p. 2**20 numbers: each 16-bit value ~16 times, the ones next to
    # the threshold included.
    n = 1 << 20
    keep = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _keep_kernel[(n // 4096,)](torch.tensor([777], device=DEVICE), keep, p, BLOCK=4096)
    assert torch.equal(keep.cpu().bool(), random_numbers(777, n) >= p * 65536)


def test_dropout_random_numbers_are_uniform_and_uncorrelated():
    # Dropout reads consecutive indices (neighbouring probabilities, a new seed per call): each stream must
    # be uniform over 16 bits, neighbours and the streams of nearby seeds uncorrelated.
    u = random_numbers(12345)
    n = u.numel()
    assert u.min() >= 0 and u.max() < 65536
    counts = torch.bincount((u // 256).long(), minlength=256).double()
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 255 + 5 * (2 * 255) ** 0.5  # chi-square, 255 degrees of freedom: 5 standard deviations

    def corr(x, y):
        return float(torch.corrcoef(torch.stack([x, y]))[0, 1])

    bound = 5 / n**0.5
    assert abs(corr(u[:-1], u[1:])) < bound
    assert abs(corr(u[:-8], u[8:])) < bound
    other = random_numbers(12346)
    assert abs(corr(u, other)) < bound
    # keep masks at p = 1/2 from the two seeds agree on half the elements
    agree = float(((u >= 32768) == (other >= 32768)).double().mean())
    assert abs(agree - 0.5) < 5 * (0.25 / n) ** 0.5


def test_tiny_t5_trains_and_generates_the_same_with_triton_attention(tiny_model_dir):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.loss import token_loss_sum
    from trainer.model.swaps import use_fused_t5_ops

    def load(use_triton: bool):
        # Loaded in fp32, then cast: in fp16 transformers keeps T5's `wo` in fp32 (mixed dtypes on CPU).
        model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
        model.to(DEVICE, DTYPE)
        use_fused_t5_ops(model)
        if use_triton:
            use_triton_attention(model)
        return model

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 7:], mask[1, 7:] = 0, 0
    labels = torch.randint(3, 100, (3, 9), generator=g)
    labels[2, 5:] = -100
    batch = {k: x.to(DEVICE) for k, x in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}
    results = {}
    for use_triton in (False, True):
        model = load(use_triton)
        model.eval()  # dropout off: the two must agree
        loss = token_loss_sum(model, batch)
        loss.backward()
        bias_grad = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad
        generated = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=6,
            do_sample=False,
        )
        results[use_triton] = (float(loss), bias_grad.float().clone(), generated)
    assert results[True][0] == pytest.approx(results[False][0], rel=2e-3)
    assert rel_err(results[True][1], results[False][1]) < 2e-2 * TOL
    assert torch.equal(results[True][2], results[False][2])


def test_the_decoding_engine_encodes_padded_prompts_through_the_kernels_as_eager_does(tiny_model_dir):
    """The decoding engine's encoder pass (trainer.model.t5_decoding: `encode`) with the Triton attention runs
    the kernels with each right-padded prompt one record; its hidden states at the real positions are eager
    attention's."""
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.swaps import use_fused_t5_ops
    from trainer.model.t5_decoding import T5DecodingParts

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 70), generator=g)  # 70: two key blocks, the second partial
    mask = torch.ones_like(ids)
    ids[1, 40:], mask[1, 40:] = 0, 0
    ids[2, 5:], mask[2, 5:] = 0, 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    states = {}
    for use_triton in (False, True):
        model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
        model.to(DEVICE, DTYPE).eval()
        use_fused_t5_ops(model)
        if use_triton:
            use_triton_attention(model)
        with torch.no_grad():
            states[use_triton] = T5DecodingParts(model).encode(ids, mask)
    real = mask.bool()
    assert states[True].shape == states[False].shape
    assert rel_err(states[True][real], states[False][real]) < 3e-3 * TOL

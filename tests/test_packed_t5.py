"""A packed batch's loss (trainer.model.packed_t5 through Seq2SeqLMLoss) against its records' losses computed
one by one with the plain HF model, on the tiny FLAN-T5: T5's own attention with dense segment masks (fp32),
and the packed Triton kernels (fp16 in the interpreter on CPU, bf16 on CUDA)."""

from __future__ import annotations

import pytest
import torch
from packed_batches import pack

from trainer.model.loss import Seq2SeqLMLoss
from trainer.model.packed_t5 import decoder_input_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TOL = 4 if DEVICE == "cuda" else 1  # bf16's rounding errors are ~8x fp16's

# (source, target) lengths and (rows, source capacity, target capacity): a record of one source token and
# one of one target token; records crossing the kernels' 64-token tiles and a last row left empty in the big
# batch; the small ones (for the kernels, slow in the interpreter) fill one tile per row.
BIG = [(7, 9), (1, 3), (40, 50), (12, 1), (30, 20), (25, 44), (3, 60)], (4, 80, 100)
SMALL = [(7, 9), (1, 3), (20, 30), (12, 1), (5, 14), (2, 6)], (2, 32, 48)
ONE_ROW = [(7, 9), (1, 3), (12, 14)], (1, 24, 32)


def records(lengths, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(3, 500, (s,), generator=g).tolist(), torch.randint(3, 500, (t,), generator=g).tolist())
        for s, t in lengths
    ]


def load(model_dir, dtype=torch.float32, *, triton_attention=False):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.fused_t5 import use_triton_attention
    from trainer.model.swaps import use_fused_t5_ops

    # Loaded in fp32, then cast: in fp16 transformers keeps T5's `wo` in fp32 (mixed dtypes on CPU).
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, attn_implementation="eager").to(DEVICE, dtype)
    use_fused_t5_ops(model)
    if triton_attention:
        use_triton_attention(model)
    return model


def per_record_loss_and_grads(model, recs):
    """Sum of the records' summed token losses, each record alone (unpacked, unpadded), and its gradients."""
    loss_module = Seq2SeqLMLoss(model)
    model.zero_grad()
    total = 0.0
    for src, tgt in recs:
        ids = torch.tensor([src], device=DEVICE)
        loss = loss_module(
            input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([tgt], device=DEVICE)
        )
        loss.backward()
        total += loss.item()
    return total, grads_of(model)


def grads_of(model) -> dict:
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_loss_and_grads(model, batch):
    model.zero_grad()
    loss = Seq2SeqLMLoss(model)(**{k: v.to(DEVICE) for k, v in batch.items()})
    loss.backward()
    return loss.item(), grads_of(model)


def assert_grads_close(got: dict, want: dict, tol: float):
    assert got.keys() == want.keys()
    for name in want:
        err = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30))
        assert err < tol, (name, err)


def test_decoder_inputs_are_each_records_labels_shifted_right():
    from transformers import T5ForConditionalGeneration

    from trainer.model.tiny_model import flan_t5_config

    lengths, shape = BIG
    recs = records(lengths)
    batch = pack(recs, *shape)
    got = decoder_input_ids(batch["labels"], batch["decoder_segment_ids"], batch["decoder_positions"], 0, 0)
    model = T5ForConditionalGeneration(flan_t5_config("tiny", vocab_size=500))  # start and pad ids 0
    seg, k = batch["decoder_segment_ids"], 0
    for row in range(shape[0]):
        for segment in range(1, int(seg[row].max()) + 1):  # the records in order
            span = seg[row] == segment
            target = torch.tensor([recs[k][1]])
            assert torch.equal(batch["labels"][row, span], target[0])
            assert torch.equal(got[row, span], model._shift_right(target)[0])
            k += 1
    assert k == len(recs)
    assert (got[seg == 0] == 0).all()  # padding: the pad id


def test_packed_loss_and_gradients_equal_the_sum_over_records_fp32(tiny_model_dir):
    # T5's own attention with dense segment masks: the eager (CPU) fallback of packed batches
    model = load(tiny_model_dir).eval()  # dropout off
    recs = records(BIG[0])
    want_loss, want_grads = per_record_loss_and_grads(model, recs)
    loss, grads = packed_loss_and_grads(model, pack(recs, *BIG[1]))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert_grads_close(grads, want_grads, 1e-4)


def test_packed_kernels_give_the_sum_over_records(tiny_model_dir, monkeypatch):
    # The same through the Triton kernels: the bias computed inside them (T5's dense bias never is), its
    # gradient summed into the table
    from transformers.models.t5.modeling_t5 import T5Attention

    recs = records(SMALL[0], seed=1)
    reference = load(tiny_model_dir, torch.float32).eval()
    want_loss, want_grads = per_record_loss_and_grads(reference, recs)
    model = load(tiny_model_dir, KERNEL_DTYPE, triton_attention=True).eval()

    def no_dense_bias(*args, **kwargs):
        raise AssertionError("T5's dense (H, T, S) position bias was computed")

    monkeypatch.setattr(T5Attention, "compute_bias", no_dense_bias)
    loss, grads = packed_loss_and_grads(model, pack(recs, *SMALL[1]))
    assert loss == pytest.approx(want_loss, rel=3e-3 * TOL)
    assert_grads_close(grads, want_grads, 3e-2 * TOL)  # the bias tables of both stacks included


def test_checkpoint_recompute_drops_the_same_probabilities(tiny_model_dir, monkeypatch):
    # Training mode (dropout 0.1 everywhere, attention included): gradient checkpointing on every block but
    # the last decoder block recomputes each block's forward with the same random numbers, so the loss and
    # gradients equal those of a run without checkpointing from the same seed.
    from trainer.model import fused_t5
    from trainer.model.load import skip_checkpointing

    calls = []
    attend = fused_t5.packed_attention  # the kernels' entry point, as T5's attention calls it

    def counted(*args, dropout_p, **kwargs):
        calls.append(dropout_p)
        return attend(*args, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(fused_t5, "packed_attention", counted)
    batch = pack(records(ONE_ROW[0], seed=2), *ONE_ROW[1])
    model = load(tiny_model_dir, KERNEL_DTYPE, triton_attention=True).train()
    torch.manual_seed(5)
    plain = packed_loss_and_grads(model, batch)
    assert len(calls) == 6 and min(calls) > 0  # 2 encoder + 2 x 2 decoder attentions, all with dropout
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert skip_checkpointing(model, 1) == (1, 0)
    torch.manual_seed(5)
    checkpointed = packed_loss_and_grads(model, batch)
    assert len(calls) == 6 + 6 + 4  # + the recompute of 2 encoder blocks and 1 decoder block
    assert checkpointed[0] == plain[0]
    for name, grad in plain[1].items():
        assert torch.equal(checkpointed[1][name], grad), name

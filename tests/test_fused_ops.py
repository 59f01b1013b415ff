"""The fused gated-GELU and residual-dropout kernels (trainer.kernels.fused_ops) against torch's ops, and
inside a real T5.

On a machine without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), in
float32; on CUDA in bfloat16, as the trainer runs them.
"""

from __future__ import annotations

import pytest
import torch

from trainer.kernels.fused_ops import BLOCK, gated_gelu_linear, norm_and_residual, residual_dropout
from trainer.model.fused_t5 import use_fused_gated_gelu, use_fused_residual_dropout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = 2e-2 if DEVICE == "cuda" else 1e-5  # bf16 there


def inputs(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (2 * torch.randn(*shape, generator=g)).to(DEVICE, DTYPE).requires_grad_()
    # |b| >= 0.5: the product is zero only where dropout removed it, so the output shows the mask
    b = torch.randn(*shape, generator=g)
    b = (b.sign() * (b.abs() + 0.5)).to(DEVICE, DTYPE).requires_grad_()
    return a, b


def gated_gelu(a, b, p=0.0):
    """The kernels' product itself: the output projection an identity (exact in every dtype)."""
    return gated_gelu_linear(a, b, torch.eye(a.size(-1), device=a.device, dtype=a.dtype), p)


def reference(a, b):
    return torch.nn.functional.gelu(a.float(), approximate="tanh") * b.float()


def rel_err(x, y):
    x, y = x.detach().float(), y.detach().float()
    return float((x - y).norm() / y.norm())


# One partial block, and several blocks with a ragged end (the random numbers must not depend on the block)
@pytest.mark.parametrize("shape", [(3, 7, 40), (2, 3 * BLOCK // 16 + 5, 16)])
def test_matches_torch_gelu_tanh_times_b(shape):
    a, b = inputs(*shape)
    out = gated_gelu(a, b)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    da, db = torch.autograd.grad(out, (a, b), grad)
    ref = reference(a, b)
    rda, rdb = torch.autograd.grad(ref, (a, b), grad.float())
    assert out.dtype == DTYPE and out.shape == a.shape
    assert rel_err(out, ref) < TOL
    assert rel_err(da, rda) < TOL and rel_err(db, rdb) < TOL


@pytest.mark.parametrize("shape", [(3, 7, 40), (2, 3 * BLOCK // 16 + 5, 16)])
def test_dropout_keeps_one_minus_p_and_backward_drops_the_same(shape):
    p = 0.25
    a, b = inputs(*shape)
    torch.manual_seed(5)
    out = gated_gelu(a, b, p)
    ref = reference(a, b)
    dropped = out == 0
    n = out.numel()
    assert abs(dropped.float().mean() - p) < 5 * (p * (1 - p) / n) ** 0.5  # 5 standard deviations
    kept = ~dropped
    assert rel_err(out[kept], ref[kept] / (1 - p)) < TOL
    # The backward regenerates the same mask: gradients vanish exactly where the output was dropped.
    da, db = torch.autograd.grad(out, (a, b), torch.ones_like(out))
    rda, rdb = torch.autograd.grad(ref, (a, b), kept.float() / (1 - p))
    assert torch.all(db[dropped] == 0) and torch.all(da[dropped] == 0)
    assert rel_err(da, rda) < TOL and rel_err(db, rdb) < TOL
    torch.manual_seed(6)
    assert not torch.equal(gated_gelu(a, b, p) == 0, dropped)  # a new seed, a new mask


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_the_output_projections_weight_gradient_uses_the_forwards_product_to_the_bit(p):
    # The backward makes the product (wo's input) again instead of keeping it: the same bits as the forward's,
    # dropout included; with weight_grad_in_place the gradient is added into .grad by the matmul.
    a, b = inputs(3, 7, 40)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 40, generator=g).to(DEVICE, DTYPE).requires_grad_()
    grad = torch.randn(3, 7, 24, generator=g).to(DEVICE, DTYPE)
    torch.manual_seed(7)
    product = gated_gelu(a, b, p).detach()
    torch.manual_seed(7)
    out = gated_gelu_linear(a, b, weight, p)
    assert torch.equal(out, torch.nn.functional.linear(product, weight))
    (dw,) = torch.autograd.grad(out, (weight,), grad)
    assert torch.equal(dw, grad.reshape(-1, 24).t().mm(product.reshape(-1, 40)))
    weight.grad = dw.clone()
    torch.manual_seed(7)
    gated_gelu_linear(a, b, weight, p, weight_grad_in_place=True).backward(grad)
    assert rel_err(weight.grad, 2 * dw) < 1e-2 if DEVICE == "cuda" else torch.allclose(weight.grad, 2 * dw)


def test_checkpoint_recompute_reproduces_dropout():
    a, b = inputs(4, 50, 24)

    def ff(a, b):
        return residual_dropout(a, gated_gelu(a, b, 0.3), 0.2).float().square().sum()

    torch.manual_seed(3)
    plain = torch.autograd.grad(ff(a, b), (a, b))
    torch.manual_seed(3)
    loss = torch.utils.checkpoint.checkpoint(ff, a, b, use_reentrant=False)
    recomputed = torch.autograd.grad(loss, (a, b))
    for x, y in zip(plain, recomputed, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("shape", [(3, 7, 40), (2, 3 * BLOCK // 16 + 5, 16)])
def test_residual_dropout_adds_the_kept_part_and_backward_drops_the_same(shape):
    p = 0.25
    residual, x = inputs(*shape)  # |x| >= 0.5: x / (1 - p) is never 0 where kept
    torch.manual_seed(5)
    out = residual_dropout(residual, x, p)
    kept = (out.float() - residual.float()).abs() > 0.25
    n = out.numel()
    assert abs(float((~kept).float().mean()) - p) < 5 * (p * (1 - p) / n) ** 0.5  # 5 standard deviations
    expected = residual.float() + torch.where(kept, x.float() / (1 - p), 0.0)
    assert rel_err(out, expected) < TOL
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    d_residual, dx = torch.autograd.grad(out, (residual, x), grad)
    assert torch.equal(d_residual, grad)
    assert torch.all(dx[~kept] == 0)
    assert rel_err(dx, torch.where(kept, grad.float() / (1 - p), 0.0)) < TOL
    assert torch.equal(residual_dropout(residual, x, 0.0), residual + x)  # p = 0: the plain sum
    torch.manual_seed(6)
    assert not torch.equal(residual_dropout(residual, x, p), out)  # a new seed, a new mask


# More rows than programs on CPU; columns not a power of two; T5-base's width (a warp count rounded up).
@pytest.mark.parametrize("shape", [(3, 7, 40), (70, 64), (5, 768)])
@pytest.mark.parametrize("rows_at_a_time", [1, 4])  # the rows of a program's last group partly outside
def test_norm_and_residual_backward_sums_both_gradients_as_torch_does(shape, rows_at_a_time, monkeypatch):
    from trainer.kernels import fused_ops

    monkeypatch.setattr(fused_ops, "NORM_BWD_ROWS", rows_at_a_time)
    g = torch.Generator().manual_seed(0)
    norm = torch.nn.RMSNorm(shape[-1], eps=1e-6).to(DEVICE, DTYPE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(shape[-1], generator=g))
    x = (3 * torch.randn(*shape, generator=g)).to(DEVICE, DTYPE).requires_grad_()
    grad_y, grad_residual = (torch.randn(*shape, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    normed, residual = norm_and_residual(x, norm)
    assert residual is not x and torch.equal(residual, x)  # the same values, through the op's backward
    dx, dw = torch.autograd.grad((normed, residual), (x, norm.weight), (grad_y, grad_residual))
    ref_normed = norm(x)
    rdx, rdw = torch.autograd.grad((ref_normed, x), (x, norm.weight), (grad_y, grad_residual))
    assert torch.equal(normed, ref_normed)  # the forward is torch's
    assert rel_err(dx, rdx) < TOL and rel_err(dw, rdw) < TOL


def test_the_norm_backward_asks_triton_for_a_power_of_two_warps_at_every_t5_width():
    """Triton refuses any other warp count on a GPU (the interpreter on CPU does not check): FLAN-T5 small,
    base, large and XL, and widths between."""
    from trainer.kernels.fused_ops import norm_bwd_warps

    for cols in (512, 768, 1024, 2048, 4096, 40, 1000, 1536):
        warps = norm_bwd_warps(cols)
        assert 4 <= warps <= 16 and warps & (warps - 1) == 0, (cols, warps)


def test_mismatched_inputs_are_refused():
    a, b = inputs(2, 8)
    with pytest.raises(ValueError, match="differ"):
        gated_gelu(a, b[:, :4])
    with pytest.raises(ValueError, match="differ"):
        residual_dropout(a, b[:, :4], 0.1)


def test_tiny_t5_with_the_fused_ops_keeps_its_weights_loss_and_generations(tiny_model_dir):
    from transformers import AutoModelForSeq2SeqLM

    from trainer.model.loss import token_loss_sum
    from trainer.model.swaps import use_fused_t5_ops

    def load():
        model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
        return model.to(DEVICE, DTYPE)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 11), generator=g)
    labels = torch.randint(3, 100, (3, 9), generator=g)
    batch = {
        k: x.to(DEVICE)
        for k, x in dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).items()
    }
    plain, fused = load().eval(), load().eval()  # dropout off: the two must agree
    keys = list(plain.state_dict())
    blocks = len(plain.encoder.block) + len(plain.decoder.block)
    assert use_fused_gated_gelu(fused) == blocks
    # every sublayer: self-attention and feed-forward, plus cross-attention in the decoder
    assert use_fused_residual_dropout(fused) == 2 * blocks + len(plain.decoder.block)
    # and the norms as torch's RMSNorm, whose backward then takes each sublayer's residual gradient too
    norms = use_fused_t5_ops(fused)[0]
    assert norms == 2 * blocks + len(plain.decoder.block) + 2  # + each stack's final norm
    assert list(fused.state_dict()) == keys  # checkpoints load either way
    losses, grads, generated = [], [], []
    for model in (plain, fused):
        loss = token_loss_sum(model, batch)
        loss.backward()
        losses.append(float(loss))
        first = model.encoder.block[0].layer[0]
        grads.append(
            [first.SelfAttention.q.weight.grad, first.layer_norm.weight.grad, model.shared.weight.grad]
        )
        # generation runs the attention sublayers with a cache
        generated.append(model.generate(input_ids=batch["input_ids"], max_new_tokens=5, do_sample=False))
    assert losses[1] == pytest.approx(losses[0], rel=TOL)
    assert all(rel_err(fused, plain) < 5 * TOL for fused, plain in zip(grads[1], grads[0], strict=True))
    assert torch.equal(generated[1], generated[0])
    fused.train()  # dropout on: training moves the loss
    torch.manual_seed(0)
    assert float(token_loss_sum(fused, batch)) != losses[1]

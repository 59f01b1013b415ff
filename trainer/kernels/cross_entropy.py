"""The LM head's summed token cross-entropy, without materialising full logits.

A 32k vocabulary makes the LM head's logits the largest tensors of a step: B x T x 32128 in bf16, plus the
fp32 copy, log-softmax and gradients that a plain `F.cross_entropy(logits.float())` keeps, several GiB at a
16k-token micro-batch. `linear_cross_entropy` instead walks the target tokens in chunks: for each chunk it
computes the logits, the loss and, when gradients are needed, the gradients of the hidden states and of the
head's weight (softmax minus one-hot, in fp32), then drops the chunk's logits. Backward only scales the stored
gradients. The arithmetic is the reference's: a bf16 matmul for the logits, fp32 for the softmax and loss.

On a GPU one Triton kernel per chunk (trainer.kernels.fused_ops.cross_entropy_rows_) reads the 16-bit logits
twice (their log-sum-exp, then the gradient written over them); torch's ops (on CPU) make an fp32 copy and
pass over it ~6 times.
"""

from __future__ import annotations

import torch

# Rows of logits per chunk: 4096 x 32128 fp32 is 0.5 GiB.
CHUNK_TOKENS = 4096


class LinearCrossEntropy(torch.autograd.Function):
    """The LM head's matmul and the cross-entropy over chunks of rows: no full fp32 logits tensor forward or
    backward (`linear_cross_entropy` is its entry point)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # A frozen head (LoRA, trainer.model.lora): no head gradient, neither its accumulator nor its matmuls.
        head_grad = ctx.needs_input_grad[1]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for a float64 model
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if head_grad else None
        fused = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
        for start in range(0, hidden.size(0), chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            y = labels[start : start + chunk_tokens]
            if fused:
                from trainer.kernels.fused_ops import (
                    cross_entropy_rows_,  # Triton: imported where a GPU runs it
                )

                logits = h @ weight.t()
                loss += cross_entropy_rows_(logits, y, need_grad).sum()
                g = logits  # the kernel wrote the gradient over them
            else:
                loss_sum, g = _chunk_loss(h @ weight.t(), y, need_grad, acc)
                loss += loss_sum
            if need_grad:
                g = g.to(hidden.dtype)
                grad_hidden[start : start + chunk_tokens] = g @ weight
                if head_grad:
                    grad_weight += (g.t() @ h).to(acc)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if head_grad else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        g = grad_loss.to(grad_hidden.dtype)
        return grad_hidden * g, None if grad_weight is None else grad_weight * g, None, None


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool, acc: torch.dtype):
    """What trainer.kernels.fused_ops.cross_entropy_rows_ computes, in torch ops over an `acc` copy of the
    logits: the chunk's summed loss and (with need_grad) its gradient, in `acc`."""
    counted = (labels != -100)[:, None]  # rows labelled -100 add nothing to the loss or the gradients
    labels = labels.clamp(min=0)
    logits = logits.to(acc)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = (lse - logits.gather(1, labels[:, None])).masked_fill(~counted, 0).sum()
    if not need_grad:
        return loss, None
    # d(sum of losses)/d(logits) = softmax - one_hot, in place over the copy; an uncounted row's infinite
    # log-sum-exp makes its softmax 0.
    g = logits.sub_(lse.masked_fill(~counted, float("inf"))).exp_()
    g.scatter_add_(1, labels[:, None], -counted.to(acc))
    return loss, g


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS
) -> torch.Tensor:
    """Sum over tokens with label != -100 of cross_entropy(hidden @ weight.T, label), in fp32.

    hidden: (..., d) in the model's dtype; weight: the LM head (vocab, d); labels: (...), -100 where
    padding. Only the labelled rows are multiplied by the head, except while a CUDA graph is being captured:
    selecting them needs their number on the host, so there every row is multiplied and the unlabelled ones
    are masked out.
    """
    rows, labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    if not (rows.is_cuda and torch.cuda.is_current_stream_capturing()):
        keep = labels != -100
        rows, labels = rows[keep], labels[keep]
    return LinearCrossEntropy.apply(rows, weight, labels, chunk_tokens)

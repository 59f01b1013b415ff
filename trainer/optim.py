"""Optimizers and learning-rate schedules.

bf16 weights lose small updates: once |update| < |w| * 2**-9 the sum rounds back to w. With
`bf16_update: kahan` every optimizer keeps a bf16 compensation buffer per weight that carries the rounding
error into the next step (Kahan summation), so the effective weight is accurate to ~16 bits of mantissa:
- AdamW: torch-optimi's `AdamW(kahan_sum=True)` (states in the weight dtype, foreach/triton kernels).
- Adafactor: `Adafactor` below, transformers' algorithm (factored second moment, update clipping) with the
  same compensation. torch-optimi has no Adafactor.
`bf16_update: naive` uses torch's AdamW (fused on CUDA) / Adafactor without compensation, for comparison.
fp32 weights need no compensation and use torch's AdamW.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with T5's fine-tuning settings and optional Kahan-compensated updates.

    Matches `transformers.optimization.Adafactor(scale_parameter=False, relative_step=False,
    warmup_init=False, beta1=None)`: an external learning rate, a factored second moment for matrices, update
    clipping at RMS `clip_threshold`. The update is computed in fp32; with `kahan=True` the part of it that
    the bf16 weight cannot represent is kept in a bf16 buffer and added back on the next step.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        weight_decay: float = 0.0,
        kahan: bool = True,
    ):
        defaults = dict(
            lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.kahan = kahan

    @staticmethod
    def _rms(t: torch.Tensor) -> torch.Tensor:
        return t.norm(2) / (t.numel() ** 0.5)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                factored = grad.dim() >= 2
                if not state:
                    state["step"] = 0
                    if factored:
                        state["exp_avg_sq_row"] = grad.new_zeros(grad.shape[:-1])
                        state["exp_avg_sq_col"] = grad.new_zeros(grad.shape[:-2] + grad.shape[-1:])
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)
                    if self.kahan and p.dtype != torch.float32:
                        state["kahan_comp"] = torch.zeros_like(p)
                state["step"] += 1
                beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
                update = grad.square() + group["eps"][0]
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    c_factor = col.unsqueeze(-2).rsqrt()
                    update = torch.mul(r_factor, c_factor).mul_(grad)
                else:
                    state["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = state["exp_avg_sq"].rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(group["lr"])

                comp = state.get("kahan_comp")
                w = p.float()
                if comp is not None:
                    w.add_(comp.float())
                if group["weight_decay"]:
                    w.add_(w, alpha=-group["weight_decay"] * group["lr"])
                w.sub_(update)
                p.copy_(w)
                if comp is not None:
                    comp.copy_(w.sub_(p.float()))  # what bf16 could not hold this step
        return loss


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by cfg.optimizer / cfg.bf16_update for `model`'s trainable weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    low_precision = params[0].dtype in (torch.bfloat16, torch.float16)
    kahan = low_precision and cfg.bf16_update == "kahan"
    if cfg.optimizer == "adafactor":
        opt = Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, kahan=kahan)
        log.info("optimizer: Adafactor (T5 settings, factored), %s updates", "Kahan" if kahan else "plain")
        return opt
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if kahan:
        import optimi

        opt = optimi.AdamW(
            params,
            lr=cfg.learning_rate,
            betas=betas,
            eps=cfg.adam_epsilon,
            weight_decay=cfg.weight_decay,
            kahan_sum=True,
        )
        log.info("optimizer: torch-optimi AdamW with Kahan-compensated bf16 updates")
        return opt
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        params,
        lr=cfg.learning_rate,
        betas=betas,
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )
    what = "naive bf16 updates" if low_precision else f"{params[0].dtype} weights"
    log.info("optimizer: torch AdamW (%s), %s", "fused" if fused else "foreach", what)
    return opt


def lr_lambda(step: int, *, kind: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): warmup, then decay to 0."""
    if warmup_steps > 0 and step < warmup_steps and kind != "constant":
        return (step + 1) / warmup_steps
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    """LambdaLR with cfg's warmup and decay; its state_dict goes into checkpoints."""

    def fn(step: int) -> float:
        return lr_lambda(
            step, kind=cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps, total_steps=total_steps
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

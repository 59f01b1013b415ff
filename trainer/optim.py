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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.adafactor_kernels import WeightGroup

log = logging.getLogger(__name__)


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with T5's fine-tuning settings and optional Kahan-compensated updates.

    Matches `transformers.optimization.Adafactor(scale_parameter=False, relative_step=False,
    warmup_init=False, beta1=None)`: an external learning rate, a factored second moment for matrices, update
    clipping at RMS `clip_threshold`. The update is computed in fp32; with `kahan=True` the part of it that
    the bf16 weight cannot represent is kept in a bf16 buffer and added back on the next step.

    On a GPU the weights of one shape are updated together by trainer.adafactor_kernels (four launches per
    shape, each weight read where it lies); elsewhere (CPU, FSDP's sharded weights) one at a time by
    `adafactor_update`.
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
            lr=lr,
            eps=eps,
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            weight_decay=weight_decay,
            # Read by torch's zero_grad: the gradients zeroed by one launch per dtype, not one per weight.
            foreach=True,
        )
        super().__init__(params, defaults)
        self.kahan = kahan
        # The step's device scalars, one (lr, beta2t, weight decay, gradient scale) tensor per group, device
        # and distinct step count, kept from step to step so that a captured `apply` (trainer.cuda_graphs)
        # reads this step's.
        self._scalars: dict[tuple, torch.Tensor] = {}
        # The kernels' address tables per batch of same-shape weights, kept from step to step while those
        # tensors stay put.
        self._weight_groups: dict[tuple, WeightGroup] = {}
        self._work: list[tuple[list[torch.Tensor], torch.Tensor, dict, WeightGroup | None]] = []

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.advance()
        self.apply()
        return loss

    @torch.no_grad()
    def advance(self, grad_scale: torch.Tensor | None = None) -> tuple:
        """The host's part of a step: states for new weights, step counts, the step's scalars queued to the
        device, and the batches of same-shape weights `apply` updates. Returns their layout: equal layouts
        make equal `apply` calls (the same tensors at the same addresses), which a captured `apply` needs.
        `grad_scale`: a one-element device tensor the update multiplies every gradient by as it reads it
        (gradient clipping's coefficient, `clip_coefficient`), so the gradients are not written over first."""
        self._work = []
        for gi, group in enumerate(self.param_groups):
            # Same-shape weights at the same step count, updated together.
            batches: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                kind = (p.shape, p.dtype, p.device, "kahan_comp" in state, _on_kernels(p))
                batches.setdefault((state["step"], kind), []).append(p)
            slots: dict[tuple, torch.Tensor] = {}  # (device, step) -> its scalars
            for (step, kind), params in batches.items():
                _, _, device, _, kernels = kind
                if (device, step) not in slots:
                    slots[device, step] = self._queue_scalars(gi, len(slots), device, step, group, grad_scale)
                weight_group = self._weight_group((gi, kind), params) if kernels else None
                self._work.append((params, slots[device, step], group, weight_group))
        return tuple(
            (tuple(map(id, params)), id(scalars), weight_group and weight_group.addresses)
            for params, scalars, _, weight_group in self._work
        )

    def retreat(self) -> None:
        """Take back the `advance` of a step that is skipped (a non-finite loss or gradient): the step counts
        as they were. The next `advance` queues its scalars again."""
        for params, *_ in self._work:
            for p in params:
                self.state[p]["step"] -= 1
        self._work = []

    @torch.no_grad()
    def apply(self) -> None:
        """The device's part of the step `advance` prepared: every weight's update; the host only launches."""
        for params, scalars, group, weight_group in self._work:
            eps, clip_threshold = group["eps"][0], group["clip_threshold"]
            if weight_group is not None:
                weight_group.update(scalars, eps, clip_threshold)
                continue
            for p in params:
                state = self.state[p]
                adafactor_update(
                    p,
                    p.grad,
                    state.get("exp_avg_sq_row"),
                    state.get("exp_avg_sq_col"),
                    state.get("exp_avg_sq"),
                    state.get("kahan_comp"),
                    scalars,
                    eps,
                    clip_threshold,
                )

    def _weight_group(self, key: tuple, params: list[torch.Tensor]) -> WeightGroup:
        """The kernels' tables for `params`, made again only when a tensor moved (new gradients, loaded
        states)."""
        from trainer.adafactor_kernels import WeightGroup

        states = [self.state[p] for p in params]
        kept = self._weight_groups.get(key)
        if kept is None or kept.addresses != WeightGroup.addresses_of(WeightGroup.tensors_of(params, states)):
            kept = self._weight_groups[key] = WeightGroup.build(params, states)
        return kept

    def _queue_scalars(
        self, group_index: int, slot: int, device, step: int, group: dict, grad_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """[lr, beta2t, weight decay, gradient scale] of `step` copied into the kept device tensor of (group,
        device, slot). A tensor, because they change every step and a captured update must read this step's;
        the gradient scale is copied from its device tensor (1 without one)."""
        values = torch.tensor(
            [group["lr"], 1.0 - math.pow(step, group["decay_rate"]), group["weight_decay"], 1.0],
            dtype=torch.float32,
        )
        key = (group_index, device, slot)
        if key not in self._scalars:
            self._scalars[key] = torch.empty(4, dtype=torch.float32, device=device)
        scalars = self._scalars[key]
        if device.type == "cuda":
            # From pinned memory the copy is queued; from pageable memory the host would wait for the GPU to
            # finish what is queued before it.
            values = values.pin_memory()
        scalars.copy_(values, non_blocking=True)
        if grad_scale is not None:
            scalars[3:].copy_(grad_scale.reshape(1), non_blocking=True)
        return scalars

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = p.new_zeros(p.shape[:-1], dtype=torch.float32)
            state["exp_avg_sq_col"] = p.new_zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32)
        else:
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if self.kahan and p.dtype != torch.float32:
            state["kahan_comp"] = torch.zeros_like(p)


def _on_kernels(p: torch.Tensor) -> bool:
    """Whether trainer.adafactor_kernels update `p` (a GPU's; imported there only: they need Triton)."""
    if not p.is_cuda:
        return False
    from trainer.adafactor_kernels import WeightGroup

    return WeightGroup.supports(p)


def adafactor_update(p, grad, row, col, sq, comp, scalars, eps: float, clip_threshold: float) -> None:
    """One Adafactor step of one weight, in place, in torch ops: the second-moment statistics (`row`/`col`
    for matrices, `sq` otherwise), the weight `p` and its Kahan buffer `comp` (or None). scalars: [lr,
    beta2t, weight decay, gradient scale] as a float32 tensor on p's device. What trainer.adafactor_kernels
    computes on a GPU."""
    lr, beta2t, weight_decay, grad_scale = scalars[0], scalars[1], scalars[2], scalars[3]
    grad = grad.float() * grad_scale
    update = grad.square() + eps
    if row is not None:
        row.mul_(beta2t).add_(update.mean(dim=-1) * (1.0 - beta2t))
        col.mul_(beta2t).add_(update.mean(dim=-2) * (1.0 - beta2t))
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
        update = r_factor * col.unsqueeze(-2).rsqrt() * grad
    else:
        sq.mul_(beta2t).add_(update * (1.0 - beta2t))
        update = sq.rsqrt() * grad
    rms = update.square().mean().sqrt()
    update = update / (rms / clip_threshold).clamp(min=1.0) * lr
    w = p.float()
    if comp is not None:
        w = w + comp.float()
    w = w - w * (weight_decay * lr) - update
    if comp is None:
        p.copy_(w)
    else:  # 16-bit weights
        rounded = w.to(p.dtype)
        p.copy_(rounded)
        comp.copy_(w - rounded.float())  # what the weight's dtype could not hold this step


def clip_coefficient(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor gradient clipping multiplies the gradients by, min(1, max_norm / norm) (as
    torch.nn.utils.clip_grad_norm_ computes it), on the norm's device; None for `max_norm` 0 (the norm is
    only measured, as in Hugging Face)."""
    if max_norm <= 0:
        return None
    return (max_norm / (grad_norm.float() + 1e-6)).clamp(max=1.0)


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

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

import functools
import logging
import math

import torch

log = logging.getLogger(__name__)


# Weights updated in one compiled call: stacking bounds the temporaries (~5x this) and keeps the chunks few
# (FLAN-T5-XL: 24 calls instead of 557, whose host time the GPU would wait for).
STACK_BYTES = 256 << 20


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with T5's fine-tuning settings and optional Kahan-compensated updates.

    Matches `transformers.optimization.Adafactor(scale_parameter=False, relative_step=False,
    warmup_init=False, beta1=None)`: an external learning rate, a factored second moment for matrices, update
    clipping at RMS `clip_threshold`. The update is computed in fp32; with `kahan=True` the part of it that
    the bf16 weight cannot represent is kept in a bf16 buffer and added back on the next step.

    Weights of one shape are updated together, stacked up to STACK_BYTES at a time, by one call of
    `adafactor_update`, compiled when `compile` is true (default: on CUDA). FSDP's sharded weights are
    updated one at a time, uncompiled.
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
        compile: bool | None = None,
    ):
        defaults = dict(
            lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.kahan = kahan
        self.compile = compile
        # The step's device scalars, one (lr, beta2t, weight decay) tensor per group, device and distinct step
        # count, kept from step to step so that a captured `apply` (trainer.cuda_graphs) reads this step's.
        self._scalars: dict[tuple, torch.Tensor] = {}
        self._work: list[tuple[list[torch.Tensor], torch.Tensor, dict]] = []  # what `apply` updates

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.advance()
        self.apply()
        return loss

    @torch.no_grad()
    def advance(self) -> tuple:
        """The host's part of a step: states for new weights, step counts, the step's scalars queued to the
        device, and the stacks `apply` updates. Returns the stacks' layout: equal layouts make equal `apply`
        calls (the same tensors), which is what a captured `apply` needs."""
        self._work = []
        for gi, group in enumerate(self.param_groups):
            stacks: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                key = (p.shape, p.dtype, p.device, state["step"], "kahan_comp" in state, _plain(p))
                stacks.setdefault(key, []).append(p)
            slots: dict[tuple, torch.Tensor] = {}  # (device, step) -> its scalars
            for (shape, dtype, device, step, _, plain), params in stacks.items():
                if (device, step) not in slots:
                    slots[device, step] = self._queue_scalars(gi, len(slots), device, step, group)
                per_stack = max(1, STACK_BYTES // (math.prod(shape) * dtype.itemsize)) if plain else 1
                for i in range(0, len(params), per_stack):
                    self._work.append((params[i : i + per_stack], slots[device, step], group))
        return tuple((tuple(map(id, params)), id(scalars)) for params, scalars, _ in self._work)

    @torch.no_grad()
    def apply(self) -> None:
        """The device's part of the step `advance` prepared: every stack's update; the host only launches."""
        for params, scalars, group in self._work:
            self._update_stack(params, scalars, group)

    def _queue_scalars(self, group_index: int, slot: int, device, step: int, group: dict) -> torch.Tensor:
        """[lr, beta2t, weight decay] of `step` copied into the kept device tensor of (group, device, slot).
        A tensor, because they change every step and a compiled update must not recompile."""
        values = torch.tensor(
            [group["lr"], 1.0 - math.pow(step, group["decay_rate"]), group["weight_decay"]],
            dtype=torch.float32,
        )
        key = (group_index, device, slot)
        if key not in self._scalars:
            self._scalars[key] = torch.empty(3, dtype=torch.float32, device=device)
        if device.type == "cuda":
            # From pinned memory the copy is queued; from pageable memory the host would wait for the GPU to
            # finish what is queued before it.
            values = values.pin_memory()
        return self._scalars[key].copy_(values, non_blocking=True)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = p.new_zeros(p.shape[:-1], dtype=torch.float32)
            state["exp_avg_sq_col"] = p.new_zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32)
        else:
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if self.kahan and p.dtype != torch.float32:
            state["kahan_comp"] = torch.zeros_like(p)

    def _update_stack(self, params: list[torch.Tensor], scalars: torch.Tensor, group: dict) -> None:
        """One update of same-shape weights, stacked (one alone is updated in place); the results are copied
        back to each tensor."""
        names = ["exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "kahan_comp"]
        owned = {n: [self.state[p][n] for p in params] for n in names if n in self.state[params[0]]}
        if len(params) == 1:
            stacked, weights, grads = {n: ts[0] for n, ts in owned.items()}, params[0], params[0].grad
        else:
            stacked = {n: torch.stack(ts) for n, ts in owned.items()}
            weights, grads = torch.stack(params), torch.stack([p.grad for p in params])
        compiled = self.compile if self.compile is not None else weights.device.type == "cuda"
        compiled = compiled and _plain(weights)
        update = compiled_adafactor_update() if compiled else adafactor_update
        # The stacks have one shape per weight shape and chunk size; the default limit (8) is too few for
        # some models, and past it the update would silently run uncompiled.
        with torch._dynamo.config.patch(recompile_limit=64):
            update(
                weights,
                grads,
                stacked.get("exp_avg_sq_row"),
                stacked.get("exp_avg_sq_col"),
                stacked.get("exp_avg_sq"),
                stacked.get("kahan_comp"),
                scalars,
                group["eps"][0],
                group["clip_threshold"],
                params[0].dim(),
            )
        if len(params) > 1:
            torch._foreach_copy_(params, weights.unbind(0))
            for n, ts in owned.items():
                torch._foreach_copy_(ts, stacked[n].unbind(0))


def _plain(t: torch.Tensor) -> bool:
    """Not a tensor subclass such as FSDP's sharded DTensor weights, which Adafactor neither stacks (no
    `_foreach_copy_` for them) nor compiles (not tried on GPUs here): they are updated one at a time,
    eagerly."""
    return type(t.data) is torch.Tensor


def adafactor_update(
    p, grad, row, col, sq, comp, scalars, eps: float, clip_threshold: float, param_dims: int
) -> None:
    """One Adafactor step for a stack of weights, in place: the second-moment statistics (`row`/`col` for
    matrices, `sq` otherwise), the weights `p` and their Kahan buffer `comp` (or None). Leading dimensions
    beyond a weight's own `param_dims` index the stack. scalars: [lr, beta2t, weight decay] as a float32
    tensor on p's device."""
    lr, beta2t, weight_decay = scalars[0], scalars[1], scalars[2]
    grad = grad.float()
    update = grad.square() + eps
    if row is not None:
        row.mul_(beta2t).add_(update.mean(dim=-1) * (1.0 - beta2t))
        col.mul_(beta2t).add_(update.mean(dim=-2) * (1.0 - beta2t))
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
        update = r_factor * col.unsqueeze(-2).rsqrt() * grad
    else:
        sq.mul_(beta2t).add_(update * (1.0 - beta2t))
        update = sq.rsqrt() * grad
    rms = update.square().mean(dim=tuple(range(-param_dims, 0)), keepdim=True).sqrt()
    update = update / (rms / clip_threshold).clamp(min=1.0) * lr
    w = p.float()
    if comp is not None:
        w = w + comp.float()
    w = w - w * (weight_decay * lr) - update
    if comp is None:
        p.copy_(w)
    else:  # bf16 weights
        rounded = round_to_bf16(w)
        p.copy_(rounded)
        comp.copy_(w - rounded)  # what the bf16 weight could not hold this step


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to the nearest bf16 value (ties to even), still fp32, as `x.bfloat16().float()`.

    Integer arithmetic on the bits, because compilers may drop a round trip through bf16: inductor keeps
    intermediates in fp32 (unless `emulate_precision_casts`, which torch 2.11 still skipped here), and the
    Kahan buffer `w - w.bfloat16().float()` came out zero."""
    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)


@functools.cache
def compiled_adafactor_update():
    """adafactor_update compiled: ~25 elementwise passes fused into a few kernels per stack. Static shapes
    (one compile per weight shape) make faster kernels than dynamic ones (bench/NOTES.md)."""
    return torch.compile(adafactor_update, dynamic=False)


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

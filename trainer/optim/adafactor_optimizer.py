"""Adafactor (Shazeer & Stern 2018) with T5's fine-tuning settings and Kahan-compensated bf16 updates: the
optimizer trainer.optim.adafactor declares. torch-optimi has no Adafactor.

bf16 weights lose small updates: once |update| < |w| * 2**-9 the sum rounds back to w. With
`bf16_update: kahan` a bf16 compensation buffer per weight carries the rounding error into the next step
(Kahan summation), so the effective weight is accurate to ~16 bits of mantissa.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.kernels.adafactor_kernels import WeightGroup


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with T5's fine-tuning settings and optional Kahan-compensated updates.

    Matches `transformers.optimization.Adafactor(scale_parameter=False, relative_step=False,
    warmup_init=False, beta1=None)`: an external learning rate, a factored second moment for matrices, update
    clipping at RMS `clip_threshold`. The update is computed in fp32; with `kahan=True` the part of it that
    the bf16 weight cannot represent is kept in a bf16 buffer and added back on the next step.

    On a GPU the weights of one shape are updated together by trainer.kernels.adafactor_kernels (four launches
    per shape, each weight read where it lies); on the CPU one at a time by `adafactor_update`. FSDP's sharded
    weights (DTensors) are updated on each rank's shards with two all-reduces per step for all of them: by
    the kernels' `update_shards` on a GPU, by `sharded_adafactor_update` on the CPU. Under FSDP the row
    states are split like the weights' rows, the column states whole on every rank.
    """

    # The statistics are fp32 whatever the weights' dtype (the kernels read and write them as fp32).
    FP32_STATES = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")

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
        # and distinct step count, kept from step to step so that a captured `apply` (trainer.run.cuda_graphs)
        # reads this step's.
        self._scalars: dict[tuple, torch.Tensor] = {}
        # The kernels' address tables per batch of same-shape weights, kept from step to step while those
        # tensors stay put.
        self._weight_groups: dict[tuple, WeightGroup] = {}
        self._work: list[tuple[list[torch.Tensor], torch.Tensor, dict, WeightGroup | None]] = []
        # Aligned copies of gradients the kernels' tables point at (FSDP2's, `_weight_group`): the tables hold
        # addresses only, so the copies live here until `apply` has run.
        self._grad_copies: list[torch.Tensor] = []
        self._advanced = False  # `advance` prepared a step that `apply` has not run yet

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, with the second-moment statistics kept in fp32: torch casts every floating-point state to
        its weight's dtype (bf16 statistics would lose precision, and the kernels would write past them)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for key in self.FP32_STATES:
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        """The update: the step `advance` prepared (advanced here when it was not), applied. The loop calls
        this rather than `apply`, so that torch's schedulers see the optimizer step before theirs."""
        loss = closure() if closure is not None else None
        if not self._advanced:
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
        self._work, self._grad_copies, self._advanced = [], [], True
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
        self._work, self._grad_copies, self._advanced = [], [], False

    @torch.no_grad()
    def apply(self) -> None:
        """The device's part of the step `advance` prepared: every weight's update; the host only launches."""
        self._advanced = False
        from torch.distributed.tensor import DTensor

        sharded, shard_groups, mesh = [], [], None
        for params, scalars, group, weight_group in self._work:
            eps, clip_threshold = group["eps"][0], group["clip_threshold"]
            if weight_group is not None and isinstance(params[0], DTensor):
                shard_groups.append((weight_group, scalars, eps, clip_threshold))
                mesh = params[0].device_mesh
                continue
            if weight_group is not None:
                weight_group.update(scalars, eps, clip_threshold)
                continue
            if isinstance(params[0], DTensor):
                sharded += [(p, self.state[p], scalars, eps, clip_threshold) for p in params]
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
        if shard_groups:
            import torch.distributed as dist

            from trainer.kernels.adafactor_kernels import update_shards

            process_group = mesh.get_group()
            update_shards(shard_groups, lambda t: dist.all_reduce(t, group=process_group))
        if sharded:
            sharded_adafactor_update(sharded)
        self._grad_copies = []  # the kernels that read them are queued: the allocator keeps them until done

    def _weight_group(self, key: tuple, params: list[torch.Tensor]) -> WeightGroup:
        """The kernels' tables for `params` (FSDP's: their local shards), made again only when a tensor moved
        (new gradients, loaded states)."""
        from torch.distributed.tensor import DTensor

        from trainer.kernels.adafactor_kernels import WeightGroup  # Triton: on a GPU only (_on_kernels)

        states = [self.state[p] for p in params]
        grads, whole_shape = None, None
        if isinstance(params[0], DTensor):
            # FSDP2's gradients are views into its reduce-scatter's output; one not on a 16-byte boundary
            # is read from a copy (this rank's choice alone: the kernels run on every rank either way).
            grads = [p.grad.to_local() for p in params]
            copies = {i: g.clone() for i, g in enumerate(grads) if g.data_ptr() % 16}
            grads = [copies.get(i, g) for i, g in enumerate(grads)]
            self._grad_copies += copies.values()
            params, whole_shape = [p.to_local() for p in params], tuple(params[0].shape)
            states = [{k: _local(v) for k, v in state.items()} for state in states]
        kept = self._weight_groups.get(key)
        tensors = WeightGroup.tensors_of(params, states, grads)
        if kept is None or kept.addresses != WeightGroup.addresses_of(tensors):
            kept = self._weight_groups[key] = WeightGroup.build(params, states, grads, whole_shape)
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
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor import zeros as dtensor_zeros

        state["step"] = 0
        if p.dim() >= 2:
            rows, cols = p.shape[:-1], p.shape[:-2] + p.shape[-1:]
            if isinstance(p, DTensor):  # FSDP's shard: the row state split like its rows, the columns' whole
                on = dict(dtype=torch.float32, device_mesh=p.device_mesh)
                state["exp_avg_sq_row"] = dtensor_zeros(rows, placements=[Shard(0)], **on)
                state["exp_avg_sq_col"] = dtensor_zeros(cols, placements=[Replicate()], **on)
            else:
                state["exp_avg_sq_row"] = p.new_zeros(rows, dtype=torch.float32)
                state["exp_avg_sq_col"] = p.new_zeros(cols, dtype=torch.float32)
        else:
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if self.kahan and p.dtype != torch.float32:
            state["kahan_comp"] = torch.zeros_like(p)


def _on_kernels(p: torch.Tensor) -> bool:
    """Whether trainer.kernels.adafactor_kernels update `p` (a GPU's; imported there only: they need
    Triton). FSDP's shards: decided by what is the same on every rank (the kernels' all-reduces must meet
    the other ranks'); a shard's gradient off a 16-byte boundary is read from a copy."""
    if not p.is_cuda:
        return False
    from torch.distributed.tensor import DTensor

    from trainer.kernels.adafactor_kernels import WeightGroup

    if isinstance(p, DTensor):  # the shard stands in for its gradient: FSDP2 gives it the shard's dtype
        local = p.to_local()
        return p.dim() <= 2 and WeightGroup.supports(local, local)
    return WeightGroup.supports(p)


def _local(t):
    """A DTensor's local part (FSDP's shard); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def adafactor_update(p, grad, row, col, sq, comp, scalars, eps: float, clip_threshold: float) -> None:
    """One Adafactor step of one weight, in place, in torch ops: the second-moment statistics (`row`/`col`
    for matrices, `sq` otherwise), the weight `p` and its Kahan buffer `comp` (or None). scalars: [lr,
    beta2t, weight decay, gradient scale] as a float32 tensor on p's device. What
    trainer.kernels.adafactor_kernels computes on a GPU."""
    beta2t, grad_scale = scalars[1], scalars[3]
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
    write_update(p, comp, update, update.square().mean().sqrt(), scalars, clip_threshold)


def write_update(p, comp, update, rms, scalars, clip_threshold: float) -> None:
    """The end of an Adafactor step: `update` (fp32, unclipped) clipped by its `rms`, times the learning
    rate, weight decay, and the weight `p` written in place; with a Kahan buffer `comp` (16-bit weights) the
    part of the new weight its dtype cannot hold is kept there for the next step."""
    lr, weight_decay = scalars[0], scalars[2]
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


def sharded_adafactor_update(weights: list[tuple]) -> None:
    """`adafactor_update` of FSDP's sharded weights, all at once, in torch ops (the CPU's way; a GPU runs
    trainer.kernels.adafactor_kernels.update_shards, the same passes): `weights` are (p, its state, scalars,
    eps, clip_threshold), p a DTensor split by rows (FSDP2's Shard(0)) whose gradient and row state are
    split the same way, the column state whole on every rank.

    Each rank works on its own rows, as a DTensor op would, but with two all-reduces for all the weights
    instead of collectives per weight and op: one for what the factored statistics need from every rank
    (each column's sum over this rank's rows, this rank's row-state sum), one for each update's sum of
    squares (its RMS). The update is computed again in the last pass rather than kept: no fp32 copy of the
    shards."""
    import torch.distributed as dist

    if any(p.dim() > 2 for p, *_ in weights):
        raise ValueError("Adafactor on FSDP's shards updates weights of one or two dimensions (T5's)")
    group = weights[0][0].device_mesh.get_group()
    device = weights[0][0].to_local().device

    def scaled_grad(p, scalars):
        return _local(p.grad).float() * scalars[3]

    def factored_update(p, state, grad, row_mean):
        r_factor = (_local(state["exp_avg_sq_row"]) / row_mean).rsqrt().unsqueeze(-1)
        return r_factor * _local(state["exp_avg_sq_col"]).unsqueeze(-2).rsqrt() * grad

    # 1. Row states of this rank's rows; each weight's column sums over them and its row-state sum.
    sizes = [p.shape[1] + 1 if p.dim() == 2 else 0 for p, *_ in weights]
    stats = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    offset = 0
    for (p, state, scalars, eps, _), size in zip(weights, sizes, strict=True):
        update = scaled_grad(p, scalars).square() + eps
        beta2t = scalars[1]
        if p.dim() == 2:
            row = _local(state["exp_avg_sq_row"])
            if row.numel():
                row.mul_(beta2t).add_(update.mean(dim=-1) * (1.0 - beta2t))
                stats[offset : offset + size - 1] = update.sum(dim=-2)
                stats[offset + size - 1] = row.sum()
        else:
            _local(state["exp_avg_sq"]).mul_(beta2t).add_(update * (1.0 - beta2t))
        offset += size
    dist.all_reduce(stats, group=group)
    # 2. The column states (whole on every rank), and each update's sum of squares over this rank's part.
    squares = torch.zeros(len(weights), dtype=torch.float32, device=device)
    row_means, offset = [], 0
    for i, ((p, state, scalars, _, _), size) in enumerate(zip(weights, sizes, strict=True)):
        grad, beta2t = scaled_grad(p, scalars), scalars[1]
        if p.dim() == 2:
            rows = p.shape[0]
            col_mean = stats[offset : offset + size - 1] / rows
            _local(state["exp_avg_sq_col"]).mul_(beta2t).add_(col_mean * (1.0 - beta2t))
            row_means.append(stats[offset + size - 1] / rows)
            update = factored_update(p, state, grad, row_means[-1])
        else:
            row_means.append(None)
            update = _local(state["exp_avg_sq"]).rsqrt() * grad
        squares[i] = update.square().sum()
        offset += size
    dist.all_reduce(squares, group=group)
    # 3. The update again, clipped by its RMS over the whole weight, written into this rank's shard.
    for i, (p, state, scalars, _, clip_threshold) in enumerate(weights):
        grad = scaled_grad(p, scalars)
        if p.dim() == 2:
            update = factored_update(p, state, grad, row_means[i])
        else:
            update = _local(state["exp_avg_sq"]).rsqrt() * grad
        rms = (squares[i] / p.numel()).sqrt()
        write_update(_local(p), _local(state.get("kahan_comp")), update, rms, scalars, clip_threshold)

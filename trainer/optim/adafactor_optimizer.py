"""Adafactor (Shazeer & Stern 2018) with T5's fine-tuning settings and Kahan-compensated bf16 updates: the
optimizer trainer.optim.adafactor declares. torch-optimi has no Adafactor.

bf16 weights lose small updates: once |update| < |w| * 2**-9 the sum rounds back to w. With
`bf16_update: kahan` a bf16 compensation buffer per weight carries the rounding error into the next step
(Kahan summation), so the effective weight is accurate to ~16 bits of mantissa. With `bf16_update:
kahan_8bit` the buffer is one byte per weight: the rounding error in units of 1/256 of the weight's last bit
(it is at most half a bit: 128 units), each code rounded up or down with the probability of the remainder,
so nothing is lost on average and the noise is 1/256 of what rounding the weight itself stochastically adds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from trainer.infra.distributed import local_shard

if TYPE_CHECKING:
    from trainer.kernels.adafactor_kernels import WeightGroup


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with T5's fine-tuning settings and optional Kahan-compensated updates.

    Matches `transformers.optimization.Adafactor(scale_parameter=False, relative_step=False,
    warmup_init=False, beta1=None)`: an external learning rate, a factored second moment for matrices, update
    clipping at RMS `clip_threshold`. The update is computed in fp32; with `bf16_update="kahan"` the part of
    it that the bf16 weight cannot represent is kept in a bf16 buffer and added back on the next step; with
    `"kahan_8bit"` as 8-bit codes, stochastically rounded by a hash of each element's index keyed by the
    step (trainer.kernels.dropout.uniform16: the same numbers on every path, every rank and every FSDP2
    split, so a shard's codes are the whole weight's).

    On a GPU the weights of one shape are updated together by trainer.kernels.adafactor_kernels (four launches
    per shape, each weight read where it lies); on the CPU one at a time by `adafactor_update`. FSDP's sharded
    weights (DTensors) are updated on each rank's shards with two all-reduces per step for all of them: by
    the kernels' `update_shards` on a GPU, by `sharded_adafactor_update` on the CPU. Under FSDP the row
    states are split like the weights' rows, the column states whole on every rank.
    """

    # States whose dtype is not the weights': the statistics are fp32 (the kernels read and write them as
    # fp32), the 8-bit Kahan codes int8.
    STATE_DTYPES = {
        "exp_avg_sq_row": torch.float32,
        "exp_avg_sq_col": torch.float32,
        "exp_avg_sq": torch.float32,
        "kahan_codes": torch.int8,
    }

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        weight_decay: float = 0.0,
        bf16_update: str = "kahan",
    ):
        if bf16_update not in ("kahan", "kahan_8bit", "naive"):  # the config key's values
            raise ValueError(f"Adafactor: bf16_update is kahan, kahan_8bit or naive, not {bf16_update!r}")
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
        self.kahan = bf16_update != "naive"
        self.kahan_8bit = bf16_update == "kahan_8bit"
        # The 8-bit codes' seed of a step is this and the step count (`_rounding_seed`): the same on every
        # rank (the loop seeds torch alike everywhere) and after a resume, with no generator state.
        self._seed_base = torch.initial_seed()
        # The step's device scalars, one (lr, beta2t, weight decay, gradient scale, codes' seed) tensor per
        # group, device and distinct step count, kept from step to step so that a captured `apply`
        # (trainer.run.cuda_graphs) reads this step's.
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
        """torch's, with the states of STATE_DTYPES kept in theirs: torch casts every state of a
        floating-point weight to the weight's dtype (bf16 statistics would lose precision, codes would read as
        a bf16 buffer, and the kernels would write past both)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for key, dtype in self.STATE_DTYPES.items():
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=dtype)

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
                kind = (p.shape, p.dtype, p.device, _kahan_kind(state), _on_kernels(p))
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
                sharded += [
                    (p, self.state[p], scalars, eps, clip_threshold, self._rounding(n, p))
                    for n, p in enumerate(params)
                ]
                continue
            for n, p in enumerate(params):
                state = self.state[p]
                adafactor_update(
                    p,
                    p.grad,
                    state.get("exp_avg_sq_row"),
                    state.get("exp_avg_sq_col"),
                    state.get("exp_avg_sq"),
                    _kahan_buffer(state),
                    scalars,
                    eps,
                    clip_threshold,
                    (n, 0),
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
        grads, whole_shape, first_element = None, None, _first_element(params[0])
        if isinstance(params[0], DTensor):
            # FSDP2's gradients are views into its reduce-scatter's output; one not on a 16-byte boundary
            # is read from a copy (this rank's choice alone: the kernels run on every rank either way).
            grads = [p.grad.to_local() for p in params]
            copies = {i: g.clone() for i, g in enumerate(grads) if g.data_ptr() % 16}
            grads = [copies.get(i, g) for i, g in enumerate(grads)]
            self._grad_copies += copies.values()
            params, whole_shape = [p.to_local() for p in params], tuple(params[0].shape)
            states = [{k: local_shard(v) for k, v in state.items()} for state in states]
        kept = self._weight_groups.get(key)
        tensors = WeightGroup.tensors_of(params, states, grads)
        if kept is None or kept.addresses != WeightGroup.addresses_of(tensors):
            kept = self._weight_groups[key] = WeightGroup.build(
                params, states, grads, whole_shape, first_element
            )
        return kept

    def _queue_scalars(
        self, group_index: int, slot: int, device, step: int, group: dict, grad_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """[lr, beta2t, weight decay, gradient scale, rounding seed] of `step` copied into the kept device
        tensor of (group, device, slot). A tensor, because they change every step and a captured update must
        read this step's; the gradient scale is copied from its device tensor (1 without one)."""
        decay = 1.0 - math.pow(step, group["decay_rate"])
        seed = self._rounding_seed(step) if self.kahan_8bit else 0
        values = torch.tensor([group["lr"], decay, group["weight_decay"], 1.0, seed], dtype=torch.float32)
        key = (group_index, device, slot)
        if key not in self._scalars:
            self._scalars[key] = torch.empty(5, dtype=torch.float32, device=device)
        scalars = self._scalars[key]
        if device.type == "cuda":
            # From pinned memory the copy is queued; from pageable memory the host would wait for the GPU to
            # finish what is queued before it.
            values = values.pin_memory()
        scalars.copy_(values, non_blocking=True)
        if grad_scale is not None:
            scalars[3:].copy_(grad_scale.reshape(1), non_blocking=True)
        return scalars

    def _rounding_seed(self, step: int) -> int:
        """The 8-bit codes' seed for `step`: distinct for 2**24 steps (an odd multiplier), exact in the fp32
        scalars."""
        return (self._seed_base * 0x9E3779B1 + step * 0x85EBCA6B) % (1 << 24)

    def _rounding(self, n: int, p) -> tuple[int, int]:
        """What the torch ops need to round the 8-bit codes of weight `p`, the `n`-th of its batch, as the
        kernels do: (n, the index of its first element in the whole weight)."""
        return n, _first_element(p)

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
            if self.kahan_8bit and p.dtype == torch.bfloat16:  # the codes' unit is a bf16 weight's
                state["kahan_codes"] = torch.zeros_like(p, dtype=torch.int8)
            else:
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


def _kahan_buffer(state: dict):
    """A weight's Kahan buffer: bf16 (`kahan_comp`), 8-bit codes (`kahan_codes`), or None."""
    return state.get("kahan_comp", state.get("kahan_codes"))


def _kahan_kind(state: dict) -> str | None:
    return next((key for key in ("kahan_comp", "kahan_codes") if key in state), None)


def _first_element(p) -> int:
    """The index, in the whole weight, of the first element of this rank's part of FSDP2's shard `p` (a
    DTensor split by rows): FSDP2 splits as torch.chunk does (ceil(rows / ranks) rows each, the last ranks
    fewer or none). 0 for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 0
    ranks, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    rows = p.shape[0]
    return min(rank * -(-rows // ranks), rows) * math.prod(p.shape[1:])


def adafactor_update(
    p, grad, row, col, sq, comp, scalars, eps: float, clip_threshold: float, rounding=None
) -> None:
    """One Adafactor step of one weight, in place, in torch ops: the second-moment statistics (`row`/`col`
    for matrices, `sq` otherwise), the weight `p` and its Kahan buffer `comp` (bf16, int8 codes, or None).
    scalars: [lr, beta2t, weight decay, gradient scale, the codes' seed] as a float32 tensor on p's device;
    `rounding`: `Adafactor._rounding`'s, for codes. What trainer.kernels.adafactor_kernels computes on a
    GPU."""
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
    write_update(p, comp, update, update.square().mean().sqrt(), scalars, clip_threshold, rounding)


def write_update(p, comp, update, rms, scalars, clip_threshold: float, rounding=None) -> None:
    """The end of an Adafactor step: `update` (fp32, unclipped) clipped by its `rms`, times the learning
    rate, weight decay, and the weight `p` written in place; with a Kahan buffer `comp` (16-bit weights) the
    part of the new weight its dtype cannot hold is kept there for the next step: as it is (a bf16 buffer),
    or as 8-bit codes in units of `code_unit`, rounded up with the probability of the remainder by the
    kernels' numbers (`rounding`: the weight's place in its group and its first element's index)."""
    lr, weight_decay = scalars[0], scalars[2]
    update = update / (rms / clip_threshold).clamp(min=1.0) * lr
    w = p.float()
    codes = comp is not None and comp.dtype == torch.int8
    if codes:
        w = w + comp.float() * code_unit(w)
    elif comp is not None:
        w = w + comp.float()
    w = w - w * (weight_decay * lr) - update
    if comp is None:
        p.copy_(w)
        return
    rounded = w.to(p.dtype)
    p.copy_(rounded)
    if not codes:
        comp.copy_(w - rounded.float())  # what the weight's dtype could not hold this step
        return
    from trainer.kernels.dropout import uniform16_reference

    rounded = rounded.float()
    n, index_offset = rounding
    index = torch.arange(p.numel(), device=p.device).view(p.shape) + index_offset
    chance = uniform16_reference(scalars[4].to(torch.int64) + n, index).float()
    units = torch.floor((w - rounded) / code_unit(rounded) + (chance + 0.5) / 65536)
    comp.copy_(units.clamp(-128, 127).to(torch.int8))


def code_unit(w: torch.Tensor) -> torch.Tensor:
    """What one 8-bit Kahan code is worth next to the bf16 weights `w` (fp32 holding bf16 values): 1/256 of
    each one's last bit, 2**(exponent - 15); the smallest normal number's for zero and subnormal weights. The
    kernels' `_code_unit`."""
    exponent = (w.contiguous().view(torch.int32) >> 23) & 0xFF
    return ((exponent.clamp(min=16) - 15) << 23).view(torch.float32)


def sharded_adafactor_update(weights: list[tuple]) -> None:
    """`adafactor_update` of FSDP's sharded weights, all at once, in torch ops (the CPU's way; a GPU runs
    trainer.kernels.adafactor_kernels.update_shards, the same passes): `weights` are (p, its state, scalars,
    eps, clip_threshold, `Adafactor._rounding`'s), p a DTensor split by rows (FSDP2's Shard(0))
    whose gradient and row state are split the same way, the column state whole on every rank.

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
        return local_shard(p.grad).float() * scalars[3]

    def factored_update(p, state, grad, row_mean):
        r_factor = (local_shard(state["exp_avg_sq_row"]) / row_mean).rsqrt().unsqueeze(-1)
        return r_factor * local_shard(state["exp_avg_sq_col"]).unsqueeze(-2).rsqrt() * grad

    # 1. Row states of this rank's rows; each weight's column sums over them and its row-state sum.
    sizes = [p.shape[1] + 1 if p.dim() == 2 else 0 for p, *_ in weights]
    stats = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    offset = 0
    for (p, state, scalars, eps, *_), size in zip(weights, sizes, strict=True):
        update = scaled_grad(p, scalars).square() + eps
        beta2t = scalars[1]
        if p.dim() == 2:
            row = local_shard(state["exp_avg_sq_row"])
            if row.numel():
                row.mul_(beta2t).add_(update.mean(dim=-1) * (1.0 - beta2t))
                stats[offset : offset + size - 1] = update.sum(dim=-2)
                stats[offset + size - 1] = row.sum()
        else:
            local_shard(state["exp_avg_sq"]).mul_(beta2t).add_(update * (1.0 - beta2t))
        offset += size
    dist.all_reduce(stats, group=group)
    # 2. The column states (whole on every rank), and each update's sum of squares over this rank's part.
    squares = torch.zeros(len(weights), dtype=torch.float32, device=device)
    row_means, offset = [], 0
    for i, ((p, state, scalars, *_), size) in enumerate(zip(weights, sizes, strict=True)):
        grad, beta2t = scaled_grad(p, scalars), scalars[1]
        if p.dim() == 2:
            rows = p.shape[0]
            col_mean = stats[offset : offset + size - 1] / rows
            local_shard(state["exp_avg_sq_col"]).mul_(beta2t).add_(col_mean * (1.0 - beta2t))
            row_means.append(stats[offset + size - 1] / rows)
            update = factored_update(p, state, grad, row_means[-1])
        else:
            row_means.append(None)
            update = local_shard(state["exp_avg_sq"]).rsqrt() * grad
        squares[i] = update.square().sum()
        offset += size
    dist.all_reduce(squares, group=group)
    # 3. The update again, clipped by its RMS over the whole weight, written into this rank's shard.
    for i, (p, state, scalars, _, clip_threshold, rounding) in enumerate(weights):
        grad = scaled_grad(p, scalars)
        if p.dim() == 2:
            update = factored_update(p, state, grad, row_means[i])
        else:
            update = local_shard(state["exp_avg_sq"]).rsqrt() * grad
        rms = (squares[i] / p.numel()).sqrt()
        write_update(
            local_shard(p), local_shard(_kahan_buffer(state)), update, rms, scalars, clip_threshold, rounding
        )

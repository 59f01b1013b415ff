"""AdamW with 8-bit moments (trainer.kernels.adamw8bit_kernels): the update of torch's AdamW (decoupled
weight decay, bias-corrected moments), its two moments kept blockwise in 8 bits, bf16 weights rounded
stochastically. On a GPU one kernel launch per group of same-size weights; elsewhere torch ops per weight.

States per weight: `step` (a 0-d fp32 count, as torch's), and `exp_avg_codes`, `exp_avg_scale`,
`exp_avg_sq_codes`, `exp_avg_sq_scale` (uint8 in the weight's shape, fp32 per block of 256) or, for a weight
not in whole blocks, fp32 `exp_avg` and `exp_avg_sq`. Plain tensors: DCP checkpoints and re-splits them as
any optimizer's.
"""

from __future__ import annotations

import math

import torch

from trainer.kernels import adamw8bit_kernels as kernels


class AdamW8bit(torch.optim.Optimizer):
    def __init__(
        self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 0.0, stochastic_rounding: bool = True,
    ):  # fmt: skip
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.stochastic_rounding = stochastic_rounding
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The signed and unsigned dynamic maps (fp32) on `device`."""
        if device not in self._maps:
            self._maps[device] = tuple(
                torch.tensor(kernels.dynamic_map(signed), dtype=torch.float32, device=device)
                for signed in (True, False)
            )
        return self._maps[device]

    def _new_state(self, p: torch.Tensor) -> dict:
        state = {"step": torch.tensor(0.0)}
        if kernels.quantized(p.numel()):
            for name in ("exp_avg", "exp_avg_sq"):  # codes 0 at scale 0: zero moments
                state[f"{name}_codes"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
                state[f"{name}_scale"] = torch.zeros(p.numel() // kernels.BLOCK, device=p.device)
        else:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, with each state in the dtype it was saved in: torch casts every state to its weight's
        dtype, which would turn the codes, scales and fp32 moments into bf16."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key != "step" and torch.is_tensor(value):
                    self.state[p][key] = value.to(device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            batches: dict[tuple, list[torch.Tensor]] = {}  # weights the kernel updates in one launch
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._new_state(p))
                state["step"] += 1
                t = state["step"].item()
                scalars = kernels.StepScalars(
                    lr=float(group["lr"]), weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], bias_correction1=1 - beta1**t,
                    sqrt_bias_correction2=math.sqrt(1 - beta2**t),
                )  # fmt: skip
                if kernels.supports(p, p.grad):  # in whole blocks: 8-bit moments
                    batches.setdefault((p.dtype, p.numel(), scalars), []).append(p)
                else:
                    kernels.reference_update(
                        p, p.grad, state, self.maps(p.device), scalars, self.stochastic_rounding
                    )
            for (_, _, scalars), weights in batches.items():
                kernels.update_group(
                    weights,
                    [p.grad for p in weights],
                    [self.state[p] for p in weights],
                    self.maps(weights[0].device),
                    scalars,
                    self.stochastic_rounding,
                )
        return loss

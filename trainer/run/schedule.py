"""Learning-rate schedules and gradient clipping's coefficient.

The learning-rate schedules are transformers.get_scheduler's, over a horizon of optimizer steps that the loop
may move (set_horizon: a run with a time budget ends its schedule where the budget ends). The optimizers
themselves are trainer.optim's.
"""

from __future__ import annotations

import logging
import math

import torch

from trainer.config import ConfigError

log = logging.getLogger(__name__)


def clip_coefficient(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor gradient clipping multiplies the gradients by, min(1, max_norm / norm) (as
    torch.nn.utils.clip_grad_norm_ computes it), on the norm's device; None for `max_norm` 0 (the norm is
    only measured, as in Hugging Face)."""
    if max_norm <= 0:
        return None
    return (max_norm / (grad_norm.float() + 1e-6)).clamp(max=1.0)


def warmup_steps(cfg, total_steps: int) -> int:
    """The warm-up's optimizer steps: cfg.warmup_steps, or below 1 that ratio of `total_steps`, rounded up (as
    transformers' TrainingArguments.get_warmup_steps)."""
    if cfg.warmup_steps >= 1:
        return int(cfg.warmup_steps)
    return math.ceil(total_steps * cfg.warmup_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`transformers.get_scheduler`'s cfg.lr_scheduler_type schedule of `optimizer` over `total_steps`
    optimizer steps (its horizon: the run's steps, or where its time budget ends), with cfg's warm-up and
    lr_scheduler_kwargs; its state_dict goes into checkpoints. ConfigError for kwargs the schedule does not
    take or needs."""
    from transformers import get_scheduler

    try:
        return get_scheduler(
            cfg.lr_scheduler_type,
            optimizer,
            num_warmup_steps=warmup_steps(cfg, total_steps),
            num_training_steps=total_steps,
            scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs),
        )
    # A kwarg the schedule does not take, or one it needs (min_lr, num_decay_steps).
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"lr_scheduler_type {cfg.lr_scheduler_type}, lr_scheduler_kwargs {cfg.lr_scheduler_kwargs}: {e}",
            key=("lr_scheduler_type", "lr_scheduler_kwargs"),
        ) from None


def check_scheduler(cfg, horizon: int) -> None:
    """Build cfg's schedule once: a bad lr_scheduler_kwargs is a ConfigError before the model loads."""
    _stand_in_schedule(cfg, horizon, cfg.learning_rate)


def set_horizon(scheduler: torch.optim.lr_scheduler.LambdaLR, cfg, horizon: int) -> None:
    """Make `scheduler` (build_scheduler's) end at `horizon`: its next `step()` and those after follow the
    schedule built for `horizon` (a warm-up ratio included), from the step it is at."""
    built = _stand_in_schedule(cfg, horizon, scheduler.optimizer.defaults["lr"])
    scheduler.lr_lambdas = [built.lr_lambdas[0] for _ in scheduler.lr_lambdas]


def _stand_in_schedule(cfg, horizon: int, lr: float) -> torch.optim.lr_scheduler.LambdaLR:
    """cfg's schedule over `horizon` steps of a stand-in optimizer with peak learning rate `lr`: a real
    optimizer's learning rates are left as they are."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    return build_scheduler(stand_in, cfg, horizon)

"""One optimizer step's forward and backward: the token-summed loss, gradient accumulation over micro-batches,
and the out-of-memory back-off.

One optimizer step = `gradient_accumulation_steps` loader batches. The loss is the sum of token
cross-entropies over the whole accumulated batch divided by its number of target tokens, so k micro-batches
give the same gradient as one batch of all of them. On CUDA out-of-memory the loader batches are split into
halves (then quarters, ...) on the Python side: the same data in the same order, the same effective batch,
more micro-steps; with several processes (`ddp`) every rank halves together, whichever ran out.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch

from trainer.config import TrainConfig
from trainer.data.loader import split_batch, to_device
from trainer.infra import distributed, memory
from trainer.model.loss import token_loss_sum
from trainer.optim.adafactor_optimizer import Adafactor
from trainer.plan.memory_plan import RunPlan, probe_shapes
from trainer.run.run_state import OomBackoff
from trainer.run.schedule import clip_coefficient

log = logging.getLogger(__name__)


def accumulate_gradients(
    model,
    group: list[dict],
    split: int,
    stop=None,
    n_target: int | None = None,
    graph=None,
    sync_each_micro_batch: bool = True,
):
    """Forward+backward over the loader batches of one optimizer step, each split into `split` micro-batches.

    Gradients are of (sum of token losses) / (target tokens in the whole group). Returns (loss sum tensor,
    number of target tokens), or None when `stop` became true at a micro-batch boundary. `n_target`: this
    rank's target-token count when the caller has it from the host copy of the batches (counting the GPU
    copy would wait for the GPU to finish the previous step). `graph`: a
    trainer.run.cuda_graphs.MicroStepGraph over `model` that runs the micro-steps instead.

    Several ranks: the group is this rank's part of the global one. The target-token count is summed over
    ranks before any backward, so that once the ranks' gradients are summed (`ddp`: the caller's all-reduce)
    the result is (sum of all ranks' token losses) / (global target tokens), as one process would compute
    over the global batch; FSDP2 averages over ranks as it reduce-scatters, so its ranks scale by the number
    of ranks on top. `sync_each_micro_batch` false (FSDP2): the gradients are reduce-scattered after the last
    micro-batch only. The returned count is the global one, the loss sum this rank's.
    """

    if n_target is None:
        n_target = sum(int((b["labels"] != -100).sum()) for b in group)
    n_target = int(distributed.all_sum([n_target])[0])
    sharded = distributed.is_sharded(model)
    averaged_over = distributed.world_size() if sharded else 1
    tokens = max(n_target, 1) / averaged_over
    micro_batches = [micro for batch in group for micro in split_batch(batch, split)]
    total = 0.0
    for i, micro in enumerate(micro_batches):
        if stop:
            return None
        if sharded and not sync_each_micro_batch:
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        if graph is not None:
            loss_sum = graph.run(micro, 1.0 / tokens)
        else:
            loss_sum = token_loss_sum(model, micro)
            (loss_sum / tokens).backward()
        total = total + loss_sum.detach()  # no sync with the GPU here
    return total, n_target


def optimizer_step(
    model,
    optimizer,
    scheduler,
    loss_sum,
    n_target: int,
    max_grad_norm: float,
    graph=None,
    grad_buffer=None,
) -> tuple[float, float]:
    """After `accumulate_gradients`: clip, then update unless the loss or the gradient norm is not finite
    (that step is skipped); the schedule advances either way. Returns the step's loss (token mean over the
    job) and gradient norm. `graph`: the MicroStepGraph that ran the micro-steps (it replays the update);
    `grad_buffer`: the gradients' buffer (trainer.infra.distributed.GradientBuffer), or None under FSDP2."""
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = distributed.grad_norm(params)
    adafactor = optimizer if isinstance(optimizer, Adafactor) else None
    if adafactor is not None:
        # The host's part of the update (step counts, the step's scalars, the kernels' tables) while the GPU
        # is still busy: after the wait below it would idle until the update is launched. Taken back if the
        # step is skipped. Clipping is a factor the update applies as it reads the gradients.
        layout = adafactor.advance(grad_scale=clip_coefficient(grad_norm, max_grad_norm))
    elif max_grad_norm > 0:  # 0: the norm is only measured, as in Hugging Face
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm)
    # One wait for the GPU per step, for both numbers the update depends on.
    loss_sum, grad_norm = torch.stack([loss_sum.float(), grad_norm.float()]).tolist()
    loss = distributed.all_sum([loss_sum])[0] / max(n_target, 1)  # the same on every rank
    updated = math.isfinite(loss) and math.isfinite(grad_norm)
    if not updated:
        if adafactor is not None:
            adafactor.retreat()
    elif graph is not None and adafactor is not None:
        graph.update(adafactor, layout)
    else:
        optimizer.step()  # Adafactor's applies the step its `advance` prepared above
    # Gradients in their buffer stay where they are, zeroed (a CUDA graph adds into them there).
    optimizer.zero_grad(set_to_none=graph is None and grad_buffer is None)
    with warnings.catch_warnings():
        if not updated:  # torch warns when the first update is skipped; the loop says so itself
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)`", UserWarning)
        scheduler.step()
    return loss, grad_norm


def accumulate_with_oom_backoff(
    model,
    group: list[dict],
    oom: OomBackoff,
    cfg: TrainConfig,
    plan: RunPlan,
    reporter=None,
    step: int = 0,
    stop=None,
    n_target: int | None = None,
    graph=None,
    grad_buffer=None,
):
    """accumulate_gradients, halving the micro-batch (doubling oom.split) on out-of-memory and retrying the
    same data, at most cfg.max_oom_halvings times in the run.

    Several ranks (`ddp`): every rank runs its micro-batches (a rank out of memory stops at that micro-batch)
    and then all agree, in one all-reduce on the CPU, whether any ran out; if one did, all drop their
    gradients and halve together, so the effective batch stays the same on every rank. Otherwise
    `grad_buffer` (trainer.infra.distributed.GradientBuffer) sums the gradients over ranks. Under FSDP2 a
    rank's micro-step is full of collectives the others wait in: there is no such point, and the run stops."""
    while True:
        out_of_memory = False
        if grad_buffer is not None:
            grad_buffer.attach()
        try:
            result = accumulate_gradients(
                model, group, oom.split, stop, n_target, graph, cfg.fsdp_sync_each_micro_batch
            )
        except torch.OutOfMemoryError:
            if distributed.is_sharded(model):
                # The other ranks wait in this micro-step's all-gathers: no retry, torchrun stops them all.
                raise RuntimeError(
                    f"out of GPU memory on rank {distributed.rank()} at step {step} under fsdp, whose "
                    "micro-steps the ranks run together: the micro-batch cannot be halved; lower max_tokens "
                    "or per_device_train_batch_size"
                ) from None
            out_of_memory = True  # handled below, outside the except block, so the traceback's tensors go
        failed_ranks = distributed.ranks_where(out_of_memory)
        if not failed_ranks:
            if grad_buffer is not None and result is not None:
                grad_buffer.all_reduce()
            return result
        if graph is not None:  # its memory pool holds a micro-step's activations; halves are a new shape
            graph.reset()
        model.zero_grad(set_to_none=True)
        memory.free_memory()
        oom.halvings += 1
        where = f" on rank {', '.join(map(str, failed_ranks))}" if distributed.is_distributed() else ""
        if oom.halvings > cfg.max_oom_halvings:
            raise RuntimeError(
                f"out of GPU memory at step {step}{where} even after {cfg.max_oom_halvings} halvings of the "
                f"micro-batch (now 1/{oom.split} of a loader batch); lower max_tokens or "
                f"per_device_train_batch_size.\n{memory.memory_summary()}"
            )
        oom.split *= 2
        accumulation = cfg.gradient_accumulation_steps * oom.split
        micro = plan.micro_batch(oom.split)
        if distributed.rank() == 0:
            log.warning(
                "out of memory at step %d%s: micro-batch halved to %s, accumulation %d (same effective "
                "batch)",
                step,
                where + (" (every rank halves)" if where else ""),
                micro,
                accumulation,
            )
        if reporter is not None:
            reporter.oom_backoff(step=step, micro_batch=micro, accumulation=accumulation)


def probe_memory(
    train_module, cfg: TrainConfig, plan: RunPlan, oom: OomBackoff, device, grad_buffer=None
) -> None:
    """oom_probe: before training, one forward+backward on each of the largest micro-batch shapes the loader
    can yield (random ids), through the OOM back-off, so a budget that does not fit is halved now rather than
    hours into the run (`grad_buffer`: the gradients' buffer, where they go as in training). The gradients
    are dropped."""
    shapes = probe_shapes(cfg, plan)
    g = torch.Generator().manual_seed(0)
    for rows, src, tgt in shapes:
        batch = {
            "input_ids": torch.randint(3, 100, (rows, src), generator=g),  # any vocabulary has these ids
            "attention_mask": torch.ones(rows, src, dtype=torch.long),
            "labels": torch.randint(3, 100, (rows, tgt), generator=g),
        }
        if cfg.packing:  # the packed path, one record filling each row
            batch["encoder_segment_ids"] = torch.ones(rows, src, dtype=torch.long)
            batch["decoder_segment_ids"] = torch.ones(rows, tgt, dtype=torch.long)
            batch["encoder_positions"] = torch.arange(src).expand(rows, src).contiguous()
            batch["decoder_positions"] = torch.arange(tgt).expand(rows, tgt).contiguous()
        batches = [to_device(batch, device)]
        accumulate_with_oom_backoff(train_module, batches, oom, cfg, plan, step=0, grad_buffer=grad_buffer)
        train_module.zero_grad(set_to_none=True)
    memory.free_memory()
    log.info(
        "oom_probe: the largest micro-batches the loader can yield fit with micro-batch %s",
        plan.micro_batch(oom.split),
    )

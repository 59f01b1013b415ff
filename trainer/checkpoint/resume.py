"""Resuming a run: which checkpoint (`resume: auto`, a path, or none), where its loader position puts this
run's ranks, and what in the config changed since it was written (refused when it changes what the loader
position means, warned otherwise)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer.checkpoint.store import NAME, checkpoint_problem
from trainer.config import ConfigError
from trainer.data.loader import RecipeDataError, stream_for
from trainer.infra import distributed
from trainer.infra.redact import redact_obj

log = logging.getLogger(__name__)

# Keys whose change on resume changes nothing about what was already trained, or is expected.
_RESUME_FREE_KEYS = {
    "max_steps",
    "num_train_epochs",
    "max_time",
    "resume",
    "output_dir",
    "progress_bar",
    "run_name",
    "push_to_hub",
    "hub_model_id",
    "hub_strategy",
    "hub_private_repo",
    "hub_upload_timeout",
    "hub_request_timeout",
    "hub_retry_waits",
}


# Keys the checkpoint's tensors are shaped by: full weights or LoRA adapters, and the adapters' shapes.
_RESUME_FIXED_KEYS = ("adapter", "lora_r", "lora_target_modules")


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """resume "auto": the newest usable checkpoint in `output_dir` (None if there is none; damaged ones are
    skipped with a warning); "never": None; else that checkpoint, which must be usable (else ConfigError)."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        problem = checkpoint_problem(path)
        if problem:
            raise ConfigError(f"resume: {path} is not a usable checkpoint ({problem})")
        return path
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    named = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := NAME.match(p.name)) and p.is_dir()]
    for _, path in sorted(named, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("resume: skipping %s, it cannot be resumed from (%s)", path, problem)
    return None


def resume_position(
    checkpoint: Path, saved: dict, saved_world_size: int, stream, cfg, tokenizer_file: str
) -> dict:
    """This rank's train-stream state for resuming from `checkpoint`, whose loader position `saved` is rank
    0's in a run of `saved_world_size` ranks.

    Rank r of W reads the epoch's global batches r, r+W, r+2W, ... (rust_loader/core/src/plan.rs), so after
    k batches per rank the first k*W global batches are consumed, whatever the rank. With the same W every
    rank continues at k. With another W' every rank continues at floor(k*W / W'): when W' does not divide
    k*W, up to W'-1 global batches are read a second time, none is skipped. (The epoch's order is the same for
    every W; only its last few batches, cut so that every rank has as many, differ.)

    The loader's fingerprint covers the data, the loader settings and the rank/world size; rank 0 checks the
    saved one (against a stream built like the saving run's rank 0 when W changed: its index is cached) and
    refuses other data or settings (ConfigError). The other ranks read the same files with the same config.
    `cfg`: the config with the planned batching applied (`RunPlan.applied_to`)."""
    world_size = distributed.world_size()
    if distributed.rank() == 0:
        reference = stream
        if saved_world_size != world_size:
            reference = stream_for(cfg, tokenizer_file, "train", rank=0, world_size=saved_world_size)
        try:
            reference.load_state_dict(saved)  # raises on other data or settings
        except RecipeDataError as e:
            raise ConfigError(
                f"resume from {checkpoint}: {e}. Train on the same data with the same batching, or start "
                "over with resume: never or another output_dir"
            ) from None
    consumed = int(saved["batches_consumed"]) * saved_world_size // world_size
    if saved_world_size != world_size:
        log.info(
            "resuming on %d ranks from a checkpoint of %d: %d batches per rank consumed in epoch %d -> %d",
            world_size,
            saved_world_size,
            saved["batches_consumed"],
            saved["epoch"],
            consumed,
        )
    return dict(stream.state_dict(), epoch=int(saved["epoch"]), batches_consumed=consumed)


def check_resume_config(checkpoint: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """ConfigError naming the keys when the config `now` changes what `checkpoint` (written with the config
    `saved`) holds: a LoRA run's adapters or a full run's weights, the adapters' rank or projections, the
    optimizer's states (another optimizer, or bf16 weights' Kahan buffer kept another way)."""
    adapters = bool(now.get("adapter") or saved.get("adapter"))
    fixed = [*_RESUME_FIXED_KEYS] if adapters else ["adapter"]
    # bf16 weights' Kahan buffer is bf16, 8-bit or none by bf16_update (adapters are fp32: none).
    fixed += ["optimizer"] if adapters or now.get("dtype") == "float32" else ["optimizer", "bf16_update"]

    def value(config: dict[str, Any], key: str):
        v = config.get(key)
        return sorted(v) if isinstance(v, list) else v  # the projections in any order: the same adapters

    changed = [k for k in fixed if k in saved and value(saved, k) != value(now, k)]
    if changed:
        raise ConfigError(
            f"resume: {checkpoint} was written with {', '.join(f'{k} {saved[k]!r}' for k in changed)}, which "
            f"this config changes to {', '.join(repr(now.get(k)) for k in changed)}: its tensors cannot be "
            "loaded. Set them back, or start over with resume: never or another output_dir",
            key=tuple(changed),
        )


# Keys the memory plan fills in for the card it runs on (trainer.plan.memory_plan.RunPlan.applied_to): the
# same config on another machine may plan them otherwise, which changes nothing of the experiment.
_PLANNED_KEYS = {
    "max_tokens",
    "decoder_blocks_without_checkpointing",
    "encoder_blocks_without_checkpointing",
}


def changed_keys(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys where the config `now` (secrets masked, as checkpoints store it) differs from the one the
    checkpoint was written with, leaving out the keys a resume may change freely."""
    return sorted(k for k in saved.keys() & now.keys() if k not in _RESUME_FREE_KEYS and saved[k] != now[k])


def _changes(keys: list[str], saved: dict[str, Any], now: dict[str, Any]) -> str:
    return ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in keys)


def refuse_changes_to_a_finished_run(checkpoint: Path, why: str, how: str, saved: dict, now: dict) -> None:
    """ConfigError (exit 2) when a finished run is run again with a changed config: nothing would train, and
    an exit 0 would read as a successful run of the new experiment. The same config is a clean exit 0."""
    changed = [k for k in changed_keys(saved, now) if k not in _PLANNED_KEYS]
    if changed:
        raise ConfigError(
            f"{checkpoint} {why}: this run is already finished, and the config changes "
            f"{_changes(changed, saved, now)}, which would train nothing. Set another output_dir for the new "
            f"experiment, resume: never to start over in this one, or {how}",
            key=tuple(changed),
        )


def warn_config_changes(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Warn, naming the keys, where the config `now` differs from the checkpoint's. The optimizer and
    scheduler states come from the checkpoint, so a changed learning_rate does not apply."""
    changed = changed_keys(saved, now)
    if changed:
        log.warning(
            "resuming with a config that differs from the checkpoint's: %s; the optimizer and learning-rate "
            "schedule continue from the checkpoint's state (start over in another output_dir to apply them)",
            _changes(changed, saved, now),
        )


def saved_config(cfg) -> dict[str, Any]:
    """The config as checkpoints store it and compare it: a dict, secrets masked."""
    return redact_obj(cfg.to_dict())

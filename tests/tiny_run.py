"""What the suites' short training runs of the tiny model share."""

from __future__ import annotations

from pathlib import Path


def tiny_run_values(model_dir: Path, data: Path, out: Path, **overrides) -> dict:
    """Config values of a short fp32 run of `model_dir` on `data` into `out`: 64/96-token rows, lr 1e-3, a
    train-log row per step, no gradient checkpointing, nothing reported (W&B, Discord, progress bar);
    `overrides` on top."""
    return (
        dict(
            model_name_or_path=str(model_dir),
            dtype="float32",
            train_files=[str(data)],
            max_source_length=64,
            max_target_length=96,
            learning_rate=1e-3,
            logging_steps=1,
            gradient_checkpointing=False,
            output_dir=str(out),
            report_to="none",
            progress_bar=False,
            discord_progress_minutes=-1,
        )
        | overrides
    )

"""One typed training config: a YAML file plus `--set key=value` overrides.

Names follow Hugging Face `Seq2SeqTrainingArguments` where a concept exists there. Secrets (W&B key,
Discord webhook, HF token) are never config fields: they come only from the environment.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.infra.redact import MASK
from trainer.optim import OPTIMIZERS

log = logging.getLogger(__name__)

DataFormat = Literal["recipenlg-csv", "foodcom-csv", "jsonl", "parquet", "arrow"]
DATA_FORMATS: tuple[str, ...] = typing.get_args(DataFormat)  # the recipe file formats the loader reads
Task = Literal["ingredients-to-recipe", "title-to-recipe"]
OptimizerName = Literal[tuple(OPTIMIZERS)]  # type: ignore[valid-type]  # trainer.optim's, each in its module
HubStrategy = Literal["end", "every_save", "checkpoint", "all_checkpoints"]
TASKS: tuple[str, ...] = typing.get_args(Task)  # the loader's prompt presets
# T5's projections a LoRA adapter can sit on (PEFT's module names; trainer.model.lora), and the default. Not
# the embeddings or the LM head: the loss reads the head's weight directly (trainer.model.loss).
LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "wi_0", "wi_1", "wi", "wo")
LORA_DEFAULT_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "wi_0", "wi_1", "wo")
# transformers.get_scheduler's schedules that step with the optimizer (not those driven by a metric).
SchedulerName = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
]


# What an evaluation reports (HF names: eval_<name>): the loss, and the scores of generated recipes
# (trainer.eval.recipe_metrics.generation_metrics; tests/test_recipe_metrics.py checks that the names agree).
GENERATION_METRICS: tuple[str, ...] = (
    "rouge1",
    "rouge2",
    "rougeL",
    "bleu",
    "chrf",
    "ingredient_coverage",
    "invented_ingredients",
    "structure",
    "repetition",
    "length_ratio",
)
EVAL_METRICS: tuple[str, ...] = ("loss", *GENERATION_METRICS)
LOWER_IS_BETTER = frozenset({"loss", "invented_ingredients", "repetition"})


@dataclass(frozen=True)
class DataSource:
    """An entry of train_files/eval_files given as a mapping: `path` (a file, glob, `datasets.save_to_disk`
    directory or Hugging Face dataset `hf://datasets/OWNER/NAME[@REVISION]`), its mixing `weight` (an epoch
    draws weight x its records; train_files only), and for a dataset its `split` (default train) and subset
    `name`. A plain string is the same with the defaults."""

    path: str
    weight: float = 1.0
    split: str | None = None
    name: str | None = None

    def __str__(self) -> str:
        extras = [f"{k} {v:g}" if k == "weight" else f"{k} {v}" for k, v in self._given()]
        return f"{self.path} ({', '.join(extras)})" if extras else self.path

    def _given(self) -> list[tuple[str, Any]]:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [(k, getattr(self, k)) for k in ("weight", "split", "name") if getattr(self, k) != defaults[k]]


def source_path(entry: str | DataSource) -> str:
    """The path of a train_files/eval_files entry."""
    return entry.path if isinstance(entry, DataSource) else entry


class ConfigError(ValueError):
    """A config file or override that cannot be used; raised before anything heavy loads. `key`: the config
    key (or keys) a value check is about, so that the message can say where it was set."""

    def __init__(self, message: str, key: str | tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = (key,) if isinstance(key, str) else key

    @classmethod
    def of(cls, problems: list[str]) -> ConfigError:
        """One error for every problem found in a config and its overrides: each one's line (`file:line:
        ...`), the file's in file order, then the overrides'."""

        def place(problem: str) -> tuple[int, int]:
            where = problem.split(": ", 1)[0]
            line = where.rsplit(":", 1)[-1].split(" ")[0]
            return (1, 0) if where.startswith("--set") else (0, int(line) if line.isdigit() else 0)

        ordered = sorted(problems, key=place)
        if len(ordered) == 1:
            return cls(ordered[0])
        return cls(f"{len(ordered)} problems:\n" + "\n".join(f"  {p}" for p in ordered))


def _key(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A config key: its default (or `factory` for a list or mapping) and its one-line help, kept where
    Hugging Face keeps it (`field(metadata={"help": ...})`); `trainer train --help` and docs/config.md show
    it."""
    return field(default=default, default_factory=factory, metadata={"help": help})


@dataclass
class TrainConfig:
    # --- model ---
    model_name_or_path: str = _key(
        "google/flan-t5-xl", "A Hugging Face Hub id, or a local directory saved with save_pretrained."
    )
    dtype: Literal["bfloat16", "float32"] = _key(
        "bfloat16", "The weights' dtype: bfloat16 (with bf16_update) or float32."
    )
    attn_implementation: str = _key(
        "triton",
        "triton: the trainer's fused T5 attention kernels on CUDA (eager elsewhere); or any name "
        "transformers accepts (eager, sdpa).",
    )
    gradient_checkpointing: bool = _key(
        True, "Recompute activations in the backward instead of keeping them."
    )
    decoder_blocks_without_checkpointing: int | None = _key(
        None,
        "With checkpointing: how many of the last decoder blocks keep their activations; null: as many as "
        "the memory plan fits.",
    )
    encoder_blocks_without_checkpointing: int | None = _key(
        None,
        "The same for the last encoder blocks; null: as many as fit once every decoder block keeps its own.",
    )
    torch_compile: bool = _key(
        False,
        "torch.compile each T5 block (slower start). The fused Triton ops stay outside the compiled graphs, "
        "so it compiles the few ops between them: no faster under fsdp, measured (bench/multi_gpu.py).",
    )
    cuda_graphs: bool = _key(
        False,
        "Replay each micro-step and the optimizer update as CUDA graphs (needs packing). Under fsdp each "
        "micro-step with FSDP2's collectives; the update runs eagerly.",
    )
    random_init: bool = _key(
        False, "Random weights in model_name_or_path's architecture, from its config.json (benchmarks)."
    )

    # --- data ---
    train_files: list[str | DataSource] = _key(
        help="Recipe files or globs (RecipeNLG or Food.com CSV, JSONL, Parquet, Arrow; .gz/.zst too), "
        "datasets.save_to_disk directories or hf://datasets/OWNER/NAME; an entry may be a mapping {path, "
        "weight, split, name}: weight mixes the sources (docs/loader.md).",
        factory=list,
    )
    data_format: DataFormat | None = _key(None, "The files' format; null: from each file's extension.")
    columns: dict[str, str] | None = _key(
        None,
        "The column each field is in, for files with other names, e.g. {title: name, ingredients: ingr} "
        "(fields: title, ingredients, directions, ner, source, target).",
    )
    task: Task = _key("ingredients-to-recipe", "The prompt preset: what the source holds.")
    source_template: str | None = _key(
        None, "The source text, with {title}, {ingredients}, {directions}, {ner}; null: the task's."
    )
    target_template: str | None = _key(
        None, "The target text, placeholders as source_template; null: the task's."
    )
    max_source_length: int = _key(512, "Source tokens kept per record (longer ones are truncated).")
    max_target_length: int = _key(512, "Target tokens kept per record (longer ones are truncated).")
    per_device_train_batch_size: int | None = _key(
        None, "Rows per micro-batch; or set max_tokens; neither: the memory plan's token budget."
    )
    max_tokens: int | None = _key(
        None, "Token budget per micro-batch, rows x (longest source + longest target), length-bucketed."
    )
    pad_to_multiple_of: int | None = _key(None, "Round padded lengths up to a multiple of this.")
    packing: bool = _key(
        False, "Several records per row, each with its own positions and attention (docs/loader.md)."
    )
    packed_source_length: int | None = _key(
        None, "Encoder row length when packing; null: chosen from the data."
    )
    packed_target_length: int | None = _key(
        None, "Decoder row length when packing; null: chosen from the data."
    )
    shuffle: bool = _key(True, "Shuffle the training records every epoch (with seed).")
    strict_data: bool = _key(False, "Stop at the first bad record instead of skipping and counting it.")
    dedup: bool = _key(False, "Drop records whose rendered source and target repeat an earlier one.")
    eval_fraction: float = _key(
        0.01, "Share of train_files held out for evaluation, by record hash (never trained on)."
    )
    eval_files: list[str | DataSource] = _key(
        help="A held-out set of its own (files or globs): evaluated on instead of eval_fraction's share.",
        factory=list,
    )
    eval_max_batches: int = _key(50, "Each evaluation's loss: over at most this many held-out batches.")
    loader_threads: int | None = _key(
        None, "The Rust loader's worker threads; null: chosen from the CPU count."
    )
    make_demo_data: bool = _key(
        False, "Write sample recipes and the tiny model under data/quickstart/ when missing (quickstart)."
    )
    demo_records: int = _key(2000, "How many sample recipes make_demo_data writes.")

    # --- adapters (docs/lora.md): axolotl's and PEFT's names ---
    adapter: Literal["lora"] | None = _key(
        None,
        "lora: train LoRA adapters (PEFT) over the frozen base, merged into final/ at the end; null: full "
        "fine-tuning.",
    )
    lora_r: int = _key(16, "The adapters' rank.")
    lora_alpha: float = _key(32.0, "The adapters' scaling is lora_alpha / lora_r.")
    lora_dropout: float = _key(0.0, "Dropout on each adapter's input.")
    lora_target_modules: list[str] = _key(
        help="T5's projections that get adapters: q, k, v, o (attention), wi_0, wi_1 (or wi) and wo "
        "(feed-forward).",
        factory=lambda: list(LORA_DEFAULT_TARGETS),
    )

    # --- optimization ---
    optimizer: OptimizerName = _key("adamw", " or ".join(spec.help for spec in OPTIMIZERS.values()) + ".")
    bf16_update: Literal["kahan", "kahan_8bit", "naive"] = _key(
        "kahan",
        "How bf16 weights take updates: kahan (a bf16 compensation buffer per weight: no small update lost; "
        "adamw8bit rounds stochastically instead), kahan_8bit (adafactor: the same buffer in one byte per "
        "weight, its codes rounded stochastically), or naive (rounded to nearest: small updates lost).",
    )
    learning_rate: float = _key(1e-4, "The peak learning rate.")
    weight_decay: float = _key(0.0, "Decoupled weight decay (AdamW and Adafactor).")
    adam_beta1: float = _key(0.9, "AdamW's beta1.")
    adam_beta2: float = _key(0.999, "AdamW's beta2.")
    adam_epsilon: float = _key(1e-8, "AdamW's epsilon.")
    max_grad_norm: float = _key(1.0, "Clip the gradients' global norm to this; 0: measured, not clipped.")
    lr_scheduler_type: SchedulerName = _key(
        "linear", "The learning-rate schedule, transformers.get_scheduler's of that name."
    )
    lr_scheduler_kwargs: dict[str, Any] = _key(
        help="The schedule's own arguments, e.g. {min_lr_rate: 0.1} or {num_decay_steps: 1000}.", factory=dict
    )
    warmup_steps: float = _key(
        0,
        "Linear warm-up: optimizer steps, or below 1 a ratio of the run's steps (warmup_ratio is taken too).",
    )
    gradient_accumulation_steps: int = _key(1, "Micro-batches per optimizer step.")
    max_steps: int = _key(-1, "Optimizer steps of the run; > 0 overrides num_train_epochs.")
    num_train_epochs: float = _key(1.0, "Epochs of the run (fractions allowed), unless max_steps > 0.")
    max_time: float | str | None = _key(
        None,
        "A training time budget, seconds or e.g. 10h, 90m, 1d12h, counted over restarts; the schedule ends "
        "with it.",
    )
    seed: int = _key(
        42, "Seed of the data order, dropout, random weights and the evaluations' generation sample."
    )

    # --- memory ---
    cuda_alloc_conf: str = _key(
        "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF, used unless that variable is already set."
    )
    empty_cache_steps: int = _key(
        100, "torch.cuda.empty_cache() every N optimizer steps and after each evaluation; 0: never."
    )
    gpu_memory_limit_gib: float | None = _key(
        None, "Cap this process's GPU memory (emulates a smaller card)."
    )
    oom_probe: bool = _key(
        False, "Before training, try the largest micro-batches the loader yields; halve the budget if needed."
    )
    max_oom_halvings: int = _key(4, "On out-of-memory, halve the micro-batch at most this many times.")
    max_consecutive_nan_steps: int = _key(5, "Stop after this many optimizer steps in a row with NaN/inf.")

    # --- logging, evaluation, checkpoints ---
    output_dir: str = _key("outputs/run", "Checkpoints, final/, the train log and the run summary go here.")
    logging_steps: int | float | Literal["epoch"] = _key(
        10,
        "Log loss, learning rate, tokens/s and memory every N optimizer steps (below 1: a ratio of the run; "
        "epoch: once an epoch).",
    )
    eval_steps: int | float | Literal["epoch"] = _key(
        500,
        "Evaluate every N optimizer steps (below 1: a ratio of the run's steps; epoch: at each epoch's end), "
        "and at the last one.",
    )
    save_steps: int | float | Literal["epoch"] = _key(
        500,
        "Save a checkpoint every N optimizer steps (below 1: a ratio of the run's steps; epoch: at each "
        "epoch's end), and at the last one.",
    )
    save_total_limit: int = _key(
        3, "Keep the newest N checkpoints (the best one is kept too); 0 or null: all."
    )
    resume: str = _key(
        "auto", "auto (the newest usable checkpoint in output_dir), never, or a checkpoint's path."
    )
    eval_generation_records: int = _key(
        64, "Each evaluation generates for this many held-out records and scores them; 0: loss only."
    )
    num_eval_generations: int = _key(3, "Of those, how many the log, Discord and W&B's table show.")
    generation_max_new_tokens: int | None = _key(
        None, "New tokens per generation; null: the model's generation_config, else max_target_length."
    )
    generation_num_beams: int | None = _key(
        None, "Beams per generation; null: the model's generation_config."
    )
    metric_for_best_model: str = _key(
        "eval_loss", "The evaluation metric that picks the best checkpoint (eval_loss, eval_rougeL, ...)."
    )
    greater_is_better: bool | None = _key(
        None, "Whether higher is better; null: lower for loss, invented_ingredients, repetition."
    )
    load_best_model_at_end: bool = _key(
        False, "final/ holds the best checkpoint's weights, not the last step's."
    )
    early_stopping_patience: int | None = _key(
        None, "Stop after this many evaluations in a row without improvement; null: never."
    )
    early_stopping_threshold: float = _key(0.0, "The improvement that counts, for early stopping.")
    progress_bar: bool = _key(True, "A progress bar on a terminal (log lines elsewhere, always).")
    profile_steps: int = _key(
        0, "torch.profiler over this many optimizer steps, report in output_dir/profile/; 0: off."
    )
    profile_start_step: int = _key(5, "Steps before the profiled window (compilation, allocator warm-up).")
    profile_memory: bool = _key(
        False,
        "With profile_steps on a GPU: record every allocation of the profiled window too: "
        "profile/memory.txt (what is allocated at the peak, by source line; what is reserved, by memory pool "
        "and stream) and memory_snapshot.pickle (open in pytorch.org/memory_viz).",
    )
    save_final: bool = _key(True, "A checkpoint and final/ at the end (benchmarks turn it off).")

    # --- monitoring (secrets come from the environment only) ---
    report_to: list[Literal["wandb", "tensorboard"]] = _key(
        help="Where the metrics go: wandb (offline without a key), tensorboard (event files in logging_dir), "
        "both ([wandb, tensorboard] or all), or none ([] too).",
        factory=lambda: ["wandb"],
    )
    logging_dir: str | None = _key(
        None, "TensorBoard's event files (report_to: tensorboard); null: output_dir/runs."
    )
    wandb_project: str | None = _key(None, "W&B project; null: WANDB_PROJECT, else recipe-t5.")
    wandb_entity: str | None = _key(None, "W&B entity (user or team); null: WANDB_ENTITY or your default.")
    run_name: str | None = _key(None, "The run's name in W&B and Discord; null: output_dir's name.")
    discord_progress_minutes: float = _key(
        30.0, "A Discord progress message at most this often (DISCORD_WEBHOOK_URL); negative: none."
    )

    # --- Hugging Face Hub (Seq2SeqTrainer's names; the token comes from HF_TOKEN, never from the config) ---
    push_to_hub: bool = _key(
        False, "Upload the model to the Hub as the run saves it, from a background thread (HF_TOKEN)."
    )
    hub_model_id: str | None = _key(
        None, "The repository: name (in the token's namespace) or namespace/name; null: output_dir's name."
    )
    hub_strategy: HubStrategy = _key(
        "every_save",
        "end: final/ at the end; every_save: also each checkpoint's model files; checkpoint: also the newest "
        "checkpoint to last-checkpoint/; all_checkpoints: also each checkpoint to checkpoint-<step>/.",
    )
    hub_private_repo: bool | None = _key(
        None, "Create the repository private; null: the namespace's default (an existing one keeps its own)."
    )
    hub_upload_timeout: float | str = _key(
        "1h",
        "How long the end of the run waits for the last upload (seconds or e.g. 90m); the rest stays pending "
        "in output_dir for the next run.",
    )
    hub_request_timeout: float | str = _key(
        "2m",
        "How long one request to the Hub may wait for the next bytes before it fails and is tried again "
        "(seconds or e.g. 2m): a Hub that stops answering is said in the log and Discord within minutes.",
    )

    hub_retry_waits: list[float | str] = _key(
        help="How long a failed upload waits before each new try (seconds or e.g. 30s), one entry per retry; "
        "[]: one try. Whatever still fails is tried with the next save and at the end.",
        factory=lambda: ["5s", "30s"],
    )

    # --- distributed (torchrun; docs/distributed.md) ---
    distributed_strategy: Literal["ddp", "fsdp"] = _key(
        "ddp",
        "Under torchrun: ddp (the whole model on every GPU, gradients summed once per optimizer step) or "
        "fsdp (FSDP2: weights, gradients and optimizer states split across the GPUs).",
    )
    ddp_timeout: int = _key(
        1800,
        "Seconds a collective waits for another process before the run fails (a machine that went down); a "
        "process that crashes ends the others at once.",
    )
    fsdp_reshard_after_forward: bool = _key(
        True,
        "fsdp: free each block's gathered weights after its forward and gather them again for its backward; "
        "false keeps them (the whole model's bf16 weights on every GPU, one all-gather per block less).",
    )
    fsdp_sync_each_micro_batch: bool = _key(
        True,
        "fsdp: reduce-scatter the gradients after every micro-batch; false: only after the step's last (the "
        "whole model's gradients on every GPU until then, one reduce-scatter per step; not with "
        "cuda_graphs).",
    )

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size is not None and self.max_tokens is not None:
            raise ConfigError(
                "set per_device_train_batch_size or max_tokens, not both: null unsets the other (e.g. --set "
                "max_tokens=null to batch by rows)",
                key=("per_device_train_batch_size", "max_tokens"),
            )
        # A key whose default is null may be null ("or null" in the message); the others must be set.
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if value != "epoch" and not (0 < value < 1 or (value >= 1 and value == int(value))):
                raise ConfigError(
                    f"{name} must be a whole number of steps >= 1, below 1 a ratio of the run's steps, or "
                    f"epoch, got {value}",
                    key=name,
                )
        at_least = {
            "gradient_accumulation_steps": 1,
            "per_device_train_batch_size": 1,
            "max_tokens": 1,
            "pad_to_multiple_of": 1,
            "max_source_length": 1,
            "max_target_length": 1,
            "decoder_blocks_without_checkpointing": 0,
            "encoder_blocks_without_checkpointing": 0,
            "warmup_steps": 0,
            "empty_cache_steps": 0,
            "save_total_limit": 0,
            "max_oom_halvings": 0,
            "eval_generation_records": 0,
            "num_eval_generations": 0,
            "generation_max_new_tokens": 1,
            "generation_num_beams": 1,
            "early_stopping_patience": 1,
            "ddp_timeout": 1,
        }
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                nullable = " or null" if defaults[name] is None else ""
                raise ConfigError(f"{name} must be >= {low}{nullable}, got {value}", key=name)
        if not math.isfinite(self.warmup_steps) or (
            self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps)
        ):
            raise ConfigError(
                f"warmup_steps must be a whole number of steps, or below 1 a ratio of the run's steps, got "
                f"{self.warmup_steps}",
                key="warmup_steps",
            )
        if self.cuda_graphs and not self.packing:
            raise ConfigError(
                "cuda_graphs needs packing: true (a graph replays one batch shape; packed micro-batches all "
                "have one): with packing false, set cuda_graphs false too",
                key=("packing", "cuda_graphs"),
            )
        if self.cuda_graphs and self.torch_compile:
            raise ConfigError(
                "cuda_graphs and torch_compile: use one of them", key=("cuda_graphs", "torch_compile")
            )
        self._check_adapter_keys()
        if self.profile_memory and self.profile_steps <= 0:
            raise ConfigError(
                "profile_memory records the allocations of the profiled window: set profile_steps too "
                "(e.g. profile_steps: 1)",
                key=("profile_memory", "profile_steps"),
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(
                f"eval_fraction must be in [0, 1), got {self.eval_fraction}", key="eval_fraction"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ConfigError(
                f"learning_rate must be a positive number, got {self.learning_rate}", key="learning_rate"
            )
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise ConfigError(
                f"max_grad_norm must be >= 0 (0: no clipping, as in HF), got {self.max_grad_norm}",
                key="max_grad_norm",
            )
        if self.max_steps <= 0 and not (math.isfinite(self.num_train_epochs) and self.num_train_epochs > 0):
            raise ConfigError(
                f"set max_steps > 0 or num_train_epochs > 0 (got max_steps {self.max_steps}, "
                f"num_train_epochs {self.num_train_epochs})",
                key=("max_steps", "num_train_epochs"),
            )
        if self.max_time is not None:
            parse_duration(self.max_time, "max_time")  # a clear error now, not when the loop reads it
        parse_duration(self.hub_upload_timeout, "hub_upload_timeout")
        parse_duration(self.hub_request_timeout, "hub_request_timeout")
        for wait in self.hub_retry_waits:
            parse_duration(wait, "hub_retry_waits")
        self._check_the_optimizer_can("kahan_8bit", "bf16_update", "keeps no 8-bit Kahan buffer", "kahan")
        self._check_the_optimizer_can(
            "fsdp", "distributed_strategy", "does not update FSDP2's sharded weights", "ddp"
        )
        self._check_best_model_keys()
        # `~` in a path means the home directory, as in a shell.
        self.output_dir = os.path.expanduser(self.output_dir)
        self.train_files = [_expand_source(f) for f in self.train_files]
        self.eval_files = [_expand_source(f) for f in self.eval_files]
        for key, entries in (("train_files", self.train_files), ("eval_files", self.eval_files)):
            for f in entries:
                if isinstance(f, DataSource) and not (math.isfinite(f.weight) and f.weight >= 0):
                    raise ConfigError(
                        f"{key}: weight of {f.path} must be a number >= 0, got {f.weight}", key=key
                    )
                if key == "eval_files" and isinstance(f, DataSource) and f.weight != 1:
                    raise ConfigError(
                        f"eval_files: {f.path} has weight {f.weight:g}; held-out records are evaluated once "
                        "each (weights are for train_files)",
                        key=key,
                    )
        if self.model_name_or_path.startswith("~"):
            self.model_name_or_path = os.path.expanduser(self.model_name_or_path)
        if self.resume not in ("auto", "never"):
            self.resume = os.path.expanduser(self.resume)

    @property
    def hub_upload_timeout_s(self) -> float:
        return parse_duration(self.hub_upload_timeout, "hub_upload_timeout")

    def every(self, name: str, total_steps: int, steps_per_epoch: float) -> int:
        """`logging_steps`, `eval_steps` or `save_steps` in optimizer steps: below 1, that ratio of
        `total_steps` rounded up, as transformers reads it; epoch: an epoch's steps, rounded."""
        value = getattr(self, name)
        if value == "epoch":
            return max(1, round(steps_per_epoch))
        return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)

    @property
    def hub_request_timeout_s(self) -> float:
        return parse_duration(self.hub_request_timeout, "hub_request_timeout")

    @property
    def hub_retry_waits_s(self) -> list[float]:
        return [parse_duration(wait, "hub_retry_waits") for wait in self.hub_retry_waits]

    @property
    def max_time_s(self) -> float | None:
        """max_time in seconds, or None for no time budget."""
        return None if self.max_time is None else parse_duration(self.max_time, "max_time")

    def _check_the_optimizer_can(self, value: str, key: str, cannot: str, instead: str) -> None:
        """One line naming both keys when `key: value` asks the optimizer for what its spec (trainer.optim)
        does not declare (its attribute named `value`), with the value of `key` to set instead."""
        if getattr(self, key) != value or getattr(OPTIMIZERS[self.optimizer], value):
            return
        able = ", ".join(name for name, spec in OPTIMIZERS.items() if getattr(spec, value))
        message = f"optimizer: {self.optimizer} {cannot}: use {key}: {instead}, or optimizer: {able}"
        raise ConfigError(message, key=("optimizer", key))

    def _check_adapter_keys(self) -> None:
        if self.adapter is None:
            return
        if self.lora_r < 1:
            raise ConfigError(f"lora_r must be >= 1, got {self.lora_r}", key="lora_r")
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(
                f"lora_alpha must be a positive number, got {self.lora_alpha}", key="lora_alpha"
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}", key="lora_dropout")
        unknown = [name for name in self.lora_target_modules if name not in LORA_TARGETS]
        if unknown or not self.lora_target_modules:
            what = f"{', '.join(map(repr, unknown))} cannot take an adapter" if unknown else "is empty"
            raise ConfigError(
                f"lora_target_modules {what}: choose from T5's projections {', '.join(LORA_TARGETS)} (the "
                "embeddings and the LM head are not supported)",
                key="lora_target_modules",
            )
        if self.distributed_strategy == "fsdp":
            raise ConfigError(
                "adapter: lora trains with one process or distributed_strategy: ddp, not fsdp (the adapters "
                "and their optimizer states are small, and FLAN-T5-XXL's frozen weights with them fit one "
                "32 GB card: set distributed_strategy: ddp; docs/distributed.md)",
                key=("adapter", "distributed_strategy"),
            )

    def _check_best_model_keys(self) -> None:
        name = self.metric_for_best_model.removeprefix("eval_")
        if name not in EVAL_METRICS:
            raise ConfigError(
                f"metric_for_best_model {self.metric_for_best_model!r} is not an evaluation metric; choose "
                f"one of {', '.join(EVAL_METRICS)} (with or without eval_)",
                key="metric_for_best_model",
            )
        if name in GENERATION_METRICS and self.eval_generation_records == 0:
            raise ConfigError(
                f"metric_for_best_model {self.metric_for_best_model!r} is a generation metric, but "
                "eval_generation_records is 0 (no generation at evaluation): raise it or choose eval_loss",
                key="metric_for_best_model",
            )
        if name == "length_ratio" and self.greater_is_better is None:
            raise ConfigError(
                "metric_for_best_model length_ratio has no better direction (1.0 is the reference's length): "
                "set greater_is_better, or choose another metric",
                key="metric_for_best_model",
            )
        if not (math.isfinite(self.early_stopping_threshold) and self.early_stopping_threshold >= 0):
            raise ConfigError(
                f"early_stopping_threshold must be >= 0, got {self.early_stopping_threshold}",
                key="early_stopping_threshold",
            )
        evaluates = bool(self.eval_files) or self.eval_fraction > 0
        for key in ("load_best_model_at_end", "early_stopping_patience"):
            if getattr(self, key) and not evaluates:
                raise ConfigError(f"{key} needs evaluations: set eval_fraction > 0 or eval_files", key=key)

    @property
    def best_metric_key(self) -> str:
        """metric_for_best_model as the evaluation's metrics name it: "eval_loss", "eval_rougeL", ..."""
        return "eval_" + self.metric_for_best_model.removeprefix("eval_")

    @property
    def best_is_greater(self) -> bool:
        """greater_is_better, or its default for the metric: lower is better for a loss and for the metrics
        that count faults (HF's default says higher for every name not ending in "loss")."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        return self.best_metric_key.removeprefix("eval_") not in LOWER_IS_BETTER

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
        """Read a YAML config, apply `key=value` overrides, check names and types. An error names where the
        key came from: `file:line` for the file's keys, `--set key=value` for an override's."""
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        problems: list[str] = []  # every one is said, in one error, once names and types are checked
        if path is not None:
            path = Path(path)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
            loaded, lines = read_yaml(text, str(path))
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: expected a mapping of config keys, got {type(loaded).__name__}")
            sources.update({key: f"{path}:{lines[key]}" if key in lines else str(path) for key in loaded})
            values.update(_take_hf_names(loaded, sources, str(path), problems))
        given: dict[str, Any] = {}
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            given[key] = read_yaml(raw, f"override {item!r}")[0] if raw.strip() else None
            # A secret given where it does not belong is not repeated in the message that refuses it.
            sources[key] = f"--set {key}={MASK}" if key in SECRET_NAMES else f"--set {item}"
        # An override replaces the file's value, whichever name either of them uses; the overrides are taken
        # together (text_column and summary_column make one columns mapping).
        values.update(_take_hf_names(given, sources, "--set", problems))
        return cls.from_dict(
            values, source=str(path) if path else "overrides", sources=sources, problems=problems
        )

    @classmethod
    def from_dict(
        cls,
        values: dict[str, Any],
        source: str = "config",
        sources: dict[str, str] | None = None,
        problems: list[str] | None = None,
    ) -> TrainConfig:
        """Check names and types, and say every problem at once (with those `problems` found before).
        `sources`: where each key came from, for the error message (default `source`)."""
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        sources = dict(sources or {})
        problems = list(problems or [])
        values = _take_hf_names(values, sources, source, problems)
        checked = {}
        for key, value in values.items():
            where = sources.get(key, source)
            if key not in names:
                answer = ANSWERS.get(key)
                if answer is not None and answer.startswith(NOTHING_TO_SET):
                    log.warning("%s: %r is not a key here, and is left out: %s", where, key, answer)
                elif answer is not None:
                    problems.append(f"{where}: {key!r} is not a key here: {answer}")
                else:
                    close = difflib.get_close_matches(str(key), names, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    problems.append(f"{where}: unknown config key {key!r}{hint}")
                continue
            try:
                value = _hf_value(key, value, where)
                checked[key] = _check_type(key, value, hints[key], where)
            except ConfigError as e:
                problems.append(str(e))
        if problems:
            raise ConfigError.of(problems)
        unused = [k for k in checked if k.startswith("lora_")] if checked.get("adapter") is None else []
        if unused:
            log.warning(
                "%s set, but adapter is null (full fine-tuning): not used (adapter: lora trains adapters)",
                ", ".join(f"{k} ({sources.get(k, source)})" for k in unused),
            )
        try:
            return cls(**checked)
        except ConfigError as e:  # a value check: say where each value was set (file:line, --set k=v)
            placed = [(k, sources[k]) for k in e.keys if k in sources]
            if not placed:
                raise
            # an interlock of two keys: both places, so that a preset's half is found
            where = " and ".join(f"{src} ({k})" for k, src in placed) if len(placed) > 1 else placed[0][1]
            raise ConfigError(f"{where}: {e}", key=e.keys) from None


def _expand_source(entry: str | DataSource) -> str | DataSource:
    """`~` in an entry's path means the home directory, as in a shell."""
    if isinstance(entry, DataSource):
        return dataclasses.replace(entry, path=os.path.expanduser(entry.path))
    return os.path.expanduser(entry)


# The dataclass's sections, in order, each named with its first key: how `trainer train --help` and
# docs/config.md group the keys.
SECTIONS: tuple[tuple[str, str], ...] = (
    ("model", "model_name_or_path"),
    ("data", "train_files"),
    ("adapters", "adapter"),
    ("optimization", "optimizer"),
    ("memory", "cuda_alloc_conf"),
    ("logging, evaluation, checkpoints", "output_dir"),
    ("monitoring", "report_to"),
    ("Hugging Face Hub", "push_to_hub"),
    ("distributed (torchrun)", "distributed_strategy"),
)


def sections() -> list[tuple[str, list[dataclasses.Field]]]:
    """TrainConfig's fields by section, in the dataclass's order."""
    starts = dict((first, title) for title, first in SECTIONS)
    grouped: list[tuple[str, list[dataclasses.Field]]] = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in starts:
            grouped.append((starts[f.name], []))
        grouped[-1][1].append(f)
    return grouped


@dataclass(frozen=True)
class HfName:
    """A name of Hugging Face's `Seq2SeqTrainingArguments` that this trainer spells otherwise. With `convert`,
    it is taken as `key`, its value converted (`taken` says how; ValueError, with the reason, for a value that
    has no counterpart here); without, it is refused. `hint` says what `key` takes. No `key`: a name whose
    value can only ask for what is so anyway (DROPPED) or be refused."""

    key: str | None
    hint: str
    convert: typing.Callable[[Any], Any] | None = None
    taken: str = ""


# Hugging Face's optim values that are this trainer's optimizers: the same algorithm and settings (each
# optimizer's module in trainer.optim names them).
HF_OPTIMIZERS = {hf: spec.name for spec in OPTIMIZERS.values() for hf in spec.hf_names}


def _hf_optim(value: Any) -> str:
    if value not in HF_OPTIMIZERS:
        raise ValueError("has no counterpart here")
    return HF_OPTIMIZERS[value]


def _hf_warmup_ratio(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value < 1:
        raise ValueError("is not a ratio in [0, 1)")
    return value


def _hf_empty_cache_steps(value: Any) -> Any:
    return 0 if value is None else value


def _hf_generation_max_length(value: Any) -> Any:
    # A seq2seq model's generated sequence starts with the decoder's start token, which max_length counts.
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError("is not a number of tokens")
    if value < 2:
        raise ValueError("leaves no new token (it counts the decoder's start token)")
    return value - 1


DROPPED = object()  # a converter's answer for a name whose value asks for what is so anyway: nothing to set


def _hf_flag(when_true: Any, when_false: Any = DROPPED) -> typing.Callable[[Any], Any]:
    """A Hugging Face boolean as this trainer's value for true and for false (DROPPED: nothing to set)."""

    def convert(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError("is not true or false")
        return when_true if value else when_false

    return convert


def _hf_only(same: bool, otherwise: str) -> typing.Callable[[Any], Any]:
    """A Hugging Face boolean that asks for what is so here when it is `same` (nothing to set); refused with
    `otherwise` when it is not."""

    def convert(value: Any) -> Any:
        if value is same:
            return DROPPED
        raise ValueError(f"is not taken here: {otherwise}")

    return convert


def _hf_bf16(value: Any) -> Any:
    """bf16 true (or axolotl's auto: bf16 where the GPU has it, which every GPU this trains on does) as
    bfloat16, false as float32."""
    if value == "auto":
        return "bfloat16"
    return _hf_flag("bfloat16", "float32")(value)


def _hf_fp16(value: Any) -> Any:
    if value is False or value is None or value == "auto":  # axolotl's auto: fp16 only without bf16
        return DROPPED
    raise ValueError(
        "is not supported: T5's activations overflow fp16's range (65504), which is why its checkpoints are "
        "bf16; bf16 has fp32's range"
    )


def _same(value: Any) -> Any:
    return value


def _as_list(prefix: str = "") -> typing.Callable[[Any], Any]:
    """A Hugging Face script's one path (`train_file`, `dataset_name`) as this trainer's list of sources,
    each given `prefix` (hf://datasets/ for a Hub dataset's name)."""

    def convert(value: Any) -> Any:
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(i, str) and i.strip() for i in items):
            raise ValueError("is not a path or a list of them")
        return [i if i.startswith("hf://") or not prefix else prefix + i for i in items]

    return convert


def _as_column(field: str) -> typing.Callable[[Any], Any]:
    """run_summarization's `text_column`/`summary_column` as `columns`' source/target (a pair used
    verbatim)."""

    def convert(value: Any) -> Any:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("is not a column name")
        return {field: value}

    return convert


def _hf_strategy(off: str) -> typing.Callable[[Any], Any]:
    """Hugging Face's `*_strategy` values as the matching `*_steps` key's: "steps" asks for nothing (that key
    says how many), "epoch" is its epoch; `off` says what stands for "no" here."""

    def convert(value: Any) -> Any:
        if value == "steps":
            return DROPPED
        if value == "epoch":
            return "epoch"
        if value is False or value in ("no", "best"):  # YAML reads a bare `no` as false
            raise ValueError(f"has no counterpart here: {off}")
        raise ValueError("is not one of steps, epoch, no")

    return convert


def _hf_resume(value: Any) -> Any:
    if value is True:
        return "auto"
    if value is False or value is None:
        return "never"
    return value


HF_NAMES: dict[str, HfName] = {
    "optim": HfName(
        "optimizer",
        " or ".join(OPTIMIZERS),
        _hf_optim,
        "; ".join(f"{', '.join(spec.hf_names)} as {spec.name}" for spec in OPTIMIZERS.values())
        + " (the same settings); the others are refused",
    ),
    "warmup_ratio": HfName(
        "warmup_steps",
        "steps, or below 1 a ratio of the run's steps",
        _hf_warmup_ratio,
        "the same ratio: below 1, warmup_steps is a ratio, as in transformers 5",
    ),
    "torch_empty_cache_steps": HfName(
        "empty_cache_steps",
        "every N optimizer steps and after each evaluation; 0: never",
        _hf_empty_cache_steps,
        "the same N, null as 0 (never); it also clears after each evaluation",
    ),
    "generation_max_length": HfName(
        "generation_max_new_tokens",
        "new tokens per generated recipe",
        _hf_generation_max_length,
        "N as N - 1 new tokens: a seq2seq max_length counts the decoder's start token",
    ),
    "resume_from_checkpoint": HfName(
        "resume",
        "auto, never, or a checkpoint's path",
        _hf_resume,
        "true as auto, false or null as never, a path as that checkpoint",
    ),
    "bf16": HfName(
        "dtype",
        "bfloat16: bf16 weights with Kahan-compensated updates, no fp32 copy; or float32",
        _hf_bf16,
        "true or auto as bfloat16 (the default), false as float32",
    ),
    "fp16": HfName(
        "dtype", "bfloat16 or float32", _hf_fp16, "false or auto is taken (nothing to set); true is refused"
    ),
    "predict_with_generate": HfName(
        "eval_generation_records",
        "held-out records each evaluation generates for and scores; 0: the loss alone",
        _hf_flag(DROPPED, 0),  # evaluations generate by default; false: the loss alone
        "true as the default (evaluations generate), false as 0",
    ),
    # axolotl's and PEFT's names for the same things
    "base_model": HfName("model_name_or_path", "a Hub id or a local directory", _same, "axolotl's name"),
    "micro_batch_size": HfName("per_device_train_batch_size", "rows per micro-batch", _same, "axolotl's"),
    "num_epochs": HfName("num_train_epochs", "epochs of the run", _same, "axolotl's name"),
    "lr_scheduler": HfName("lr_scheduler_type", "transformers' schedule names", _same, "axolotl's name"),
    "sample_packing": HfName("packing", "several records per row", _same, "axolotl's name"),
    "wandb_name": HfName("run_name", "the run's name in W&B and Discord", _same, "axolotl's name"),
    "auto_resume_from_checkpoints": HfName(
        "resume",
        "auto, never, or a checkpoint's path",
        _hf_flag("auto", "never"),
        "true as auto, false as never",
    ),
    "r": HfName("lora_r", "LoRA's rank", _same, "PEFT's LoraConfig name"),
    "target_modules": HfName("lora_target_modules", "the projections LoRA adapts", _same, "PEFT's name"),
    **{
        name: HfName(
            "eval_steps",
            "evaluations every N optimizer steps or every epoch, and at the last one",
            _hf_strategy(
                "to train without evaluations, hold nothing out: eval_fraction: 0 and no eval_files"
            ),
            "steps as nothing to set, eval_steps says how many; epoch as eval_steps: epoch; no is refused",
        )
        for name in ("eval_strategy", "evaluation_strategy")  # transformers 5's name and the older one
    },
    "save_strategy": HfName(
        "save_steps",
        "checkpoints every N optimizer steps or every epoch, and at the last one",
        _hf_strategy(
            "a run always saves (resuming and the best model come from checkpoints): every save_steps and at "
            "the last step, the best one kept beside the newest save_total_limit"
        ),
        "steps as nothing to set, save_steps says how many; epoch as save_steps: epoch; no and best are "
        "refused",
    ),
    "logging_strategy": HfName(
        "logging_steps",
        "train-log rows every N optimizer steps or every epoch",
        _hf_strategy("the loop logs every logging_steps"),
        "steps as nothing to set, logging_steps says how many; epoch as logging_steps: epoch; no is refused",
    ),
    "dataloader_num_workers": HfName("loader_threads", "the Rust loader's worker threads"),
    # Hugging Face's run_summarization/run_translation scripts' data and model arguments
    "train_file": HfName("train_files", "files or globs, a list", _as_list(), "a path as a list of one"),
    "validation_file": HfName("eval_files", "held-out files, a list", _as_list(), "a path as a list of one"),
    "dataset_name": HfName(
        "train_files",
        "files, globs or Hub datasets, a list",
        _as_list("hf://datasets/"),
        "as hf://datasets/NAME",
    ),
    "text_column": HfName(
        "columns", "the column each field is in", _as_column("source"), "as columns: {source: NAME}, verbatim"
    ),
    "summary_column": HfName(
        "columns", "the column each field is in", _as_column("target"), "as columns: {target: NAME}, verbatim"
    ),
    "num_beams": HfName("generation_num_beams", "beams of each evaluation's generation", _same, "the same"),
    "preprocessing_num_workers": HfName("loader_threads", "the Rust loader's worker threads"),
    "overwrite_output_dir": HfName(
        "resume",
        "auto, never, or a checkpoint's path",
        _hf_flag("never"),
        "true as resume: never (start over in output_dir), false as nothing to set",
    ),
    "disable_tqdm": HfName(
        "progress_bar", "a progress bar on a terminal", _hf_flag(False, True), "true as progress_bar: false"
    ),
    **{
        name: HfName(
            None,
            "",
            _hf_only(same, why),
            f"taken when {str(same).lower()} (nothing to set); else refused: {why}",
        )
        for name, same, why in (
            ("do_train", True, "`trainer train` always trains; `trainer evaluate` scores a trained model"),
            (
                "do_eval",
                True,
                "evaluations run when something is held out; off with eval_fraction: 0 and no eval_files",
            ),
            ("do_predict", False, "`trainer generate` and `trainer evaluate` predict with a trained model"),
            ("save_safetensors", True, "a checkpoint's weights are always model.safetensors"),
            (
                "pad_to_max_length",
                False,
                "a batch is padded to its longest record (to a multiple of pad_to_multiple_of), or packed "
                "(packing: true)",
            ),
            ("ignore_pad_token_for_loss", True, "padding never counts in the loss"),
            ("tf32", False, "the matmuls run in dtype, bfloat16 (the default) or full float32, never TF32"),
            (
                "load_in_4bit",
                False,
                "no quantized base (QLoRA); LoRA over the bf16 base (adapter: lora) fits FLAN-T5-XL on 16 GB "
                "and FLAN-T5-XXL on 32 GB (docs/lora.md)",
            ),
            (
                "load_in_8bit",
                False,
                "no quantized base; LoRA over the bf16 base (adapter: lora, docs/lora.md)",
            ),
            ("train_on_inputs", False, "an encoder-decoder's loss is on the target; the source is its input"),
        )
    },
    "adafactor": HfName(
        "optimizer",
        " or ".join(OPTIMIZERS),
        _hf_flag("adafactor"),
        "true as optimizer: adafactor (transformers' old flag), false as nothing to set",
    ),
}


def _shown(value: Any) -> str:
    """A config value as a refusal quotes it: booleans and null as YAML writes them (what the user typed),
    anything else as Python shows it (strings quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _hf_value(key: str, value: Any, where: str) -> Any:
    """A value in the form Hugging Face or axolotl write it, as this trainer's: report_to as a list or
    "all", save_total_limit null (keep all), optimizer as an HF optim name."""
    if key == "report_to":
        items = value if isinstance(value, list) else [value]
        names = {"all": ["wandb", "tensorboard"], "wandb": ["wandb"], "tensorboard": ["tensorboard"]}
        names |= {"none": [], None: []}
        other = [i for i in items if i not in names]
        if other:
            raise ConfigError(
                f"{where}: report_to {other[0]!r} is not supported: wandb (WANDB_MODE=offline keeps runs off "
                "the cloud), tensorboard, all (both) or none; Discord with DISCORD_WEBHOOK_URL"
            )
        return list(dict.fromkeys(name for item in items for name in names[item]))
    if key == "save_total_limit" and value is None:
        return 0
    if key == "optimizer" and value in HF_OPTIMIZERS:
        return HF_OPTIMIZERS[value]
    return value


def _take_hf_names(
    values: dict[str, Any], sources: dict[str, str], source: str, problems: list[str]
) -> dict[str, Any]:
    """`values` (of one source: a file, an override) with Hugging Face's names (HF_NAMES) taken as this
    trainer's keys, their sources moved along; ConfigError naming where it was set for a name that is refused,
    a value without a counterpart, or a name given beside the key it stands for."""
    taken = {}
    for name, value in values.items():
        hf = HF_NAMES.get(name)
        if hf is None:
            continue
        where = sources.get(name, source)
        if hf.convert is None:
            problems.append(
                f"{where}: {name!r} is Hugging Face's name; this trainer's key is {hf.key!r} ({hf.hint})"
            )
            taken[name] = (hf.key, DROPPED)
            continue
        try:
            taken[name] = (hf.key, hf.convert(value))
        except ValueError as e:
            ours = f"; this trainer's key is {hf.key!r} ({hf.hint})" if hf.key else ""
            # YAML reads a bare `no` as false: said as it was written
            shown = "no" if value is False and name.endswith("_strategy") else _shown(value)
            problems.append(f"{where}: {name} {shown} {e}{ours}")
            taken[name] = (hf.key, DROPPED)
            continue
        if hf.key in values and taken[name][1] is not DROPPED:  # `save_strategy: steps` beside save_steps
            problems.append(
                f"{where} and {sources.get(hf.key, source)}: {name!r} is Hugging Face's name for {hf.key!r} "
                f"({hf.hint}): set one of them"
            )
    out = {k: v for k, v in values.items() if k not in taken}
    for name, (key, value) in taken.items():
        if value is DROPPED:
            sources.pop(name, None)
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):  # text_column and summary_column
            value = out[key] | value
        elif isinstance(value, list) and isinstance(out.get(key), list):  # train_file and dataset_name
            value = out[key] + value
        out[key] = value
        if name in sources:
            sources[key] = sources.pop(name)
    return out


# Names under which users bring a secret (refused below: secrets live in the environment); the refusal shows
# redact's mask instead of the value.
SECRET_NAMES = frozenset(("hub_token", "push_to_hub_token", "wandb_api_key", "token"))

# Names users bring from Hugging Face, axolotl and PEFT that have no key here, each with its own answer
# (rather than the nearest key by spelling, which points the wrong way: hub_token is not max_tokens).
# How an answer starts when the key asks for what is so anyway: a warning, and the run goes on.
NOTHING_TO_SET = "nothing to set"
ANSWERS: dict[str, str] = {
    "hub_token": "a token is never written in a config: put it in HF_TOKEN in the environment (.env for "
    "Docker)",
    **dict.fromkeys(
        ("push_to_hub_token", "token"),
        "a token is never written in a config: put it in HF_TOKEN in the environment",
    ),
    "wandb_api_key": "a key is never written in a config: put it in WANDB_API_KEY in the environment",
    "deepspeed": "not supported: several GPUs shard the model with FSDP2 here (distributed_strategy: fsdp "
    "under torchrun, docs/distributed.md)",
    "fsdp": "Hugging Face's fsdp options: here distributed_strategy: fsdp under torchrun (FSDP2)",
    "sequence_len": "an encoder-decoder has two lengths: max_source_length and max_target_length",
    "max_seq_length": "an encoder-decoder has two lengths: max_source_length and max_target_length",
    "datasets": "the data is train_files: paths, globs, save_to_disk directories or hf://datasets/OWNER/NAME "
    "(docs/loader.md)",
    "val_set_size": "eval_fraction: the share of train_files held out (or eval_files)",
    "local_rank": "torchrun sets it; nothing to configure",
    "gradient_checkpointing_kwargs": "checkpointing is always non-reentrant here; the plan decides which "
    "blocks skip it",
    "lora_target_linear": "lora_target_modules names the projections (docs/lora.md)",
    "per_device_eval_batch_size": "evaluation batches are sized by the memory plan, as training's max_tokens "
    "(eval_max_batches bounds how many an evaluation takes)",
    "eval_accumulation_steps": "nothing to set: an evaluation keeps only sums on the GPU (eval_max_batches "
    "bounds how many batches it takes)",
    "remove_unused_columns": "nothing to set: the loader reads only the fields the task needs",
    "label_smoothing_factor": "not supported: the loss is plain cross-entropy (the fused kernel's)",
    "group_by_length": "nothing to set: max_tokens batches records of similar lengths together (0.97 of the "
    "tokens real), and packing: true packs them into full rows (the presets)",
    "sortish_sampler": "nothing to set: max_tokens batches records of similar lengths together, and packing: "
    "true packs them into full rows (the presets)",
    "auto_find_batch_size": "nothing to set: the memory plan sizes the batch, and a step out of GPU memory "
    "is retried with its batch halved",
    "include_tokens_per_second": "nothing to set: the log and run_summary.json always have tokens/s",
    "ddp_find_unused_parameters": "nothing to set: ddp here sums the trained weights' gradients once per "
    "optimizer step, with no unused ones to find",
    "fp16_full_eval": "evaluations run in dtype (bfloat16 by default); fp16 overflows T5's activations",
    "bf16_full_eval": "evaluations run in dtype (bfloat16 by default)",
    "data_seed": "seed orders the data too (one seed: data order, dropout, evaluation samples)",
    "log_level": "the command's -v/--verbose says more",
    "dataset_config_name": "the subset goes with the dataset in train_files: [{path: "
    "hf://datasets/OWNER/NAME, name: SUBSET}] (docs/loader.md)",
    "test_file": "a run has no test split: `trainer evaluate --model DIR --data FILE` scores a trained "
    "model on it",
    "source_prefix": "source_template writes the source text, e.g. 'summarize: {ingredients}' (pre-rendered "
    "pairs are used verbatim)",
    "val_max_target_length": "evaluations keep max_target_length; generation_max_new_tokens bounds what "
    "they generate",
    "max_train_samples": "not supported: training reads all of train_files; max_steps or max_time bounds "
    "the run",
    "max_eval_samples": "eval_max_batches bounds an evaluation's loss (in batches), eval_generation_records "
    "the records it generates for",
    "max_predict_samples": "`trainer evaluate --max-records N` scores N records",
    "overwrite_cache": "nothing to set: records are tokenized as they are read, with no tokenized cache",
    "logging_first_step": "not supported: the log has every logging_steps-th step and the last "
    "(logging_steps: 1 logs each)",
    "dataloader_pin_memory": "nothing to set: batches go to the GPU from pinned memory",
    "eval_delay": "not supported: evaluations run every eval_steps",
    "eval_on_start": "not supported: `trainer evaluate --model MODEL --data FILE` scores the model before "
    "training",
    "save_only_model": "not supported: a checkpoint holds the optimizer's state to resume from; final/ "
    "holds the model alone",
    "neftune_noise_alpha": "not supported: no noise is added to the embeddings",
    **dict.fromkeys(
        ("use_cpu", "no_cuda"),
        "the GPU is used when there is one; CUDA_VISIBLE_DEVICES= (empty) in the environment trains on the "
        "CPU",
    ),
    "full_determinism": "nothing to set: seed fixes the data order, dropout and the evaluation samples",
    "ddp_backend": "nothing to set: torchrun's processes use NCCL on GPUs, gloo on the CPU",
    "cache_dir": "HF_HOME (or HF_HUB_CACHE) in the environment says where Hub files are cached",
    "model_revision": "not supported: model_name_or_path takes a Hub id (its main revision) or a local "
    "directory (`hf download ID --revision REV --local-dir DIR`)",
    "use_fast_tokenizer": "nothing to set: the loader reads the model's tokenizer.json (the fast tokenizer)",
    "trust_remote_code": "not supported: T5 models run through transformers' own code",
    # axolotl's
    **dict.fromkeys(
        ("flash_attention", "xformers_attention", "sdp_attention"),
        "nothing to set: attention runs in this trainer's fused Triton kernels on CUDA (attn_implementation)",
    ),
    "pad_to_sequence_len": "nothing to set: a batch is padded to its longest record, or packed (packing: "
    "true)",
    **dict.fromkeys(
        ("evals_per_epoch", "saves_per_epoch"),
        "eval_steps and save_steps: every N steps, below 1 a ratio of the run's steps, or epoch",
    ),
    **dict.fromkeys(
        ("wandb_watch", "wandb_log_model"),
        "not supported: W&B gets the metrics, the config and generations; final/ holds the model",
    ),
    "special_tokens": "nothing to set: the model's tokenizer is used as it is",
    "dataset_prepared_path": "nothing to set: records are tokenized as they are read, with no prepared copy",
    **dict.fromkeys(
        ("model_type", "tokenizer_type", "base_model_config"),
        "nothing to set: the model's config.json says what it is (T5)",
    ),
    "debug": "the command's -v/--verbose says more",
    "fp8": "not supported: FP8 matmuls were measured slower than bf16 at FLAN-T5's widths on an H100 and "
    "worse per token (docs/quality.md)",
}


_DURATION = re.compile(
    r"^(?:(?P<d>\d+(?:\.\d+)?)d)?(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$"
)
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: float | str, key: str) -> float:
    """Seconds of a duration: a number of seconds (36000, "36000"), days, hours, minutes and seconds in
    that order ("10h", "90m", "1d12h", "2h30m", "1h 30m 10s"), or Lightning's DD:HH:MM:SS and HH:MM:SS
    ("00:12:00:00"). ConfigError naming `key` for anything else, or for a duration that is not positive."""
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            m = _DURATION.match(text)
            if m and text:
                seconds = sum(float(v) * _UNIT_SECONDS[unit] for unit, v in m.groupdict().items() if v)
            parts = text.split(":")
            if len(parts) in (3, 4) and all(p.isdigit() for p in parts):
                seconds = sum(int(p) * s for p, s in zip(reversed(parts), (1, 60, 3600, 86400), strict=False))
    if seconds is None or not math.isfinite(seconds):
        raise ConfigError(
            f"{key}: {value!r} is not a duration; give seconds (36000) or e.g. 10h, 90m, 1d12h, 2h30m, "
            "00:12:00:00 (DD:HH:MM:SS)",
            key=key,
        )
    if seconds <= 0:
        unset = " (null: no time budget)" if key == "max_time" else ""
        raise ConfigError(f"{key} must be more than 0{unset}, got {value!r}", key=key)
    return seconds


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(key, first_line, line)
        self.key, self.first_line, self.line = key, first_line, line


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping. YAML requires unique keys, but PyYAML keeps
    the last one silently: `max_steps: 10` and further down `max_steps: 20000` would plan 20,000 steps."""

    def construct_mapping(self, node, deep=False):
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` overrides on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_lines:
                    raise _DuplicateKey(key, first_lines[key], line)
                first_lines[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str) -> tuple[yaml.Node | None, Any]:
    """The document's node (for the keys' lines) and its data."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        return node, loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def read_yaml(text: str, name: str) -> tuple[Any, dict[str, int]]:
    """The YAML document in `text` and the line of each top-level key. Invalid YAML or a duplicate key is a
    ConfigError in one line naming `name` (a file, or `override 'k=v'`) and the line."""
    override = name.startswith("override ")
    try:
        try:
            node, data = _parse_yaml(text)
        except yaml.YAMLError:
            # JSON (Hugging Face's args.json) indented with tabs, which YAML refuses as indentation: the same
            # document, on the same lines, with spaces (whose fault, if any, is the document's own).
            spaced = re.sub(r"^\t+", lambda m: "  " * len(m.group()), text, flags=re.M)
            if spaced == text:
                raise
            node, data = _parse_yaml(spaced)
    except _DuplicateKey as e:
        where = "" if override else f":{e.line}"
        lines = "" if override else f" (lines {e.first_line} and {e.line})"
        raise ConfigError(f"{name}{where}: key {e.key!r} is given twice{lines}; keep one") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if override:
            raise ConfigError(
                f"{name}: the value is not valid YAML ({problem}); quote lists for the shell, "
                "e.g. --set 'train_files=[a.csv, b.csv]'"
            ) from None
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{name}{where}: not valid YAML ({problem})") from None
    lines = {}
    if isinstance(node, yaml.MappingNode):
        lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return data, lines


def _check_type(key: str, value: Any, hint: Any, source: str) -> Any:
    """Return `value` converted to `hint` where the conversion is lossless, else raise ConfigError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        mapped = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and mapped:  # a mapping is meant as the dataclass: its own errors say why
            return _check_type(key, value, mapped[0], source)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(key, value, arg, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{source}: {key}={value!r} has the wrong type")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{source}: {key} must be one of {list(allowed)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} entries must be a string or a mapping, got {value!r}")
        hints = typing.get_type_hints(hint)
        names = [f.name for f in dataclasses.fields(hint)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ConfigError(
                f"{source}: {key}: unknown key {unknown[0]!r} in {value!r} (keys: {', '.join(names)})"
            )
        required = [f.name for f in dataclasses.fields(hint) if f.default is dataclasses.MISSING]
        if missing := [k for k in required if k not in value]:
            raise ConfigError(f"{source}: {key}: {value!r} needs {missing[0]!r}")
        return hint(**{k: _check_type(f"{key}.{k}", v, hints[k], source) for k, v in value.items()})
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping, e.g. {{name: value}}, got {value!r}")
        if value_type is Any:  # the schedule's own arguments (lr_scheduler_kwargs): it checks them
            return {_check_type(key, k, key_type, source): v for k, v in value.items()}
        return {
            _check_type(key, k, key_type, source): _check_type(f"{key}.{k}", v, value_type, source)
            for k, v in value.items()
        }
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if isinstance(value, (str, dict)):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list, got {value!r}")
        return [_check_type(key, v, item_type, source) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{source}: {key} has an unsupported type {hint}")
    raise ConfigError(f"{source}: {key} must be {hint.__name__}, got {value!r} ({type(value).__name__})")

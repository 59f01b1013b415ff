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

log = logging.getLogger(__name__)

DataFormat = Literal["recipenlg-csv", "foodcom-csv", "jsonl"]
DATA_FORMATS: tuple[str, ...] = typing.get_args(DataFormat)  # the recipe file formats the loader reads
Task = Literal["ingredients-to-recipe", "title-to-recipe"]
HubStrategy = Literal["end", "every_save", "checkpoint", "all_checkpoints"]
TASKS: tuple[str, ...] = typing.get_args(Task)  # the loader's prompt presets
# T5's projections a LoRA adapter can sit on (PEFT's module names; trainer.lora), and the default. Not the
# embeddings or the LM head: the loss reads the head's weight directly (trainer.loss).
LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "wi_0", "wi_1", "wi", "wo")
LORA_DEFAULT_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "wi_0", "wi_1", "wo")


# What an evaluation reports (HF names: eval_<name>): the loss, and the scores of generated recipes
# (trainer.recipe_metrics.generation_metrics; tests/test_recipe_metrics.py checks that the names agree).
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


class ConfigError(ValueError):
    """A config file or override that cannot be used; raised before anything heavy loads. `key`: the config
    key (or keys) a value check is about, so that the message can say where it was set."""

    def __init__(self, message: str, key: str | tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = (key,) if isinstance(key, str) else key


@dataclass
class TrainConfig:
    # --- model ---
    model_name_or_path: str = "google/flan-t5-xl"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # triton: fused attention kernels with T5's position bias (trainer.attention) on CUDA; eager elsewhere.
    # Any name transformers accepts works too; bench/NOTES.md compares them.
    attn_implementation: str = "triton"
    gradient_checkpointing: bool = True
    # With checkpointing: how many of the last decoder blocks keep their activations instead of recomputing
    # them in the backward (they are the first to run it). None: as many as the memory plan fits on the GPU.
    decoder_blocks_without_checkpointing: int | None = None
    # The same for the encoder's last blocks. None: as many as fit once every decoder block keeps its own.
    encoder_blocks_without_checkpointing: int | None = None
    torch_compile: bool = False  # compile each T5 block (slower start, faster steps on a GPU)
    # Replay each micro-step (forward, backward, gradient accumulation) as a CUDA graph, so that the host's
    # launches stop limiting small micro-batches. Needs packing (one batch shape); not under fsdp.
    cuda_graphs: bool = False
    random_init: bool = False  # build the architecture from model_name_or_path's config.json (benchmarks)

    # --- data ---
    train_files: list[str] = field(default_factory=list)  # paths or globs; csv, jsonl, optionally .gz/.zst
    data_format: DataFormat | None = None  # None: by file extension
    task: Task = "ingredients-to-recipe"
    source_template: str | None = None
    target_template: str | None = None
    max_source_length: int = 512
    max_target_length: int = 512
    per_device_train_batch_size: int | None = None  # rows per micro-batch; or use max_tokens
    max_tokens: int | None = None  # token budget per micro-batch: rows x (longest source + longest target)
    pad_to_multiple_of: int | None = None
    # Several records per row, with segment ids and positions (docs/loader.md); rows per micro-batch:
    # per_device_train_batch_size, or max_tokens // (packed_source_length + packed_target_length).
    packing: bool = False
    packed_source_length: int | None = None  # encoder row length when packing; None: chosen from the data
    packed_target_length: int | None = None  # decoder row length when packing; None: chosen from the data
    shuffle: bool = True
    strict_data: bool = False  # raise on the first bad record instead of skipping and counting it
    dedup: bool = False
    eval_fraction: float = 0.01  # held out by record hash, never trained on
    # A held-out set of its own (paths or globs): evaluated on instead; eval_fraction is then not used and
    # every record of train_files is trained on.
    eval_files: list[str] = field(default_factory=list)
    eval_max_batches: int = 50
    loader_threads: int | None = None
    make_demo_data: bool = False  # create sample recipes and the tiny model if missing (quickstart only)
    demo_records: int = 2000

    # --- adapters (docs/lora.md): axolotl's and PEFT's names ---
    # lora: train LoRA adapters (PEFT) over the frozen base, merged into final/ at the end; null: full
    # fine-tuning.
    adapter: Literal["lora"] | None = None
    lora_r: int = 16  # the adapters' rank
    lora_alpha: float = 32.0  # their scaling is lora_alpha / lora_r
    lora_dropout: float = 0.0  # dropout on each adapter's input
    # T5's projections that get adapters: q, k, v, o (attention), wi_0, wi_1 (or wi) and wo (feed-forward).
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))

    # --- optimization ---
    optimizer: Literal["adamw", "adafactor"] = "adamw"
    # How bf16 weights receive updates: Kahan-compensated (no silent loss of small updates), or naive.
    bf16_update: Literal["kahan", "naive"] = "kahan"
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_steps: int = 0
    gradient_accumulation_steps: int = 1
    max_steps: int = -1  # > 0 overrides num_train_epochs
    num_train_epochs: float = 1.0
    # A time budget for the training: seconds, or a duration such as "10h", "90m", "1d12h", "2h30m". Counted
    # over restarts (checkpoints keep the time used); when spent the run ends as a finished one would.
    max_time: float | str | None = None
    seed: int = 42

    # --- memory ---
    cuda_alloc_conf: str = "expandable_segments:True"  # used unless PYTORCH_CUDA_ALLOC_CONF is already set
    # torch.cuda.empty_cache() every N optimizer steps and after each evaluation; 0: never.
    empty_cache_steps: int = 100
    gpu_memory_limit_gib: float | None = None  # cap this process (emulates a smaller card)
    oom_probe: bool = False  # try the largest batch the loader can produce before training
    max_oom_halvings: int = 4
    max_consecutive_nan_steps: int = 5

    # --- logging, evaluation, checkpoints ---
    output_dir: str = "outputs/run"
    logging_steps: int = 10
    eval_steps: int = 500
    save_steps: int = 500
    save_total_limit: int = 3
    resume: str = "auto"  # "auto" (newest valid checkpoint in output_dir), "never", or a checkpoint path
    # Each evaluation generates for this many held-out records (a fixed sample, drawn with `seed`) and
    # scores them as `trainer evaluate` does (eval/rougeL, eval/ingredient_coverage, ...); 0: eval loss only.
    eval_generation_records: int = 64
    num_eval_generations: int = 3  # of those, shown in the log, Discord and the W&B table
    # None: the model's generation_config, else max_target_length (as `trainer generate`).
    generation_max_new_tokens: int | None = None
    generation_num_beams: int | None = None  # None: the model's generation_config (greedy for FLAN-T5)
    # The best checkpoint: by which evaluation metric (HF's names, with or without "eval_"), in which
    # direction (None: lower for loss, invented_ingredients, repetition; higher for the others), and whether
    # final/ holds its weights rather than the last step's.
    metric_for_best_model: str = "eval_loss"
    greater_is_better: bool | None = None
    load_best_model_at_end: bool = False
    # Stop after this many evaluations in a row without an improvement of the metric by more than the
    # threshold (HF's EarlyStoppingCallback); None: never.
    early_stopping_patience: int | None = None
    early_stopping_threshold: float = 0.0
    progress_bar: bool = True
    profile_steps: int = (
        0  # > 0: torch.profiler over this many optimizer steps, report in output_dir/profile/
    )
    profile_start_step: int = 5  # steps before the profiled window (compilation and allocator warm-up)
    save_final: bool = True  # a checkpoint and final/ at the end (benchmarks turn it off)

    # --- monitoring (secrets come from the environment only) ---
    report_to: Literal["wandb", "none"] = "wandb"
    wandb_project: str | None = None  # else WANDB_PROJECT, else "recipe-t5"
    wandb_entity: str | None = None
    run_name: str | None = None
    discord_progress_minutes: float = 30.0

    # --- Hugging Face Hub (Seq2SeqTrainer's names; the token comes from HF_TOKEN, never from the config) ---
    # Upload the model to the Hub as the run saves it, from a background thread that never holds training up.
    push_to_hub: bool = False
    # The repository: "name" (in the token's namespace) or "namespace/name"; None: output_dir's name.
    hub_model_id: str | None = None
    # What is uploaded when: end (final/, at the end), every_save (also each checkpoint's model files to the
    # repository's root), checkpoint (also the whole newest checkpoint to last-checkpoint/, to resume from),
    # all_checkpoints (also each checkpoint to its own checkpoint-<step>/).
    hub_strategy: HubStrategy = "every_save"
    # Create the repository private; None: the namespace's default. An existing repository keeps its own.
    hub_private_repo: bool | None = None
    # How long the end of the run waits for the last upload (seconds, or a duration such as 90m or 2h); what
    # is not uploaded by then stays pending in output_dir, and the same command run again uploads it.
    hub_upload_timeout: float | str = "1h"

    # --- distributed (torchrun; docs/distributed.md) ---
    # ddp: the whole model on every GPU, gradients summed once per optimizer step; fsdp: FSDP2, weights,
    # gradients and optimizer states split across the GPUs.
    distributed_strategy: Literal["ddp", "fsdp"] = "ddp"
    # Seconds a collective waits for another process before the run fails (HF's ddp_timeout): a machine that
    # went down. A process that crashes ends the others at once.
    ddp_timeout: int = 1800
    # fsdp: free each block's gathered weights after its forward and gather them again for its backward;
    # false keeps them (the whole model's bf16 weights on every GPU, one all-gather per block less).
    fsdp_reshard_after_forward: bool = True
    # fsdp: reduce-scatter the gradients after every micro-batch; false: only after the step's last (the
    # whole model's fp32 gradients on every GPU until then, one reduce-scatter per step).
    fsdp_sync_each_micro_batch: bool = True

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size is not None and self.max_tokens is not None:
            raise ConfigError(
                "set per_device_train_batch_size or max_tokens, not both",
                key=("per_device_train_batch_size", "max_tokens"),
            )
        # A key whose default is null may be null ("or null" in the message); the others must be set.
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        at_least = {
            "gradient_accumulation_steps": 1,
            "logging_steps": 1,
            "eval_steps": 1,
            "save_steps": 1,
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
        if self.cuda_graphs and not self.packing:
            raise ConfigError(
                "cuda_graphs needs packing: true (a graph replays one batch shape; packed micro-batches all "
                "have one)",
                key=("cuda_graphs", "packing"),
            )
        if self.cuda_graphs and self.torch_compile:
            raise ConfigError(
                "cuda_graphs and torch_compile: use one of them", key=("cuda_graphs", "torch_compile")
            )
        self._check_adapter_keys()
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
        self._check_best_model_keys()
        # `~` in a path means the home directory, as in a shell.
        self.output_dir = os.path.expanduser(self.output_dir)
        self.train_files = [os.path.expanduser(f) for f in self.train_files]
        self.eval_files = [os.path.expanduser(f) for f in self.eval_files]
        if self.model_name_or_path.startswith("~"):
            self.model_name_or_path = os.path.expanduser(self.model_name_or_path)
        if self.resume not in ("auto", "never"):
            self.resume = os.path.expanduser(self.resume)

    @property
    def hub_upload_timeout_s(self) -> float:
        return parse_duration(self.hub_upload_timeout, "hub_upload_timeout")

    @property
    def max_time_s(self) -> float | None:
        """max_time in seconds, or None for no time budget."""
        return None if self.max_time is None else parse_duration(self.max_time, "max_time")

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
                "and their optimizer states are small: nothing for FSDP to shard but the frozen base)",
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
        if path is not None:
            path = Path(path)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
            loaded, lines = _read_yaml(text, str(path))
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: expected a mapping of config keys, got {type(loaded).__name__}")
            values.update(loaded)
            sources.update({key: f"{path}:{lines[key]}" if key in lines else str(path) for key in loaded})
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            values[key] = _read_yaml(raw, f"override {item!r}")[0] if raw.strip() else None
            sources[key] = f"--set {item}"
        return cls.from_dict(values, source=str(path) if path else "overrides", sources=sources)

    @classmethod
    def from_dict(
        cls, values: dict[str, Any], source: str = "config", sources: dict[str, str] | None = None
    ) -> TrainConfig:
        """Check names and types. `sources`: where each key came from, for the error message (default
        `source`)."""
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        checked = {}
        for key, value in values.items():
            where = (sources or {}).get(key, source)
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{where}: unknown config key {key!r}{hint}")
            checked[key] = _check_type(key, value, hints[key], where)
        unused = [k for k in checked if k.startswith("lora_")] if checked.get("adapter") is None else []
        if unused:
            log.warning(
                "%s set, but adapter is null (full fine-tuning): not used (adapter: lora trains adapters)",
                ", ".join(f"{k} ({(sources or {}).get(k, source)})" for k in unused),
            )
        try:
            return cls(**checked)
        except ConfigError as e:  # a value check: say where the value was set (file:line, --set k=v)
            where = next((sources[k] for k in e.keys if k in (sources or {})), None)
            if where is None:
                raise
            raise ConfigError(f"{where}: {e}", key=e.keys) from None


_DURATION = re.compile(
    r"^(?:(?P<d>\d+(?:\.\d+)?)d)?(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$"
)
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: float | str, key: str) -> float:
    """Seconds of a duration: a number of seconds (36000, "36000"), or days, hours, minutes and seconds in
    that order ("10h", "90m", "1d12h", "2h30m", "1h 30m 10s"). ConfigError naming `key` for anything else,
    or for a duration that is not positive."""
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
    if seconds is None or not math.isfinite(seconds):
        raise ConfigError(
            f"{key}: {value!r} is not a duration; give seconds (36000) or e.g. 10h, 90m, 1d12h, 2h30m",
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


def _read_yaml(text: str, name: str) -> tuple[Any, dict[str, int]]:
    """The YAML document in `text` and the line of each top-level key. Invalid YAML or a duplicate key is a
    ConfigError in one line naming `name` (a file, or `override 'k=v'`) and the line."""
    override = name.startswith("override ")
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
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
    finally:
        loader.dispose()
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
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if isinstance(value, str):
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

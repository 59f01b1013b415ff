"""The typed config: presets load, unknown keys and wrong types are clear errors before anything loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.config import ConfigError, TrainConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_presets_load(name):
    cfg = TrainConfig.load(CONFIGS / name)
    assert cfg.train_files and cfg.output_dir


def test_xl_preset_is_bf16_with_compensated_updates():
    cfg = TrainConfig.load(CONFIGS / "flan-t5-xl-rtx5090.yaml")
    assert cfg.model_name_or_path == "google/flan-t5-xl"
    assert (cfg.dtype, cfg.bf16_update, cfg.gradient_checkpointing) == ("bfloat16", "kahan", True)


def test_overrides_are_typed():
    cfg = TrainConfig.load(CONFIGS / "quickstart.yaml", ["learning_rate=3e-4", "max_steps=7", "resume=never"])
    assert (cfg.learning_rate, cfg.max_steps, cfg.resume) == (3e-4, 7, "never")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learning_rte=1e-4", "unknown config key 'learning_rte' (did you mean 'learning_rate'?)"),
        ("max_steps=ten", "max_steps must be int"),
        ("optimizer=sgd", "optimizer must be one of"),
        ("gradient_accumulation_steps=0", "gradient_accumulation_steps must be >= 1"),
        ("max_steps", "not of the form key=value"),
        ("max_tokens=0", "max_tokens must be >= 1 or null, got 0"),  # the quickstart batches by token budget
        ("max_source_length=0", "max_source_length must be >= 1, got 0"),
        ("warmup_steps=-5", "warmup_steps must be >= 0"),
        ("learning_rate=-1", "learning_rate must be a positive number"),
        ("learning_rate=.nan", "learning_rate must be a positive number"),
        ("max_grad_norm=-1", "max_grad_norm must be >= 0 (0: no clipping"),
        ("learning_rate=[1", "override 'learning_rate=[1': the value is not valid YAML"),
        (
            "cuda_graphs=true",
            "--set cuda_graphs=true: cuda_graphs needs packing: true",
        ),  # unpacked: many shapes
        ("profile_memory=true", "profile_memory records the allocations of the profiled window: set profile"),
    ],
)
def test_bad_overrides_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.load(CONFIGS / "quickstart.yaml", [override])


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (36000, 36000.0),
        ("36000", 36000.0),
        ("12h", 43200.0),
        ("90m", 5400.0),
        ("1d12h", 129600.0),
        ("2h30m", 9000.0),
        ("1h 30m 10s", 5410.0),
        (1.5, 1.5),
    ],
)
def test_max_time_takes_seconds_or_a_duration(value, seconds):
    assert TrainConfig(max_time=value).max_time_s == seconds
    assert TrainConfig().max_time_s is None  # no time budget unless one is set


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("max_time=12x", "max_time: '12x' is not a duration; give seconds (36000) or e.g. 10h"),
        ("max_time=m30", "max_time: 'm30' is not a duration"),
        ("max_time=0", "max_time must be more than 0 (null: no time budget), got 0"),
    ],
)
def test_a_bad_max_time_is_one_clear_error(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.load(CONFIGS / "quickstart.yaml", [override])


def test_the_cache_is_cleared_every_100_steps_unless_a_config_says_never():
    assert TrainConfig().empty_cache_steps == 100
    for name in ("quickstart.yaml", "flan-t5-xl-rtx5090.yaml"):  # the presets keep the default
        assert TrainConfig.load(CONFIGS / name).empty_cache_steps == 100
    assert TrainConfig.load(CONFIGS / "quickstart.yaml", ["empty_cache_steps=0"]).empty_cache_steps == 0


def test_bad_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        TrainConfig.load(bad)


def test_every_set_counts_and_paths_expand_the_home_directory(tmp_path):
    from trainer.cli import build_parser

    args = build_parser().parse_args(
        ["train", "--config", "c.yaml", "--set", "max_steps=3", "--set", "seed=1"]
    )
    assert args.set == ["max_steps=3", "seed=1"]
    cfg = TrainConfig.load(None, ["output_dir=~/runs/a", "train_files=[~/data/r.csv]", "resume=~/runs/a/ck"])
    home = str(Path.home())
    assert cfg.output_dir == f"{home}/runs/a" and cfg.train_files == [f"{home}/data/r.csv"]
    assert cfg.resume == f"{home}/runs/a/ck"
    with pytest.raises(ConfigError, match="set max_steps > 0 or num_train_epochs > 0"):
        TrainConfig.load(None, ["max_steps=-1", "num_train_epochs=0"])


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 10\nlearning_rate: 1.0e-3\noptimizer:\n  adamw\nmax_steps: 20000\n")
    with pytest.raises(ConfigError) as twice:
        TrainConfig.load(config)
    assert str(twice.value) == f"{config}:5: key 'max_steps' is given twice (lines 1 and 5); keep one"
    nested = tmp_path / "nested.yaml"
    nested.write_text("train_files:\n  - a.csv\nmax_steps: {a: 1, b: 2,\n  a: 3}\n")
    with pytest.raises(ConfigError, match=r"nested\.yaml:4: key 'a' is given twice \(lines 3 and 4\)"):
        TrainConfig.load(nested)
    with pytest.raises(ConfigError, match=r"override 'train_files=\{a: 1, a: 2\}': key 'a' is given twice"):
        TrainConfig.load(None, ["train_files={a: 1, a: 2}"])
    # YAML's merge key overrides on purpose; and --set after the file is how a value is changed.
    from trainer.config import read_yaml

    values, lines = read_yaml("base: &b {x: 1}\nother:\n  <<: *b\n  x: 2\n", "merge.yaml")
    assert values["other"] == {"x": 2} and lines == {"base": 1, "other": 2}
    assert TrainConfig.load(CONFIGS / "quickstart.yaml", ["max_steps=3", "max_steps=4"]).max_steps == 4


def test_an_error_names_where_the_key_came_from(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 10\n\nlearning_rte: 1.0e-3\noptimizer: sgd\n")
    with pytest.raises(ConfigError) as unknown:
        TrainConfig.load(config)
    assert str(unknown.value) == (  # every problem of the file at once, in its order
        f"2 problems:\n  {config}:3: unknown config key 'learning_rte' (did you mean 'learning_rate'?)\n"
        f"  {config}:4: optimizer must be one of ['adamw', 'adamw8bit', 'adafactor'], got 'sgd'"
    )
    # The file's keys are fine; the override is what is wrong, and the message says so.
    with pytest.raises(ConfigError) as from_set:
        TrainConfig.load(CONFIGS / "quickstart.yaml", ["max_stepz=3"])
    assert str(from_set.value).startswith("--set max_stepz=3: unknown config key 'max_stepz'")
    with pytest.raises(ConfigError, match=r"^--set optimizer=sgd: optimizer must be one of"):
        TrainConfig.load(CONFIGS / "quickstart.yaml", ["optimizer=sgd"])
    typed = tmp_path / "typed.yaml"
    typed.write_text("max_steps: 10\noptimizer: sgd\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(typed))}:2: optimizer must be one of"):
        TrainConfig.load(typed)


def test_a_value_out_of_range_names_the_file_and_line_or_the_override(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 10\nlearning_rate: -1\neval_fraction: 1.5\n")
    with pytest.raises(ConfigError) as bad:
        TrainConfig.load(config)
    assert str(bad.value).startswith(f"{config}:3: eval_fraction must be in [0, 1)")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(config))}:2: learning_rate must be a positive"):
        TrainConfig.load(config, ["eval_fraction=0.1"])
    with pytest.raises(ConfigError, match=r"^--set max_time=10x: max_time: '10x' is not a duration"):
        TrainConfig.load(CONFIGS / "quickstart.yaml", ["max_time=10x"])
    # two keys at fault: both places named
    with pytest.raises(
        ConfigError,
        match=r"^--set max_steps=0 \(max_steps\) and --set num_train_epochs=0 \(num_train_epochs\): set "
        r"max_steps > 0 or num_train_epochs > 0",
    ):
        TrainConfig.load(CONFIGS / "quickstart.yaml", ["max_steps=0", "num_train_epochs=0"])


def test_invalid_yaml_is_one_line_with_the_line_number(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 10\ntrain_files: [a.csv\nseed: 1\n")
    with pytest.raises(ConfigError) as invalid:
        TrainConfig.load(bad)
    assert str(invalid.value).startswith(f"{bad}:3: not valid YAML (") and "\n" not in str(invalid.value)


def test_hugging_face_args_json_indented_with_tabs_loads(tmp_path):
    """JSON is YAML but for tabs as indentation: an args.json written with tabs loads, its keys' lines kept
    for messages; a YAML fault elsewhere is still reported where it is."""
    args = tmp_path / "args.json"
    args.write_text('{\n\t"max_steps": 10,\n\t"do_train": true,\n\t"lerning_rate": 1e-4\n}\n')
    with pytest.raises(ConfigError, match=r"args\.json:4: unknown config key 'lerning_rate'"):
        TrainConfig.load(args)
    args.write_text('{\n\t"max_steps": 10,\n\t"do_train": true\n}\n')
    assert TrainConfig.load(args).max_steps == 10
    args.write_text('{\n\t"max_steps": [10,\n}\n')
    with pytest.raises(ConfigError, match=r"args\.json:\d+: not valid YAML"):
        TrainConfig.load(args)


def test_every_key_has_its_help_in_the_dataclass_and_a_section():
    import dataclasses

    from trainer.config import SECTIONS, sections

    fields = dataclasses.fields(TrainConfig)
    assert [f.name for f in fields if not f.metadata.get("help", "").strip()] == []
    assert [title for title, _ in sections()] == [title for title, _ in SECTIONS]
    assert [f.name for _, group in sections() for f in group] == [f.name for f in fields]


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("optim=adamw_torch_fused", "optimizer", "adamw"),
        ("optim=adamw_torch", "optimizer", "adamw"),
        ("optim=adafactor", "optimizer", "adafactor"),
        ("optim=adamw_bnb_8bit", "optimizer", "adamw8bit"),
        ("warmup_ratio=0.1", "warmup_steps", 0.1),
        ("torch_empty_cache_steps=50", "empty_cache_steps", 50),
        ("torch_empty_cache_steps=null", "empty_cache_steps", 0),  # HF's None: never
        ("generation_max_length=128", "generation_max_new_tokens", 127),  # max_length counts the start token
        ("resume_from_checkpoint=true", "resume", "auto"),
        ("resume_from_checkpoint=false", "resume", "never"),
        ("resume_from_checkpoint=/runs/a/checkpoint-500", "resume", "/runs/a/checkpoint-500"),
    ],
)
def test_hugging_face_names_with_the_same_meaning_are_taken(override, key, value):
    # An override replaces the file's value under either name (the quickstart sets optimizer, warmup_steps,
    # generation_max_new_tokens).
    cfg = TrainConfig.load(CONFIGS / "quickstart.yaml", [override])
    assert getattr(cfg, key) == value


def test_hugging_face_names_without_a_counterpart_are_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as refused:
        TrainConfig.load(CONFIGS / "quickstart.yaml", ["fp16=true"])
    assert str(refused.value).startswith(
        "--set fp16=true: fp16 true is not supported: T5's activations overflow fp16's range (65504)"
    )
    with pytest.raises(ConfigError) as no_checkpoints:
        TrainConfig.load(None, ["save_strategy=no"])
    assert str(no_checkpoints.value).startswith(
        "--set save_strategy=no: save_strategy no has no counterpart here: a run always saves"
    )  # YAML reads a bare no as false; the line names what was typed
    with pytest.raises(
        ConfigError, match=r"evaluation_strategy no has no counterpart here: to train without "
    ):
        TrainConfig.load(None, ["evaluation_strategy=no"])
    config = tmp_path / "hf.yaml"
    config.write_text("max_steps: 10\noptim: lion_32bit\n")
    with pytest.raises(ConfigError) as no_such_optimizer:
        TrainConfig.load(config)
    assert str(no_such_optimizer.value) == (
        f"{config}:2: optim 'lion_32bit' has no counterpart here; this trainer's key is 'optimizer' "
        "(adamw or adamw8bit or adafactor)"
    )
    with pytest.raises(
        ConfigError, match=r"^--set generation_max_length=1: generation_max_length 1 leaves no"
    ):
        TrainConfig.load(None, ["generation_max_length=1"])
    with pytest.raises(
        ConfigError, match=r"^--set warmup_ratio=1.5: warmup_ratio 1.5 is not a ratio in \[0, 1\)"
    ):
        TrainConfig.load(None, ["warmup_ratio=1.5"])


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("bf16=true", "dtype", "bfloat16"),  # the default, as Hugging Face users write it
        ("bf16=false", "dtype", "float32"),
        ("fp16=false", "dtype", "bfloat16"),  # asks for nothing
        ("report_to=wandb", "report_to", ["wandb"]),
        ("report_to=[wandb]", "report_to", ["wandb"]),
        ("report_to=tensorboard", "report_to", ["tensorboard"]),
        ("report_to=[tensorboard, wandb, wandb]", "report_to", ["tensorboard", "wandb"]),
        ("report_to=all", "report_to", ["wandb", "tensorboard"]),
        ("report_to=none", "report_to", []),
        ("report_to=[]", "report_to", []),
        ("report_to=[none]", "report_to", []),
        ("save_total_limit=null", "save_total_limit", 0),  # Hugging Face's "keep all"
        ("save_steps=0.1", "save_steps", 0.1),
        ("eval_steps=0.25", "eval_steps", 0.25),
        ("logging_steps=0.5", "logging_steps", 0.5),
        ("max_time=00:12:00:00", "max_time", "00:12:00:00"),
        ("predict_with_generate=true", "eval_generation_records", 64),
        ("predict_with_generate=false", "eval_generation_records", 0),
        ("optimizer=adamw_torch_fused", "optimizer", "adamw"),
        ("num_epochs=2", "num_train_epochs", 2),  # axolotl's names
        ("base_model=google/flan-t5-base", "model_name_or_path", "google/flan-t5-base"),
        ("lr_scheduler=cosine", "lr_scheduler_type", "cosine"),
        ("r=8", "lora_r", 8),  # PEFT's
        ("save_strategy=steps", "save_steps", 500),  # asks for what is so anyway
        ("eval_strategy=epoch", "eval_steps", "epoch"),
        ("evaluation_strategy=epoch", "eval_steps", "epoch"),  # transformers 4's name
        ("logging_strategy=epoch", "logging_steps", "epoch"),
    ],
)
def test_what_hugging_face_and_axolotl_users_write_is_taken(override, key, value):
    assert getattr(TrainConfig.load(None, [override]), key) == value


def test_the_lines_every_seq2seq_training_arguments_file_holds_ask_for_what_is_so(tmp_path):
    config = tmp_path / "hf.yaml"
    config.write_text(
        "do_train: true\ndo_eval: true\ndo_predict: false\nsave_safetensors: true\n"
        "overwrite_output_dir: false\nadafactor: false\ndisable_tqdm: false\n"
    )
    assert TrainConfig.load(config) == TrainConfig.load(None)
    config.write_text("overwrite_output_dir: true\ndisable_tqdm: true\nadafactor: true\n")
    cfg = TrainConfig.load(config)
    assert (cfg.resume, cfg.progress_bar, cfg.optimizer) == ("never", False, "adafactor")


def test_the_lines_every_axolotl_config_holds_load(tmp_path):
    """axolotl's boilerplate for a full fine-tune (its examples' `bf16: auto`, an empty `fp16:`, `tf32:
    false`, no quantization, no training on inputs) asks for what is so here; its names are taken."""
    config = tmp_path / "axolotl.yml"
    config.write_text(
        "base_model: google/flan-t5-base\nload_in_8bit: false\nload_in_4bit: false\nsample_packing: true\n"
        "micro_batch_size: 4\nnum_epochs: 2\noptimizer: adamw_torch_fused\nlr_scheduler: cosine\n"
        "train_on_inputs: false\nbf16: auto\nfp16:\ntf32: false\nwandb_name: flan-base-recipes\n"
        "auto_resume_from_checkpoints: true\n"
    )
    cfg = TrainConfig.load(config)
    assert (cfg.model_name_or_path, cfg.packing, cfg.per_device_train_batch_size) == (
        "google/flan-t5-base",
        True,
        4,
    )
    assert (cfg.num_train_epochs, cfg.optimizer, cfg.lr_scheduler_type) == (2, "adamw", "cosine")
    assert (cfg.dtype, cfg.run_name, cfg.resume) == ("bfloat16", "flan-base-recipes", "auto")
    for line, answer in [
        ("load_in_4bit: true", "no quantized base (QLoRA)"),
        ("tf32: true", "never TF32"),
    ]:
        config.write_text(line + "\n")
        with pytest.raises(ConfigError, match=re.escape(answer)):
            TrainConfig.load(config)


def test_a_hugging_face_config_with_its_strategies_and_steps_loads(tmp_path):
    """The lines a Seq2SeqTrainingArguments YAML holds: `*_strategy: steps` beside the `*_steps` they read."""
    config = tmp_path / "hf.yaml"
    config.write_text(
        "eval_strategy: steps\neval_steps: 200\nsave_strategy: steps\nsave_steps: 400\nlogging_strategy: "
        "steps\nlogging_steps: 50\n"
    )
    cfg = TrainConfig.load(config)
    assert (cfg.eval_steps, cfg.save_steps, cfg.logging_steps) == (200, 400, 50)
    config.write_text("save_strategy: epoch\nsave_steps: 400\n")  # HF would ignore save_steps: say so
    with pytest.raises(
        ConfigError, match=f"^{config}:1 and {config}:2: 'save_strategy' is Hugging Face's name"
    ):
        TrainConfig.load(config)


def test_ratios_of_the_run_and_lightning_durations_resolve():
    cfg = TrainConfig.load(
        None, ["save_steps=0.1", "eval_steps=0.25", "logging_steps=7", "max_time=00:12:00:00"]
    )
    assert cfg.every("save_steps", 1000, 500.0) == 100 and cfg.every("save_steps", 15, 5.0) == 2  # rounded up
    assert cfg.every("eval_steps", 10, 5.0) == 3 and cfg.every("logging_steps", 10, 5.0) == 7
    by_epoch = TrainConfig.load(None, ["save_steps=epoch", "eval_steps=epoch"])
    assert by_epoch.every("save_steps", 3000, 1000.4) == 1000 and by_epoch.every("eval_steps", 3, 0.3) == 1
    assert cfg.max_time_s == 12 * 3600 and TrainConfig.load(None, ["max_time=01:30:00"]).max_time_s == 5400
    with pytest.raises(
        ConfigError,
        match="save_steps must be a whole number of steps >= 1, below 1 a ratio of the run's steps, or epoch",
    ):
        TrainConfig.load(None, ["save_steps=2.5"])


@pytest.mark.parametrize(
    ("override", "answer"),
    [
        (
            "deepspeed=ds.json",
            "'deepspeed' is not a key here: not supported: several GPUs shard the model with FSDP2",
        ),
        ("load_in_4bit=true", "load_in_4bit true is not taken here: no quantized base (QLoRA)"),
        ("sequence_len=512", "an encoder-decoder has two lengths: max_source_length and max_target_length"),
        ("report_to=[wandb, comet_ml]", "report_to 'comet_ml' is not supported: wandb (WANDB_MODE=offline"),
        ("overwrite_output_dir=maybe", "this trainer's key is 'resume'"),
        ("per_device_eval_batch_size=8", "evaluation batches are sized by the memory plan"),
        ("save_safetensors=false", "a checkpoint's weights are always model.safetensors"),  # was: save_steps?
        ("do_train=false", "`trainer train` always trains"),
        ("label_smoothing_factor=0.1", "not supported: the loss is plain cross-entropy"),
        ("fp8=true", "FP8 matmuls were measured slower than bf16"),  # axolotl's key
        ("evals_per_epoch=4", "eval_steps and save_steps: every N steps"),
    ],
)
def test_names_known_elsewhere_get_their_own_answer_not_the_nearest_spelling(override, answer):
    with pytest.raises(ConfigError) as refused:
        TrainConfig.load(None, [override])
    message = str(refused.value)
    assert message.startswith(f"--set {override}: ") and answer in message and "did you mean" not in message


def test_keys_that_ask_for_what_is_so_anyway_are_a_warning_and_the_config_loads(tmp_path, caplog):
    """A key whose answer is "nothing to set" (axolotl's flash_attention, Hugging Face's
    eval_accumulation_steps) is left out with a warning naming file:line; the rest of the config is taken."""
    config = tmp_path / "foreign.yaml"
    config.write_text("max_steps: 7\nflash_attention: true\neval_accumulation_steps: 4\n")
    with caplog.at_level("WARNING", logger="trainer.config"):
        assert TrainConfig.load(config).max_steps == 7
    assert f"{config}:2: 'flash_attention' is not a key here, and is left out: nothing to set" in caplog.text
    assert (
        f"{config}:3: 'eval_accumulation_steps' is not a key here, and is left out: nothing to" in caplog.text
    )


def test_a_foreign_config_says_every_problem_at_once_in_file_order(tmp_path):
    """A run_summarization-style YAML with keys this trainer cannot take, one far down the file and one with
    a wrong type: one error, every line of it with its file:line, in the file's order, then the
    overrides'."""
    config = tmp_path / "summarization.yaml"
    config.write_text(
        "model_name_or_path: t5-small\nper_device_eval_batch_size: 8\nlearning_rate: fast\n"
        "logging_first_step: true\neval_strategy: no\n" + "\n" * 20 + "dataloader_num_workrs: 4\n"
    )
    with pytest.raises(ConfigError) as refused:
        TrainConfig.load(config, ["max_stepz=3"])
    lines = str(refused.value).splitlines()
    assert lines[0] == "6 problems:", lines
    places = [line.strip().split(": ", 1)[0] for line in lines[1:]]
    assert places == [f"{config}:{n}" for n in (2, 3, 4, 5, 26)] + ["--set max_stepz=3"], lines
    assert "learning_rate must be float, got 'fast'" in lines[2] and "did you mean 'max_steps'" in lines[6]


@pytest.mark.parametrize("name", ["hub_token", "token", "push_to_hub_token", "wandb_api_key"])
def test_a_secret_given_as_a_key_is_refused_without_repeating_it(name):
    secret = "hf_" + "aBcD1234" * 5
    with pytest.raises(ConfigError) as refused:
        TrainConfig.load(None, [f"{name}={secret}"])
    message = str(refused.value)
    assert message.startswith(f"--set {name}=***: {name!r} is not a key here: a ")
    assert "is never written in a config: put it in" in message and secret not in message


def test_hugging_face_scripts_data_arguments_are_taken_as_this_trainers_keys():
    """run_summarization's train_file/validation_file/dataset_name and text_column/summary_column (the two
    together: one columns mapping), num_beams; and the ones without a key here, each with its answer."""
    cfg = TrainConfig.load(
        None,
        [
            "train_file=data/recipes.csv",
            "validation_file=data/held_out.csv",
            "text_column=article",
            "summary_column=summary",
            "num_beams=4",
            "pad_to_max_length=false",
            "ignore_pad_token_for_loss=true",
        ],
    )
    assert cfg.train_files == ["data/recipes.csv"] and cfg.eval_files == ["data/held_out.csv"]
    assert cfg.columns == {"source": "article", "target": "summary"} and cfg.generation_num_beams == 4
    both = TrainConfig.load(None, ["train_file=a.csv", "dataset_name=me/recipes"])
    assert both.train_files == ["a.csv", "hf://datasets/me/recipes"]
    for override, answer in [
        ("dataset_config_name=default", "[{path: hf://datasets/OWNER/NAME, name: SUBSET}]"),
        ("max_train_samples=100", "training reads all of train_files; max_steps or max_time bounds the run"),
        ("pad_to_max_length=true", "a batch is padded to its longest record"),
        ("source_prefix=summarize: ", "source_template writes the source text"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(answer)):
            TrainConfig.load(None, [override])


def test_an_interlock_names_the_preset_line_that_set_the_other_half():
    with pytest.raises(ConfigError) as both:
        TrainConfig.load(CONFIGS / "flan-t5-xl-rtx5090.yaml", ["per_device_train_batch_size=8"])
    assert re.match(
        r"--set per_device_train_batch_size=8 \(per_device_train_batch_size\) and "
        r".*flan-t5-xl-rtx5090.yaml:\d+ \(max_tokens\): set per_device_train_batch_size or max_tokens, "
        r"not both: null unsets the other",
        str(both.value),
    ), str(both.value)
    with pytest.raises(ConfigError) as graphs:
        TrainConfig.load(CONFIGS / "flan-t5-xl-rtx5090.yaml", ["packing=false"])
    assert str(graphs.value).startswith("--set packing=false (packing) and ") and "(cuda_graphs)" in str(
        graphs.value
    )
    assert "with packing false, set cuda_graphs false too" in str(graphs.value)
    cfg = TrainConfig.load(
        CONFIGS / "flan-t5-xl-rtx5090.yaml", ["per_device_train_batch_size=8", "max_tokens=null"]
    )
    assert cfg.per_device_train_batch_size == 8 and cfg.max_tokens is None


def test_warmup_steps_below_one_is_a_ratio_and_warmup_ratio_beside_it_is_one_error(tmp_path):
    assert TrainConfig.load(None, ["warmup_steps=0.05"]).warmup_steps == 0.05
    assert TrainConfig.load(None, ["warmup_steps=20"]).warmup_steps == 20
    with pytest.raises(ConfigError, match=r"^--set warmup_steps=2.5: warmup_steps must be a whole number"):
        TrainConfig.load(None, ["warmup_steps=2.5"])
    config = tmp_path / "both.yaml"
    config.write_text("warmup_steps: 100\nwarmup_ratio: 0.1\n")
    with pytest.raises(ConfigError) as both:
        TrainConfig.load(config)
    assert str(both.value) == (
        f"{config}:2 and {config}:1: 'warmup_ratio' is Hugging Face's name for 'warmup_steps' (steps, or "
        "below 1 a ratio of the run's steps): set one of them"
    )
    # A --set replaces the file's value, whichever name the file used.
    assert TrainConfig.load(CONFIGS / "quickstart.yaml", ["warmup_ratio=0.1"]).warmup_steps == 0.1


def test_lr_scheduler_kwargs_is_a_mapping():
    cfg = TrainConfig.load(
        None, ["lr_scheduler_type=cosine_with_min_lr", "lr_scheduler_kwargs={min_lr_rate: 0.1}"]
    )
    assert cfg.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    with pytest.raises(
        ConfigError, match=r"^--set lr_scheduler_kwargs=0.1: lr_scheduler_kwargs must be a mapping"
    ):
        TrainConfig.load(None, ["lr_scheduler_kwargs=0.1"])


def test_an_8bit_kahan_buffer_is_taken_for_adafactor_and_refused_elsewhere(tmp_path):
    """`bf16_update: kahan_8bit` for adafactor; AdamW (torch-optimi's Kahan buffer) and adamw8bit
    (stochastic rounding, no buffer) keep none: one line naming both keys where they were set."""
    config = tmp_path / "c.yaml"
    config.write_text("optimizer: adafactor\nbf16_update: kahan_8bit\n")
    assert TrainConfig.load(config).bf16_update == "kahan_8bit"
    for optimizer in ("adamw", "adamw8bit"):
        config.write_text(f"optimizer: {optimizer}\nbf16_update: kahan_8bit\n")
        with pytest.raises(
            ConfigError,
            match=rf"c.yaml:1 \(optimizer\) and .*c.yaml:2 \(bf16_update\): optimizer: {optimizer} keeps no "
            r"8-bit Kahan buffer: use bf16_update: kahan, or optimizer: adafactor",
        ):
            TrainConfig.load(config)


def test_an_optimizer_that_cannot_update_fsdp_shards_is_refused_naming_both_keys(tmp_path, monkeypatch):
    """What trainer.optim declares about FSDP decides the config: an optimizer without it is one line naming
    where the optimizer and the strategy were set (an optimizer declared so, as a new one could be)."""
    from trainer.optim import OPTIMIZERS
    from trainer.optim.adamw import AdamW

    class NoShards(AdamW):
        name, fsdp = "adamw", False

    monkeypatch.setitem(OPTIMIZERS, "adamw", NoShards())
    config = tmp_path / "c.yaml"
    config.write_text("optimizer: adamw\ndistributed_strategy: fsdp\n")
    with pytest.raises(
        ConfigError,
        match=r"c.yaml:1 \(optimizer\) and .*c.yaml:2 \(distributed_strategy\): "
        r"optimizer: adamw does not update FSDP2's sharded weights: use distributed_strategy: ddp, "
        r"or optimizer: adafactor",
    ):
        TrainConfig.load(config)

"""The `trainer` command line. What the user sees is decided here: the messages for expected errors (one
line, exit code 2), the log format, and the command's own output."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import sys
import textwrap
import typing

import yaml

DESCRIPTION = """\
Fine-tune FLAN-T5 on recipe files (RecipeNLG CSV, Food.com CSV, JSONL, Parquet, Arrow) or Hugging Face
datasets on one GPU or several.

Start with `trainer presets` (a config for each card) and `trainer init --preset NAME --data 'recipes/*.csv'`
(writes one here), then check it: `trainer train --config FILE --dry-run`, `trainer plan --config FILE`. The
preset quickstart trains a tiny model on generated recipes on the CPU (2 minutes on 2 idle cores)."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"  # with the date: runs last days


# What train_files takes, as the commands that take data say it.
DATA_SOURCES = (
    "recipe files or quoted globs (CSV, JSONL, Parquet, Arrow; .gz/.zst allowed), save_to_disk directories "
    "or hf://datasets/OWNER/NAME"
)
_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")  # a KEY=VALUE word
CONFIG_DOC = "docs/config.md"
CONFIG_DOC_COMMAND = f"trainer config --markdown > {CONFIG_DOC}"


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    # One value per --set, so that positional arguments after it stay positional; every --set counts.
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key: --set max_steps=100 --set 'train_files=[a.csv]' (or several KEY=VALUE "
        "words after one --set)",
    )


def _add_config(parser: argparse.ArgumentParser) -> None:
    """The config file, as `CONFIG` (axolotl's `axolotl train config.yml`, Hugging Face's scripts' one
    file) or `--config CONFIG`; neither: the defaults and the keys given (`--train_files ...`)."""
    help_ = "YAML config (`trainer presets` lists the shipped ones; `trainer init` writes one)"
    parser.add_argument("config_file", nargs="?", metavar="CONFIG", help=f"{help_}; or --config CONFIG")
    parser.add_argument("--config", help=help_)


def config_path(args: argparse.Namespace) -> str | None:
    """The config file of `trainer train`/`plan`, given as CONFIG or --config; None: only keys were given
    (the defaults for the rest). ConfigError when it is given twice, or nothing at all is."""
    from trainer.config import ConfigError

    given = list(dict.fromkeys(p for p in (args.config_file, args.config) if p))
    if len(given) > 1:
        raise ConfigError(f"two configs given, {given[0]} and --config {given[1]}: give one")
    if not given and not args.set:
        raise ConfigError(
            f"no config: `trainer {args.command} CONFIG.yaml` (`trainer presets` lists the shipped ones, "
            "`trainer init --preset NAME` writes one), or the keys themselves (--train_files data.csv "
            "--output_dir outputs/run ...; the rest at the defaults `trainer config` lists)"
        )
    if not given:
        logging.getLogger("trainer").info("no config file: the keys given, the defaults for the rest")
    return given[0] if given else None


def one_override_per_set(argv: list[str]) -> list[str]:
    """`--set a=1 b=2` as `--set a=1 --set b=2`: every KEY=VALUE word after a --set counts, and the first
    other word (say, a file for `data inspect`) stays a positional argument."""
    out: list[str] = []
    expect_value = in_overrides = False
    for word in argv:
        if expect_value:  # the value of --set itself, whatever it looks like
            expect_value, in_overrides = False, True
        elif word == "--set":
            expect_value = True
        elif word.startswith("--set="):
            in_overrides = True
        elif in_overrides and _OVERRIDE.match(word):
            out.append("--set")
        else:
            in_overrides = False
        out.append(word)
    return out


# The subcommands that read a config, and their own options: any other `--name` there is a config key.
CONFIG_COMMANDS = {
    "train": {"--config", "--set", "--dry-run", "--help", "-h"},
    "plan": {"--config", "--set", "--gpu-memory", "--processes", "--hours", "--help", "-h"},
}


def config_flags_as_overrides(argv: list[str]) -> list[str]:
    """HfArgumentParser's `--learning_rate 1e-4`, `--learning_rate=1e-4`, `--bf16` (a flag alone: true) and
    `--report_to wandb tensorboard` (several words: a list) after `trainer train` or `trainer plan`, as `--set
    learning_rate=1e-4`: any `--name` that is not one of the subcommand's own options names a config key (an
    unknown one is then a config error with its suggestion)."""
    at = next((i for i, w in enumerate(argv) if not w.startswith("-")), None)
    own = CONFIG_COMMANDS.get(argv[at]) if at is not None else None
    if own is None:
        return argv
    out: list[str] = argv[: at + 1]  # `trainer --verbose train`: options before the command are the program's
    words = iter(range(at + 1, len(argv)))
    for i in words:
        word = argv[i]
        name, eq, value = word.partition("=")
        if not word.startswith("--") or name in own or word == "--":
            out.append(word)
            if name in own and not eq and name not in ("--dry-run", "--help", "-h"):  # its value follows
                following = next(words, None)
                if following is not None:
                    out.append(argv[following])
            continue
        key = name[2:].replace("-", "_")
        if not eq:
            # The words up to the next option: none is a flag alone (true, as HfArgumentParser reads a bool);
            # several are a list (`--report_to wandb tensorboard`, `--train_files data/*.csv` as the shell
            # expands it).
            following = list(itertools.takewhile(_key_value_word, argv[i + 1 :]))
            for _ in following:
                next(words, None)
            if not following:
                value = "true"
            elif len(following) == 1:
                value = following[0]
            else:
                value = json.dumps([_scalar(w) for w in following])
        out += ["--set", f"{key}={value}"]
    return out


def _key_value_word(word: str) -> bool:
    """Whether a word after `--key` is its value: not the next option, nor the config file (`--bf16
    config.yaml`: no data file is YAML)."""
    return not word.startswith("--") and not word.lower().endswith((".yaml", ".yml"))


def _scalar(word: str):
    """A word as the YAML scalar it reads as (a number, true, ...), or the word itself."""
    try:
        value = yaml.safe_load(word)
    except yaml.YAMLError:  # `*.csv` reads as an alias
        return word
    return value if isinstance(value, (int, float, bool, str)) else word


def _type_name(hint) -> str:
    """A config key's type in words: `int or null`, `bfloat16 | float32`, `list of str`, `mapping`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    if args and type(None) in args:  # X | None
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if args:
        return " or ".join(_type_name(a) for a in args)
    return hint.__name__


def _default(f: dataclasses.Field) -> str:
    """A config key's default as YAML writes it."""
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _config_keys():
    """(section, [(key, type, default, help)]) for every section of TrainConfig."""
    from trainer.config import TrainConfig, sections

    hints = typing.get_type_hints(TrainConfig)
    return [
        (title, [(f.name, _type_name(hints[f.name]), _default(f), f.metadata["help"]) for f in fields])
        for title, fields in sections()
    ]


def _hf_names() -> list[tuple[str, str]]:
    """(a name from Hugging Face, axolotl or PEFT, what this trainer does with it) for each name of
    config.HF_NAMES and config.ANSWERS."""
    from trainer.config import ANSWERS, HF_NAMES

    def taken(hf) -> str:
        if hf.key is None:
            return hf.taken
        return f"taken as {hf.key} ({hf.taken})" if hf.convert else f"refused: set {hf.key} ({hf.hint})"

    return [(name, taken(hf)) for name, hf in HF_NAMES.items()] + [
        (name, f"refused: {answer}") for name, answer in ANSWERS.items()
    ]


def _wrap(text: str, width: int, first: str, then: str) -> list[str]:
    # Whole words only: `feed-forward` and paths stay in one piece.
    return textwrap.wrap(
        text,
        width,
        initial_indent=first,
        subsequent_indent=then,
        break_on_hyphens=False,
        break_long_words=False,
    )


def config_keys_text() -> str:
    """Every config key by section, `key: type = default` and its help below, then Hugging Face's names: what
    `trainer train --help` ends with and `trainer config` prints."""
    width = max(60, min(shutil.get_terminal_size().columns, 110)) - 2
    lines = [f"config keys (in the YAML file, or --set KEY=VALUE; {CONFIG_DOC} lists them too):"]
    for title, keys in _config_keys():
        lines += ["", f"{title}:"]
        for name, kind, default, text in keys:
            lines.append(f"  {name}: {kind} = {default}")
            lines += _wrap(text, width, "      ", "      ")
    lines += [
        "",
        "Names from Hugging Face (Seq2SeqTrainingArguments), axolotl and PEFT, and what they do here:",
    ]
    for name, what in _hf_names():
        lines += _wrap(f"{name}: {what}", width, "  ", "      ")
    return "\n".join(lines)


def config_keys_markdown() -> str:
    """docs/config.md: every config key by section, as tables, then Hugging Face's names."""
    lines = [
        "# Config keys",
        "",
        f"Generated by `{CONFIG_DOC_COMMAND}` from `TrainConfig` in trainer/config.py, whose fields hold "
        "these help texts: edit them there.",
        "",
        "A config is a YAML file of these keys (`configs/` has the presets); `--set KEY=VALUE` overrides any "
        "of them. The names are Hugging Face `Seq2SeqTrainingArguments`' where it has the same setting. "
        "`trainer train --help` and `trainer config` print this list.",
    ]
    for title, keys in _config_keys():
        lines += [
            "",
            f"## {title[0].upper()}{title[1:]}",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for name, kind, default, text in keys:
            cells = [f"`{name}`", kind.replace("|", "\\|"), f"`{default}`", text.replace("|", "\\|")]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Names from Hugging Face, axolotl and PEFT",
        "",
        "Names of `Seq2SeqTrainingArguments`, axolotl and PEFT that this trainer spells otherwise, or has no "
        "key for: taken as its key where the meaning is the same, else refused with a line saying what to "
        "do. Their values are taken in Hugging Face's forms too: `report_to: [wandb]` or `all`, "
        "`save_total_limit: null` (keep all), `save_steps`, `eval_steps` and `logging_steps` below 1 (a "
        "ratio of the run's steps) or `epoch` (`save_strategy: epoch`), `max_time: 00:12:00:00` "
        "(Lightning's), `optimizer: adamw_torch_fused` (`optim`'s names); and `trainer train --KEY VALUE` as "
        "HfArgumentParser reads it, several words a list (`--report_to wandb tensorboard`), the config file "
        "first as axolotl takes it (`trainer train config.yaml`) or none (the keys given, the defaults for "
        "the rest).",
        "",
        "| name | here |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {what} |" for name, what in _hf_names()]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The `trainer` command line: every subcommand and option, with its help."""
    from trainer import __version__
    from trainer.config import DATA_FORMATS

    parser = argparse.ArgumentParser(
        prog="trainer", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a model from a YAML config",
        description="Train a model from a YAML config of the keys below (CONFIG or --config CONFIG); --set "
        "KEY=VALUE overrides any of them, and so does --KEY VALUE (as Hugging Face's HfArgumentParser reads "
        "it; --KEY alone: true). Without a config: the keys given, the defaults for the rest.",
        epilog=config_keys_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config(train)
    _add_overrides(train)
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, the model's files (its tokenizer too: cached for a Hub id), the data and the "
        "plan, then exit without loading the model",
    )

    config = sub.add_parser(
        "config",
        help="list every config key: its type, default and meaning (as `trainer train --help` ends)",
        description=f"Every config key, with its type, default and meaning. `{CONFIG_DOC_COMMAND}` writes "
        "the documentation.",
    )
    config.add_argument("--markdown", action="store_true", help=f"as Markdown, what {CONFIG_DOC} holds")

    plan = sub.add_parser(
        "plan",
        help="predict peak GPU memory for a config, and the training time on named GPUs",
        description="Predict a config's peak GPU memory by component on a card of --gpu-memory, the largest "
        "micro-batch that fits, the host memory a checkpoint's copy takes, and the time of an epoch and of "
        "the run on the RTX 5090, 4090, 4080, 3090, L40S, RTX 6000 Ada, A100, H100 and H200, without loading "
        "the model. --set KEY=VALUE or --KEY VALUE override the config.",
    )
    _add_config(plan)
    _add_overrides(plan)
    plan.add_argument("--gpu-memory", default="32GiB", help="card size, e.g. 32GiB or 24GB")
    plan.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes (GPUs) of the run, torchrun's nnodes x nproc_per_node: the plan is one GPU's, e.g. "
        "of its shard under distributed_strategy fsdp (default 1)",
    )
    plan.add_argument(
        "--hours", type=float, help="also say how much of the data this many hours of training cover"
    )

    sub.add_parser(
        "presets",
        help="list the presets shipped with the trainer: card, model, what trains, predicted speed",
        description="The presets shipped with the trainer, each a config for one card: its model, what it "
        "trains and its predicted speed there (as `trainer plan` predicts it without data). `trainer init "
        "--preset NAME` writes one as a local config.",
    )
    init = sub.add_parser(
        "init",
        help="write a local config from a shipped preset, with your data and output paths",
        description="Write a local config from a preset shipped with the trainer (`trainer presets` lists "
        "them), comments included. The presets' paths are the container's (/data, /outputs): without --data "
        "and --output they become data/ and outputs/ under the working directory.",
    )
    init.add_argument(
        "--preset",
        required=True,
        help="a preset's name (xl-rtx4090), its file's, or the end of one (rtx4090)",
    )
    init.add_argument(
        "--data", nargs="+", help=f"train_files: {DATA_SOURCES} (default: the preset's, under data/)"
    )
    init.add_argument("--output", help="output_dir (default: the preset's, under outputs/)")
    init.add_argument("--to", help="the config file to write (default: the preset's file name, here)")
    init.add_argument("--force", action="store_true", help="replace --to if it exists")

    data = sub.add_parser("data", help="sample data and inspect recipe files").add_subparsers(
        dest="data_command", required=True
    )
    sample = data.add_parser("sample", help="write realistic generated recipes in a real dump's format")
    sample.add_argument(
        "--out",
        required=True,
        help="file to write; its name says the format: .csv (RecipeNLG), .jsonl, .parquet, .arrow, each "
        "optionally .gz/.zst",
    )
    sample.add_argument("--n", type=int, default=1000, help="number of recipes (default %(default)s)")
    sample.add_argument(
        "--seed", type=int, default=0, help="the same seed writes the same recipes (default %(default)s)"
    )
    sample.add_argument(
        "--format",
        choices=DATA_FORMATS,
        help="must match --out's name; foodcom-csv writes Food.com's layout to a .csv (default: from the "
        "name)",
    )
    demo = data.add_parser(
        "demo",
        help="write the recipes and tiny model that a make_demo_data config trains on, if missing",
    )
    demo.add_argument("--config", required=True, help="YAML config with make_demo_data: true")
    _add_overrides(demo)
    inspect = data.add_parser("inspect", help="count records, skips, token lengths and padding")
    inspect.add_argument("paths", nargs="+", help=DATA_SOURCES)
    inspect.add_argument("--config", help="YAML config whose tokenizer, task and batching to use")
    _add_overrides(inspect)

    tiny = sub.add_parser("tiny-model", help="build a tiny random FLAN-T5 and tokenizer for offline use")
    tiny.add_argument("--out", required=True, help="directory to write the model and its tokenizer into")
    tiny.add_argument(
        "--seed", type=int, default=0, help="the same seed gives the same model (default %(default)s)"
    )

    health = sub.add_parser("healthcheck", help="exit 0 if the loop's heartbeat file is fresh, else 1")
    where = health.add_mutually_exclusive_group(required=True)
    where.add_argument("--file", help="heartbeat file to check")
    where.add_argument("--config", help="YAML config of the run: checks <output_dir>/heartbeat")
    _add_overrides(health)
    health.add_argument("--max-age", type=float, default=900.0, help="allowed seconds since the last beat")

    from trainer.eval.evaluate import add_evaluate_parser
    from trainer.eval.generate import add_generate_parser
    from trainer.eval.serve import add_serve_parser

    add_generate_parser(sub)
    add_evaluate_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(config_flags_as_overrides(one_override_per_set(argv)))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT
    )
    if args.command in ("train", "generate", "evaluate", "serve") and sys.stderr.isatty():
        # The imports below are the first wait a person meets; on a terminal only: a script's first line
        # stays the result (or the one line of an error).
        logging.getLogger("trainer.cli").info(
            "loading PyTorch and transformers (5-10 s; up to 30 s on a busy 2-core machine)"
        )
    from trainer._loader import RecipeDataError, RecipeFileError
    from trainer.config import ConfigError
    from trainer.data.prompt import ModelDirError
    from trainer.eval.generate import UsageError
    from trainer.infra.disk import out_of_space_message
    from trainer.infra.redact import install_log_redaction, redact
    from trainer.infra.run_lock import OutputDirLocked
    from trainer.infra.stopping import PeerLost
    from trainer.model.model_files import ModelFilesError

    # Secrets (W&B key, Discord webhook, HF token) are masked in every log line from here on.
    install_log_redaction()

    def refused(line: str, e: BaseException) -> int:
        """Exit 2 with one line; a training run that could not start also says it on Discord."""
        print(line, file=sys.stderr)
        if args.command == "train" and not getattr(e, "run_reported", False):
            from trainer.report.start_failure import report_start_failure

            report_start_failure(line, argv)
        return 2

    try:
        return run_command(args)
    except OutputDirLocked as e:  # another trainer writes into this output_dir: the message names it
        return refused(f"trainer: {redact(str(e))}", e)
    except (UsageError, ModelDirError) as e:  # generate/evaluate: a value or model directory it cannot use
        return refused(f"trainer {args.command}: {redact(str(e))}", e)
    except ModelFilesError as e:  # model_name_or_path's files: the message says which and how to get them
        return refused(f"trainer: model error: {redact(str(e))}", e)
    except ConfigError as e:
        return refused(f"trainer: config error: {redact(str(e))}", e)
    except PeerLost:  # another rank of a torchrun run ended: logged where it showed; its own log says why
        return 1
    except (RecipeDataError, RecipeFileError) as e:  # bad data or paths: the message names the file and line
        return refused(f"trainer: data error: {redact(str(e))}", e)
    except KeyboardInterrupt:
        print("trainer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output's reader left (`trainer config | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except SystemExit:
        raise
    except BaseException as e:  # not only Exception: torch's CheckpointException derives from BaseException
        full_disk = out_of_space_message(e)  # a full disk in any form: one line, the traceback under -v
        if full_disk is not None:
            logging.getLogger("trainer").debug("out of disk space", exc_info=True)
            print(f"trainer: {redact(full_disk)}", file=sys.stderr)
            return 1
        # Through the logger, not Python's default hook, so the traceback is redacted like every log line.
        logging.getLogger("trainer").critical("failed", exc_info=True)
        return 1


# Commands that load transformers or huggingface_hub, whose output then goes through the trainer's logging
# (`trainer train` does that itself, as train() does it for scripts).
_LIBRARY_COMMANDS = {"plan", "tiny-model", "generate", "evaluate", "serve", "inspect", "demo"}


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit code (expected faults are raised to `main`, which says them)."""
    if {args.command, getattr(args, "data_command", None)} & _LIBRARY_COMMANDS:
        from trainer.infra.library_logs import route_library_output

        route_library_output()
    if hasattr(args, "run"):  # subcommands that bring their own entry point (generate, evaluate, serve)
        return args.run(args)
    if args.command == "config":
        sys.stdout.write(config_keys_markdown() if args.markdown else config_keys_text() + "\n")
        return 0
    if args.command == "train":
        from trainer.config import TrainConfig

        cfg = TrainConfig.load(config_path(args), args.set)  # a config error before torch is imported
        from trainer.run.train import train

        return train(cfg, dry_run=args.dry_run)
    if args.command == "plan":
        from trainer.config import TrainConfig
        from trainer.plan.plan_report import print_plan

        cfg = TrainConfig.load(config_path(args), args.set)
        return print_plan(cfg, args.gpu_memory, args.hours, args.processes)
    if args.command == "presets":
        from trainer.plan.presets import presets_table

        print(presets_table())
        return 0
    if args.command == "init":
        from pathlib import Path

        from trainer.plan.presets import find_preset, write_config

        preset = find_preset(args.preset)
        print(write_config(preset, Path(args.to or preset.file_name), args.data, args.output, args.force))
        return 0
    if args.command == "healthcheck":
        from trainer.infra.healthcheck import check_heartbeat, heartbeat_path

        if args.file:
            path = args.file
        else:
            from trainer.config import ConfigError, TrainConfig
            from trainer.infra.redact import redact

            try:
                path = heartbeat_path(TrainConfig.load(args.config, args.set).output_dir)
            except ConfigError as e:  # exit 2 is reserved by Docker's HEALTHCHECK: report unhealthy instead
                print(f"trainer: config error: {redact(str(e))}", file=sys.stderr)
                return 1
        fresh, reason = check_heartbeat(path, args.max_age)
        print(reason)
        return 0 if fresh else 1
    if args.command == "tiny-model":
        from trainer.model.tiny_model import build_tiny_model

        build_tiny_model(args.out, seed=args.seed)
        print(f"wrote a tiny FLAN-T5 and its tokenizer to {args.out}")
        return 0
    if args.data_command == "sample":
        from trainer.data.sample import write_sample

        try:
            written = write_sample(args.out, n=args.n, seed=args.seed, fmt=args.format)
        except ValueError as e:  # a file name that says no format, or another format than --format
            print(f"trainer data sample: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.n} recipes ({written}) to {args.out}")
        return 0
    if args.data_command == "demo":
        from trainer.config import TrainConfig
        from trainer.data.sample import demo_data

        cfg = TrainConfig.load(args.config, args.set)
        if not cfg.make_demo_data:
            print(f"nothing to write: {args.config} does not set make_demo_data")
            return 0
        missing, made = demo_data(cfg)
        if missing != made:  # ensure_demo_data warned about each path it would not write
            return 2
        print(f"wrote {', '.join(map(str, made))}" if made else "the demo data is there already")
        return 0
    from trainer.config import TrainConfig
    from trainer.data.loader import inspect_report
    from trainer.model.model_files import ModelFilesError

    cfg = TrainConfig.load(args.config, args.set)
    try:
        print(inspect_report(args.paths, cfg))
    except ModelFilesError as e:
        if args.config:
            raise
        raise ModelFilesError(
            f"{e} (without --config, inspect counts tokens with {cfg.model_name_or_path}'s tokenizer: give "
            "--config with your training config, e.g. --config configs/quickstart.yaml for the quickstart's "
            "recipes)"
        ) from None
    return 0

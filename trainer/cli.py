"""The `trainer` command line. What the user sees is decided here: the messages for expected errors (one
line, exit code 2), the log format, and the command's own output."""

from __future__ import annotations

import argparse
import logging
import re
import sys

DESCRIPTION = """\
Fine-tune FLAN-T5 on recipe files (RecipeNLG CSV, Food.com CSV, JSONL) on one GPU or several.

Start with `trainer train --config configs/quickstart.yaml` (CPU, a few minutes) or check a real config
first with `trainer train --config CONFIG --dry-run` and `trainer plan --config CONFIG`."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"  # with the date: runs last days


_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")  # a KEY=VALUE word


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


def _one_override_per_set(argv: list[str]) -> list[str]:
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


def _build_parser() -> argparse.ArgumentParser:
    from trainer.config import DATA_FORMATS

    parser = argparse.ArgumentParser(
        prog="trainer", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a YAML config")
    train.add_argument("--config", required=True, help="YAML config (see configs/)")
    _add_overrides(train)
    train.add_argument("--dry-run", action="store_true", help="check the config and data paths, then exit")

    plan = sub.add_parser(
        "plan", help="predict peak GPU memory for a config, and the training time on named GPUs"
    )
    plan.add_argument("--config", required=True)
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

    data = sub.add_parser("data", help="sample data and inspect recipe files").add_subparsers(
        dest="data_command", required=True
    )
    sample = data.add_parser("sample", help="write realistic generated recipes in a real dump's format")
    sample.add_argument("--out", required=True)
    sample.add_argument("--n", type=int, default=1000)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--format", choices=DATA_FORMATS, default=DATA_FORMATS[0])
    inspect = data.add_parser("inspect", help="count records, skips, token lengths and padding")
    inspect.add_argument("paths", nargs="+", help="recipe files (CSV, JSONL; .gz/.zst allowed)")
    inspect.add_argument("--config", help="YAML config whose tokenizer, task and batching to use")
    _add_overrides(inspect)

    tiny = sub.add_parser("tiny-model", help="build a tiny random FLAN-T5 and tokenizer for offline use")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)

    health = sub.add_parser("healthcheck", help="exit 0 if the loop's heartbeat file is fresh, else 1")
    where = health.add_mutually_exclusive_group(required=True)
    where.add_argument("--file", help="heartbeat file to check")
    where.add_argument("--config", help="YAML config of the run: checks <output_dir>/heartbeat")
    _add_overrides(health)
    health.add_argument("--max-age", type=float, default=900.0, help="allowed seconds since the last beat")

    from trainer.evaluate import add_evaluate_parser
    from trainer.generate import add_generate_parser
    from trainer.serve import add_serve_parser

    add_generate_parser(sub)
    add_evaluate_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(_one_override_per_set(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT
    )
    from trainer._loader import RecipeDataError, RecipeFileError
    from trainer.config import ConfigError
    from trainer.disk import out_of_space_message
    from trainer.distributed import PeerLost
    from trainer.generate import UsageError
    from trainer.prompt import ModelDirError
    from trainer.redact import install_log_redaction, redact
    from trainer.run_lock import OutputDirLocked

    # Secrets (W&B key, Discord webhook, HF token) are masked in every log line from here on.
    install_log_redaction()
    try:
        return _run(args)
    except OutputDirLocked as e:  # another trainer writes into this output_dir: the message names it
        print(f"trainer: {redact(str(e))}", file=sys.stderr)
        return 2
    except (UsageError, ModelDirError) as e:  # generate/evaluate: a value or model directory it cannot use
        print(f"trainer {args.command}: {redact(str(e))}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"trainer: config error: {redact(str(e))}", file=sys.stderr)
        return 2
    except PeerLost:  # another rank of a torchrun run ended: logged where it showed; its own log says why
        return 1
    except (RecipeDataError, RecipeFileError) as e:  # bad data or paths: the message names the file and line
        print(f"trainer: data error: {redact(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainer: interrupted", file=sys.stderr)
        return 130
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


def _run(args: argparse.Namespace) -> int:
    if hasattr(args, "run"):  # subcommands that bring their own entry point (generate, evaluate, serve)
        return args.run(args)
    if args.command == "train":
        from trainer.config import TrainConfig
        from trainer.train import train

        cfg = TrainConfig.load(args.config, args.set)
        return train(cfg, dry_run=args.dry_run)
    if args.command == "plan":
        from trainer.config import TrainConfig
        from trainer.plan_report import print_plan

        cfg = TrainConfig.load(args.config, args.set)
        return print_plan(cfg, args.gpu_memory, args.hours, args.processes)
    if args.command == "healthcheck":
        from trainer.healthcheck import check_heartbeat, heartbeat_path

        if args.file:
            path = args.file
        else:
            from trainer.config import ConfigError, TrainConfig
            from trainer.redact import redact

            try:
                path = heartbeat_path(TrainConfig.load(args.config, args.set).output_dir)
            except ConfigError as e:  # exit 2 is reserved by Docker's HEALTHCHECK: report unhealthy instead
                print(f"trainer: config error: {redact(str(e))}", file=sys.stderr)
                return 1
        fresh, reason = check_heartbeat(path, args.max_age)
        print(reason)
        return 0 if fresh else 1
    if args.command == "tiny-model":
        from trainer.tiny_model import build_tiny_model

        build_tiny_model(args.out, seed=args.seed)
        print(f"wrote a tiny FLAN-T5 and its tokenizer to {args.out}")
        return 0
    if args.data_command == "sample":
        from trainer.sample import write_sample

        write_sample(args.out, n=args.n, seed=args.seed, fmt=args.format)
        print(f"wrote {args.n} recipes to {args.out}")
        return 0
    from trainer.config import TrainConfig
    from trainer.data import inspect_report

    cfg = TrainConfig.load(args.config, args.set)
    print(inspect_report(args.paths, cfg))
    return 0

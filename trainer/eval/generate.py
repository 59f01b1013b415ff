"""`trainer generate`: recipes from a trained model, prompted exactly as it was trained.

The model directory carries its prompt template (`recipe_template.json`, trainer/data/prompt.py); a plain
Hugging Face model directory without one is prompted with the task preset. Prompts are rendered and tokenized
by the training loader's Rust code (`RecipeRenderer`), from recipe files in any format the loader reads or
from `--ingredients`/`--title`. Generation runs on the decoding engine (trainer.eval.decoding), in bf16 on a
GPU, as many prompts at once as a budget of cache tokens holds; beam search on Hugging Face's `generate`.
Rows come out in input order. Decoding options take Hugging Face's names; what is not given comes from the
model's generation_config.

`generate_ids` is the batched generation itself (the training loop's evaluation, `trainer serve`'s beam
search and bench/generate_speed.py use it); `generate_rows` adds decoding and reading the recipes back.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from trainer.config import DATA_FORMATS, TASKS, TrainConfig
from trainer.data.loader import resolve_sources, skipped_summary
from trainer.data.prompt import (
    DEFAULT_TASK,
    TEMPLATE_FILE,
    ModelDirError,
    PromptTemplate,
    load_prompt_template,
    parse_recipe,
    template_parts,
)
from trainer.infra.disk import write_text_atomic
from trainer.model.model_files import is_adapter_dir

log = logging.getLogger(__name__)


class DecodingOption(NamedTuple):
    """A decoding option: its type, Hugging Face's default, its help, and the values it takes. Every number
    has both bounds: an option whose cost grows with its value (beams, tokens, n-gram sizes) cannot make one
    request slow for everyone (`trainer serve`), and a value too large for a tensor is refused, not a
    crash."""

    kind: type
    hf_default: Any
    help: str
    low: float | None = None  # the least value (bool: None)
    high: float | None = None  # the largest value
    low_open: bool = False  # `low` itself is refused: the value must be above it

    def check(self, name: str, value: Any, flag: str) -> None:
        """UsageError, naming the option as `{flag}{name}`, for a value outside the bounds."""
        if self.kind is bool:
            return
        if not math.isfinite(value):  # NaN passes every comparison
            raise UsageError(f"{flag}{name} must be a finite number, got {value}")
        low, high = self.low, self.high
        if self.low_open and self.high is not None and not low < value <= high:
            if high == 1:
                raise UsageError(f"{flag}{name} must be in ({_num(low)}, 1], got {value}")
            raise UsageError(f"{flag}{name} must be > {_num(low)} and <= {_num(high)}, got {value}")
        if low is not None and value < low:
            raise UsageError(f"{flag}{name} must be >= {_num(low)}, got {value}")
        if high is not None and value > high:
            raise UsageError(f"{flag}{name} must be <= {_num(high)}, got {value}")


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


# An n-gram ban costs a pass over each row's tokens per n-gram token, at every step; NoRepeatNGram's usual
# sizes are 2 to 4. 32 leaves room for any real use.
MAX_NO_REPEAT_NGRAM = 32
# Hugging Face GenerationConfig names, with their bounds; `--num-beams` works too.
DECODING_OPTIONS: dict[str, DecodingOption] = {
    "num_beams": DecodingOption(
        int,
        1,
        "beams per prompt (1: greedy or sampling; beam search runs on Hugging Face's generate)",
        1,
        64,
    ),
    "max_new_tokens": DecodingOption(
        int, None, "new tokens per recipe (without a generation_config value: max_target_length)", 1, 65536
    ),
    "do_sample": DecodingOption(bool, False, "sample instead of the most likely token"),
    "temperature": DecodingOption(float, 1.0, "sampling temperature (with --do_sample)", 0.0, 100.0, True),
    "top_p": DecodingOption(
        float, 1.0, "nucleus sampling: keep the likeliest tokens up to this probability", 0.0, 1.0, True
    ),
    "top_k": DecodingOption(int, 50, "sampling: keep the k likeliest tokens", 1, 1_000_000),
    "no_repeat_ngram_size": DecodingOption(
        int, 0, "never repeat an n-gram of this size (0: off)", 0, MAX_NO_REPEAT_NGRAM
    ),
    "repetition_penalty": DecodingOption(
        float, 1.0, "penalise tokens already generated (1.0: off)", 0.0, 100.0, True
    ),
}
# Cache tokens decoded at once: rows x beams x (prompt + new tokens). FLAN-T5-XL keeps 192 KiB of cache per
# token (24 decoder layers x keys and values x 2048 x bf16): 32k tokens are 6 GiB. Without --max-batch-tokens:
# on a GPU what a share of its free memory holds, at most AUTO_BATCH_TOKENS_MAX; on the CPU the default.
DEFAULT_BATCH_TOKENS = 32768
AUTO_BATCH_TOKENS_MAX = 131072
AUTO_FREE_MEMORY_SHARE = 0.5  # the rest: the encoder's activations as prompts join, the logits, fragmentation


@dataclass(frozen=True)
class ModelDir:
    """A model directory to generate with: its tokenizer file and its prompt template."""

    path: Path
    template: PromptTemplate
    template_saved: bool  # False: a plain Hugging Face directory, prompted with the task preset

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"


def open_model_dir(model_dir: str | os.PathLike[str], task: str | None = None) -> ModelDir:
    """Check `model_dir` is a saved model and read its prompt template; a directory without one gets the
    `task` preset (ingredients-to-recipe by default), said in one log line. Raises ModelDirError."""
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise ModelDirError(f"{path}: no such model directory")
    model_file = "adapter_config.json" if is_adapter_dir(path) else "config.json"
    for name in (model_file, "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelDirError(f"{path}: not a model directory saved with save_pretrained (no {name})")
    template = load_prompt_template(path)
    if template is None:
        template = PromptTemplate.preset(task or DEFAULT_TASK)
        log.info(
            "%s has no %s: prompting with the %s preset %r",
            path,
            TEMPLATE_FILE,
            template.task,
            template.source_template,
        )
        return ModelDir(path, template, template_saved=False)
    if task is not None and task != template.task:
        log.warning(
            "--task %s ignored: the model was trained for %s (its %s)", task, template.task, TEMPLATE_FILE
        )
    return ModelDir(path, template, template_saved=True)


def load_for_generation(model_dir: ModelDir, device: str | None = None):
    """The model of `model_dir` for generation, loaded as training loads it (trainer.model.load.load_model:
    T5's norms and GELU fused, a LoRA checkpoint's adapter merged into the base it names), bf16 on a GPU
    (fp32 on the CPU, or on a GPU without bf16), SDPA attention, in eval mode with the KV cache on. Raises
    ModelDirError when the weights cannot be loaded."""
    # torch and transformers take seconds to import: loaded when a model is (`trainer --help` imports this
    # module for its parser)
    import torch
    from safetensors import SafetensorError

    from trainer.model.load import load_model

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = "bfloat16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    cfg = TrainConfig(
        model_name_or_path=str(model_dir.path),
        dtype=dtype,
        attn_implementation="sdpa",
        gradient_checkpointing=False,
    )
    try:
        model = load_model(cfg, dev)
    except (OSError, ValueError, SafetensorError) as e:  # unreadable or truncated weights, a bad config
        raise ModelDirError(f"{model_dir.path}: cannot load the model ({str(e).splitlines()[0]})") from None
    return prepare_for_generation(model)


def prepare_for_generation(model):
    """Eval mode, the KV cache on (training loads models with it off), and the decoder's self-attention
    projections packed for the decoding engine (trainer.model.t5_decoding.pack_self_attention)."""
    from trainer.model.t5_decoding import pack_self_attention, supports_static_decoding

    model.eval()
    model.config.use_cache = True
    if supports_static_decoding(model) is None:
        pack_self_attention(model)
    return model


def batch_token_budget(model, given: int | None) -> int:
    """`given` (--max-batch-tokens), or without one: on a GPU the cache tokens that AUTO_FREE_MEMORY_SHARE of
    its free memory holds (4,096 to AUTO_BATCH_TOKENS_MAX), on the CPU DEFAULT_BATCH_TOKENS."""
    import torch

    if given is not None:
        return given
    device = next(model.parameters()).device
    if device.type != "cuda":
        return DEFAULT_BATCH_TOKENS
    config = model.config
    element = next(model.parameters()).element_size()
    per_token = config.num_decoder_layers * 2 * config.num_heads * config.d_kv * element
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(AUTO_FREE_MEMORY_SHARE * free // per_token)
    return max(4096, min(AUTO_BATCH_TOKENS_MAX, budget))


def decoding_settings(model, template: PromptTemplate, given: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The keyword arguments for `model.generate` (the options given; the rest stays the model's
    generation_config) and a line saying every decoding value and where it came from."""
    config = model.generation_config
    kwargs = {k: v for k, v in given.items() if v is not None}
    if "max_new_tokens" not in kwargs and config.max_new_tokens is None:
        # HF's fallback is max_length=20 tokens: a recipe needs the length it was trained to write.
        kwargs["max_new_tokens"] = template.max_target_length
    said = []
    for name, option in DECODING_OPTIONS.items():
        hf_default = option.hf_default
        if name in given:
            value, source = given[name], "given"
        elif name in kwargs:
            value, source = kwargs[name], "training max_target_length"
        elif getattr(config, name, None) is not None:
            value, source = getattr(config, name), "generation_config"
        else:
            value, source = hf_default, "default"
        said.append(f"{name}={value} ({source})")
    return kwargs, "decoding: " + ", ".join(said)


def plan_batches(costs: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices of rows in batches, costliest first, each batch `rows x its costliest row <= max_batch_tokens`
    (a row over the budget alone gets its own batch)."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) + 1 <= max_batch_tokens // max(costs[batches[-1][0]], 1):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def generate_ids(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    on_batch: Callable[[int], None] | None = None,
    **generate_kwargs,
) -> list[list[int]]:
    """Generated ids (without the decoder start token, through `</s>`) for each prompt's ids, in input order.

    `generate_kwargs` take `model.generate`'s names. Greedy and sampled decoding run on the decoding engine
    (trainer.eval.decoding: static caches, CUDA graphs, continuous batching in as many rows as
    `max_batch_tokens` holds at (longest prompt + max_new_tokens) tokens a row). What only Hugging Face's
    `generate` does (beam search, constraints; sharded weights, `synced_gpus`) runs there, in batches sorted
    by length under the same budget (rows x beams x (prompt + new tokens)). `on_batch(rows)` after rows
    finish.
    """
    import torch

    from trainer.eval.decoding import Decoding, decode, static_decoding_reason

    decoding = static_decoding_reason(model, generate_kwargs)
    if isinstance(decoding, Decoding):
        with torch.no_grad():
            out, _ = decode(model, prompts, decoding, max_batch_tokens=max_batch_tokens, on_done=on_batch)
        return out
    log.info("decoding with Hugging Face's generate (%s)", decoding)
    return hf_generate_ids(model, prompts, pad_id, max_batch_tokens, on_batch, generate_kwargs)


def hf_generate_ids(model, prompts, pad_id, max_batch_tokens, on_batch, generate_kwargs) -> list[list[int]]:
    """`generate_ids` through Hugging Face's `model.generate`: prompts sorted by length, in batches with rows
    x beams x (prompt + max_new_tokens) under `max_batch_tokens`, each padded to its longest prompt."""
    import torch

    config = model.generation_config
    new_tokens = generate_kwargs.get("max_new_tokens") or config.max_new_tokens or config.max_length or 20
    beams = generate_kwargs.get("num_beams") or config.num_beams or 1
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    costs = [beams * (len(p) + new_tokens) for p in prompts]
    device = next(model.parameters()).device
    out: list[list[int]] = [[] for _ in prompts]
    # no_grad, not inference_mode: the training loop generates with FSDP2-sharded models, whose unsharding
    # fails under inference mode (pytorch/pytorch#197327).
    with torch.no_grad():
        for batch in plan_batches(costs, max_batch_tokens):
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(prompts[i])] = torch.as_tensor(prompts[i])
                mask[row, : len(prompts[i])] = 1
            seqs = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True, **generate_kwargs
            )
            for row, i in enumerate(batch):
                ids_i = seqs[row, 1:].tolist()
                end = next((k + 1 for k, t in enumerate(ids_i) if t in eos_ids), len(ids_i))
                out[i] = ids_i[:end]  # through the end-of-sequence token; the padding after it dropped
            if on_batch is not None:
                on_batch(len(batch))
    return out


class Progress:
    """Prompts done: a tqdm bar on a terminal, else a plain log line at most every 10 s."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self.done = total, what, 0
        self.started = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=what, unit="prompt", dynamic_ncols=True, file=sys.stderr)

    def __call__(self, rows: int) -> None:
        self.done += rows
        if self.bar is not None:
            self.bar.update(rows)
            return
        now = time.monotonic()
        if now - self.last >= 10 or self.done == self.total:
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            log.info(
                "%s: %d/%d prompts (%.0f%%), %.2f prompts/s",
                self.what,
                self.done,
                self.total,
                100 * self.done / self.total,
                rate,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def generate_rows(
    model,
    tokenizer_file: str | os.PathLike[str],
    template: PromptTemplate,
    records: Sequence[dict[str, Any]],
    decoding: dict[str, Any],
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    what: str = "generate",
) -> list[dict[str, Any]]:
    """One output row per record (as `RecipeRenderer` gives them, with ids): id, source, generated, new_tokens
    (how many it generated), the generated text read back into title / ingredients / directions by the target
    template (None where it does not follow it), and reference where the record has one. `decoding`:
    `model.generate` options."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.fspath(tokenizer_file))
    progress = Progress(len(records), what)
    try:
        ids = generate_ids(
            model,
            [r["source_ids"] for r in records],
            pad_id=model.config.pad_token_id or 0,
            max_batch_tokens=max_batch_tokens,
            on_batch=progress,
            **decoding,
        )
    finally:
        progress.close()
    texts = tok.decode_batch(ids, skip_special_tokens=True)
    rows = []
    for r, text, new in zip(records, texts, ids, strict=True):
        parsed = parse_recipe(text, template.target_template)
        fields = parsed.fields() if parsed else {"title": None, "ingredients": None, "directions": None}
        row = {"id": r["id"], "source": r["source"], "generated": text, "new_tokens": len(new), **fields}
        if r["reference"] is not None:
            row["reference"] = r["reference"]
        rows.append(row)
    return rows


# -- the command line ------------------------------------------------------------------------------------


class UsageError(ValueError):
    """A command-line value that cannot be used (one line, exit 2)."""


def strict_subparser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make a subcommand's bad or unknown options one line (`trainer generate: ...`) with exit 2, instead of
    argparse's usage block; the top-level parser would otherwise report unknown options itself."""
    name = parser.prog

    def error(message: str):
        print(f"{name}: {message} (see {name} --help)", file=sys.stderr)
        raise SystemExit(2)

    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        namespace, extra = parse_known(args, namespace)
        if extra:
            error(f"unknown option {' '.join(extra)}")
        return namespace, []

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    return parser


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_model_arguments(p: argparse.ArgumentParser, data_format: bool = True) -> None:
    """Options `trainer generate`, `evaluate` and `serve` share: the model, decoding and batching (and the
    input files' format, but for serve)."""
    p.add_argument(
        "--model",
        "--model_name_or_path",  # Hugging Face's and this trainer's config's name for it
        "--model-name-or-path",
        dest="model",
        required=True,
        help="model directory (final/ or a checkpoint of a run)",
    )
    p.add_argument(
        "--task", choices=TASKS, help=f"for a model without {TEMPLATE_FILE} (default: {DEFAULT_TASK})"
    )
    if data_format:
        p.add_argument(
            "--data-format",
            "--data_format",
            choices=DATA_FORMATS,
            help="input format, if not by the file extension",
        )
    p.add_argument("--device", help="cuda, cpu, cuda:1 ... (default: cuda when there is one)")
    p.add_argument(
        "--max-batch-tokens",
        "--max_batch_tokens",
        type=int,
        help="cache tokens decoded at once, rows x beams x (prompt + max_new_tokens) (default: what half the "
        f"GPU's free memory holds, at most {AUTO_BATCH_TOKENS_MAX:,}; {DEFAULT_BATCH_TOKENS:,} on the CPU)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="random seed of sampling (and of evaluate's --max-records draw)"
    )
    g = p.add_argument_group("decoding (Hugging Face names; default: the model's generation_config)")
    for name, option in DECODING_OPTIONS.items():
        kind, text = option.kind, option.help
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        if kind is bool:  # `--do_sample` alone, or `--do_sample false`, as HfArgumentParser reads it
            g.add_argument(
                *spellings, dest=name, type=_bool, nargs="?", const=True, metavar="BOOL", help=text
            )
        else:
            g.add_argument(*spellings, dest=name, type=kind, metavar=kind.__name__.upper(), help=text)


def check_decoding(given: dict[str, Any], flag: str = "--") -> None:
    """UsageError, naming the option as `{flag}{name}`, for a decoding value outside its bounds."""
    for name, value in given.items():
        if name in DECODING_OPTIONS:
            DECODING_OPTIONS[name].check(name, value, flag)


def decoding_given(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding options given on the command line, checked."""
    given = {name: getattr(args, name) for name in DECODING_OPTIONS if getattr(args, name) is not None}
    check_decoding(given)
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise UsageError(f"--max-batch-tokens must be >= 1, got {args.max_batch_tokens}")
    return given


def add_generate_parser(sub) -> None:
    """`trainer generate` on the CLI's subparsers."""
    p = sub.add_parser(
        "generate",
        help="generate recipes with a trained model",
        description="Generate recipes with a trained model, prompted as it was trained. Writes one JSON "
        "row per prompt: id, source, generated, title, ingredients, directions, and reference when the input "
        "has one. Greedy and sampled decoding run on the trainer's decoding engine (static caches, CUDA "
        "graphs, continuous batching); beam search runs on Hugging Face's generate.",
    )
    add_model_arguments(p)
    p.add_argument(
        "--input",
        nargs="+",
        action="extend",
        default=[],
        metavar="FILE",
        help="recipe files or globs (RecipeNLG/Food.com CSV, JSONL, Parquet, Arrow; .gz/.zst), save_to_disk "
        "directories or hf://datasets/OWNER/NAME; a record needs only the fields of the prompt",
    )
    p.add_argument("--ingredients", help='one prompt\'s ingredients, separated by ";": "2 eggs; 1 cup flour"')
    p.add_argument("--title", help="one prompt's title (title-to-recipe)")
    p.add_argument("--output", help="JSONL file to write (default: standard output)")
    p.set_defaults(run=run_generate)
    strict_subparser(p)


def split_ingredients(text: str) -> list[str]:
    """`--ingredients "2 eggs; 1 cup flour"` as items (the renderer joins them back with "; ")."""
    return [i.strip() for i in text.split(";") if i.strip()]


def prompt_fields(template: PromptTemplate) -> set[str]:
    """The record fields the model's prompt is rendered from ({"ingredients"}, {"title"}, ...)."""
    return {name for kind, name in template_parts(template.source_template) if kind == "field"}


def cli_record(
    renderer, template: PromptTemplate, title: str | None, ingredients: str | None, flag: str = "--"
) -> dict[str, Any]:
    """The prompt typed with --ingredients / --title (`serve`'s request: `flag` ""), rendered and tokenized
    as training did."""
    items = split_ingredients(ingredients or "")
    needs = prompt_fields(template)
    for name, value in (("ingredients", items), ("title", title)):
        if name in needs and not value:
            raise UsageError(f"the model's prompt {template.source_template!r} needs {flag}{name}")
    if not needs <= {"ingredients", "title"}:
        raise UsageError(
            f"the model's prompt {template.source_template!r} needs fields only recipe files can give"
        )
    return renderer.render(id="cli:1", title=title or "", ingredients=items)


def write_jsonl(rows: Sequence[dict[str, Any]], output: str | None) -> None:
    """Rows as JSON lines to `output` (written beside and renamed into place), or to standard output."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)


def read_records(
    renderer, paths: Sequence[str], data_format: str | None, columns: dict[str, str] | None = None, **split
) -> list[dict[str, Any]]:
    """The usable records of `paths` through the loader's renderer (fields in `columns`, as the training read
    them), skips said in one warning. A Hugging Face dataset (hf://datasets/OWNER/NAME, a save_to_disk
    directory) is read from its Parquet copy, as train_files reads it."""
    files, _ = resolve_sources(list(paths))
    records, skipped, examples = renderer.read(files, data_format=data_format, columns=columns, **split)
    stats = {"skipped": skipped, "examples": examples}
    if line := skipped_summary(stats, len(records), training=False):
        log.warning("data: %s", line)
    log.info("data: %d records from %s", len(records), ", ".join(paths))
    return records


def run_generate(args: argparse.Namespace) -> int:
    """`trainer generate`; a value or model directory it cannot use raises UsageError or ModelDirError, which
    the CLI prints as one line (exit 2)."""
    import torch

    given = decoding_given(args)
    if args.ingredients is not None and not split_ingredients(args.ingredients):
        raise UsageError(
            '--ingredients is empty: give ingredients separated by ";", '
            'e.g. --ingredients "2 eggs; 1 cup flour"'
        )
    if args.title is not None and not args.title.strip():
        raise UsageError("--title is empty")
    if not args.input and args.ingredients is None and args.title is None:
        raise UsageError("give --input FILE ..., or --ingredients (and/or --title) for one prompt")
    if args.input and (args.ingredients is not None or args.title is not None):
        raise UsageError("give --input or --ingredients/--title, not both")
    model_dir = open_model_dir(args.model, args.task)
    renderer = model_dir.template.renderer(model_dir.tokenizer_file)
    if args.input:
        records = read_records(renderer, args.input, args.data_format, model_dir.template.columns)
    else:
        records = [cli_record(renderer, model_dir.template, args.title, args.ingredients)]
    model = load_for_generation(model_dir, args.device)
    decoding, said = decoding_settings(model, model_dir.template, given)
    log.info("%s", said)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    rows = generate_rows(
        model,
        model_dir.tokenizer_file,
        model_dir.template,
        records,
        decoding,
        batch_token_budget(model, args.max_batch_tokens),
    )
    log.info("generated %d recipes in %.1f s", len(rows), time.monotonic() - started)
    write_jsonl(rows, args.output)
    if args.output:
        log.info("wrote %s", args.output)
    return 0

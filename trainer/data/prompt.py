"""The prompt template that travels with a model, and reading generated recipes back with it.

Training renders each recipe into a source (the prompt) and a target with templates (trainer/data/loader.py).
The model only works when prompted exactly as it was trained, so `save_prompt_template(model_dir, cfg)` writes
the resolved templates (presets expanded), the training lengths and data hints to `recipe_template.json`
beside config.json, and `load_prompt_template(model_dir)` reads them back: a model directory copied alone is
enough to generate with. Prompts are rendered by the training loader's own Rust renderer
(`PromptTemplate.renderer()`), so they are byte-identical to the training sources, and tokenized with its
tokenizer and truncation.

`parse_recipe(text, template)` reads a generated text back into its fields by the template's literal
separators: ingredients split at "; ", directions at their numbers "1. ... 2. ...".
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer._loader import RecipeRenderer
from trainer.infra.disk import write_text_atomic

if TYPE_CHECKING:
    from trainer.config import TrainConfig

__all__ = [
    "TEMPLATE_FILE",
    "ModelDirError",
    "ParsedRecipe",
    "PromptTemplate",
    "load_prompt_template",
    "parse_recipe",
    "save_prompt_template",
]

TEMPLATE_FILE = "recipe_template.json"
FORMAT_VERSION = 1
DEFAULT_TASK = "ingredients-to-recipe"


class ModelDirError(ValueError):
    """A model directory that cannot be used: missing, not a model, or with a broken template file."""


@dataclass(frozen=True)
class PromptTemplate:
    """How a model's training data was rendered: everything needed to prompt it the same way."""

    task: str
    source_template: str
    target_template: str
    max_source_length: int = 512
    max_target_length: int = 512
    data_format: str | None = None
    eval_fraction: float = 0.0
    columns: dict[str, str] | None = None  # the column each field is in, as the training read the files

    @classmethod
    def preset(cls, task: str = DEFAULT_TASK, **lengths: int) -> PromptTemplate:
        """The templates of a preset task, resolved by the loader's renderer."""
        r = RecipeRenderer(task=task)
        return cls(task, r.source_template, r.target_template, **lengths)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> PromptTemplate:
        """The template a training config renders with, presets expanded by the loader's renderer (a bad
        template raises RecipeDataError, as the loader would)."""
        r = RecipeRenderer(
            task=cfg.task, source_template=cfg.source_template, target_template=cfg.target_template
        )
        return cls(
            task=cfg.task,
            source_template=r.source_template,
            target_template=r.target_template,
            max_source_length=cfg.max_source_length,
            max_target_length=cfg.max_target_length,
            data_format=cfg.data_format,
            eval_fraction=cfg.eval_fraction,
            columns=cfg.columns,
        )

    def renderer(self, tokenizer: str | os.PathLike[str] | None = None) -> RecipeRenderer:
        """The training loader's renderer for these templates; with `tokenizer` (a tokenizer.json or a model
        directory) it also gives token ids, truncated to the training lengths."""
        return RecipeRenderer(
            task=self.task,
            source_template=self.source_template,
            target_template=self.target_template,
            tokenizer=None if tokenizer is None else os.fspath(tokenizer),
            max_source_length=self.max_source_length,
            max_target_length=self.max_target_length,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}


def save_prompt_template(model_dir: str | os.PathLike[str], cfg: TrainConfig) -> Path:
    """Write `recipe_template.json` for a model trained with `cfg` into `model_dir` (final/ or a checkpoint);
    returns its path. The templates are resolved through the renderer, so a bad template fails here too."""
    template = PromptTemplate.from_config(cfg)
    path = Path(model_dir) / TEMPLATE_FILE
    write_text_atomic(path, json.dumps(template.to_dict(), indent=2) + "\n")
    return path


def load_prompt_template(model_dir: str | os.PathLike[str]) -> PromptTemplate | None:
    """The template saved with the model in `model_dir`, or None when it has none (a plain Hugging Face model
    directory). Raises ModelDirError for a file that cannot be read or used."""
    path = Path(model_dir) / TEMPLATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path}: cannot read the prompt template ({e})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get("format_version") != FORMAT_VERSION:
        raise ModelDirError(
            f"{path}: format_version {data.get('format_version')!r}, this trainer reads {FORMAT_VERSION}"
        )
    fields = {f.name: f for f in dataclasses.fields(PromptTemplate)}
    values = {k: v for k, v in data.items() if k in fields}
    try:
        template = PromptTemplate(**values)
        template.renderer()  # the templates must parse, as the loader parses them
    except (TypeError, ValueError) as e:
        raise ModelDirError(f"{path}: not a usable prompt template ({e})") from None
    return template


# -- reading a generated recipe back ---------------------------------------------------------------------

# Placeholder -> field; the loader accepts {NER} for {ner}.
_FIELD_NAMES = {
    "title": "title",
    "ingredients": "ingredients",
    "directions": "directions",
    "ner": "ner",
    "NER": "ner",
}


def template_parts(template: str) -> list[tuple[str, str]]:
    """A template as ("lit", text) and ("field", name) parts, by the loader's rules ({{ and }}: braces)."""
    parts: list[tuple[str, str]] = []
    lit, i = "", 0
    while i < len(template):
        c = template[i]
        if c in "{}" and template[i : i + 2] in ("{{", "}}"):
            lit, i = lit + c, i + 2
        elif c == "{":
            end = template.index("}", i)  # the renderer has validated the template
            if lit:
                parts.append(("lit", lit))
                lit = ""
            parts.append(("field", _FIELD_NAMES[template[i + 1 : end]]))
            i = end + 1
        else:
            lit, i = lit + c, i + 1
    if lit:
        parts.append(("lit", lit))
    return parts


@dataclass
class ParsedRecipe:
    """A recipe read back from text by a template; fields the template does not use stay None."""

    title: str | None = None
    ingredients: list[str] | None = None
    directions: list[str] | None = None
    ner: list[str] | None = None
    directions_numbered: bool = False

    def fields(self) -> dict[str, Any]:
        """The fields the template had, for a JSON row."""
        out = {"title": self.title, "ingredients": self.ingredients, "directions": self.directions}
        if self.ner is not None:
            out["ner"] = self.ner
        return out


def _literal_pattern(text: str) -> str:
    # A decoded text may differ from the rendered one in whitespace (T5 collapses runs of spaces).
    return r"\s*".join(re.escape(w) for w in text.split()) if text.strip() else r"\s*"


def _split_steps(text: str) -> tuple[list[str], bool]:
    """Directions "1. Mix. 2. Bake." as steps, and whether they were numbered from 1 in order."""
    text = text.strip()
    first = re.match(r"1\.\s+", text)
    if not first:
        return ([text] if text else []), False
    steps, pos, k = [], first.end(), 2
    while nxt := re.compile(rf"\s{k}\.\s+").search(text, pos):
        steps.append(text[pos : nxt.start()].strip())
        pos, k = nxt.end(), k + 1
    steps.append(text[pos:].strip())
    return [s for s in steps if s], True


def parse_recipe(text: str, template: str) -> ParsedRecipe | None:
    """Read `text` back into the fields of `template` (a source or target template), or None when it does not
    follow the template's literal parts in order."""
    parts = template_parts(template)
    fields = [name for kind, name in parts if kind == "field"]
    if not fields:
        return None
    pattern, seen = "", 0
    for kind, value in parts:
        if kind == "lit":
            pattern += _literal_pattern(value)
        else:
            seen += 1
            lazy = "" if seen == len(fields) else "?"  # the last field takes the rest
            pattern += rf"\s*(?P<{value}_{seen}>.*{lazy})\s*"
    m = re.fullmatch(pattern, text.strip(), flags=re.DOTALL)
    if m is None:
        return None
    out = ParsedRecipe()
    for k, name in enumerate(fields, start=1):
        value = m.group(f"{name}_{k}").strip()
        if name == "title":
            out.title = value
        elif name == "ingredients":
            out.ingredients = [i.strip() for i in value.split(";") if i.strip()]
        elif name == "directions":
            out.directions, out.directions_numbered = _split_steps(value)
        else:
            out.ner = [i.strip() for i in value.split(",") if i.strip()]
    return out

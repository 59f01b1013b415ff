"""The prompt template travels with the model, and generation renders prompts as the training loader does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer import _loader
from trainer.config import TrainConfig
from trainer.data.loader import RecipeDataError, RecipeFileError, RecipeStream
from trainer.data.prompt import (
    TEMPLATE_FILE,
    ModelDirError,
    PromptTemplate,
    load_prompt_template,
    save_prompt_template,
)


def loader_rows(paths, tokenizer, **kw) -> list[tuple[list[int], list[int]]]:
    """(input ids, label ids) of every record, in file order, as the training loader batches them."""
    rows = []
    for b in RecipeStream(paths, tokenizer, batch_size=1, **kw):
        rows.append((b["input_ids"][0][b["attention_mask"][0] == 1].tolist(), b["labels"][0].tolist()))
    return rows


@pytest.mark.parametrize("fixture", ["sample_csv", "sample_foodcom", "sample_jsonl"])
def test_prompt_ids_are_the_training_loaders(request, tiny_model_dir: Path, fixture: str) -> None:
    path = request.getfixturevalue(fixture)
    lengths = {"max_source_length": 48, "max_target_length": 96}  # truncation is part of what must agree
    template = PromptTemplate.preset("ingredients-to-recipe", **lengths)
    records, skipped, _ = template.renderer(tiny_model_dir).read([str(path)])
    want = loader_rows(path, tiny_model_dir, **lengths)
    assert skipped == {} and len(records) == len(want) > 100
    for r, (source_ids, target_ids) in zip(records, want, strict=True):
        assert (r["source_ids"], r["target_ids"]) == (source_ids, target_ids), r["id"]
    first_line = 1 if fixture == "sample_jsonl" else 2  # CSV: after the header
    assert records[0]["id"] == f"{path}:{first_line}"


def test_custom_templates_and_the_eval_split_are_the_loaders(
    tmp_path: Path, tiny_model_dir, sample_csv
) -> None:
    cfg = TrainConfig(
        train_files=[str(sample_csv)],
        model_name_or_path=str(tiny_model_dir),
        source_template="Ingredients: {ingredients}. Title: {title}. Recipe:",
        target_template="{directions}",
        max_source_length=64,
        max_target_length=64,
        eval_fraction=0.1,
    )
    save_prompt_template(tmp_path, cfg)
    template = load_prompt_template(tmp_path)
    assert template is not None
    assert (template.source_template, template.target_template) == (cfg.source_template, cfg.target_template)
    assert template.eval_fraction == 0.1
    records, _, _ = template.renderer(tiny_model_dir).read([str(sample_csv)], split="eval", eval_fraction=0.1)
    want = loader_rows(
        sample_csv,
        tiny_model_dir,
        source_template=cfg.source_template,
        target_template=cfg.target_template,
        max_source_length=64,
        max_target_length=64,
        split="eval",
        eval_fraction=0.1,
    )
    assert 20 < len(records) == len(want) < 100
    assert [(r["source_ids"], r["target_ids"]) for r in records] == want
    assert records[0]["source"].startswith("Ingredients: ") and records[0]["source"].endswith(". Recipe:")


def test_template_file_is_resolved_and_validated(tmp_path: Path) -> None:
    cfg = TrainConfig(task="title-to-recipe", max_source_length=64, max_target_length=256, eval_fraction=0.02)
    path = save_prompt_template(tmp_path, cfg)
    saved = json.loads(path.read_text())
    # Presets are written out: the directory does not depend on this trainer's presets.
    assert saved == {
        "format_version": 1,
        "task": "title-to-recipe",
        "source_template": "Write a recipe for: {title}",
        "target_template": "title: {title} | ingredients: {ingredients} | directions: {directions}",
        "max_source_length": 64,
        "max_target_length": 256,
        "data_format": None,
        "eval_fraction": 0.02,
        "columns": None,
    }
    assert load_prompt_template(tmp_path / "nowhere") is None
    for text, reason in [
        ("{not json", "cannot read"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({**saved, "format_version": 7}), "format_version 7"),
        (json.dumps({**saved, "source_template": "{titel}"}), "{titel}"),
    ]:
        path.write_text(text)
        with pytest.raises(ModelDirError, match=reason.replace("{", r"\{")) as e:
            load_prompt_template(tmp_path)
        assert str(tmp_path / TEMPLATE_FILE) in str(e.value)


def test_records_without_directions_are_prompts(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"ingredients": ["2 eggs", "1 cup flour"]})
        + "\n"
        + json.dumps({"title": "Soup"})
        + "\n"
        + json.dumps({"title": "Pie", "ingredients": ["1 egg"], "directions": ["Mix.", "Bake."]})
        + "\n"
    )
    records, skipped, examples = PromptTemplate.preset().renderer(tiny_model_dir).read([str(path)])
    assert [r["id"] for r in records] == [f"{path}:1", f"{path}:3"]
    assert records[0]["source"] == "Write a recipe with these ingredients: 2 eggs; 1 cup flour"
    assert records[0]["reference"] is None and records[0]["target_ids"] is None
    assert records[1]["reference"] == "title: Pie | ingredients: 1 egg | directions: 1. Mix. 2. Bake."
    assert skipped == {"missing_field": 1} and examples[0].startswith(f"{path}:2: missing_field")


def test_errors_are_the_loaders_exception_types(tmp_path: Path, tiny_model_dir: Path) -> None:
    renderer = PromptTemplate.preset().renderer(tiny_model_dir)
    with pytest.raises(RecipeFileError, match="no such file"):
        renderer.read([str(tmp_path / "missing.csv")])
    (tmp_path / "bad.jsonl").write_text('{"title": "only a title"}\n')
    with pytest.raises(RecipeDataError, match="no usable records"):
        renderer.read([str(tmp_path / "bad.jsonl")])
    with pytest.raises(RecipeDataError, match="unknown data_format"):
        renderer.read([str(tmp_path / "bad.jsonl")], data_format="xml")
    with pytest.raises(RecipeDataError, match="empty_ingredients"):
        renderer.render(title="Pie")
    with pytest.raises(RecipeDataError, match="unknown placeholder"):
        _loader.RecipeRenderer(source_template="{titel}")

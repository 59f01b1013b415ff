"""`trainer generate` and `trainer evaluate` on the tiny model: prompts as in training, rows in input order,
one-line errors, the eval loss of the training loop, and a model card whose snippet runs."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from tokenizers import Tokenizer
from transformers import AutoModelForSeq2SeqLM

from trainer.checkpoint.model_card import ModelCardInfo, write_model_card
from trainer.cli import main
from trainer.config import TrainConfig
from trainer.data.loader import RecipeStream
from trainer.data.prompt import TEMPLATE_FILE, PromptTemplate, save_prompt_template
from trainer.eval.evaluate import eval_loss, record_batches, sample_records
from trainer.eval.generate import generate_ids, plan_batches
from trainer.model.loss import token_loss_sum

LENGTHS = {"max_source_length": 64, "max_target_length": 96}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model as a run's final/: weights, tokenizer and the prompt template of its config."""
    out = tmp_path_factory.mktemp("run") / "final"
    shutil.copytree(tiny_model_dir, out)
    save_prompt_template(out, TrainConfig(eval_fraction=0.1, **LENGTHS))
    return out


@pytest.fixture
def cli(capfd, caplog):
    """Runs `trainer ARGS...` in this process: (exit code, stdout, stderr and the log lines)."""
    caplog.set_level(logging.INFO)

    def run(*argv: str) -> tuple[int, str, str]:
        caplog.clear()
        code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err + caplog.text

    return run


def test_plan_batches_keeps_every_row_once_under_the_budget() -> None:
    costs = [30, 10, 50, 20, 40, 200, 10]
    batches = plan_batches(costs, max_batch_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(len(costs)))
    assert batches[0] == [5]  # over the budget alone: its own batch, first (the costliest fails first)
    for b in batches[1:]:
        assert len(b) * max(costs[i] for i in b) <= 100
    assert [costs[b[0]] for b in batches] == sorted((costs[b[0]] for b in batches), reverse=True)


def test_generate_ids_come_back_in_input_order(model_dir: Path) -> None:
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    renderer = PromptTemplate.preset(**LENGTHS).renderer(model_dir)
    prompts = [
        renderer.render(ingredients=items)["source_ids"]
        for items in (["1 egg"], ["2 cups flour", "1 cup milk", "3 eggs", "salt"], ["butter", "sugar"])
    ]
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    # A budget of one row per batch: no padding, so each output is exactly the prompt's own.
    got = generate_ids(model, prompts, max_batch_tokens=1, **kwargs)
    for p, ids in zip(prompts, got, strict=True):
        alone = model.generate(input_ids=torch.tensor([p]), **kwargs)[0, 1:].tolist()
        assert ids == alone
    assert len(generate_ids(model, prompts, max_batch_tokens=10_000, **kwargs)) == 3


def test_generate_from_a_file_renders_what_training_tokenized(model_dir, sample_jsonl, tmp_path, cli) -> None:
    out = tmp_path / "recipes.jsonl"
    code, stdout, err = cli(
        "generate", "--model", str(model_dir), "--input", str(sample_jsonl), "--output", str(out),
        "--max-new-tokens", "4", "--num_beams", "2",
    )  # fmt: skip
    assert code == 0, err
    assert stdout == ""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert "num_beams=2 (given)" in err and "no_repeat_ngram_size=3 (generation_config)" in err
    # The prompt of each row is the source the training loader tokenized for that record, in file order.
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_truncation(LENGTHS["max_source_length"])
    trained = [
        b["input_ids"][0][b["attention_mask"][0] == 1].tolist()
        for b in RecipeStream(sample_jsonl, model_dir, batch_size=1, **LENGTHS)
    ]
    assert len(rows) == len(trained) == 300
    assert [tok.encode(r["source"]).ids for r in rows] == trained
    assert [r["id"] for r in rows[:2]] == [f"{sample_jsonl}:1", f"{sample_jsonl}:2"]
    for r in rows:
        fields = {"id", "source", "generated", "new_tokens", "reference"}
        assert set(r) == fields | {"title", "ingredients", "directions"}
        assert 0 < r["new_tokens"] <= 4  # --max-new-tokens
        assert r["reference"].startswith("title: ")


def test_generate_one_prompt_to_stdout(model_dir: Path, tmp_path: Path, cli) -> None:
    code, stdout, err = cli(  # the model under Hugging Face's name for it
        "generate", "--model_name_or_path", str(model_dir), "--ingredients", "2 eggs; 1 cup flour ;",
        "--max_new_tokens", "5", "--do_sample", "--top_p", "0.9",
    )  # fmt: skip
    assert code == 0, err
    (row,) = [json.loads(line) for line in stdout.splitlines()]  # stdout is the JSONL alone; logs are stderr
    assert row["id"] == "cli:1"
    assert row["source"] == "Write a recipe with these ingredients: 2 eggs; 1 cup flour"
    assert "reference" not in row
    assert "do_sample=True (given)" in err and "top_p=0.9 (given)" in err


def test_a_plain_model_directory_uses_the_task_preset(tiny_model_dir: Path, cli) -> None:
    code, stdout, err = cli(
        "generate", "--model", str(tiny_model_dir), "--task", "title-to-recipe", "--title", "Lemon Pie",
        "--max_new_tokens", "3",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(stdout)["source"] == "Write a recipe for: Lemon Pie"
    said = [line for line in err.splitlines() if TEMPLATE_FILE in line]
    assert len(said) == 1 and "title-to-recipe preset" in said[0]
    # The preset without a title to fill it is a usage error.
    code, _, err = cli("generate", "--model", str(tiny_model_dir), "--task", "title-to-recipe",
                           "--ingredients", "1 egg")  # fmt: skip
    assert code == 2 and "needs --title" in err


def test_a_model_directory_copied_alone_is_enough(model_dir: Path, tmp_path: Path, cli) -> None:
    custom = tmp_path / "custom"
    shutil.copytree(model_dir, custom)
    save_prompt_template(custom, TrainConfig(source_template="Cook with {ingredients} please", **LENGTHS))
    moved = tmp_path / "elsewhere" / "model"
    shutil.move(custom, moved)
    code, stdout, err = cli("generate", "--model", str(moved), "--ingredients", "rice; beans",
                                "--max_new_tokens", "2")  # fmt: skip
    assert code == 0, err
    assert json.loads(stdout)["source"] == "Cook with rice; beans please"
    assert TEMPLATE_FILE not in err  # the saved template was used, no preset announced


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ingredients", " ; ;"], "--ingredients is empty"),
        (["--ingredients", "1 egg", "--beams", "4"], "unknown option --beams 4"),
        (["--ingredients", "1 egg", "--num_beams", "0"], "--num_beams must be >= 1"),
        (["--ingredients", "1 egg", "--temperature", "warm"], "invalid float value: 'warm'"),
        (["--ingredients", "1 egg", "--input", "x.csv"], "not both"),
        ([], "give --input"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(model_dir: Path, capfd, args, message) -> None:
    with pytest.raises(SystemExit) as e:  # argparse's own errors exit; ours return 2
        sys.exit(main(["generate", "--model", str(model_dir), *args]))
    _, err = capfd.readouterr()
    assert e.value.code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert lines[0].startswith("trainer generate: ")


def test_missing_or_broken_model_directory(model_dir: Path, tmp_path: Path, cli) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    bad_template = tmp_path / "bad_template"
    shutil.copytree(model_dir, bad_template)
    (bad_template / TEMPLATE_FILE).write_text("{")
    for path, message in [
        (tmp_path / "nope", "no such model directory"),
        (no_tokenizer, "no tokenizer.json"),
        (bad_template, "cannot read the prompt template"),
        (broken, "cannot load the model"),
    ]:
        code, _, err = cli("generate", "--model", str(path), "--ingredients", "1 egg")
        lines = [line for line in err.splitlines() if line.startswith("trainer generate: ")]
        assert code == 2 and len(lines) == 1 and message in lines[0] and str(path) in lines[0], err
        assert "Traceback" not in err


def test_bad_input_file_is_the_data_error_line(model_dir: Path, tmp_path: Path, cli) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no ingredients"}\n')
    code, _, err = cli("generate", "--model", str(model_dir), "--input", str(bad))
    assert code == 2
    assert f"trainer: data error: {bad}: no usable records" in err and "missing_field: 1" in err


def test_eval_loss_is_the_training_loops(model_dir: Path, sample_csv: Path) -> None:
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    records, _, _ = PromptTemplate.preset(**LENGTHS).renderer(model_dir).read([str(sample_csv)])
    records = records[:40]
    with torch.no_grad():
        total, tokens = 0.0, 0
        for i, b in enumerate(RecipeStream(sample_csv, model_dir, batch_size=8, **LENGTHS)):
            if i == 5:
                break
            batch = {k: torch.as_tensor(v) for k, v in b.items()}
            total += float(token_loss_sum(model, batch))
            tokens += int((batch["labels"] != -100).sum())
    # Other batching (by length, a small budget), the same token mean.
    batches = record_batches(records, max_batch_tokens=600)
    assert eval_loss(model, batches, torch.device("cpu")) == pytest.approx(total / tokens, rel=1e-5)
    assert math.log(model.config.vocab_size) / 2 < total / tokens < 2 * math.log(model.config.vocab_size)


def test_sample_records_is_seeded_and_keeps_file_order() -> None:
    records = [{"id": i} for i in range(100)]
    a, b = sample_records(records, 10, seed=3), sample_records(records, 10, seed=3)
    assert a == b and len(a) == 10 and [r["id"] for r in a] == sorted(r["id"] for r in a)
    assert sample_records(records, 10, seed=4) != a
    assert sample_records(records, 500, seed=3) == records


def test_evaluate_prints_a_table_and_writes_the_report(model_dir, sample_csv, tmp_path, cli) -> None:
    report = tmp_path / "report.json"
    args = ["evaluate", "--model", str(model_dir), "--data", str(sample_csv), "--max_new_tokens", "8"]
    code, stdout, err = cli(*args, "--split", "eval", "--max-records", "12", "--output", str(report),
                                )  # fmt: skip
    assert code == 0, err
    for label in ("eval loss", "ROUGE-L", "BLEU", "chrF", "ingredient coverage", "structure ok", "records"):
        assert label in stdout, stdout
    data = json.loads(report.read_text())
    held_out = RecipeStream(sample_csv, model_dir, batch_size=1, split="eval", eval_fraction=0.1, **LENGTHS)
    assert held_out.stats()["records"] > 12 and data["records"] == 12
    metrics = data["metrics"]
    assert {"loss", "rouge1", "rouge2", "rougeL", "bleu", "chrf", "ingredient_coverage", "structure"} <= set(
        metrics
    )
    assert all(math.isfinite(v) for v in metrics.values())
    assert len(data["generations"]) == 12 and data["template"]["eval_fraction"] == 0.1
    # The same 12 records every time.
    code, stdout2, _ = cli(*args, "--split", "eval", "--max-records", "12")
    assert code == 0 and re.sub(r"\s+", " ", stdout2) == re.sub(r"\s+", " ", stdout)


def test_model_card_snippet_runs_with_the_exact_prompt(model_dir: Path, tmp_path: Path) -> None:
    template = PromptTemplate.preset(**LENGTHS)
    info = ModelCardInfo(
        model_path=str(model_dir),
        base_model="google/flan-t5-xl",
        template=template,
        train_files=["data/recipes.csv"],
        train_records=1960,
        eval_records=40,
        skipped_records=3,
        steps=250,
        tokens=1_234_567,
        wall_time_s=95.0,
        hardware="CPU",
        metrics={"eval/loss": 2.05, "eval/rougeL": 31.2, "eval/gen_len": 87.5, "eval/scoring_runtime": 0.4}
        | {"eval/runtime": 12.5, "eval/generation_runtime": 9.1},
        last_eval_step=250,
    )
    card = write_model_card(model_dir, info).read_text()
    assert card.startswith("---\nbase_model: google/flan-t5-xl\n")
    # The metadata, read back by huggingface_hub: the weights' evaluation as model-index, its scores only.
    metadata = ModelCard(card).data
    assert metadata.pipeline_tag == "text2text-generation" and metadata.datasets is None  # a local file
    assert {(r.metric_type, r.metric_value) for r in metadata.eval_results} == {
        ("loss", 2.05),
        ("rougeL", 31.2),
    }
    assert (
        f"trainer generate --model {model_dir} --ingredients '2 eggs; 1 cup flour; 1 cup milk; 1 lemon'"
        in card
    )
    assert "| records | 1,960 trained on, 40 held out, 3 of 2,003 skipped |" in card
    assert "| `eval/rougeL` | 31.2 |" in card and "| wall time | 1 min 35 s |" in card
    assert r"`title: {title} \| ingredients: {ingredients} \| directions: {directions}`" in card
    snippet = card.split("```python\n")[1].split("```")[0]
    prompt = template.renderer().render(ingredients=["2 eggs", "1 cup flour", "1 cup milk", "1 lemon"])[
        "source"
    ]
    assert f"prompt = {prompt!r}" in snippet
    snippet = snippet.replace(f"max_new_tokens={LENGTHS['max_target_length']}", "max_new_tokens=4")
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_a_saved_model_says_its_head_is_its_own_and_loads_without_a_tie_warning(
    tiny_model_dir: Path, sample_csv: Path, tmp_path: Path
) -> None:
    from trainer.checkpoint.store import save_pretrained

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir)
    saved = tmp_path / "final"  # as a run writes its checkpoints and final/
    save_pretrained(model, saved)
    shutil.copy(tiny_model_dir / "tokenizer.json", saved)
    # FLAN-T5's LM head is its own: the config says so (transformers 4 would otherwise tie it to the
    # embedding), and the head is the trained one.
    config = json.loads((saved / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "scale_decoder_outputs" not in config
    loaded = AutoModelForSeq2SeqLM.from_pretrained(saved)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.shared.weight)
    for args in (
        ["generate", "--model", str(saved), "--ingredients", "1 egg", "--max_new_tokens", "3"],
        [
            "evaluate",
            "--model",
            str(saved),
            "--data",
            str(sample_csv),
            "--max-records",
            "4",
            "--max_new_tokens",
            "3",
        ],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "trainer", *args], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "tied weights" not in done.stderr and "tie_word_embeddings" not in done.stderr, done.stderr

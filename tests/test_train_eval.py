"""Evaluation during training on the tiny model: generation metrics every eval_steps, the best checkpoint kept
and put in final/, early stopping, eval_files, and checkpoints that generate on their own."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from tiny_run import tiny_run_values

from trainer.cli import main
from trainer.config import ConfigError, TrainConfig
from trainer.data.prompt import TEMPLATE_FILE
from trainer.report.step_meter import SUMMARY, TRAIN_LOG
from trainer.run.train import train


def _cfg(tiny_model_dir, sample_csv, out, **kw) -> TrainConfig:
    values = dict(
        per_device_train_batch_size=8,
        eval_fraction=0.05,
        eval_max_batches=2,
        warmup_steps=2,
        max_steps=8,
        eval_steps=2,
        save_steps=2,
        eval_generation_records=6,
        num_eval_generations=1,
        generation_max_new_tokens=8,
    )
    return TrainConfig.from_dict(tiny_run_values(tiny_model_dir, sample_csv, out, **values | kw))


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]


def test_final_is_the_best_checkpoint_kept_through_rotation_and_every_model_generates(
    tiny_model_dir, sample_csv, tmp_path, capsys
):
    out = tmp_path / "out"
    # The loss falls as the tiny model trains, so "greater is better" makes the first evaluation the best:
    # a best that is neither the last step nor among the newest save_total_limit checkpoints.
    cfg = _cfg(
        tiny_model_dir,
        sample_csv,
        out,
        save_total_limit=1,
        metric_for_best_model="loss",
        greater_is_better=True,
        load_best_model_at_end=True,
    )
    assert train(cfg) == 0

    # Every eval_steps, a train-log row with the eval loss and the generation metrics, under HF's names.
    evals = [r for r in _rows(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6, 8]
    for row in evals:
        assert {"eval_rougeL", "eval_bleu", "eval_chrf", "eval_ingredient_coverage", "eval_structure"} <= set(
            row
        )
        assert "time" in row and "loss" not in row
    best = max(evals, key=lambda r: r["eval_loss"])["step"]
    assert best == 2

    # The best checkpoint survives save_total_limit; final/ holds its weights, and the summary says so.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-8"]
    weights = (out / "final" / "model.safetensors").read_bytes()
    assert weights == (out / "checkpoint-2" / "model.safetensors").read_bytes()
    assert weights != (out / "checkpoint-8" / "model.safetensors").read_bytes()
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["best_global_step"] == 2 and summary["final_model_step"] == 2
    assert summary["metric_for_best_model"] == "eval_loss" and summary["best_metric"] == evals[0]["eval_loss"]

    # trainer_state.json speaks Hugging Face's TrainerState too: what its scripts and tools read.
    from transformers import TrainerState

    saved = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    hf_keys = {f.name for f in dataclasses.fields(TrainerState)} & saved.keys()
    assert {"global_step", "epoch", "log_history", "best_metric", "best_model_checkpoint"} <= hf_keys
    hf_state = TrainerState(**{k: saved[k] for k in hf_keys})
    # the log as it was when the checkpoint was taken: every step (the evaluation at 8 runs beside the write)
    history = hf_state.log_history
    assert hf_state.global_step == 8 and history == _rows(out)[: len(history)]
    assert [r["step"] for r in history if "loss" in r] == list(range(1, 9))
    assert hf_state.best_model_checkpoint == str(out / "checkpoint-2")
    assert hf_state.best_metric == evals[0]["eval_loss"] and hf_state.best_global_step == 2
    early = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [r["step"] for r in early["log_history"]] == [1, 2, 2]  # two steps and the evaluation at 2

    # The model card says whose weights these are, with the evaluation's metrics.
    card = (out / "final" / "README.md").read_text()
    assert "weights of step 2 of 8, the best evaluation by `eval_loss`" in card
    assert "| `eval/rougeL` |" in card and f"trainer generate --model {out / 'final'}" in card

    # Every checkpoint and final/ carry the prompt template: each generates on its own, prompted as trained.
    for model in (out / "final", out / "checkpoint-2", out / "checkpoint-8"):
        assert json.loads((model / TEMPLATE_FILE).read_text())["max_source_length"] == 64
        capsys.readouterr()
        args = [
            "generate",
            "--model",
            str(model),
            "--ingredients",
            "2 eggs; 1 cup flour",
            "--max_new_tokens",
            "4",
        ]
        assert main(args) == 0
        (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert row["source"] == "Write a recipe with these ingredients: 2 eggs; 1 cup flour"


def test_early_stopping_ends_the_run_and_a_rerun_keeps_it_finished(
    tiny_model_dir, sample_csv, tmp_path, caplog
):
    out = tmp_path / "out"
    # Greater is better on a falling loss: the second evaluation is no improvement; patience 1 stops there.
    cfg = _cfg(
        tiny_model_dir,
        sample_csv,
        out,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        early_stopping_patience=1,
    )
    caplog.set_level(logging.INFO)
    assert train(cfg) == 0
    assert max(r["step"] for r in _rows(out)) == 4
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["steps"] == 4 and summary["stopped_by"] == "early_stopping"
    assert summary["best_global_step"] == 2 and summary["final_model_step"] == 4  # not load_best_model_at_end
    assert (out / "final" / "model.safetensors").is_file()
    assert "early stopping: 1 evaluations in a row without eval_loss improving" in caplog.text

    # The same command again: the run is finished (the early-stopping count is in the checkpoint).
    caplog.clear()
    assert train(cfg) == 0
    assert "this run is already finished" in caplog.text and max(r["step"] for r in _rows(out)) == 4


def test_eval_files_are_the_held_out_set_and_nothing_of_train_files_is_held_out(
    tiny_model_dir, sample_csv, tmp_path, caplog
):
    from trainer.data.sample import write_sample

    held_out = tmp_path / "held_out.csv"
    write_sample(held_out, 40, seed=7, fmt="recipenlg-csv")
    cfg = _cfg(tiny_model_dir, sample_csv, tmp_path / "out", eval_files=[str(held_out)], eval_fraction=0.05)
    caplog.set_level(logging.INFO)
    assert train(cfg, dry_run=True) == 0
    assert f"data: 500 records for training from {sample_csv}" in caplog.text
    assert f"40 for evaluation from {held_out}" in caplog.text
    assert "evaluation: generating for 6 of 40 held-out records" in caplog.text


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"metric_for_best_model": "eval_accuracy"},
            "metric_for_best_model 'eval_accuracy' is not an evaluation",
        ),
        (
            {"metric_for_best_model": "rougeL", "eval_generation_records": 0},
            "eval_generation_records is 0",
        ),
        ({"metric_for_best_model": "length_ratio"}, "set greater_is_better"),
        ({"load_best_model_at_end": True, "eval_fraction": 0.0}, "load_best_model_at_end needs evaluations"),
        ({"early_stopping_patience": 0}, "early_stopping_patience"),
    ],
)
def test_best_model_keys_that_cannot_work_are_one_config_error(keys, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(keys)


def test_best_and_early_stopping_count_follow_hugging_face():
    from trainer.run.run_state import RunState

    state = RunState()

    def evaluate(step: int, rouge: float) -> bool:
        state.step = step
        return state.track_evaluation({"eval_rougeL": rouge}, "eval_rougeL", True, 0.5, f"ckpt-{step}")

    assert evaluate(1, 10.0) and state.early_stopping_patience_counter == 0  # the first is the best
    # Better, but by no more than the threshold: the new best, and still one evaluation without improvement.
    assert evaluate(2, 10.3) and state.best["step"] == 2 and state.early_stopping_patience_counter == 1
    assert (
        not evaluate(3, float("nan")) and state.early_stopping_patience_counter == 2
    )  # NaN is no improvement
    assert state.early_stopping_due(2) and not state.early_stopping_due(None)
    assert evaluate(4, 11.0) and state.early_stopping_patience_counter == 0
    assert state.best == {
        "metric": "eval_rougeL",
        "value": 11.0,
        "step": 4,
        "path": "ckpt-4",
        "metrics": {"eval_rougeL": 11.0},
    }
    # What a checkpoint stores comes back; one written before metric_for_best_model is read as eval_loss.
    again = RunState.from_trainer_state(dict(state.trainer_state({}, "8 rows", []), step=4))
    assert again.best == state.best and again.early_stopping_patience_counter == 0
    old = RunState.from_trainer_state({"step": 5, "best": {"eval_loss": 1.5, "path": "ckpt-5", "step": 5}})
    assert old.best == {"metric": "eval_loss", "value": 1.5, "step": 5, "path": "ckpt-5"}


def test_trainer_evaluate_on_a_runs_model_scores_what_its_last_evaluation_logged(
    tiny_model_dir, sample_csv, tmp_path
):
    """final/ carries the evaluations' decoding (generation_max_new_tokens in its generation_config.json),
    so `trainer evaluate` on the records the run held out, with no decoding flag, gives the numbers the run
    logged for the same weights (every held-out record generated for, so no draw differs)."""
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, sample_csv, out, max_steps=4, eval_steps=4, eval_generation_records=10_000)
    assert train(cfg) == 0
    (logged,) = [r for r in _rows(out) if "eval_rougeL" in r]
    assert json.loads((out / "final" / "generation_config.json").read_text())["max_new_tokens"] == 8
    report = tmp_path / "report.json"
    args = ["evaluate", "--model", str(out / "final"), "--data", str(sample_csv), "--split", "eval"]
    assert main([*args, "--device", "cpu", "--output", str(report)]) == 0
    scored = json.loads(report.read_text())["metrics"]
    for name in ("rougeL", "bleu", "chrf", "ingredient_coverage", "structure"):
        assert scored[name] == pytest.approx(logged[f"eval_{name}"], abs=1e-9), name

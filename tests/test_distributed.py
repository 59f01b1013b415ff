"""torchrun on the CPU (gloo), real processes: 2 ranks train the tiny model as 1 process does with the same
global batch, and a checkpoint saved by 2 ranks resumes in 1 process where the 1-process run would be.

The global batch is the same: the loader gives rank r of 2 the global batches r, r+2, ..., so 2 ranks with
accumulation 1 see, per step, the 2 batches that 1 process with accumulation 2 sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_run import tiny_run_values

from trainer.config import TrainConfig
from trainer.train import SUMMARY, TRAIN_LOG, train

STEPS = 4
SAVE_AT = 2


@pytest.fixture(scope="module")
def model_dir(tiny_model_without_dropout) -> Path:
    """Dropout off: its random masks would differ between 1 and 2 processes."""
    return tiny_model_without_dropout


def _values(model_dir, sample_csv, out, **kw) -> dict:
    values = dict(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        eval_fraction=0.05,
        eval_max_batches=2,
        warmup_steps=2,
        max_steps=STEPS,
        eval_steps=1000,  # evaluates (and generates) once, at the end
        save_steps=SAVE_AT,
        num_eval_generations=1,
        generation_max_new_tokens=8,
    )
    return tiny_run_values(model_dir, sample_csv, out, **values | kw)


def _torchrun(values: dict, tmp_path: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    config = tmp_path / f"{Path(values['output_dir']).name}.yaml"
    config.write_text(yaml.safe_dump(values))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "trainer", "train", "--config", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # training rows (evaluations: "eval_loss")


@pytest.fixture(scope="module")
def single(model_dir, sample_csv, tmp_path_factory) -> dict[int, float]:
    """The reference: 1 process, accumulation 2, in this process."""
    out = tmp_path_factory.mktemp("single") / "out"
    assert (
        train(TrainConfig.from_dict(_values(model_dir, sample_csv, out, gradient_accumulation_steps=2))) == 0
    )
    return _losses(out)


def _one_process(model_dir, sample_csv, out: Path, **kw) -> dict[int, float]:
    """The losses of the run in this process with accumulation 2: what 2 ranks with accumulation 1 train."""
    assert (
        train(TrainConfig.from_dict(_values(model_dir, sample_csv, out, gradient_accumulation_steps=2, **kw)))
        == 0
    )
    return _losses(out)


def _resume_in_one_process(model_dir, sample_csv, checkpoint: Path, out: Path, **kw) -> dict[int, float]:
    values = _values(model_dir, sample_csv, out, gradient_accumulation_steps=2, resume=str(checkpoint), **kw)
    assert train(TrainConfig.from_dict(values)) == 0
    return _losses(out)


def test_ddp_two_ranks_match_one_process_and_resume_in_one(model_dir, sample_csv, single, tmp_path):
    out = tmp_path / "ddp"
    run = _torchrun(_values(model_dir, sample_csv, out, distributed_strategy="ddp"), tmp_path)
    assert "process group: 2 ranks, backend gloo" in run.stderr
    assert run.stderr.count(f"finished: {STEPS} steps") == 1, "rank 0 alone logs at INFO"

    two = _losses(out)  # rank 0 alone writes the train log: one line per step
    assert sorted(two) == list(range(1, STEPS + 1))
    for s in two:
        assert two[s] == pytest.approx(single[s], rel=1e-5), (s, two[s], single[s])
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["steps"] == STEPS and summary["final_loss"] == pytest.approx(single[STEPS], rel=1e-5)
    from transformers import AutoModelForSeq2SeqLM

    AutoModelForSeq2SeqLM.from_pretrained(out / "final")  # the final model, saved by rank 0
    ckpt = out / f"checkpoint-{SAVE_AT}"
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    assert (ckpt / "rng.pt").is_file() and (ckpt / "rng-1.pt").is_file()

    # Saved by 2 ranks, resumed by 1: the loader continues at global batch 2 x 2 = 4, the optimizer states
    # come back from DCP, and the losses are those of the run that never stopped.
    resumed = _resume_in_one_process(model_dir, sample_csv, ckpt, tmp_path / "resumed")
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for s in resumed:
        assert resumed[s] == pytest.approx(single[s], rel=1e-5), (s, resumed[s], single[s])


def test_ddp_on_packed_rows_matches_one_process_keeps_the_best_and_resumes_in_one(
    model_dir, sample_csv, tmp_path
):
    """Packed rows under torchrun: rank r of 2 trains the packed global batches r, r+2, ..., so 2 ranks match
    1 process with accumulation 2; rank 0 writes the best checkpoint's weights (by eval_loss) into final/;
    a checkpoint of 2 ranks resumes in 1 process on the same packed batches."""
    from safetensors.torch import load_file

    packed = dict(packing=True, eval_steps=1, save_steps=1, save_total_limit=2, load_best_model_at_end=True)
    one_out = tmp_path / "one-packed"
    values = _values(model_dir, sample_csv, one_out, gradient_accumulation_steps=2, **packed)
    assert train(TrainConfig.from_dict(values)) == 0
    one = _losses(one_out)

    out = tmp_path / "ddp-packed"
    run = _torchrun(_values(model_dir, sample_csv, out, distributed_strategy="ddp", **packed), tmp_path)
    assert "process group: 2 ranks, backend gloo" in run.stderr
    two = _losses(out)
    assert sorted(two) == list(range(1, STEPS + 1))
    for s in two:
        assert two[s] == pytest.approx(one[s], rel=1e-5), (s, two[s], one[s])

    summary = json.loads((out / SUMMARY).read_text())
    best = Path(summary["best_model_checkpoint"])
    assert summary["final_model_step"] == summary["best_global_step"] == int(best.name.split("-")[1])
    final_weights = load_file(out / "final" / "model.safetensors")
    best_weights = load_file(best / "model.safetensors")
    assert final_weights.keys() == best_weights.keys()
    assert all(final_weights[k].equal(best_weights[k]) for k in final_weights)

    before_last = out / f"checkpoint-{STEPS - 1}"  # kept: save_total_limit 2
    resumed = _resume_in_one_process(model_dir, sample_csv, before_last, tmp_path / "resumed", **packed)
    assert sorted(resumed) == [STEPS]
    assert resumed[STEPS] == pytest.approx(one[STEPS], rel=1e-5), (resumed, one)


def test_fsdp_two_ranks_train_like_one_process_and_resume_in_one(model_dir, sample_csv, single, tmp_path):
    """FSDP2 computes in bf16 (fp32 sharded weights and AdamW states), hence the looser tolerance; gradient
    checkpointing on, as for FLAN-T5-XL."""
    out = tmp_path / "fsdp"
    values = _values(model_dir, sample_csv, out, distributed_strategy="fsdp", gradient_checkpointing=True)
    run = _torchrun(values, tmp_path)
    assert "FSDP2 over 2 ranks" in run.stderr

    two = _losses(out)
    assert sorted(two) == list(range(1, STEPS + 1))
    for s in two:
        assert two[s] == pytest.approx(single[s], rel=2e-2), (s, two[s], single[s])
    from transformers import AutoModelForSeq2SeqLM

    AutoModelForSeq2SeqLM.from_pretrained(out / "final")  # gathered from the shards

    # The DCP checkpoint holds each rank's shards; one process loads them as whole tensors.
    resumed = _resume_in_one_process(model_dir, sample_csv, out / f"checkpoint-{SAVE_AT}", tmp_path / "r")
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for s in resumed:
        assert resumed[s] == pytest.approx(two[s], rel=2e-2), (s, resumed[s], two[s])


def test_fsdp_with_the_presets_adafactor_trains_like_one_process(model_dir, sample_csv, tmp_path):
    """Adafactor with Kahan-compensated bf16 weights (the rtx5090 preset's optimizer) on FSDP2's sharded
    weights, which it cannot stack by shape and updates one at a time."""
    values = dict(optimizer="adafactor", dtype="bfloat16")
    single = _one_process(model_dir, sample_csv, tmp_path / "one", **values)
    out = tmp_path / "fsdp"
    _torchrun(_values(model_dir, sample_csv, out, distributed_strategy="fsdp", **values), tmp_path)
    two = _losses(out)
    assert sorted(two) == list(range(1, STEPS + 1))
    assert two[STEPS] < two[1] - 0.5  # it learns
    for s in two:
        assert two[s] == pytest.approx(single[s], rel=2e-2), (s, two[s], single[s])


def test_ddp_with_lora_adapters_trains_like_one_process_and_resumes_in_one(model_dir, sample_csv, tmp_path):
    """LoRA (trainer.lora) under DDP: the adapters alone are reduced (the frozen base has no gradient), rank 0
    writes the adapter checkpoints and the merged final/, and 2 ranks' checkpoint resumes in 1 process."""
    lora = dict(adapter="lora", lora_r=4, optimizer="adamw", learning_rate=1e-2)
    one = _one_process(model_dir, sample_csv, tmp_path / "one-lora", **lora)

    out = tmp_path / "ddp-lora"
    run = _torchrun(_values(model_dir, sample_csv, out, distributed_strategy="ddp", **lora), tmp_path)
    assert "process group: 2 ranks, backend gloo" in run.stderr and "LoRA: r 4" in run.stderr
    two = _losses(out)
    assert sorted(two) == list(range(1, STEPS + 1)) and two[STEPS] < two[1]
    for s in two:
        assert two[s] == pytest.approx(one[s], rel=1e-5), (s, two[s], one[s])
    from transformers import AutoModelForSeq2SeqLM

    AutoModelForSeq2SeqLM.from_pretrained(out / "final")  # merged by rank 0
    checkpoint = out / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "rng-1.pt").is_file()

    resumed = _resume_in_one_process(model_dir, sample_csv, checkpoint, tmp_path / "resumed", **lora)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for s in resumed:
        assert resumed[s] == pytest.approx(one[s], rel=1e-5), (s, resumed[s], one[s])

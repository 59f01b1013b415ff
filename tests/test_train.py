"""The training loop end to end on the tiny model: dry run, a real SIGTERM, resume, the same loss sequence."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import threading
import time
import warnings

import pytest
import torch
from tiny_run import tiny_run_values

from trainer.checkpoint.resume import find_resume_checkpoint
from trainer.checkpoint.store import load_trainer_state
from trainer.config import ConfigError, TrainConfig
from trainer.report.step_meter import SUMMARY, TRAIN_LOG
from trainer.run.train import train

STEPS = 8


def _cfg(tiny_model_dir, sample_csv, out, **kw) -> TrainConfig:
    values = dict(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        eval_fraction=0.05,
        eval_max_batches=2,
        warmup_steps=2,
        max_steps=STEPS,
        eval_steps=1000,
        save_steps=1000,
        num_eval_generations=1,
        generation_max_new_tokens=8,
    )
    return TrainConfig.from_dict(tiny_run_values(tiny_model_dir, sample_csv, out, **values | kw))


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # training rows (evaluations: "eval_loss")


def test_dry_run_checks_data_and_loads_no_model(tiny_model_dir, sample_csv, tmp_path, caplog):
    caplog.set_level("INFO")
    assert train(_cfg(tiny_model_dir, sample_csv, tmp_path / "out"), dry_run=True) == 0
    assert "plan: 8 optimizer steps" in caplog.text
    assert not (tmp_path / "out").exists()


def test_skipped_records_are_reported_when_training_starts(tiny_model_dir, sample_csv, tmp_path, caplog):
    # The sample plus two broken rows at known lines: a short row and a list column that is not a list.
    lines = sample_csv.read_text().splitlines()
    n = len(lines)
    lines += ['9001,Short,"[""a""]"', '9002,Bad,not a list,"[""x""]",l,s,"[]"']
    data = tmp_path / "full_dataset.csv"
    data.write_text("\n".join(lines) + "\n")
    caplog.set_level("INFO")
    assert train(_cfg(tiny_model_dir, data, tmp_path / "out"), dry_run=True) == 0
    (warning,) = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "skipped" in r.getMessage()
    ]
    assert "skipped 2 of " in warning and "malformed_csv 2" in warning, warning
    assert f"{data}:{n + 1}: malformed_csv" in warning and f"{data}:{n + 2}: malformed_csv" in warning, (
        warning
    )


def test_sigterm_saves_and_resume_continues_the_same_loss_sequence(
    tiny_model_dir, sample_csv, tmp_path, caplog
):
    caplog.set_level("INFO")
    straight = tmp_path / "straight"
    assert train(_cfg(tiny_model_dir, sample_csv, straight)) == 0
    expected = _losses(straight)
    assert sorted(expected) == list(range(1, STEPS + 1))
    # The evaluation (eval_steps 1000: once, at the end) is a row of the same log, told apart by its key.
    rows = [json.loads(line) for line in (straight / TRAIN_LOG).read_text().splitlines()]
    assert all(("loss" in r) != ("eval_loss" in r) for r in rows)
    (evaluation,) = [r for r in rows if "eval_loss" in r]
    assert evaluation["step"] == STEPS and evaluation["eval_loss"] > 0 and "time" in evaluation
    assert (straight / "final" / "model.safetensors").is_file()
    assert (straight / "final" / "tokenizer.json").is_file()
    summary = json.loads((straight / SUMMARY).read_text())
    assert summary["steps"] == STEPS
    # What the wall clock went into: the steps and each kind of pause, as the last log lines say.
    goodput = summary["goodput"]
    paused = sum(goodput[f"{kind}_s"] for kind in ("save", "evaluation", "capture", "data"))
    assert goodput["steps_s"] == pytest.approx(goodput["wall_s"] - paused)
    assert goodput["evaluation_count"] == 1 and goodput["save_count"] >= 2  # the last step's, final/
    assert 0 < goodput["goodput"] < 1 and f"goodput {100 * goodput['goodput']:.1f}%: " in caplog.text
    beat = json.loads((straight / "heartbeat").read_text())
    assert beat["step"] == STEPS and abs(beat["time"] - time.time()) < 600

    # A real SIGTERM (what `docker stop` sends) once a few steps are logged: the loop saves and exits.
    stopped = tmp_path / "stopped"
    log_file = stopped / TRAIN_LOG

    def send_sigterm():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if log_file.exists() and len(log_file.read_text().splitlines()) >= 3:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=send_sigterm, daemon=True)
    killer.start()
    rc = train(_cfg(tiny_model_dir, sample_csv, stopped))
    killer.join()
    assert rc == 128 + signal.SIGTERM
    ckpt = find_resume_checkpoint("auto", stopped)
    assert ckpt is not None
    stop_step = load_trainer_state(ckpt)["step"]
    assert 3 <= stop_step < STEPS
    assert not (stopped / "final").exists()

    caplog.clear()
    assert train(_cfg(tiny_model_dir, sample_csv, stopped)) == 0
    assert f"resumed from step {stop_step}" in caplog.text
    resumed = _losses(stopped)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    # CPU, fp32: bit-identical losses, before and after the stop.
    assert [resumed[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]


def test_rerun_of_a_finished_or_killed_run(tiny_model_dir, sample_csv, tmp_path, caplog):
    caplog.set_level("INFO")
    out = tmp_path / "out"
    assert train(_cfg(tiny_model_dir, sample_csv, out, save_steps=4)) == 0
    logged = (out / TRAIN_LOG).read_text()
    summary = (out / SUMMARY).read_text()

    # The same command again: nothing to do, nothing overwritten.
    caplog.clear()
    assert train(_cfg(tiny_model_dir, sample_csv, out, save_steps=4)) == 0
    assert f"is at step {STEPS} of {STEPS}: this run is already finished" in caplog.text
    assert (out / SUMMARY).read_text() == summary and (out / TRAIN_LOG).read_text() == logged
    # A changed experiment in the finished run's output_dir would train nothing: refused (exit 2 from the
    # command line), never an exit 0 that a sweep reads as the new experiment's success.
    with pytest.raises(
        ConfigError, match=r"already finished, and the config changes learning_rate 0.001 -> 0.003,"
    ):
        train(_cfg(tiny_model_dir, sample_csv, out, save_steps=4, learning_rate=3e-3))
    assert (out / SUMMARY).read_text() == summary and (out / TRAIN_LOG).read_text() == logged
    # A run that failed while writing final/ left none (it is renamed into place whole): the rerun writes it.
    shutil.rmtree(out / "final")
    assert train(_cfg(tiny_model_dir, sample_csv, out, save_steps=4)) == 0
    assert (out / "final" / "model.safetensors").is_file() and not (out / "final.tmp").exists()
    assert (out / SUMMARY).read_text() == summary and (out / TRAIN_LOG).read_text() == logged

    # As if killed after step 8 was logged but before its checkpoint: resume at 4, with a changed learning
    # rate. The log keeps one row per step, and the optimizer's state (its learning rate too) is the
    # checkpoint's, which the warning says.
    shutil.rmtree(out / f"checkpoint-{STEPS}")
    shutil.rmtree(out / "final")
    caplog.clear()
    assert train(_cfg(tiny_model_dir, sample_csv, out, save_steps=4, learning_rate=2e-3)) == 0
    assert "learning_rate 0.001 -> 0.002" in caplog.text

    def rows(text):  # without the clock's readings: when, and how long evaluations took
        return [
            {k: v for k, v in json.loads(line).items() if k != "time" and not k.endswith("runtime")}
            for line in text.splitlines()
        ]

    assert rows((out / TRAIN_LOG).read_text()) == rows(logged)
    # The resumed process's checkpoint has the whole log as its log_history: the first process's rows too.
    history = load_trainer_state(out / f"checkpoint-{STEPS}")["log_history"]
    written = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    assert history == written[: len(history)] and [r["step"] for r in history if "loss" in r] == list(
        range(1, STEPS + 1)
    )


def test_max_time_stops_saves_evaluates_and_finishes_and_its_clock_survives_a_restart(
    tiny_model_dir, sample_csv, tmp_path, caplog
):
    caplog.set_level("INFO")
    out = tmp_path / "out"
    budget = _cfg(tiny_model_dir, sample_csv, out, max_steps=100_000, max_time="3s")
    assert train(budget) == 0
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["stopped_by"] == "max_time" and summary["steps"] < 100_000
    assert summary["train_seconds"] >= 3.0
    steps = summary["steps"]
    ckpt = find_resume_checkpoint("auto", out)  # the step it stopped at is saved, final/ written
    state = load_trainer_state(ckpt)
    assert state["step"] == steps and state["train_seconds"] >= 3.0
    assert (out / "final" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r][-1] == steps  # evaluated where it stopped
    assert "time budget reached (max_time 3s)" in caplog.text

    # The same command again: the budget is spent, nothing to do.
    caplog.clear()
    assert train(budget) == 0
    assert "its time budget (max_time 3s) spent: this run is already finished" in caplog.text
    assert json.loads((out / SUMMARY).read_text()) == summary

    # A larger budget continues the run; the time used before the restart still counts.
    assert train(_cfg(tiny_model_dir, sample_csv, out, max_steps=steps + 2, max_time="1h")) == 0
    after = json.loads((out / SUMMARY).read_text())
    assert after["steps"] == steps + 2 and after["stopped_by"] is None
    # It continues from the checkpoint's clock (the final evaluation and save after it are not in it).
    assert after["train_seconds"] > state["train_seconds"] >= 3.0


def test_unknown_model_path_fails_before_training(sample_csv, tmp_path):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="no-such-model: no such directory"):
        train(_cfg(tmp_path / "no-such-model", sample_csv, tmp_path / "out"), dry_run=True)


def test_kernel_timeline_merges_overlapping_kernels_and_finds_the_idle_slices(tmp_path):
    from trainer.report.profiling import kernel_timeline

    kernels = [(0, 10), (5, 10), (30, 10)]  # (start, duration) in us: busy 0-15 and 30-40 of 0-40
    events = [{"cat": "kernel", "ts": ts, "dur": dur} for ts, dur in kernels]
    events.append({"cat": "cpu_op", "ts": 15, "dur": 15})  # host work is not GPU time
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    timeline = kernel_timeline(path, slices=4)
    assert timeline["busy"] == pytest.approx(25 / 40)
    assert timeline["slices"] == pytest.approx([1.0, 0.5, 0.0, 1.0])
    assert timeline["collective_s"] == 0
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": events[-1:]}))
    assert kernel_timeline(tmp_path / "empty.json") is None


def test_kernel_timeline_says_how_much_collective_time_no_computation_hid(tmp_path):
    """FSDP2's all-gathers and ddp's all-reduce run as NCCL kernels on their own streams: the part of their
    time with no compute kernel beside it is what the step waited for."""
    from trainer.report.profiling import kernel_timeline

    kernels = [  # (name, start, duration) in us
        ("ncclDevKernel_AllGather_RING_LL", 0, 10),  # 0-10: compute covers 5-10
        ("gemm", 5, 20),  # compute 5-25
        ("ncclDevKernel_ReduceScatter_RING_LL", 20, 15),  # 20-35: compute covers 20-25 and 30-32
        ("rms_norm", 30, 2),
        ("ncclDevKernel_AllGather_RING_LL", 40, 5),  # 40-45: nothing beside it
    ]
    events = [{"cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    timeline = kernel_timeline(path, slices=3)
    assert timeline["collective_s"] == pytest.approx(30e-6)
    assert timeline["exposed_collective_s"] == pytest.approx((5 + 8 + 5) * 1e-6)


def test_memory_at_peak_names_what_is_live_at_the_peak_and_what_came_before():
    from trainer.report.profiling import memory_at_peak

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    # a virtual environment inside a folder named trainer: torch's frames are still torch's
    packages = "/home/me/trainer/.venv/lib/python3.11/site-packages"
    fsdp = frame(f"{packages}/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 90, "ag")
    attention = frame("/home/me/trainer/trainer/kernels/packed_attention.py", 40, "forward")
    module = frame(f"{packages}/torch/nn/modules/module.py", 1700, "_call_impl")
    trace = [  # the allocator's own format (torch.cuda.memory._snapshot()["device_traces"][device])
        {"action": "alloc", "addr": 1, "size": 100, "frames": [fsdp, module]},
        {"action": "alloc", "addr": 2, "size": 40, "frames": [attention, module]},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "free_completed", "addr": 900, "size": 30, "frames": []},  # allocated before the trace
        {"action": "alloc", "addr": 3, "size": 50, "frames": [fsdp, module]},
        {"action": "alloc", "addr": 4, "size": 90, "frames": [attention]},  # the peak, past the first 1140
        {"action": "free_completed", "addr": 4, "size": 90, "frames": []},
        {"action": "alloc", "addr": 5, "size": 20, "frames": [module]},
    ]
    peak = memory_at_peak(trace, allocated_at_start=1000)
    assert peak["peak"] == 1000 + 100 + 40 - 100 - 30 + 50 + 90
    assert peak["before_window"] == 970
    assert peak["by_source"] == {
        "trainer/kernels/packed_attention.py:40 forward": (130, 2),
        "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:90 ag <- torch/nn/modules/module.py:1700 "
        "_call_impl": (50, 1),
    }
    assert peak["peak_frames"] == [attention]


def test_reserved_memory_is_summed_by_pool_and_stream_with_what_no_tensor_holds():
    """A CUDA graph's private pool and the allocator's own, on two streams: what each reserves, what of it
    tensors hold, what waits for another stream, and the largest free block (fragmentation shows as reserve
    far above allocation with only small free blocks)."""
    from trainer.report.profiling import reserved_by_pool

    def segment(pool, stream, blocks, device=0):
        return {  # the allocator's own format (torch.cuda.memory._snapshot()["segments"])
            "device": device,
            "segment_pool_id": pool,
            "stream": stream,
            "total_size": sum(size for size, _ in blocks),
            "allocated_size": sum(size for size, state in blocks if state == "active_allocated"),
            "blocks": [{"size": size, "state": state} for size, state in blocks],
        }

    segments = [
        segment((0, 0), 7, [(100, "active_allocated"), (60, "inactive")]),
        segment((1, 0), 7, [(300, "active_allocated"), (20, "inactive"), (30, "inactive")]),
        segment((1, 0), 7, [(200, "inactive")]),
        segment((1, 0), 9, [(50, "active_awaiting_free"), (10, "inactive")]),
        segment((0, 0), 7, [(999, "active_allocated")], device=1),  # another GPU's
    ]
    rows = reserved_by_pool(segments, device=0)
    assert [(r["pool"], r["stream"]) for r in rows] == [((1, 0), 7), ((0, 0), 7), ((1, 0), 9)]
    graph_pool = rows[0]
    assert graph_pool["reserved"] == 550 and graph_pool["allocated"] == 300 and graph_pool["segments"] == 2
    assert graph_pool["largest_free"] == 200 and graph_pool["awaiting_free"] == 0
    assert rows[2]["awaiting_free"] == 50 and rows[2]["allocated"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records CUDA allocations")
def test_profile_memory_writes_what_is_allocated_at_the_peak(tiny_model_dir, sample_csv, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(
        tiny_model_dir,
        sample_csv,
        out,
        max_steps=3,
        profile_steps=1,
        profile_start_step=1,
        profile_memory=True,
    )
    assert train(cfg) == 0
    report = (out / "profile" / "memory.txt").read_text()
    assert report.startswith("allocated at the peak of the 1 profiled steps:")
    assert "trainer/" in report  # the trainer's own allocations are named by source line
    assert "reserved at the window's end, by memory pool" in report
    assert (out / "profile" / "memory_snapshot.pickle").stat().st_size > 0
    assert json.loads((out / "profile" / "summary.json").read_text())["memory_peak_bytes"] > 0


def test_profile_steps_write_a_report_of_the_profiled_window(tiny_model_dir, sample_csv, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, sample_csv, out, max_steps=4, profile_steps=2, profile_start_step=1)
    assert train(cfg) == 0
    report = (out / "profile" / "kernels.txt").read_text()
    assert report.startswith("2 optimizer steps from step 2:")
    summary = json.loads((out / "profile" / "summary.json").read_text())
    # The loop's phases are timed on the host; forward+backward dominates even on the tiny model.
    phases = summary["host_s_per_step"]
    assert set(phases) == {"data", "forward_backward", "optimizer"}
    assert phases["forward_backward"] > phases["data"]
    assert 0 < summary["wall_s_per_step"] < 60
    trace = json.loads((out / "profile" / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"forward_backward", "optimizer"} <= names
    assert len(_losses(out)) == 4  # profiling does not change the run


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tiny_model_dir, sample_csv, tmp_path):
    import shutil

    import torch
    from transformers import AutoModelForSeq2SeqLM

    # A model whose LM head has one NaN weight: every logit row, so every step's loss, is NaN.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    model = AutoModelForSeq2SeqLM.from_pretrained(broken)
    with torch.no_grad():
        model.get_output_embeddings().weight[5, 3] = float("nan")
    model.save_pretrained(broken)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    out = tmp_path / "run"
    cfg = _cfg(broken, sample_csv, out, max_consecutive_nan_steps=3)
    with (
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(RuntimeError, match="3 optimizer steps in a row had a NaN/inf loss"),
    ):
        warnings.simplefilter("always")
        train(cfg)
    # The skipped updates are the loop's own warnings, not torch's about the schedule stepping first.
    assert [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)] == []
    losses = _losses(out)
    assert list(losses) == [1, 2, 3] and all(loss != loss for loss in losses.values())  # NaN, logged
    checkpoint = find_resume_checkpoint("auto", out)
    assert checkpoint is not None and checkpoint.name == "checkpoint-3"
    assert load_trainer_state(checkpoint)["nan_skipped"] == 3
    # No update was applied: the saved weights are the ones loaded (NaN where it was put).
    saved = AutoModelForSeq2SeqLM.from_pretrained(checkpoint).state_dict()
    for name, value in before.items():
        assert torch.equal(saved[name].nan_to_num(), value.nan_to_num()), name


def test_bad_data_paths_are_one_clear_line_not_a_traceback(tiny_model_dir, tmp_path, capsys):
    from trainer.cli import main as cli_main

    config = tmp_path / "c.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\nreport_to: none\n")
    missing = tmp_path / "nothing" / "*.csv"
    assert cli_main(["train", "--config", str(config), "--dry-run", "--set", f"train_files=[{missing}]"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"trainer: data error: {missing}: glob matches no file", err


def _lrs(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    return {r["step"]: r["learning_rate"] for r in rows if "loss" in r}


def test_a_resumed_run_has_the_learning_rates_of_an_uninterrupted_one(
    tiny_model_dir, sample_csv, tmp_path, caplog
):
    caplog.set_level("INFO")
    out = tmp_path / "out"
    cfg = _cfg(
        tiny_model_dir,
        sample_csv,
        out,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=0.25,  # a ratio: 2 of the 8 steps
        save_steps=4,
    )
    assert train(cfg) == 0
    expected = _lrs(out)
    assert expected[1] == pytest.approx(5e-4) and expected[STEPS] == pytest.approx(1e-4)  # warm-up, min_lr
    # As if killed after step 8 was logged but before its checkpoint: steps 5-8 again, from checkpoint-4.
    shutil.rmtree(out / f"checkpoint-{STEPS}")
    shutil.rmtree(out / "final")
    assert train(cfg) == 0
    assert "resumed from step 4" in caplog.text
    assert _lrs(out) == expected


def test_with_max_time_the_schedule_ends_where_the_time_budget_does(
    tiny_model_dir, sample_csv, tmp_path, caplog
):
    # Each reading of the clock advances it by 50 ms: a step takes a fixed share of the budget, whatever the
    # machine, so the run's end and the schedule's are exact.
    def ticking_clock():
        ticks = itertools.count()
        return lambda: next(ticks) * 0.05

    caplog.set_level("INFO")
    out = tmp_path / "out"
    values = dict(max_steps=100_000, warmup_steps=0.1, eval_fraction=0.0, save_steps=1000)

    def horizons() -> list[int]:
        return [int(h) for h in re.findall(r"learning-rate schedule ends at step (\d+)", caplog.text)]

    assert train(_cfg(tiny_model_dir, sample_csv, out, max_time="6s", **values), clock=ticking_clock()) == 0
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["stopped_by"] == "max_time" and 10 < summary["steps"] < 100
    # Planned over 100,000 steps at first, the schedule ends at the last step once the step time is measured:
    # a linear decay to 0, which a time-stopped run used to never reach.
    assert horizons() and horizons()[-1] == summary["steps"]
    assert _lrs(out)[summary["steps"]] == 0.0

    # More time: the resumed run's schedule ends where the new budget does, at the checkpoint's step time.
    caplog.clear()
    assert train(_cfg(tiny_model_dir, sample_csv, out, max_time="9s", **values), clock=ticking_clock()) == 0
    assert re.search(r"ends at step \d+, where the time budget does at the [\d.]+ s per step", caplog.text)
    resumed = json.loads((out / SUMMARY).read_text())
    assert resumed["steps"] > summary["steps"] and horizons()[-1] == resumed["steps"]
    assert _lrs(out)[resumed["steps"]] == 0.0


def test_adafactor_steps_before_the_schedule(tiny_model_dir, sample_csv, tmp_path):
    # torch warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`" when the optimizer's
    # update did not go through its step().
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (
            train(_cfg(tiny_model_dir, sample_csv, tmp_path / "out", optimizer="adafactor", max_steps=2)) == 0
        )
    assert [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)] == []

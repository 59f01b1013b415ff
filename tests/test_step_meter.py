"""The step meter: the ETA after checkpoints and after a resume, the train log's rows, the console line."""

from __future__ import annotations

import json

import pytest

from trainer.infra.memory import GpuMemory
from trainer.report.step_meter import TRAIN_LOG, StepCounts, StepMeter, continue_train_log, format_duration


class Clock:
    """A monotonic clock the test moves: the meter measures what the simulated run spends."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def simulate(
    meter: StepMeter, clock: Clock, start: int, total: int, step_s: float, save_every: int, save_s: float
):
    """Run steps start+1..total as the loop does: each takes `step_s`, every `save_every`-th is followed by a
    checkpoint taking `save_s`. Returns {step: (ETA the meter gave after it, the time it was given)} and the
    time the run ended."""
    etas = {}
    for step in range(start + 1, total + 1):
        clock.now += step_s
        meter.step_done(step, loss=1.0, lr=1e-4, counts=StepCounts(4, 100, 200, 400))
        etas[step] = (meter.eta_s(step), clock.now)
        if step % save_every == 0:
            clock.now += save_s
    return etas, clock.now


def assert_eta_within_2x(etas: dict, end: float, steps) -> None:
    for step in steps:
        eta, at = etas[step]
        remaining = end - at
        assert remaining / 2 <= eta <= 2 * remaining, (step, eta, remaining)


def test_eta_is_right_after_a_checkpoint_and_after_a_resume(tmp_path):
    # A run of 80 steps of 1 s with a 10 s checkpoint every 20 steps (the quickstart shape that showed
    # "ETA 15m 22s" with a minute left: the old ETA divided the time since start by the steps since the
    # last checkpoint).
    clock = Clock()
    meter = StepMeter(80, 0, tmp_path, clock=clock)
    assert meter.eta_s(0) is None  # no step done yet: no estimate
    etas, end = simulate(meter, clock, 0, 80, step_s=1.0, save_every=20, save_s=10.0)
    assert_eta_within_2x(etas, end, [21, 25, 41, 61, 70])

    # The same run resumed from checkpoint-40 by a new process: it counts its own steps from 40.
    continue_train_log(tmp_path / TRAIN_LOG, 40)
    clock = Clock()
    resumed = StepMeter(80, 40, tmp_path, clock=clock)
    etas, end = simulate(resumed, clock, 40, 80, step_s=1.0, save_every=20, save_s=10.0)
    assert_eta_within_2x(etas, end, [41, 45, 61, 70])
    # The resumed process dropped the first one's rows after step 40 and logged its own: one row per step.
    rows = [json.loads(line) for line in (tmp_path / TRAIN_LOG).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 81))


def test_the_window_rates_and_the_console_line():
    clock = Clock()
    meter = StepMeter(10, 0, None, clock=clock)
    for step in (1, 2):
        clock.now += 2.0
        meter.step_done(step, loss=2.0, lr=1e-3, counts=StepCounts(8, 300, 500, 1000))
    logged = meter.log_window(2, loss=2.061791261037191, lr=1e-3, grad_norm=0.5, memory=None)
    assert logged.tokens_per_s == pytest.approx(1600 / 4.0) and logged.samples_per_s == pytest.approx(4.0)
    assert logged.real_token_share == pytest.approx(0.8)
    assert logged.eta_s == pytest.approx(2.0 * 8)
    # On a CPU the line says nothing about memory; numbers are rounded for a person.
    assert logged.line() == "step 2/10: loss 2.0618, lr 1.00e-03, 400 tokens/s, ETA 16s"
    assert "gpu/memory_peak_gib" not in logged.metrics()
    clock.now += 1.0
    meter.step_done(3, loss=2.0, lr=1e-3, counts=StepCounts(8, 300, 500, 1000))
    on_gpu = meter.log_window(3, loss=2.0, lr=1e-3, grad_norm=0.5, memory=GpuMemory(21.6, 20.1, 22.7))
    assert on_gpu.tokens_per_s == pytest.approx(800.0)  # the window started again at step 2
    assert on_gpu.line().endswith(", GPU memory 21.6 GiB peak")
    assert on_gpu.metrics()["gpu/memory_reserved_gib"] == 22.7


def test_train_log_rows_say_what_they_are_and_a_resume_drops_the_repeated_ones(tmp_path):
    meter = StepMeter(4, 0, tmp_path, clock=Clock())
    for step in (1, 2, 3):
        meter.step_done(step, loss=1.5, lr=1e-4, counts=StepCounts(2, 10, 20, 40))
        if step == 2:
            meter.evaluated(step, {"eval_loss": 1.25})
    lines = (tmp_path / TRAIN_LOG).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [("loss" in r, "eval_loss" in r) for r in rows] == [(True, False)] * 2 + [
        (False, True),
        (True, False),
    ]
    assert rows[2]["step"] == 2 and rows[2]["eval_loss"] == 1.25 and "time" in rows[2]
    assert set(rows[0]) == {  # Hugging Face's names (log_history)
        "step",
        "epoch",
        "loss",
        "learning_rate",
        "grad_norm",
        "time",
        "samples",
        "source_tokens",
        "target_tokens",
        "padded_tokens",
    }
    # Resuming from checkpoint-1: the rows of steps 2 and 3, evaluation included, are logged again.
    assert continue_train_log(tmp_path / TRAIN_LOG, 1) is None
    assert (tmp_path / TRAIN_LOG).read_text().splitlines() == lines[:1]


def test_a_run_that_starts_over_keeps_the_earlier_rows_beside_its_log(tmp_path):
    log = tmp_path / TRAIN_LOG
    assert continue_train_log(log, None) is None  # a first run: nothing to keep
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n')
    before = log.read_text()
    kept = continue_train_log(log, None)  # no checkpoint to resume: training starts over
    assert kept == tmp_path / f"{TRAIN_LOG}.1" and kept.read_text() == before and not log.exists()
    log.write_text('{"step": 1, "loss": 2.1}\n')
    assert continue_train_log(log, None) == tmp_path / f"{TRAIN_LOG}.2"  # the first kept file stays
    assert kept.read_text() == before


def test_a_resumed_log_loses_the_line_a_killed_run_cut_and_nothing_else(tmp_path):
    log = tmp_path / TRAIN_LOG
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    continue_train_log(log, 2)
    assert log.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'


def test_the_time_budget_counts_earlier_processes_and_caps_the_eta():
    clock = Clock()
    # A run resumed after 50 s of training, with a budget of 60 s: 10 s are left.
    meter = StepMeter(100, 10, None, clock=clock, seconds_before=50.0, max_time_s=60.0)
    assert meter.time_left_s() == 10.0 and not meter.out_of_time()
    assert meter.eta_s(10) == 10.0  # no step yet: the budget left is the most the run can take
    clock.now += 2.0
    meter.step_done(11, loss=1.0, lr=1e-4, counts=StepCounts(4, 100, 200, 400))
    assert meter.train_seconds == 52.0
    assert meter.eta_s(11) == 8.0  # 89 steps of 2 s would take longer than the 8 s left
    clock.now += 8.0
    assert meter.out_of_time() and meter.time_left_s() == 0.0
    assert StepMeter(100, 0, None, clock=clock).time_left_s() is None  # no budget: never out of time


def test_format_duration():
    assert [
        format_duration(s) for s in (None, -1, float("nan"), 0.4, 61, 3 * 3600 + 240, 2 * 86400 + 60)
    ] == [
        "unknown",
        "unknown",
        "unknown",
        "0s",
        "1m 1s",
        "3h 4m",
        "2d 0h 1m",
    ]

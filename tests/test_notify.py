"""Discord notifications against a real local webhook server (tests/discord_server.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from discord_server import dead_webhook_url, discord_server, limit_violations  # noqa: F401

from trainer.config import TrainConfig
from trainer.report.notify import DiscordNotifier, Priority, enforce_limits, make_embed
from trainer.report.reporter import Reporter

# Bounds on fault paths (not speed tests): how far past its timeout close() may run. Generous for a loaded
# machine, and still far below what the failure would cost: waiting out a dead server's retries
# (0.5 + 1 + 2 + 4 s per message) or a slow server's answer (SLOW_SERVER_S).
CLOSE_SLACK_S = 5.0
SLOW_SERVER_S = 30.0


def _msg(title: str, **fields) -> dict:
    return {"embeds": [make_embed("progress", title, fields=fields)]}


def _reporter(monkeypatch, url: str, tmp_path, **cfg) -> Reporter:
    monkeypatch.setenv("DISCORD_WEBHOOK_URL", url)
    monkeypatch.delenv("DISCORD_WEBHOOK", raising=False)
    cfg.setdefault("report_to", [])
    cfg.setdefault("discord_progress_minutes", 0)
    return Reporter(TrainConfig(output_dir=str(tmp_path / "run"), run_name="unit", **cfg))


def _every_event(r: Reporter) -> None:
    r.started(
        model="tiny-t5", data="recipes.csv (500 recipes)", effective_batch="8 x 4 = 32", planned_steps=100
    )
    r.progress(step=10, total=100, loss=2.5, tokens_per_s=12345.6, eta_s=3725, memory_gib=3.2)
    r.evaluated(
        step=20,
        metrics={"eval_loss": 1.75, "eval_rougeL": 23.456, "eval_ingredient_coverage": 0.8, "eval_bleu": 9.1},
        samples=[
            {
                "prompt": "Write a recipe with: eggs; flour",
                "generated": "Mix.",
                "reference": "Bake.",
                "rougeL": 0.0,
            }
        ],
        best={"metric": "eval_rougeL", "value": 23.456, "step": 20, "path": "/out/checkpoint-20"},
        early_stopping=(0, 3),
    )
    r.checkpoint_saved(step=20, path="/out/checkpoint-20")
    r.oom_backoff(step=21, micro_batch="4 rows", accumulation=8)
    r.nan_skipped(step=22, skipped_total=1)
    try:
        raise ValueError("loss exploded")
    except ValueError as e:
        r.crashed(e)
    r.stopped_by_signal(signal_name="SIGTERM", step=23, checkpoint="/out/checkpoint-23")
    r.finished(final_loss=1.5, duration_s=3600 * 26 + 61, model_dir="/out/final")


def test_every_event_arrives_within_limits(discord_server, monkeypatch, tmp_path):  # noqa: F811
    r = _reporter(monkeypatch, discord_server.url, tmp_path)
    _every_event(r)
    r.close(timeout=10)
    titles = discord_server.titles()
    assert titles == [
        "Training started: unit",
        "Progress",
        "Evaluation",
        "Checkpoint saved",
        "Out of memory: micro-batch halved",
        "Non-finite loss: step skipped",
        "Training crashed: ValueError",
        "Training stopped by SIGTERM",
        "Training finished: unit",
    ]
    assert all(r.status == 204 for r in discord_server.requests)
    payloads = discord_server.payloads
    for p in payloads:
        assert limit_violations(p) == []
        assert p["allowed_mentions"] == {"parse": []}  # nothing can ping @everyone
    fields = {f["name"]: f["value"] for f in payloads[0]["embeds"][0]["fields"]}
    assert fields["Model"] == "tiny-t5" and fields["Planned steps"] == "100"
    assert fields["Effective batch"] == "8 x 4 = 32"
    progress = {f["name"]: f["value"] for f in payloads[1]["embeds"][0]["fields"]}
    assert progress["Step"].startswith("10 / 100") and progress["ETA"] == "1h 2m"
    assert progress["Loss"] == "2.5000" and progress["GPU memory"] == "3.2 GiB"
    evaluation = {f["name"]: f["value"] for f in payloads[2]["embeds"][0]["fields"]}
    assert evaluation["Eval loss"] == "1.75" and evaluation["ROUGE-L"] == "23.46"
    assert evaluation["Ingredient coverage"] == "0.8" and evaluation["BLEU"] == "9.1"
    assert evaluation["Best"] == "rougeL 23.46 at step 20 (new)"
    assert evaluation["Early stopping"] == "0 of 3 evaluations without improvement"
    assert evaluation["Sample 1: prompt"] == "Write a recipe with: eggs; flour"
    assert evaluation["Sample 1: generated (ROUGE-L 0.0)"] == "Mix."
    crash = payloads[6]["embeds"][0]
    assert "ValueError: loss exploded" in crash["description"] and "Traceback" in crash["description"]
    finished = {f["name"]: f["value"] for f in payloads[8]["embeds"][0]["fields"]}
    assert finished == {"Final loss": "1.5000", "Duration": "1d 2h 1m", "Model": "/out/final"}


def test_progress_is_rate_limited_by_config(discord_server, monkeypatch, tmp_path):  # noqa: F811
    r = _reporter(monkeypatch, discord_server.url, tmp_path, discord_progress_minutes=30)
    for step in range(1, 50):
        r.progress(step=step, total=100, loss=1.0, tokens_per_s=1.0, eta_s=1.0, memory_gib=None)
    r.close(timeout=5)
    # The first call reports (the user sees the run is moving); the next is due 30 minutes later.
    assert discord_server.titles() == ["Progress"]


def _deep_error(depth: int, text: str):
    if depth == 0:
        raise RuntimeError(text)
    _deep_error(depth - 1, text)


def test_huge_payloads_are_truncated_to_discord_limits(discord_server, monkeypatch, tmp_path):  # noqa: F811
    r = _reporter(monkeypatch, discord_server.url, tmp_path)
    huge = "x" * 100_000
    r.started(model="m" * 5000, data="d" * 50_000, effective_batch="🍳" * 3000, planned_steps=10**12)
    try:
        _deep_error(150, "the end of the message " + huge)
    except RuntimeError as e:
        r.crashed(e)
    r.evaluated(
        step=1,
        metrics={"eval_loss": float("nan"), "eval_rougeL": 1.0},
        samples=[{"prompt": huge, "generated": "🥕" * 5000, "reference": huge, "rougeL": 1.0}] * 10,
    )
    r.close(timeout=10)
    # The server answers 400 to anything over Discord's limits, as Discord does.
    assert [q.status for q in discord_server.requests] == [204, 204, 204]
    crash = discord_server.payloads[1]["embeds"][0]
    assert crash["title"] == "Training crashed: RuntimeError"
    # A trimmed traceback keeps its end: the frame that raised.
    assert "raise RuntimeError(text)" in crash["description"]


def test_enforce_limits_on_many_embeds_and_fields():
    fields = [(f"name {i} " + "n" * 300, "v" * 2000, True) for i in range(40)]
    embeds = [make_embed("crashed", "t" * 500, "d" * 9000, fields, footer="f" * 3000) for _ in range(12)]
    payload = enforce_limits({"content": "c" * 3000, "embeds": embeds})
    assert limit_violations(payload) == []
    assert len(payload["embeds"]) <= 10
    assert len(payload["content"]) == 2000 and payload["content"].endswith("…")
    # Characters outside the BMP count double in UTF-16; the result must fit either way.
    emoji = enforce_limits({"embeds": [make_embed("progress", "🍰" * 300, "🍰" * 5000)]})
    assert limit_violations(emoji) == []


def test_429_retry_after_is_honoured(discord_server):  # noqa: F811
    discord_server.script.rate_limit_first = 1
    discord_server.script.retry_after = 0.4
    n = DiscordNotifier(discord_server.url)
    n.send(_msg("one"), kind="progress")
    assert discord_server.wait_for(1, timeout=10)
    n.close(timeout=5)
    first, second = discord_server.requests
    assert first.status == 429 and second.status == 204
    assert second.time - first.time >= 0.4
    assert discord_server.titles() == ["one"]


def test_429_without_a_body_uses_the_headers(discord_server):  # noqa: F811
    discord_server.script.rate_limit_first = 1
    discord_server.script.retry_after = 0.7  # sent as Retry-After: 1 and X-RateLimit-Reset-After: 0.700
    discord_server.script.retry_after_in_body = False
    n = DiscordNotifier(discord_server.url)
    n.send(_msg("one"), kind="progress")
    assert discord_server.wait_for(1, timeout=10)
    n.close(timeout=5)
    first, second = discord_server.requests
    assert second.time - first.time >= 0.7


def test_rate_limit_headers_make_the_client_wait(discord_server):  # noqa: F811
    # A bucket of 2 requests per 0.6 s; a client that reads X-RateLimit-Remaining never hits the 429.
    discord_server.script.bucket_limit = 2
    discord_server.script.bucket_window = 0.6
    n = DiscordNotifier(discord_server.url)
    for i in range(5):
        n.send(_msg(f"m{i}"), kind="progress")
    assert discord_server.wait_for(5, timeout=10)
    n.close(timeout=5)
    assert [q.status for q in discord_server.requests] == [204] * 5
    assert discord_server.titles() == [f"m{i}" for i in range(5)]


def test_5xx_is_retried_then_succeeds(discord_server):  # noqa: F811
    discord_server.script.error_first = 2
    n = DiscordNotifier(discord_server.url, backoff_base=0.05)
    n.send(_msg("after two 500s"), kind="finished", priority=Priority.CRITICAL)
    assert discord_server.wait_for(1, timeout=10)
    n.close(timeout=5)
    assert [q.status for q in discord_server.requests] == [500, 500, 204]


def test_5xx_gives_up_after_a_bound_and_logs_once(discord_server, caplog):  # noqa: F811
    discord_server.script.error_always = True
    n = DiscordNotifier(discord_server.url, max_retries=2, backoff_base=0.02)
    with caplog.at_level(logging.WARNING, logger="trainer.report.notify"):
        n.send(_msg("a"), kind="progress")
        n.send(_msg("b"), kind="progress")
        assert n.flush(timeout=10)
        n.close(timeout=5)
    assert len(discord_server.requests) == 2 * 3  # 1 try + 2 retries per message
    assert n.failed == 2 and n.sent == 0
    give_ups = [rec for rec in caplog.records if "HTTP 500" in rec.getMessage()]
    assert len(give_ups) == 1


def test_unknown_webhook_turns_notifications_off(discord_server, caplog):  # noqa: F811
    url = discord_server.url.replace(discord_server.token, "wrong-token-123456")
    n = DiscordNotifier(url)
    with caplog.at_level(logging.WARNING, logger="trainer.report.notify"):
        for i in range(3):
            n.send(_msg(f"m{i}"), kind="progress")
        n.flush(timeout=5)
        n.close(timeout=5)
    assert len(discord_server.requests) == 1 and discord_server.requests[0].status == 404
    assert sum("HTTP 404" in rec.getMessage() for rec in caplog.records) == 1
    assert "wrong-token-123456" not in caplog.text


def test_full_queue_drops_progress_first_and_never_critical(discord_server):  # noqa: F811
    discord_server.script.delay = 1.5  # hold the worker on the first message while the queue fills
    n = DiscordNotifier(discord_server.url, max_queue=3)
    n.send(_msg("started"), kind="started", priority=Priority.CRITICAL)
    deadline = time.monotonic() + 5
    while n.queued_kinds() and time.monotonic() < deadline:  # wait until the worker holds "started"
        time.sleep(0.005)
    sends = [
        ("p1", Priority.PROGRESS),
        ("p2", Priority.PROGRESS),
        ("c1", Priority.NORMAL),
        ("crashed", Priority.CRITICAL),  # drops p1
        ("p3", Priority.PROGRESS),  # drops p2
        ("finished", Priority.CRITICAL),  # drops p3
        ("c2", Priority.NORMAL),  # no progress left: drops the oldest non-critical, c1
        ("p4", Priority.PROGRESS),  # nothing less important to drop: p4 itself is dropped
        ("signal", Priority.CRITICAL),  # drops c2
        ("extra", Priority.CRITICAL),  # queue full of critical messages: kept anyway
    ]
    accepted = [n.send(_msg(kind), kind=kind, priority=p) for kind, p in sends]
    assert n.queued_kinds() == ["crashed", "finished", "signal", "extra"]
    assert accepted == [True] * 7 + [False, True, True]
    discord_server.script.delay = 0
    n.close(timeout=10)
    assert discord_server.titles() == ["started", "crashed", "finished", "signal", "extra"]


def test_close_is_bounded_with_a_dead_server(dead_webhook_url, caplog):  # noqa: F811
    n = DiscordNotifier(dead_webhook_url)
    for kind in ("started", "finished"):
        n.send(_msg(kind), kind=kind, priority=Priority.CRITICAL)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.report.notify"):
        n.close(timeout=1.0)
    assert time.monotonic() - start <= 1.0 + CLOSE_SLACK_S
    assert n.sent == 0
    assert "2 message(s) not sent within the 1.0s close timeout" in caplog.text


def test_dead_server_gives_up_and_logs_once(dead_webhook_url, caplog):  # noqa: F811
    n = DiscordNotifier(dead_webhook_url, max_retries=1, backoff_base=0.01)
    with caplog.at_level(logging.WARNING, logger="trainer.report.notify"):
        for i in range(3):
            n.send(_msg(f"m{i}"), kind="progress")
        assert n.flush(timeout=10)
        n.close(timeout=1)
    assert n.failed == 3 and n.sent == 0
    assert sum("giving up after 2 tries (ConnectError" in rec.getMessage() for rec in caplog.records) == 1
    assert "tok-dead" not in caplog.text


def test_close_is_bounded_with_a_slow_server(discord_server, monkeypatch, tmp_path):  # noqa: F811
    discord_server.script.delay = SLOW_SERVER_S  # far slower than the close timeout
    r = _reporter(monkeypatch, discord_server.url, tmp_path)
    _every_event(r)
    start = time.monotonic()
    r.close(timeout=1.0)
    assert time.monotonic() - start <= 1.0 + CLOSE_SLACK_S


def test_send_never_blocks_on_a_dead_server(dead_webhook_url, monkeypatch, tmp_path):  # noqa: F811
    r = _reporter(monkeypatch, dead_webhook_url, tmp_path)
    start = time.monotonic()
    for step in range(500):  # more than the queue holds
        r.progress(step=step, total=500, loss=1.0, tokens_per_s=1.0, eta_s=1.0, memory_gib=None)
        r.log_metrics({"train/loss": 1.0}, step)
    r.finished(final_loss=1.0, duration_s=1.0, model_dir="/out")
    # A bound on the fault path: 500 steps' worth of reporting returns within seconds, where one send that
    # waited on the dead server's retries would take 7.5 s.
    assert time.monotonic() - start < 5.0
    assert r._discord.queued_kinds()[-1] == "finished"
    r.close(timeout=0.2)


def test_no_webhook_means_no_notifier(monkeypatch, tmp_path):
    monkeypatch.delenv("DISCORD_WEBHOOK_URL", raising=False)
    monkeypatch.delenv("DISCORD_WEBHOOK", raising=False)
    r = Reporter(TrainConfig(report_to=[], output_dir=str(tmp_path)))
    _every_event(r)
    r.close(timeout=1)
    assert r._discord is None and r.run_id is None


def test_legacy_env_name_and_non_main_rank(discord_server, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.delenv("DISCORD_WEBHOOK_URL", raising=False)
    monkeypatch.setenv("DISCORD_WEBHOOK", discord_server.url)
    cfg = TrainConfig(report_to=[], output_dir=str(tmp_path), discord_progress_minutes=0)
    other = Reporter(cfg, is_main=False)
    _every_event(other)
    other.close(timeout=1)
    main = Reporter(cfg, is_main=True)
    main.finished(final_loss=None, duration_s=5, model_dir="/out/final")
    main.close(timeout=5)
    assert len(discord_server.payloads) == 1  # only rank 0 reports
    body = json.dumps(discord_server.payloads[0])
    assert "Training finished" in body and "n/a" in body


@pytest.mark.parametrize("status", [400, 413])
def test_rejected_payload_is_dropped_not_retried(discord_server, status):  # noqa: F811
    discord_server.script.error_first = 1
    discord_server.script.error_status = status
    n = DiscordNotifier(discord_server.url)
    n.send(_msg("rejected"), kind="progress")
    n.send(_msg("next"), kind="progress")
    assert discord_server.wait_for(1, timeout=5)
    n.close(timeout=5)
    assert [q.status for q in discord_server.requests] == [status, 204]
    assert discord_server.titles() == ["next"]


def test_messages_queued_at_exit_are_flushed_without_close(discord_server, tmp_path):  # noqa: F811
    # A process that ends without calling close() (an uncaught path in the loop) still sends what it queued.
    script = tmp_path / "child.py"
    script.write_text(
        "from trainer.config import TrainConfig\n"
        "from trainer.report.reporter import Reporter\n"
        "r = Reporter(TrainConfig(report_to=[], run_name='child'))\n"
        "r.finished(final_loss=0.5, duration_s=2.0, model_dir='/out/final')\n"
    )
    env = {
        **os.environ,
        "DISCORD_WEBHOOK_URL": discord_server.url,
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    env.pop("DISCORD_WEBHOOK", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert discord_server.titles() == ["Training finished: child"]
    assert discord_server.token not in done.stdout + done.stderr

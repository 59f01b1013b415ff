"""A training run that cannot start (a config, model or data error: exit 2) says so on Discord, once.

Such an error happens before the run's reporter exists, so without this a run watched on Discord would fail in
silence. Under Docker's `restart: on-failure`, which cannot skip an exit code, the same error comes back at
every restart: a start that fails exactly as the last notified one did (same working directory, command line
and message) logs that Discord was told already and posts nothing. The record of that failure lives in the
user's cache folder (`$XDG_CACHE_HOME/recipe-trainer`, in the image under /outputs, so it outlives the
container) and is cleared when a run starts training.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path

from trainer.infra.redact import redact
from trainer.report.notify import DiscordNotifier, Priority, make_embed, webhook_url_from_env

log = logging.getLogger(__name__)


def _record_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "recipe-trainer" / "start-failure.json"


def report_start_failure(message: str, argv: list[str]) -> None:
    """Post `message` (the one line the run ended with) to Discord, unless the previous failed start was this
    one; rank 0 only, and only with a webhook set. Never raises."""
    url = webhook_url_from_env()
    if not url or os.environ.get("RANK", "0") != "0":
        return
    try:
        key = hashlib.sha256(json.dumps([os.getcwd(), argv, message]).encode()).hexdigest()
        record = _record_path()
        try:
            previous = json.loads(record.read_text())
        except (OSError, ValueError):
            previous = {}
        if previous.get("key") == key:
            log.info(
                "the same error as the start at %s: Discord was told then, not again (restarts repeat it "
                "until the cause is fixed)",
                previous.get("time", "?"),
            )
            return
        notifier = DiscordNotifier(url)
        embed = make_embed("crashed", "Training could not start", f"```\n{redact(message)}\n```")
        embed["footer"] = {"text": socket.gethostname()}
        notifier.send({"embeds": [embed]}, kind="start_failed", priority=Priority.CRITICAL)
        notifier.close(timeout=10.0)
        if notifier.sent:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"key": key, "time": time.strftime("%Y-%m-%d %H:%M:%S")}))
    except Exception as e:  # a notification must never hide the error itself
        log.debug("could not report the failed start to Discord: %s", redact(repr(e)))


def forget_start_failure() -> None:
    """A run started: the next failed start is news again."""
    with contextlib.suppress(OSError):
        _record_path().unlink(missing_ok=True)

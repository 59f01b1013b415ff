"""Keep secrets out of logs, notifications, W&B config and checkpoints.

Secrets live only in the environment (see SECRET_ENV_VARS). `redact` replaces every secret value found in a
text with `***`, and also hides the token part of any Discord webhook URL, even one not taken from the
environment. `install_log_redaction` puts a filter on the root logger's handlers so log records are redacted
before they are written anywhere.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import traceback
import urllib.parse
from typing import Any

SECRET_ENV_VARS: tuple[str, ...] = (
    "WANDB_API_KEY",
    "DISCORD_WEBHOOK_URL",
    "DISCORD_WEBHOOK",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "SERVE_API_KEY",
)
MASK = "***"
# Values shorter than this are not treated as secrets: masking "1" or "abc" everywhere would wreck every
# message while protecting nothing (no real key or webhook is that short).
_MIN_SECRET_LEN = 6
# .../api[/v10]/webhooks/<id>/<token>: the token alone is enough to post to the channel.
_WEBHOOK_RE = re.compile(r"(/api(?:/v\d+)?/webhooks/\d+/)([A-Za-z0-9_\-.~%]+)")


def _raw_values() -> tuple[str, ...]:
    # Read on every call, so a secret set after start-up is still masked; what is derived from it is cached.
    return tuple(os.environ.get(name, "") for name in SECRET_ENV_VARS)


@functools.lru_cache(maxsize=8)
def _derived_values(raw_values: tuple[str, ...]) -> tuple[str, ...]:
    """The secret values set in the environment, longest first, with their URL-encoded forms."""
    values: set[str] = set()
    for value in raw_values:
        value = value.strip()
        if len(value) < _MIN_SECRET_LEN:
            continue
        values.add(value)
        values.add(urllib.parse.quote(value, safe=""))
        values.add(urllib.parse.quote(value))
        match = _WEBHOOK_RE.search(value)
        if match and len(match.group(2)) >= _MIN_SECRET_LEN:
            values.add(match.group(2))
    # Longest first, so a full URL is masked as a whole before its token part is.
    return tuple(sorted(values, key=len, reverse=True))


@functools.lru_cache(maxsize=8)
def _pattern(raw_values: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = [re.escape(v) for v in _derived_values(raw_values)]
    return re.compile("|".join(alternatives)) if alternatives else re.compile(r"(?!x)x")


def _redact_with(text: str, pattern: re.Pattern[str]) -> str:
    return _WEBHOOK_RE.sub(_mask_token, pattern.sub(MASK, text))


def _mask_token(match: re.Match[str]) -> str:
    return match.group(1) + MASK


def redact(text: str) -> str:
    """Return `text` with every secret value from the environment and every webhook token replaced by ***."""
    if not isinstance(text, str):
        text = str(text)
    return _redact_with(text, _pattern(_raw_values()))


def redact_obj(obj: Any) -> Any:
    """Redact every string inside nested dicts, lists and tuples (returns a new object)."""
    return _redact_obj(obj, _pattern(_raw_values()))


def _redact_obj(obj: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(obj, str):
        return _redact_with(obj, pattern)
    if isinstance(obj, dict):
        return {_redact_obj(k, pattern): _redact_obj(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_redact_obj(v, pattern) for v in obj)
    return obj


class RedactingFilter(logging.Filter):
    """A logging filter that rewrites each record's message, traceback and stack with secrets masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: keep the raw text rather than losing the record
            message = f"{record.msg} {record.args}"
        record.msg = redact(message)
        record.args = None
        if record.exc_info and record.exc_info[0] is not None:
            # The formatter uses exc_text when set, so the traceback is formatted (and masked) once here.
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FILTER = RedactingFilter()


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Mask secrets in everything written by the handlers of `logger` (default: the root logger).

    Idempotent; call it after logging is configured. Also quiets httpx/httpcore, which log request URLs
    (the webhook URL) at INFO.
    """
    target = logger if logger is not None else logging.getLogger()
    for handler in target.handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    for name in ("httpx", "httpcore"):
        quiet = logging.getLogger(name)
        if quiet.level < logging.WARNING:
            quiet.setLevel(logging.WARNING)
        if _FILTER not in quiet.filters:
            quiet.addFilter(_FILTER)

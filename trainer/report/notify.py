"""Discord webhook notifications from a background thread, so a training step never waits on the network.

`DiscordNotifier.send` puts a payload on a bounded queue and returns at once. A daemon thread posts it with
httpx, honouring Discord's rate limits (429 `retry_after`, `Retry-After`, `X-RateLimit-Remaining` /
`X-RateLimit-Reset-After`), retrying 5xx and connection errors with capped exponential backoff, and giving up
after a bound. Failures are logged once per kind; nothing here raises into the caller. `close(timeout)` gives
queued messages (finish, crash) a bounded chance to go out.

Payload limits (https://discord.com/developers/docs/resources/message#embed-object-embed-limits) are enforced
by `enforce_limits`, which truncates rather than letting Discord reject the message.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from trainer.infra.redact import redact, redact_obj

logger = logging.getLogger(__name__)

WEBHOOK_ENV_VARS = ("DISCORD_WEBHOOK_URL", "DISCORD_WEBHOOK")

# Discord's limits, in characters.
CONTENT_MAX = 2000
EMBEDS_MAX = 10
TITLE_MAX = 256
DESCRIPTION_MAX = 4096
FIELDS_MAX = 25
FIELD_NAME_MAX = 256
FIELD_VALUE_MAX = 1024
FOOTER_MAX = 2048
AUTHOR_MAX = 256
EMBED_TOTAL_MAX = 6000  # title + description + field names and values + footer + author, over all embeds
USERNAME_MAX = 80

ELLIPSIS = "…"

COLORS = {
    "started": 0x3498DB,
    "progress": 0x95A5A6,
    "evaluated": 0x9B59B6,
    "checkpoint": 0x1ABC9C,
    "oom": 0xE67E22,
    "nan": 0xE67E22,
    "crashed": 0xE74C3C,
    "signal": 0xF1C40F,
    "finished": 0x2ECC71,
    "hub": 0x2ECC71,
    "hub_failed": 0xE67E22,
}


class Priority(enum.IntEnum):
    """What may be dropped when the queue is full: progress first, then normal, never critical."""

    PROGRESS = 0
    NORMAL = 1
    CRITICAL = 2  # started, crashed, stopped, finished


def webhook_url_from_env() -> str | None:
    for name in WEBHOOK_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


# --------------------------------------------------------------------------------------------- payloads


def _ulen(text: str) -> int:
    # Count UTF-16 code units: never less than the code-point count, so the result is within the limit
    # whichever way Discord counts characters.
    return len(text.encode("utf-16-le")) // 2


def truncate(text: str, limit: int, *, keep: str = "head") -> str:
    """Cut `text` to at most `limit` characters, marking the cut with an ellipsis.

    keep="tail" keeps the end (for tracebacks, where the last frames and the error matter most).
    """
    text = str(text)
    if _ulen(text) <= limit:
        return text
    if limit <= 0:
        return ""
    if limit == 1:
        return ELLIPSIS
    n = limit - 1
    while n > 0:
        part = text[:n] if keep == "head" else text[-n:]
        if _ulen(part) <= limit - 1:
            break
        n -= max(1, (_ulen(part) - (limit - 1)))
    part = (text[:n] if keep == "head" else text[-n:]) if n > 0 else ""
    return part + ELLIPSIS if keep == "head" else ELLIPSIS + part


def embed_length(embed: dict[str, Any]) -> int:
    total = _ulen(embed.get("title", "")) + _ulen(embed.get("description", ""))
    for f in embed.get("fields", []):
        total += _ulen(f.get("name", "")) + _ulen(f.get("value", ""))
    total += _ulen(embed.get("footer", {}).get("text", ""))
    total += _ulen(embed.get("author", {}).get("name", ""))
    return total


def enforce_limits(payload: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of `payload` truncated to Discord's limits (never rejected for size)."""
    out = dict(payload)
    if "content" in out:
        out["content"] = truncate(out["content"], CONTENT_MAX)
    if "username" in out:
        out["username"] = truncate(out["username"], USERNAME_MAX)
    embeds = []
    for raw in list(out.get("embeds", []))[:EMBEDS_MAX]:
        e = dict(raw)
        if "title" in e:
            e["title"] = truncate(e["title"], TITLE_MAX)
        if "description" in e:
            e["description"] = truncate(e["description"], DESCRIPTION_MAX, keep=e.pop("_keep", "head"))
        e.pop("_keep", None)
        if "footer" in e:
            e["footer"] = {**e["footer"], "text": truncate(e["footer"].get("text", ""), FOOTER_MAX)}
        if "author" in e:
            e["author"] = {**e["author"], "name": truncate(e["author"].get("name", ""), AUTHOR_MAX)}
        e["fields"] = [
            {
                **f,
                "name": truncate(f.get("name", "") or "-", FIELD_NAME_MAX),
                "value": truncate(f.get("value", "") or "-", FIELD_VALUE_MAX),
            }
            for f in e.get("fields", [])[:FIELDS_MAX]
        ]
        if not e["fields"]:
            del e["fields"]
        embeds.append(e)
    _fit_total(embeds)
    if embeds:
        out["embeds"] = embeds
    else:
        out.pop("embeds", None)
    return out


def _fit_total(embeds: list[dict[str, Any]]) -> None:
    """Shrink descriptions, then the longest field values, until all embeds together fit in 6000."""
    excess = sum(embed_length(e) for e in embeds) - EMBED_TOTAL_MAX
    if excess <= 0:
        return
    # Descriptions first, longest first: they hold tracebacks and generated text.
    for e in sorted(embeds, key=lambda e: _ulen(e.get("description", "")), reverse=True):
        if excess <= 0:
            return
        desc = e.get("description", "")
        if desc:
            new = truncate(desc, max(0, _ulen(desc) - excess))
            excess -= _ulen(desc) - _ulen(new)
            e["description"] = new
    while excess > 0:
        candidates = [(f, e) for e in embeds for f in e.get("fields", []) if _ulen(f["value"]) > 1]
        if not candidates:
            break
        f, _ = max(candidates, key=lambda fe: _ulen(fe[0]["value"]))
        new = truncate(f["value"], max(1, _ulen(f["value"]) - excess))
        excess -= _ulen(f["value"]) - _ulen(new)
        f["value"] = new
    while excess > 0:  # still over (e.g. 10 embeds of long titles): drop the last embeds
        if len(embeds) <= 1:
            e = embeds[0]
            e["title"] = truncate(e.get("title", ""), max(1, _ulen(e.get("title", "")) - excess))
            e.pop("fields", None)
            break
        excess -= embed_length(embeds.pop())


def make_embed(
    kind: str,
    title: str,
    description: str = "",
    fields: dict[str, Any] | list[tuple[str, Any, bool]] | None = None,
    footer: str | None = None,
    keep: str = "head",
) -> dict[str, Any]:
    """One embed; `fields` maps name -> value (inline) or is a list of (name, value, inline)."""
    embed: dict[str, Any] = {"title": title, "color": COLORS.get(kind, 0x95A5A6)}
    if description:
        embed["description"] = description
        embed["_keep"] = keep
    items = list(fields.items()) if isinstance(fields, dict) else list(fields or [])
    embed["fields"] = [
        {"name": str(item[0]), "value": str(item[1]), "inline": bool(item[2]) if len(item) > 2 else True}
        for item in items
    ]
    if footer:
        embed["footer"] = {"text": footer}
    embed["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return embed


# ---------------------------------------------------------------------------------------------- client


@dataclass(order=True)
class _Message:
    seq: int
    payload: dict[str, Any] = field(compare=False)
    kind: str = field(compare=False)
    priority: Priority = field(compare=False)


class DiscordNotifier:
    """Posts webhook messages from a daemon thread through a bounded queue. Thread-safe; never raises."""

    def __init__(
        self,
        url: str,
        *,
        max_queue: int = 256,
        request_timeout: float = 5.0,
        max_retries: int = 4,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        max_rate_limit_wait: float = 60.0,
        username: str | None = "recipe-trainer",
    ):
        self.url = url
        self.max_queue = max(1, max_queue)
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.max_rate_limit_wait = max_rate_limit_wait
        self.username = username
        self.sent = 0
        self.dropped: collections.Counter[str] = collections.Counter()  # reason -> count
        self.failed = 0
        self._queue: collections.deque[_Message] = collections.deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._closing = False
        self._deadline: float | None = None  # monotonic time after which the worker stops sending
        self._next_send_at = 0.0  # monotonic; set by rate-limit headers
        self._logged_kinds: set[str] = set()
        self._disabled = False
        self._busy = False
        self._client = None
        self._thread = threading.Thread(target=self._run, name="discord-notifier", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------------------

    def send(
        self, payload: dict[str, Any], *, kind: str = "message", priority: Priority = Priority.NORMAL
    ) -> bool:
        """Queue a payload; it is redacted and truncated in the worker. Returns False if dropped at once."""
        try:
            with self._cond:
                if self._closing or self._disabled:
                    self.dropped["closed" if self._closing else "disabled"] += 1
                    return False
                if len(self._queue) >= self.max_queue and not self._make_room(priority):
                    self.dropped["queue_full"] += 1
                    self._log_once("queue_full", "Discord queue is full; dropping %s message", kind)
                    return False
                self._seq += 1
                self._queue.append(_Message(self._seq, payload, kind, priority))
                self._cond.notify_all()
            return True
        except Exception as e:  # never raise into the training loop
            self._log_once("send", "could not queue a Discord message: %s", redact(repr(e)))
            return False

    def _make_room(self, incoming: Priority) -> bool:
        """Drop the oldest progress message, else the oldest non-critical one. Caller holds the lock."""
        for victim_priority in (Priority.PROGRESS, Priority.NORMAL):
            if victim_priority > incoming and incoming != Priority.CRITICAL:
                break  # never drop a more important message to make room for a less important one
            for msg in self._queue:
                if msg.priority == victim_priority:
                    self._queue.remove(msg)
                    self.dropped["queue_full"] += 1
                    self._log_once(
                        "queue_full", "Discord queue is full; dropped an older %s message", msg.kind
                    )
                    return True
        # Full of critical messages: a critical one is still kept (there are only a handful per run).
        return incoming == Priority.CRITICAL

    def queued_kinds(self) -> list[str]:
        """Kinds of the messages waiting in the queue, oldest first (not counting one being sent)."""
        with self._cond:
            return [m.kind for m in self._queue]

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty (or `timeout`); True if everything queued has been handled."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued within `timeout` seconds, then stop (older progress messages are dropped)."""
        try:
            start = time.monotonic()
            deadline = start + max(0.0, timeout)
            with self._cond:
                if not self._closing:
                    self._closing = True
                    self._deadline = deadline
                    # Older progress messages are stale by now; the newest one still says where the run is.
                    stale = [m for m in self._queue if m.priority == Priority.PROGRESS][:-1]
                    for m in stale:
                        self._queue.remove(m)
                    self.dropped["stale_progress"] += len(stale)
                self._cond.notify_all()
            self._thread.join(max(0.0, deadline - time.monotonic()))
            with self._cond:
                left = len(self._queue) + (1 if self._busy else 0) + self.dropped["close_timeout"]
            # How long closing held the exit up: bounded by `timeout` (tests check it from this line).
            waited = time.monotonic() - start
            if left:
                logger.warning(
                    "Discord: %d message(s) not sent within the %.1fs close timeout (waited %.1f s)",
                    left,
                    timeout,
                    waited,
                )
            else:
                logger.debug("Discord: nothing left to send; closing waited %.1f s", waited)
        except Exception as e:
            logger.warning("Discord: error while closing the notifier: %s", redact(repr(e)))

    # -- worker side ------------------------------------------------------------------------------

    def _log_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            logger.warning(msg, *args)

    def _time_left(self) -> float:
        if self._deadline is None:
            return float("inf")
        return self._deadline - time.monotonic()

    def _sleep(self, seconds: float) -> None:
        """Sleep, but never past the close deadline; wakes early when close() is called."""
        end = time.monotonic() + seconds
        with self._cond:
            while True:
                left = min(end - time.monotonic(), self._time_left())
                if left <= 0:
                    return
                self._cond.wait(left)
                if self._deadline is not None and self._time_left() <= 0:
                    return

    def _run(self) -> None:
        try:
            import httpx

            self._client = httpx.Client(
                timeout=httpx.Timeout(self.request_timeout, connect=min(3.0, self.request_timeout)),
                follow_redirects=False,
                headers={"User-Agent": "recipe-t5-trainer/0.1 (Discord webhook notifier)"},
            )
        except Exception as e:
            self._disabled = True
            self._log_once("client", "Discord notifications disabled: cannot create an HTTP client: %s", e)
            return
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing:
                        self._cond.wait()
                    if not self._queue or self._time_left() <= 0:
                        if self._queue:
                            self.dropped["close_timeout"] += len(self._queue)
                            self._queue.clear()
                        return
                    msg = self._queue.popleft()
                    self._busy = True
                try:
                    self._deliver(msg)
                except Exception as e:  # a bug must not kill notifications for the rest of the run
                    self.failed += 1
                    self._log_once("bug", "Discord: unexpected error, message dropped: %s", redact(repr(e)))
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        finally:
            with contextlib.suppress(Exception):
                self._client.close()

    def _deliver(self, msg: _Message) -> None:
        if self._disabled:
            self.dropped["disabled"] += 1
            return
        payload = enforce_limits(redact_obj(msg.payload))
        payload.setdefault("allowed_mentions", {"parse": []})  # never ping @everyone or anyone else
        if self.username:
            payload.setdefault("username", self.username)
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        failures = 0
        rate_limited = 0
        while True:
            wait = self._next_send_at - time.monotonic()
            if wait > 0:
                if wait > self._time_left():
                    return self._give_up(
                        msg, "close_timeout", "Discord: rate limit outlasts the close timeout"
                    )
                self._sleep(wait)
            left = self._time_left()
            if left <= 0.05:
                return self._give_up(msg, "close_timeout", "Discord: close timeout reached, message dropped")
            try:
                response = self._client.post(
                    self.url,
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=min(self.request_timeout, left),
                )
            except Exception as e:  # connection refused, timeout, DNS, TLS ...
                failures += 1
                kind = type(e).__name__
                if failures > self.max_retries:
                    return self._give_up(
                        msg,
                        f"error:{kind}",
                        f"Discord: giving up after {failures} tries ({kind}: {redact(str(e))})",
                    )
                self._sleep(self._backoff(failures))
                continue
            self._note_rate_headers(response)
            status = response.status_code
            if 200 <= status < 300:
                self.sent += 1
                return None
            if status == 429:
                rate_limited += 1
                retry_after = self._retry_after(response)
                # Later messages wait too, even when this one is given up: sending during a ban prolongs it.
                self._next_send_at = max(self._next_send_at, time.monotonic() + retry_after)
                if rate_limited > self.max_retries + 4 or retry_after > self.max_rate_limit_wait:
                    return self._give_up(
                        msg, "429", f"Discord: rate limited (retry_after={retry_after:.1f}s)"
                    )
                continue
            if status >= 500:
                failures += 1
                if failures > self.max_retries:
                    return self._give_up(
                        msg, f"http:{status}", f"Discord: HTTP {status} after {failures} tries"
                    )
                self._sleep(self._backoff(failures))
                continue
            # 4xx: the request itself is wrong, or the webhook is gone. Retrying cannot help.
            detail = redact(response.text[:300])
            if status in (401, 403, 404):
                self._disabled = True
                return self._give_up(
                    msg,
                    f"http:{status}",
                    f"Discord: webhook rejected (HTTP {status}: {detail}); notifications off",
                )
            return self._give_up(msg, f"http:{status}", f"Discord: HTTP {status}, message dropped: {detail}")

    def _give_up(self, msg: _Message, kind: str, text: str) -> None:
        self.failed += 1
        self.dropped[kind] += 1
        if kind != "close_timeout":  # close() reports those in one line
            self._log_once(kind, "%s (%s message; further %s failures are not logged)", text, msg.kind, kind)

    def _backoff(self, failures: int) -> float:
        return min(self.backoff_cap, self.backoff_base * (2 ** (failures - 1)))

    @staticmethod
    def _retry_after(response: Any) -> float:
        """Seconds to wait after a 429: JSON `retry_after`, else `Retry-After`, else the reset header."""
        candidates = []
        try:
            data = response.json()
            if isinstance(data, dict) and data.get("retry_after") is not None:
                candidates.append(data["retry_after"])
        except Exception:
            pass
        candidates += [response.headers.get("Retry-After"), response.headers.get("X-RateLimit-Reset-After")]
        for value in candidates:
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                continue
            if seconds >= 0:
                return seconds
        return 1.0

    def _note_rate_headers(self, response: Any) -> None:
        """When the bucket is empty (`X-RateLimit-Remaining: 0`), hold the next send until it resets."""
        remaining = response.headers.get("X-RateLimit-Remaining")
        reset_after = response.headers.get("X-RateLimit-Reset-After")
        if remaining is None or reset_after is None:
            return
        try:
            if int(float(remaining)) <= 0:
                self._next_send_at = max(self._next_send_at, time.monotonic() + float(reset_after))
        except ValueError:
            pass

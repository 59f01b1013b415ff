"""A real HTTP server on 127.0.0.1 that follows Discord's webhook contract, for tests.

POST /api/webhooks/<id>/<token> with a JSON body answers 204 No Content, with Discord's `X-RateLimit-*`
headers. It rejects what Discord rejects (400 for an empty or oversized message, 404 for an unknown
webhook), and can be scripted: 429 with a `retry_after` body and headers for the first N requests, 500 for
the first N, a slow mode, and an optional rate-limit bucket (N requests per window; over it, 429).

Use the fixtures from a test module or conftest:

    from discord_server import dead_webhook_url, discord_server  # noqa: F401

`discord_server` yields a running `DiscordServer`; `dead_webhook_url` is a webhook URL on a port where
nothing listens. `limit_violations(payload)` lists how a payload breaks Discord's limits, `files_containing`
finds secrets left in a run's output directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

# Discord's documented limits, checked the way Discord checks them (400 when exceeded).
LIMITS = {
    "content": 2000,
    "embeds": 10,
    "title": 256,
    "description": 4096,
    "fields": 25,
    "field_name": 256,
    "field_value": 1024,
    "footer": 2048,
    "author": 256,
    "embed_total": 6000,
    "username": 80,
}


def _ulen(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def limit_violations(payload: Any) -> list[str]:
    """Every way `payload` breaks Discord's message limits (empty list: Discord would accept it)."""
    if not isinstance(payload, dict):
        return ["body is not a JSON object"]
    errors = []
    content = payload.get("content") or ""
    embeds = payload.get("embeds") or []
    if not content and not embeds:
        errors.append("empty message (no content, no embeds)")
    if _ulen(content) > LIMITS["content"]:
        errors.append(f"content has {_ulen(content)} > 2000 characters")
    if _ulen(payload.get("username") or "") > LIMITS["username"]:
        errors.append("username too long")
    if len(embeds) > LIMITS["embeds"]:
        errors.append(f"{len(embeds)} > 10 embeds")
    total = 0
    for i, e in enumerate(embeds):
        for key, limit in (("title", "title"), ("description", "description")):
            n = _ulen(e.get(key) or "")
            total += n
            if n > LIMITS[limit]:
                errors.append(f"embed {i} {key} has {n} > {LIMITS[limit]} characters")
        fields = e.get("fields") or []
        if len(fields) > LIMITS["fields"]:
            errors.append(f"embed {i} has {len(fields)} > 25 fields")
        for j, f in enumerate(fields):
            name, value = f.get("name") or "", f.get("value") or ""
            if not name or not value:
                errors.append(f"embed {i} field {j} has an empty name or value")
            if _ulen(name) > LIMITS["field_name"]:
                errors.append(f"embed {i} field {j} name has {_ulen(name)} > 256 characters")
            if _ulen(value) > LIMITS["field_value"]:
                errors.append(f"embed {i} field {j} value has {_ulen(value)} > 1024 characters")
            total += _ulen(name) + _ulen(value)
        footer = (e.get("footer") or {}).get("text") or ""
        author = (e.get("author") or {}).get("name") or ""
        if _ulen(footer) > LIMITS["footer"]:
            errors.append(f"embed {i} footer too long")
        if _ulen(author) > LIMITS["author"]:
            errors.append(f"embed {i} author name too long")
        total += _ulen(footer) + _ulen(author)
    if total > LIMITS["embed_total"]:
        errors.append(f"embeds hold {total} > 6000 characters in total")
    return errors


@dataclass
class Request:
    """One request as the server saw it."""

    time: float  # time.monotonic() when it arrived
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the server answered
    json: Any = None

    @property
    def title(self) -> str | None:
        try:
            return self.json["embeds"][0]["title"]
        except (TypeError, KeyError, IndexError):
            return None


@dataclass
class Script:
    """How the server answers; change the fields at any time (guarded by the server's lock)."""

    rate_limit_first: int = 0  # answer 429 to the first N POSTs
    retry_after: float = 0.5
    retry_after_in_body: bool = True  # False: only the Retry-After / X-RateLimit-Reset-After headers say it
    error_first: int = 0  # answer `error_status` to the first N POSTs (after the 429s)
    error_status: int = 500
    error_always: bool = False
    delay: float = 0.0  # seconds to wait before answering
    bucket_limit: int | None = None  # at most this many POSTs per `bucket_window`, else 429 (Discord-like)
    bucket_window: float = 2.0
    seen: int = field(default=0, repr=False)


class DiscordServer:
    """A webhook endpoint on 127.0.0.1:<free port>, serving from a thread. Records every request."""

    webhook_id = "112233445566778899"

    def __init__(self) -> None:
        self.token = "tok-" + secrets.token_urlsafe(40)
        self.script = Script()
        self.requests: list[Request] = []
        self._lock = threading.Condition()
        self._bucket: list[float] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                server._handle(self)

            def do_GET(self) -> None:
                self._reply_json(405, {"message": "405: Method Not Allowed", "code": 0})

            def _reply_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if data:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if data:
                    self.wfile.write(data)

        self._handler_cls = Handler
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False  # close() must not wait for a deliberately slow answer
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.05,), name="discord-server", daemon=True
        )
        self._thread.start()

    # -- public ------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/webhooks/{self.webhook_id}/{self.token}"

    @property
    def payloads(self) -> list[Any]:
        """JSON bodies of the messages that were accepted (2xx), in arrival order."""
        with self._lock:
            return [r.json for r in self.requests if 200 <= r.status < 300]

    @property
    def accepted(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if 200 <= r.status < 300]

    def titles(self) -> list[str | None]:
        return [r.title for r in self.accepted]

    def wait_for(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until at least `n` messages were accepted; False on timeout."""
        end = time.monotonic() + timeout
        with self._lock:
            while sum(1 for r in self.requests if 200 <= r.status < 300) < n:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- serving -----------------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        arrived = time.monotonic()
        with self._lock:
            script = self.script
            script.seen += 1
            n = script.seen
            delay = script.delay
        if delay:
            time.sleep(delay)
        status, reply, headers = self._decide(h.path, h.headers, body, n, arrived)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        with self._lock:
            self.requests.append(Request(arrived, "POST", h.path, dict(h.headers), body, status, parsed))
            self._lock.notify_all()
        # OSError: the client gave up (timed out) before the answer, which is its right.
        with contextlib.suppress(OSError):
            h._reply_json(status, reply, headers)  # type: ignore[attr-defined]

    def _decide(self, path: str, headers: Any, body: bytes, n: int, now: float):
        base = path.split("?", 1)[0].rstrip("/")
        if base != f"/api/webhooks/{self.webhook_id}/{self.token}":
            return 404, {"message": "Unknown Webhook", "code": 10015}, {}
        if "application/json" not in (headers.get("Content-Type") or ""):
            return 400, {"message": "Cannot send an empty message", "code": 50006}, {}
        s = self.script
        if n <= s.rate_limit_first:
            body, limit_headers = self._rate_limited(s.retry_after)
            if not s.retry_after_in_body:
                del body["retry_after"]
            return 429, body, limit_headers
        if s.error_always or n <= s.rate_limit_first + s.error_first:
            return s.error_status, {"message": "500: Internal Server Error", "code": 0}, {}
        try:
            payload = json.loads(body)
        except ValueError:
            return 400, {"message": "The request body contains invalid JSON.", "code": 50109}, {}
        errors = limit_violations(payload)
        if errors:
            return 400, {"message": "Invalid Form Body", "code": 50035, "errors": errors}, {}
        with self._lock:
            remaining = 5
            if s.bucket_limit is not None:
                self._bucket = [t for t in self._bucket if now - t < s.bucket_window]
                if len(self._bucket) >= s.bucket_limit:
                    wait = s.bucket_window - (now - self._bucket[0])
                    return 429, *self._rate_limited(wait)
                self._bucket.append(now)
                remaining = s.bucket_limit - len(self._bucket)
                reset_after = s.bucket_window - (now - self._bucket[0])
            else:
                reset_after = 2.0
        return 204, None, self._bucket_headers(remaining, reset_after, s.bucket_limit or 5)

    @staticmethod
    def _bucket_headers(remaining: int, reset_after: float, limit: int) -> dict[str, str]:
        return {
            "X-RateLimit-Limit": str(limit),
            "X-RateLimit-Remaining": str(max(0, remaining)),
            "X-RateLimit-Reset": f"{time.time() + reset_after:.3f}",
            "X-RateLimit-Reset-After": f"{reset_after:.3f}",
            "X-RateLimit-Bucket": "test-bucket",
        }

    def _rate_limited(self, retry_after: float):
        body = {
            "message": "You are being rate limited.",
            "retry_after": round(retry_after, 3),
            "global": False,
        }
        headers = {
            "Retry-After": str(max(1, math.ceil(retry_after))),
            "X-RateLimit-Scope": "user",
            **self._bucket_headers(0, retry_after, 5),
        }
        return body, headers


def files_containing(root: str | Path, needles: list[str]) -> list[str]:
    """'path: needle' for every file under `root` that holds one of `needles` (secrets a test looks for)."""
    hits = []
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {needle[:6]}…" for needle in needles if needle and needle.encode() in data]
    return hits


def dead_url() -> str:
    """A webhook URL on a local port where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/api/webhooks/{DiscordServer.webhook_id}/tok-dead-{secrets.token_hex(16)}"


@pytest.fixture
def discord_server():
    server = DiscordServer()
    yield server
    server.close()


@pytest.fixture
def dead_webhook_url() -> str:
    return dead_url()

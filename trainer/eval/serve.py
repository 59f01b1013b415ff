"""`trainer serve --model DIR`: a trained recipe model behind a JSON API and one web page.

    POST /generate  {"ingredients": ["2 eggs", "1 cup flour"] or "2 eggs; 1 cup flour", "title": ...,
                     Hugging Face decoding options (max_new_tokens, num_beams, do_sample, temperature, top_p,
                     top_k, repetition_penalty, no_repeat_ngram_size), "stream": false}
                    -> {"source", "generated", "title", "ingredients", "directions"}, as `trainer generate`'s
                       rows; with "stream": true, server-sent events: `token` {"delta"} as the recipe is
                       written, then `done` (the row) or `error` {"error"}
    GET /           the page: type ingredients, read the recipe as it is written
    GET /health     {"status": "ok", ...}

The prompt is rendered and tokenized by the training loader's renderer from the model's recipe_template.json,
as `trainer generate` does (`cli_record`), and decoded with its options (`decoding_settings`).

Continuous batching. One thread runs the decoding engine (trainer.eval.decoding) in a loop: before each
decoder step, waiting requests take free slots (the encoder runs for them together), every busy slot
advances by one token, streamed requests get the text their token adds, and finished ones leave and free
their slot. A request never waits for another's recipe to end; requests with different decoding options
share the steps. Beam search is Hugging Face's `generate` (its beams reorder until the end): such a request
runs alone between two steps and is answered in one piece. The queue of waiting requests is bounded
(`--max-waiting`): a full server answers 503 with a Retry-After, at once.

With SERVE_API_KEY in the environment, the page and the API want it: `Authorization: Bearer KEY` from API
clients, or HTTP Basic with the key as the password from a browser (which asks once and sends it with the
page's own requests); /health answers without it (health checks), with its status alone. The key is never
logged.

Why Starlette on uvicorn: the API is one JSON endpoint, a stream and a page. Starlette (ASGI, BSD, stable
1.x, what FastAPI, vLLM's and Gradio's servers are built on) gives routing and streamed responses, and uvicorn
is the reference ASGI server; both are small and pure Python. FastAPI would add pydantic's second set of
rules for the decoding options, which `trainer.eval.generate` already checks for the CLI, and answer with its
own error format; aiohttp brings its own server and C-extension dependencies; Flask (WSGI) has no event loop
to gather concurrent requests into a batch; Gradio is a UI framework with many dependencies and its own API.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import difflib
import hmac
import json
import logging
import math
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from trainer.data.prompt import parse_recipe
from trainer.eval.generate import (
    DECODING_OPTIONS,
    ModelDir,
    UsageError,
    add_model_arguments,
    batch_token_budget,
    check_decoding,
    cli_record,
    decoding_given,
    decoding_settings,
    generate_ids,
    load_for_generation,
    open_model_dir,
    prompt_fields,
    strict_subparser,
)
from trainer.eval.serve_page import page

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024  # a request is a list of ingredients and a few numbers
MAX_BEAMS = 8
REQUEST_FIELDS = ("ingredients", "title", "stream")
DEFAULT_PORT = 8000
API_KEY_ENV = "SERVE_API_KEY"


class BadRequest(ValueError):
    """A request the server refuses: one line, answered with `status`."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass
class Job:
    """One request on its way through the model thread. `events` receives ("token", delta) while the
    recipe is written (streamed requests), then ("done", row) or ("error", message)."""

    record: dict[str, Any]  # rendered by the loader: source, source_ids
    kwargs: dict[str, Any]  # model.generate's keyword arguments
    decoding: Any  # the engine's trainer.eval.decoding.Decoding, or why only Hugging Face's generate runs it
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[int] = field(default_factory=list)  # the tokens so far (streamed requests)
    sent: str = ""  # the text sent so far
    cancelled: bool = False  # the client went away (or was answered): nothing more to make

    def send(self, kind: str, value: Any) -> None:
        """From the model thread: an event for the request's coroutine."""
        with contextlib.suppress(RuntimeError):  # the server stopped, its event loop closed: nobody waits
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Batcher:
    """The model thread: requests in, the decoding engine's steps, streamed tokens and rows out."""

    def __init__(
        self, model, model_dir: ModelDir, max_batch_tokens: int, max_new_tokens: int, max_waiting: int
    ):
        from tokenizers import Tokenizer

        from trainer.eval.decoding import DecodingEngine

        self.model, self.model_dir = model, model_dir
        self.tokenizer = Tokenizer.from_file(os.fspath(model_dir.tokenizer_file))
        self.max_batch_tokens, self.max_new_tokens = max_batch_tokens, max_new_tokens
        self.pad_id = model.config.pad_token_id or 0
        source = model_dir.template.max_source_length
        slots = max(1, max_batch_tokens // (source + max_new_tokens + 1))
        self.engine = DecodingEngine(
            model, slots=slots, max_source_tokens=source, max_new_tokens=max_new_tokens
        )
        log.info(
            "decoding: %d requests at a time (prompts of up to %d tokens, %d new tokens), caches %.2f GiB%s",
            slots,
            source,
            max_new_tokens,
            self.engine.cache_bytes / 2**30,
            ", CUDA graphs" if self.engine.use_graphs else "",
        )
        self.waiting: queue.Queue[Job] = queue.Queue(maxsize=max_waiting)
        self.active: dict[int, Job] = {}  # slot -> its request
        self.prompts = 0
        self.most_at_once = 0  # the most requests that shared a step
        self.finished_at: list[float] = []  # when recent requests finished (the 503's Retry-After)
        self._thread = threading.Thread(target=self._run, name="serve-model", daemon=True)

    def start(self) -> None:
        """Start the model thread: from now on it admits what waits and decodes."""
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue `job`; False when the queue is full."""
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            return False
        return True

    def retry_after_s(self) -> int:
        """Seconds until the queue has probably drained, from the last minute's pace (1 to 60)."""
        now = time.monotonic()
        recent = [t for t in self.finished_at if now - t < 60]
        per_s = len(recent) / 60 if recent else 0.0
        return int(min(60, max(1, math.ceil(self.waiting.qsize() / per_s)))) if per_s else 5

    def _run(self) -> None:
        while True:
            for job in self._admit():
                self._generate_with_hf(job)
            if not self.active:
                continue
            self.most_at_once = max(self.most_at_once, len(self.active))
            try:
                self.engine.step()
                tokens, done, _ = self.engine.tokens_now()
            except Exception as e:  # out of memory and the like: these requests fail, not the server
                self._fail(list(self.active), e)
                continue
            for slot, job in list(self.active.items()):
                if job.cancelled:
                    self.engine.release(slot)
                    del self.active[slot]
                    continue
                if job.stream:  # every busy slot made one token (an end-of-sequence token adds no text)
                    self._stream(job, tokens[slot])
                if done[slot]:
                    self._finish(slot, job)

    def _admit(self) -> list[Job]:
        """Start waiting requests in free slots (waiting for one when none runs); returns the requests only
        Hugging Face's generate runs (beam search)."""
        free = self.engine.free_slots()
        starting: list[Job] = []
        others: list[Job] = []
        while len(starting) < len(free):
            try:
                job = self.waiting.get(block=not self.active and not starting and not others)
            except queue.Empty:
                break
            (others if isinstance(job.decoding, str) else starting).append(job)
            if others:
                break  # run it before taking more
        if starting:
            slots = free[: len(starting)]
            try:
                self.engine.start(
                    slots, [job.record["source_ids"] for job in starting], [job.decoding for job in starting]
                )
            except Exception:
                # One request's failure must not fail the others that joined at this step: each alone.
                for slot, job in zip(slots, starting, strict=True):
                    self._start_alone(slot, job)
            else:
                self.active.update(zip(slots, starting, strict=True))
        return others

    def _start_alone(self, slot: int, job: Job) -> None:
        try:
            self.engine.start([slot], [job.record["source_ids"]], [job.decoding])
        except Exception as e:
            self.engine.release(slot)
            log.warning("generation failed for 1 request: %s", _failure(e))
            job.send("error", _failure(e))
            return
        self.active[slot] = job

    def _stream(self, job: Job, token: int) -> None:
        """Send a streamed request the text its newest token adds (the whole so far decoded at once:
        SentencePiece joins pieces across tokens)."""
        job.ids.append(token)
        text = self.tokenizer.decode(job.ids, skip_special_tokens=True)
        # A piece that changes the text before it (rare) waits: the "done" event has the whole recipe.
        if text.startswith(job.sent) and len(text) > len(job.sent):
            job.send("token", text[len(job.sent) :])
            job.sent = text

    def _finish(self, slot: int, job: Job) -> None:
        ids = self.engine.take(slot)
        del self.active[slot]
        self._answer(job, ids)

    def _answer(self, job: Job, ids: list[int]) -> None:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        parsed = parse_recipe(text, self.model_dir.template.target_template)
        fields = parsed.fields() if parsed else {"title": None, "ingredients": None, "directions": None}
        job.send("done", {"source": job.record["source"], "generated": text, **fields})
        self.prompts += 1
        now = time.monotonic()
        self.finished_at = [t for t in self.finished_at if now - t < 60] + [now]

    def _fail(self, slots: list[int], error: Exception) -> None:
        log.warning("generation failed for %d request(s): %s", len(slots), _failure(error))
        for slot in slots:
            self.engine.release(slot)
            self.active.pop(slot).send("error", _failure(error))

    def _generate_with_hf(self, job: Job) -> None:
        """A request only Hugging Face's generate runs (beam search), alone, in one piece."""
        try:
            (ids,) = generate_ids(
                self.model,
                [job.record["source_ids"]],
                pad_id=self.pad_id,
                max_batch_tokens=self.max_batch_tokens,
                **job.kwargs,
            )
        except Exception as e:
            log.warning("generation failed for 1 request: %s", _failure(e))
            job.send("error", _failure(e))
            return
        self._answer(job, ids)


def _failure(e: Exception) -> str:
    return f"generation failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _typed(name: str, value: Any, kind: type) -> Any:
    """A decoding option's JSON value as `kind`, or BadRequest: true/false for bool, a whole number for int
    (1.0 too), any number for float."""
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # a whole number past 1e308
            raise BadRequest(
                f"{name} must be a number a float holds, got one of {len(str(value))} digits"
            ) from None
    wanted = {bool: "true or false", int: "a whole number", float: "a number"}[kind]
    raise BadRequest(f"{name} must be {wanted}, got {json.dumps(value)}")


def _check_unicode(value: Any) -> None:
    """BadRequest for a string anywhere in a request that UTF-8 cannot hold (a lone surrogate, `"\\ud800"`):
    JSON's escapes allow one, and the tokenizer would fail on it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(
                "the body has a string that is not valid Unicode (a lone surrogate escape)"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)
    elif isinstance(value, list):
        for v in value:
            _check_unicode(v)


class RecipeServer:
    """What the routes share: the model directory, its renderer, the server's decoding defaults, the
    batcher."""

    def __init__(
        self, model_dir: ModelDir, batcher: Batcher, defaults: dict[str, Any], device: str, api_key: str = ""
    ):
        self.model_dir, self.batcher, self.defaults, self.device = model_dir, batcher, defaults, device
        self.api_key = api_key
        self.renderer = model_dir.template.renderer(model_dir.tokenizer_file)
        self.needs = prompt_fields(model_dir.template)

    def parse(self, body: bytes) -> tuple[dict[str, Any], dict[str, Any], Any, bool]:
        """A request body as (the rendered prompt, model.generate's options, the engine's Decoding or why
        Hugging Face's generate runs it, whether to stream), or BadRequest naming what is wrong."""
        try:
            request = json.loads(body)
        except ValueError as e:  # also a body that is not UTF-8
            raise BadRequest(f"the body is not JSON ({e})") from None
        except RecursionError:
            raise BadRequest("the body is nested too deeply to be a request") from None
        if not isinstance(request, dict):
            raise BadRequest(
                'the body must be a JSON object, e.g. {"ingredients": ["2 eggs", "1 cup flour"]}'
            )
        _check_unicode(request)
        known = (*REQUEST_FIELDS, *DECODING_OPTIONS)
        for key in request:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise BadRequest(f"unknown field {key!r}{hint}; the fields are {', '.join(known)}")
        ingredients = request.get("ingredients")
        if isinstance(ingredients, list) and all(isinstance(i, str) for i in ingredients):
            ingredients = "; ".join(ingredients)
        elif ingredients is not None and not isinstance(ingredients, str):
            raise BadRequest('ingredients must be a list of strings or one string, items separated by "; "')
        if "ingredients" in self.needs and not (ingredients or "").replace(";", "").strip():
            raise BadRequest('ingredients is empty: give a list, or items separated by "; "')
        title = request.get("title")
        if title is not None and not isinstance(title, str):
            raise BadRequest("title must be a string")
        stream = request.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be true or false")
        given = dict(self.defaults)
        for name, option in DECODING_OPTIONS.items():
            if request.get(name) is not None:
                given[name] = _typed(name, request[name], option.kind)
        # This server's own bounds first: they are lower than the options' and say how to raise them.
        self._check_new_tokens(given.get("max_new_tokens", 0))
        if given.get("num_beams", 1) > MAX_BEAMS:
            raise BadRequest(f"num_beams must be <= {MAX_BEAMS}, got {given['num_beams']}")
        try:
            check_decoding(given, flag="")
            record = cli_record(self.renderer, self.model_dir.template, title, ingredients, flag="")
        except UsageError as e:
            raise BadRequest(str(e)) from None
        from trainer.eval.decoding import Decoding

        kwargs, _ = decoding_settings(self.batcher.model, self.model_dir.template, given)
        decoding = Decoding.of(self.batcher.model, kwargs)
        # Again for what the request did not give (the model's generation_config, the training's lengths).
        self._check_new_tokens(
            decoding.max_new_tokens if isinstance(decoding, Decoding) else kwargs["max_new_tokens"]
        )
        return record, kwargs, decoding, stream

    def _check_new_tokens(self, new_tokens: int) -> None:
        limit = self.batcher.max_new_tokens
        if new_tokens > limit:
            raise BadRequest(
                f"max_new_tokens must be <= {limit} on this server (start it with --max_new_tokens N for "
                f"longer recipes), got {new_tokens}"
            )

    def authorized(self, request) -> bool:
        """Whether `request` carries the API key (always, when none is set): `Authorization: Bearer KEY`, or
        HTTP Basic with the key as the password (any user name)."""
        if not self.api_key:
            return True
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        given = value.strip()
        if scheme.lower() == "basic":
            try:
                given = base64.b64decode(given, validate=True).decode("utf-8").partition(":")[2]
            except (ValueError, UnicodeDecodeError):  # bad base64 (binascii.Error), or not ASCII at all
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    def app(self):
        """The Starlette application."""
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        html = page(self.model_dir.template, self.needs, str(self.model_dir.path))
        unauthorized = JSONResponse(
            {"error": f"this server wants its API key ({API_KEY_ENV}): Authorization: Bearer KEY"},
            status_code=401,
            headers={"WWW-Authenticate": 'Basic realm="trainer serve", charset="UTF-8"'},
        )

        async def index(request: Request) -> Response:
            return HTMLResponse(html) if self.authorized(request) else unauthorized

        async def health(request: Request) -> Response:
            if not self.authorized(request):
                return JSONResponse({"status": "ok"})
            engine = self.batcher.engine
            return JSONResponse(
                {
                    "status": "ok",
                    "model": str(self.model_dir.path),
                    "device": self.device,
                    "waiting": self.batcher.waiting.qsize(),
                    "decoding": engine.busy(),
                    "slots": engine.slots,
                    "steps": engine.steps,
                    "most_at_once": self.batcher.most_at_once,
                    "prompts": self.batcher.prompts,
                }
            )

        async def generate(request: Request) -> Response:
            if not self.authorized(request):
                return unauthorized
            try:
                record, kwargs, decoding, stream = self.parse(await read_body(request))
            except BadRequest as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
            job = Job(record, kwargs, decoding, stream, asyncio.get_running_loop())
            if not self.batcher.submit(job):
                wait = self.batcher.retry_after_s()
                return JSONResponse(
                    {
                        "error": f"the server is full ({self.batcher.waiting.maxsize} requests waiting): "
                        f"retry in {wait} s"
                    },
                    status_code=503,
                    headers={"Retry-After": str(wait)},
                )
            if stream:
                return StreamingResponse(
                    events(job), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            try:
                kind, value = await answer_or_disconnect(job, request)
                if kind == "done":
                    return JSONResponse(value)
                if kind == "error":
                    return JSONResponse({"error": value}, status_code=500)
                return Response(status_code=499)  # nobody reads it: the client went away
            finally:
                job.cancelled = True  # the answer is sent, or the client went away: its slot is free

        return Starlette(
            routes=[
                Route("/", index, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/generate", generate, methods=["POST"]),
            ]
        )


async def read_body(request) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES, by its Content-Length or as it arrives."""
    too_large = BadRequest(f"the body is over {MAX_BODY_BYTES:,} bytes", status=413)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    return body


async def answer_or_disconnect(job: Job, request) -> tuple[str, Any]:
    """A non-streamed request's answer ("done" or "error"), or ("gone", None) as soon as its client
    disconnects: Starlette says nothing of a disconnect to a plain endpoint, so this listens for it."""

    async def answer() -> tuple[str, Any]:
        while True:
            kind, value = await job.events.get()
            if kind in ("done", "error"):
                return kind, value

    async def gone() -> tuple[str, Any]:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        return "gone", None

    tasks = [asyncio.ensure_future(answer()), asyncio.ensure_future(gone())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return next(iter(done)).result()
    finally:
        for task in tasks:
            task.cancel()


def _sse(kind: str, value: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps(value, ensure_ascii=False)}\n\n"


async def events(job: Job) -> AsyncIterator[str]:
    """A streamed request's server-sent events: `token` {"delta"}..., then `done` (the row) or `error`. A
    client that goes away cancels its request."""
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "token":
                yield _sse("token", {"delta": value})
            elif kind == "done":
                yield _sse("done", value)
                return
            else:
                yield _sse("error", {"error": value})
                return
    finally:
        job.cancelled = True


# -- the command line ------------------------------------------------------------------------------------


def add_serve_parser(sub) -> None:
    """`trainer serve` on the CLI's subparsers."""
    p = sub.add_parser(
        "serve",
        help="serve a trained model: a web page and a JSON API",
        description="Serve a trained model: a web page to try it (type ingredients, read the recipe as it "
        "is written) and POST /generate, with Hugging Face's decoding options. Concurrent requests share "
        "the decoder's steps (continuous batching: a request joins at the next step and leaves when its "
        "recipe ends). The decoding options below are the defaults for requests that do not give them; "
        "--max_new_tokens is also the most a request may ask for. Beam search (num_beams > 1) runs on "
        f"Hugging Face's generate, one request at a time. With {API_KEY_ENV} in the environment, the page "
        "and the API want that key.",
    )
    add_model_arguments(p, data_format=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port (0: any free one; default %(default)s)"
    )
    p.add_argument(
        "--max-waiting",
        "--max_waiting",
        type=int,
        default=256,
        help="requests that may wait for a free slot; more are answered 503 with a Retry-After "
        "(default %(default)s)",
    )
    p.set_defaults(run=run_serve)
    strict_subparser(p)


def max_new_tokens(model, kwargs: dict[str, Any]) -> int:
    """The server's longest recipe: its default max_new_tokens (given, the generation_config's or the
    training's max_target_length)."""
    from trainer.eval.decoding import Decoding

    decoding = Decoding.of(model, {**kwargs, "num_beams": 1})
    return decoding.max_new_tokens if isinstance(decoding, Decoding) else int(kwargs["max_new_tokens"])


def run_serve(args: argparse.Namespace) -> int:
    """`trainer serve`: load the model, listen, serve until SIGINT/SIGTERM (exit code 128 + the signal)."""
    import torch
    import uvicorn

    defaults = decoding_given(args)
    if args.max_waiting < 1:
        raise UsageError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    api_key = os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise UsageError(
            f"{API_KEY_ENV} is set but blank: give it a key, or unset it to serve without one "
            "(on 127.0.0.1 only, for yourself)"
        )
    api_key = (api_key or "").strip()
    model_dir = open_model_dir(args.model, args.task)
    try:  # before the model loads: a port in use is one line, at once
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    with contextlib.closing(sock):
        model = load_for_generation(model_dir, args.device)
        torch.manual_seed(args.seed)
        device = str(next(model.parameters()).device)
        kwargs, said = decoding_settings(model, model_dir.template, defaults)
        log.info("%s (a request's own options replace these)", said)
        budget = batch_token_budget(model, args.max_batch_tokens)
        batcher = Batcher(model, model_dir, budget, max_new_tokens(model, kwargs), args.max_waiting)
        batcher.start()
        server = RecipeServer(model_dir, batcher, defaults, device, api_key)
        if api_key:
            log.info("the page and the API want the key in %s", API_KEY_ENV)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        log.info("serving %s on http://%s:%d (POST /generate, the page at /)", model_dir.path, shown, port)
        config = uvicorn.Config(server.app(), log_config=None, access_log=False, timeout_graceful_shutdown=5)
        # uvicorn stops gracefully on SIGINT/SIGTERM and then raises the signal again, to this handler: the
        # exit code is 128 + the signal, as `trainer train`'s when a signal stops it.
        stopped_by: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
        uvicorn.Server(config).run(sockets=[sock])
    if stopped_by:
        log.info("stopped by %s", signal.Signals(stopped_by[0]).name)
        return 128 + stopped_by[0]
    return 0

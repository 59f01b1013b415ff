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

Batching. One thread runs the model. It takes the first waiting request, collects those that arrive within
`--batch-window-ms`, groups them by decoding options (one `model.generate` call needs one set), and runs each
group through `trainer generate`'s batcher (`generate_ids`: sorted by length, padded batches under
`--max-batch-tokens`). Streamed and whole requests share those batches: `model.generate` makes every row's
next token at each step anyway, and a streamer (`RowStreamer`) hands each streamed row its own, so a page
reading its recipe costs no batch slot of its own and keeps concurrent requests batched. (Beam search reorders
its beams until the end: a streamed request with num_beams > 1 gets its recipe in one piece.) A batch runs to
its end; requests that arrive meanwhile form the next one.

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
import contextlib
import difflib
import json
import logging
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
MAX_NEW_TOKENS = 2048  # a request's max_new_tokens at most (each costs a decoding step of the whole batch)
MAX_BEAMS = 8
REQUEST_FIELDS = ("ingredients", "title", "stream")
DEFAULT_PORT = 8000


class BadRequest(ValueError):
    """A request the server refuses: one line, answered with `status`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    """One request on its way through the model thread. `events` receives ("token", delta) while the
    recipe is written (streamed requests), then ("done", row) or ("error", message)."""

    record: dict[str, Any]  # rendered by the loader: source, source_ids
    decoding: dict[str, Any]  # model.generate's keyword arguments
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def send(self, kind: str, value: Any) -> None:
        """From the model thread: an event for the request's coroutine."""
        with contextlib.suppress(RuntimeError):  # the server stopped, its event loop closed: nobody waits
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class RowStreamer:
    """A transformers streamer for a batch of rows (`generate_ids`' streamer): each decoding step gives it
    every row's next token; a streamed row's job receives the text its tokens add, decoded as a whole so far
    (SentencePiece joins pieces across tokens). Rows stop at their end-of-sequence token."""

    def __init__(self, jobs: list[Job], tokenizer, eos_ids: set[int]):
        self.jobs, self.tokenizer, self.eos_ids = jobs, tokenizer, eos_ids
        self.ids: list[list[int]] = [[] for _ in jobs]
        self.sent = ["" for _ in jobs]
        self.finished = [not job.stream for job in jobs]

    def put(self, value) -> None:
        if value.dim() > 1:  # the decoder's start tokens, before the first step
            return
        for row, token in enumerate(value.tolist()):
            if self.finished[row]:
                continue
            if token in self.eos_ids:
                self.finished[row] = True
                continue
            self.ids[row].append(token)
            text = self.tokenizer.decode(self.ids[row], skip_special_tokens=True)
            # A piece that changes the text before it (rare) waits: the "done" event has the whole recipe.
            if text.startswith(self.sent[row]) and len(text) > len(self.sent[row]):
                self.jobs[row].send("token", text[len(self.sent[row]) :])
                self.sent[row] = text

    def end(self) -> None:
        pass


class Batcher:
    """The model thread: requests in, batches through generate_ids, rows (and streamed tokens) out."""

    def __init__(self, model, model_dir: ModelDir, max_batch_tokens: int, window_s: float):
        from tokenizers import Tokenizer

        self.model, self.model_dir = model, model_dir
        self.tokenizer = Tokenizer.from_file(os.fspath(model_dir.tokenizer_file))
        self.max_batch_tokens, self.window_s = max_batch_tokens, window_s
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id = model.config.pad_token_id or 0
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.batches = 0
        self.prompts = 0
        self._thread = threading.Thread(target=self._run, name="serve-model", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.waiting.put(job)

    def _run(self) -> None:
        while True:
            jobs = [self.waiting.get()]
            end = time.monotonic() + self.window_s
            while (left := end - time.monotonic()) > 0:
                try:
                    jobs.append(self.waiting.get(timeout=left))
                except queue.Empty:
                    break
            while True:  # and whatever else is already waiting
                try:
                    jobs.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            groups: dict[str, list[Job]] = {}
            for job in jobs:
                groups.setdefault(json.dumps(job.decoding, sort_keys=True), []).append(job)
            for group in groups.values():
                self._generate(group)

    def _generate(self, jobs: list[Job]) -> None:
        decoding = dict(jobs[0].decoding)
        streamer = None
        if any(job.stream for job in jobs) and decoding.get("num_beams", 1) == 1:

            def streamer(batch: list[int]) -> RowStreamer:
                return RowStreamer([jobs[i] for i in batch], self.tokenizer, self.eos_ids)

        try:
            ids = generate_ids(
                self.model,
                [job.record["source_ids"] for job in jobs],
                pad_id=self.pad_id,
                max_batch_tokens=self.max_batch_tokens,
                streamer=streamer,
                **decoding,
            )
        except Exception as e:  # out of memory, a bad option combination: these requests fail, not the server
            log.warning("generation failed for %d request(s): %s: %s", len(jobs), type(e).__name__, e)
            for job in jobs:
                job.send("error", f"generation failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            return
        self.batches += 1
        self.prompts += len(jobs)
        template = self.model_dir.template.target_template
        for job, text in zip(jobs, self.tokenizer.decode_batch(ids, skip_special_tokens=True), strict=True):
            parsed = parse_recipe(text, template)
            fields = parsed.fields() if parsed else {"title": None, "ingredients": None, "directions": None}
            job.send("done", {"source": job.record["source"], "generated": text, **fields})


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
        return float(value)
    wanted = {bool: "true or false", int: "a whole number", float: "a number"}[kind]
    raise BadRequest(f"{name} must be {wanted}, got {json.dumps(value)}")


class RecipeServer:
    """What the routes share: the model directory, its renderer, the server's decoding defaults, the
    batcher."""

    def __init__(self, model_dir: ModelDir, batcher: Batcher, defaults: dict[str, Any], device: str):
        self.model_dir, self.batcher, self.defaults, self.device = model_dir, batcher, defaults, device
        self.renderer = model_dir.template.renderer(model_dir.tokenizer_file)
        self.needs = prompt_fields(model_dir.template)

    def parse(self, body: bytes) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """A request body as (the rendered prompt, model.generate's options, whether to stream), or
        BadRequest naming what is wrong."""
        try:
            request = json.loads(body)
        except ValueError as e:  # also a body that is not UTF-8
            raise BadRequest(f"the body is not JSON ({e})") from None
        if not isinstance(request, dict):
            raise BadRequest(
                'the body must be a JSON object, e.g. {"ingredients": ["2 eggs", "1 cup flour"]}'
            )
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
        for name, (kind, _, _) in DECODING_OPTIONS.items():
            if request.get(name) is not None:
                given[name] = _typed(name, request[name], kind)
        try:
            check_decoding(given, flag="")
            record = cli_record(self.renderer, self.model_dir.template, title, ingredients, flag="")
        except UsageError as e:
            raise BadRequest(str(e)) from None
        if given.get("max_new_tokens", 0) > MAX_NEW_TOKENS:
            raise BadRequest(
                f"max_new_tokens must be <= {MAX_NEW_TOKENS} here, got {given['max_new_tokens']}"
            )
        if given.get("num_beams", 1) > MAX_BEAMS:
            raise BadRequest(f"num_beams must be <= {MAX_BEAMS}, got {given['num_beams']}")
        decoding, _ = decoding_settings(self.batcher.model, self.model_dir.template, given)
        return record, decoding, stream

    def app(self):
        """The Starlette application."""
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        html = page(self.model_dir.template, self.needs, str(self.model_dir.path))

        async def index(request: Request) -> Response:
            return HTMLResponse(html)

        async def health(request: Request) -> Response:
            return JSONResponse(
                {
                    "status": "ok",
                    "model": str(self.model_dir.path),
                    "device": self.device,
                    "waiting": self.batcher.waiting.qsize(),
                    "batches": self.batcher.batches,
                    "prompts": self.batcher.prompts,
                }
            )

        async def generate(request: Request) -> Response:
            try:
                record, decoding, stream = self.parse(await read_body(request))
            except BadRequest as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
            job = Job(record, decoding, stream, asyncio.get_running_loop())
            self.batcher.submit(job)
            if stream:
                return StreamingResponse(
                    events(job), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    return JSONResponse(value)
                if kind == "error":
                    return JSONResponse({"error": value}, status_code=500)

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


def _sse(kind: str, value: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps(value, ensure_ascii=False)}\n\n"


async def events(job: Job) -> AsyncIterator[str]:
    """A streamed request's server-sent events: `token` {"delta"}..., then `done` (the row) or `error`."""
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


# -- the command line ------------------------------------------------------------------------------------


def add_serve_parser(sub) -> None:
    """`trainer serve` on the CLI's subparsers."""
    p = sub.add_parser(
        "serve",
        help="serve a trained model: a web page and a JSON API",
        description="Serve a trained model: a web page to try it (type ingredients, read the recipe as it "
        "is written) and POST /generate, with Hugging Face's decoding options. Concurrent requests are "
        "batched. The decoding options below are the defaults for requests that do not give them.",
    )
    add_model_arguments(p, data_format=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port (0: any free one; default %(default)s)"
    )
    p.add_argument(
        "--batch-window-ms",
        "--batch_window_ms",
        type=float,
        default=10.0,
        help="how long the first request of a batch waits for others to join it (default %(default)s)",
    )
    p.set_defaults(run=run_serve)
    strict_subparser(p)


def run_serve(args: argparse.Namespace) -> int:
    """`trainer serve`: load the model, listen, serve until SIGINT/SIGTERM (exit code 128 + the signal)."""
    import torch
    import uvicorn

    defaults = decoding_given(args)
    if args.batch_window_ms < 0:
        raise UsageError(f"--batch-window-ms must be >= 0, got {args.batch_window_ms}")
    model_dir = open_model_dir(args.model, args.task)
    try:  # before the model loads: a port in use is one line, at once
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    with contextlib.closing(sock):
        model = load_for_generation(model_dir, args.device)
        torch.manual_seed(args.seed)
        device = str(next(model.parameters()).device)
        _, said = decoding_settings(model, model_dir.template, defaults)
        log.info("%s (a request's own options replace these)", said)
        batcher = Batcher(model, model_dir, args.max_batch_tokens, args.batch_window_ms / 1000)
        server = RecipeServer(model_dir, batcher, defaults, device)
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

"""`trainer serve` on the tiny model, over real HTTP on 127.0.0.1: the recipe `trainer generate` writes for
the same ingredients, streamed token by token or whole, every one of many concurrent clients getting its own,
bad requests answered with a 4xx and one line while the server keeps serving, and SIGTERM a clean exit."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess

from trainer.config import TrainConfig
from trainer.data.prompt import save_prompt_template
from trainer.eval.generate import generate_ids, load_for_generation, open_model_dir

LENGTHS = {"max_source_length": 64, "max_target_length": 24}
GREEDY = {"max_new_tokens": 16, "do_sample": False}
WORDS = ["egg", "flour", "milk", "butter", "sugar", "salt", "lemon", "garlic", "onion", "rice", "beans"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model as a run's final/: weights, tokenizer and its prompt template."""
    out = tmp_path_factory.mktemp("serve") / "final"
    shutil.copytree(tiny_model_dir, out)
    save_prompt_template(out, TrainConfig(**LENGTHS))
    return out


@pytest.fixture(scope="module")
def server(model_dir: Path):
    # The CPU, where the expected texts are computed too (a GPU decodes in bf16).
    serve = ServeProcess(model_dir, "--device", "cpu")
    yield serve
    serve.stop()


def _ingredients(i: int) -> list[str]:
    return [f"{i % 4 + 1} cups {w}" for w in WORDS[i % 5 : i % 5 + 1 + i % 6]]


def expected_texts(model_dir: Path, items: list[list[str]], **decoding) -> list[str]:
    """What `trainer generate` writes for each list of ingredients, each prompt alone (no padding)."""
    from tokenizers import Tokenizer

    found = open_model_dir(model_dir)
    renderer = found.template.renderer(found.tokenizer_file)
    model = load_for_generation(found, "cpu")
    prompts = [renderer.render(ingredients=i)["source_ids"] for i in items]
    ids = generate_ids(model, prompts, max_batch_tokens=1, **decoding)
    return Tokenizer.from_file(str(found.tokenizer_file)).decode_batch(ids, skip_special_tokens=True)


def read_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """Server-sent events as (event, data) pairs."""
    events = []
    for block in response.text.split("\n\n"):
        if block.strip():
            fields = dict(line.split(": ", 1) for line in block.splitlines())
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def test_a_request_gets_the_recipe_trainer_generate_writes(server, model_dir):
    items = ["2 eggs", "1 cup flour", "1 cup milk"]
    (expected,) = expected_texts(model_dir, [items], **GREEDY)
    as_list = httpx.post(f"{server.url}/generate", json={"ingredients": items, **GREEDY}, timeout=120)
    assert as_list.status_code == 200, as_list.text
    row = as_list.json()
    assert row["source"] == "Write a recipe with these ingredients: 2 eggs; 1 cup flour; 1 cup milk"
    assert row["generated"] == expected
    assert set(row) == {"source", "generated", "title", "ingredients", "directions"}
    as_text = httpx.post(
        f"{server.url}/generate",
        json={"ingredients": "2 eggs; 1 cup flour;1 cup milk", **GREEDY},
        timeout=120,
    )
    assert as_text.json() == row

    streamed = httpx.post(
        f"{server.url}/generate", json={"ingredients": items, "stream": True, **GREEDY}, timeout=120
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = read_events(streamed)
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) == {"token"} and len(kinds) > 2, kinds
    assert "".join(data["delta"] for kind, data in events[:-1]) == expected == events[-1][1]["generated"]


def test_concurrent_clients_each_get_their_own_recipe(server, model_dir):
    """24 clients at once, half of them streaming, a third sampling: every answer is its own prompt's, and
    the greedy ones are exactly what each prompt gives alone; the server batched them."""
    n = 24
    items = [_ingredients(i) for i in range(n)]
    expected = expected_texts(model_dir, items, **GREEDY)

    def ask(i: int) -> tuple[str, str]:
        sampled = i % 3 == 0
        body = {"ingredients": items[i], "stream": i % 2 == 0, **GREEDY}
        if sampled:
            body |= {"do_sample": True, "top_k": 20, "temperature": 0.8}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=300)
        assert response.status_code == 200, response.text
        if body["stream"]:
            events = read_events(response)
            row = events[-1][1]
            assert "".join(d["delta"] for k, d in events[:-1] if k == "token") == row["generated"]
        else:
            row = response.json()
        assert row["source"] == "Write a recipe with these ingredients: " + "; ".join(items[i])
        return row["generated"], "sampled" if sampled else "greedy"

    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(ask, range(n)))
    for i, (text, how) in enumerate(answers):
        if how == "greedy":
            assert text == expected[i], i
    health = httpx.get(f"{server.url}/health").json()
    assert health["prompts"] >= n and health["most_at_once"] >= 2, health


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"ingredients": []}', 400, "ingredients is empty"),
        (b'{"ingredients": " ; "}', 400, "ingredients is empty"),
        (b"{}", 400, "ingredients is empty"),
        (b'{"ingredients": "egg", "temprature": 0.5}', 400, "unknown field 'temprature' (did you mean"),
        (b'{"ingredients": "egg", "num_beams": "4"}', 400, 'num_beams must be a whole number, got "4"'),
        (b'{"ingredients": "egg", "do_sample": 1}', 400, "do_sample must be true or false, got 1"),
        (b'{"ingredients": [1, 2]}', 400, "ingredients must be a list of strings or one string"),
        (b'{"ingredients": "egg", "top_p": 0}', 400, "top_p must be in (0, 1], got 0.0"),
        (b'{"ingredients": "egg", "max_new_tokens": 100000}', 400, "max_new_tokens must be <= 24 on this"),
        (
            b'{"ingredients": "egg", "do_sample": true, "temperature": NaN}',
            400,
            "temperature must be a finite",
        ),
        (b'{"ingredients": "egg", "repetition_penalty": NaN}', 400, "repetition_penalty must be a finite"),
        (b'{"ingredients": "egg", "top_p": Infinity}', 400, "top_p must be a finite number, got inf"),
        (b'{"ingredients": "egg", "stream": "yes"}', 400, "stream must be true or false"),
        (b"[1, 2]", 400, "the body must be a JSON object"),
        (b"ingredients=egg", 400, "the body is not JSON"),
        (b"\xff\xfe", 400, "the body is not JSON"),
        (b"x" * (1 << 20), 413, "the body is over 65,536 bytes"),
        # What a hostile client sends: numbers no machine integer holds, nesting past Python's recursion
        # limit, strings UTF-8 cannot hold, and options whose cost grows with their value.
        (b'{"ingredients": "egg", "top_k": 1%s}' % (b"0" * 30), 400, "top_k must be <= 1000000, got 1"),
        (
            b'{"ingredients": "egg", "no_repeat_ngram_size": 1%s}' % (b"0" * 30),
            400,
            "no_repeat_ngram_size must be <=",
        ),
        (b'{"ingredients": "egg", "no_repeat_ngram_size": 15000}', 400, "no_repeat_ngram_size must be <= 32"),
        (b'{"ingredients": "egg", "num_beams": 9}', 400, "num_beams must be <= 8"),
        (
            b'{"ingredients": "egg", "temperature": 1%s}' % (b"0" * 400),
            400,
            "temperature must be a number a float",
        ),
        (
            b'{"ingredients": "egg", "repetition_penalty": 1000}',
            400,
            "repetition_penalty must be > 0 and <= 100",
        ),
        (b"[" * 60_000, 400, "the body is nested too deeply"),
        (b'{"ingredients": "\\ud800 egg"}', 400, "not valid Unicode"),
        (b'{"ingredients": "egg", "title": "\\udfff"}', 400, "not valid Unicode"),
        (b'{"\\ud800": 1}', 400, "not valid Unicode"),
    ],
)
def test_bad_requests_get_a_4xx_and_one_line_and_the_server_keeps_serving(server, body, status, message):
    response = httpx.post(f"{server.url}/generate", content=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error and "\n" not in error, error
    good = httpx.post(f"{server.url}/generate", json={"ingredients": "egg", "max_new_tokens": 2}, timeout=60)
    assert good.status_code == 200, good.text
    assert "Traceback" not in server.log, server.log


def test_a_client_that_goes_away_frees_its_slot_at_the_next_step(model_dir, tmp_path):
    """A non-streamed request for 2,000 tokens whose client gives up: the server stops decoding it (the
    steps end far below 2,000) and the next request is answered."""
    long_writer = tmp_path / "final"  # min_new_tokens: no end-of-sequence before 2,000 tokens
    shutil.copytree(model_dir, long_writer)
    generation = json.loads((long_writer / "generation_config.json").read_text())
    generation["min_new_tokens"] = 2000
    (long_writer / "generation_config.json").write_text(json.dumps(generation))
    serve = ServeProcess(long_writer, "--device", "cpu", "--max_new_tokens", "2000")
    try:
        body = {"ingredients": "2 eggs; 1 cup flour", "max_new_tokens": 2000}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{serve.url}/generate", json=body, timeout=httpx.Timeout(60, read=0.5))
        for _ in range(600):  # until the slot is free (a guard against a hang, not a time limit)
            health = httpx.get(f"{serve.url}/health").json()
            if health["decoding"] == 0 and health["waiting"] == 0:
                break
            threading.Event().wait(0.2)
        assert health["decoding"] == 0 and health["prompts"] == 0, health
        assert health["steps"] < 2000, health  # given up, not decoded to its end
        good = httpx.post(
            f"{serve.url}/generate", json={"ingredients": "egg", "max_new_tokens": 2}, timeout=60
        )
        assert good.status_code == 200, good.text
    finally:
        serve.stop()


def test_a_full_server_answers_503_at_once_with_a_retry_after(model_dir):
    """One slot and one place in the queue: of 12 concurrent requests, those that find both taken get a 503
    with a Retry-After (never a wait for a timeout); the others get their recipes."""
    serve = ServeProcess(
        model_dir,
        "--device",
        "cpu",
        "--max-batch-tokens",
        "1",
        "--max-waiting",
        "1",
        "--max_new_tokens",
        "200",
    )
    try:
        body = {"ingredients": "2 eggs; 1 cup flour", "max_new_tokens": 200}

        def ask(_: int) -> httpx.Response:
            return httpx.post(f"{serve.url}/generate", json=body, timeout=300)

        with ThreadPoolExecutor(max_workers=12) as pool:
            answers = list(pool.map(ask, range(12)))
    finally:
        serve.stop()
    statuses = sorted(a.status_code for a in answers)
    assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
    for full in (a for a in answers if a.status_code == 503):
        assert int(full.headers["retry-after"]) >= 1
        assert full.json()["error"].startswith("the server is full (1 requests waiting): retry in ")


def test_with_an_api_key_the_page_and_the_api_want_it(model_dir):
    key = "sk-serve-test-0123456789"
    serve = ServeProcess(model_dir, "--device", "cpu", env={"SERVE_API_KEY": key})
    try:
        url = serve.url
        body = {"ingredients": "2 eggs", "max_new_tokens": 4}
        page = httpx.get(url + "/")
        assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(url + "/", auth=("anyone", key)).status_code == 200  # a browser's login prompt
        assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 401
        wrong = httpx.post(f"{url}/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
        assert wrong.status_code == 401 and "SERVE_API_KEY" in wrong.json()["error"]
        # Not ASCII where base64 belongs (tests/test_serve_fuzz.py found it a 500): refused like any other.
        odd = httpx.post(
            f"{url}/generate", json=body, headers={"Authorization": b"Basic \xff\xfe"}, timeout=60
        )
        assert odd.status_code == 401, odd.text
        good = httpx.post(
            f"{url}/generate", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        assert good.status_code == 200 and good.json()["source"].endswith("2 eggs")
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}  # health checks need no key
        assert "model" in httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {key}"}).json()
    finally:
        serve.stop()
    assert "SERVE_API_KEY" in serve.log and key not in serve.log


def test_a_streamed_body_over_the_limit_is_refused_as_it_arrives(server):
    def chunks():
        for _ in range(64):
            yield b" " * 4096

    response = httpx.post(f"{server.url}/generate", content=chunks(), timeout=60)  # no Content-Length
    assert response.status_code == 413 and "over 65,536 bytes" in response.json()["error"]


def test_the_page_health_and_unknown_routes(server, model_dir):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "Write a recipe with these ingredients: {ingredients}" in page.text
    assert "<script src" not in page.text and "<link" not in page.text  # nothing fetched from elsewhere
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == str(model_dir) and health["device"] == "cpu"
    assert httpx.get(f"{server.url}/nope").status_code == 404
    assert httpx.get(f"{server.url}/generate").status_code == 405


def test_bad_command_lines_are_one_line(model_dir, tmp_path, capfd, monkeypatch):
    from trainer.cli import main

    # A key that a template left blank is refused, not taken as "no key" (a page open to everyone).
    monkeypatch.setenv("SERVE_API_KEY", "  ")
    assert main(["serve", "--model", str(model_dir)]) == 2
    err = capfd.readouterr().err
    assert "SERVE_API_KEY is set but blank" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.delenv("SERVE_API_KEY")
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "no such model directory" in capfd.readouterr().err
    assert main(["serve", "--model", str(model_dir), "--top_p", "3"]) == 2
    assert "--top_p must be in (0, 1]" in capfd.readouterr().err


def test_sigterm_stops_the_server_cleanly_and_a_busy_port_is_one_line(model_dir):
    serve = ServeProcess(model_dir, "--device", "cpu")
    try:
        port = serve.url.rsplit(":", 1)[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer",
                "serve",
                "--model",
                str(model_dir),
                "--port",
                port,
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    finally:
        code = serve.stop()
    assert code == 128 + signal.SIGTERM, serve.log  # after a graceful shutdown, as trainer train's
    assert "Finished server process" in serve.log and "Traceback" not in serve.log


def test_the_page_in_a_real_browser_writes_the_recipe_as_it_comes(server, tmp_path):
    """Chromium, headless: ingredients typed into the page, the button clicked, the recipe read as it is
    written (several pieces arrive before the end), the same text the API gives; a screenshot is kept."""
    from browser import Browser

    items = ["2 eggs", "1 cup flour", "1 cup milk", "1 lemon"]
    expected = httpx.post(f"{server.url}/generate", json={"ingredients": items}, timeout=120).json()
    with Browser() as browser:
        tab = browser.open(server.url + "/")
        tab.type_into("#ingredients", items)
        assert tab.evaluate("document.querySelector('#ingredients').value") == "\n".join(items)
        tab.click("#go")
        tab.wait_for("document.querySelector('#status').textContent === 'done'")
        assert tab.evaluate("document.querySelector('#error').hidden")
        assert tab.evaluate("document.querySelector('#stream').textContent") == expected["generated"]
        assert int(tab.evaluate("document.querySelector('#stream').dataset.tokens")) > 1
        png = tab.screenshot()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    (tmp_path / "serve-page.png").write_bytes(png)


def test_a_request_that_fails_as_it_joins_fails_alone(model_dir):
    """Five requests join the decoder at the same step (all waiting before the model thread starts); one of
    them cannot start (a prompt over the engine's capacity, as an out-of-memory would fail it): it alone gets
    its error, and the four others get the recipes they get without it."""
    import asyncio

    from trainer.eval.decoding import Decoding
    from trainer.eval.serve import Batcher, Job

    found = open_model_dir(model_dir)
    model = load_for_generation(found, "cpu")
    renderer = found.template.renderer(found.tokenizer_file)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "num_beams": 1, "no_repeat_ngram_size": 0}
    decoding = Decoding.of(model, kwargs)
    items = [_ingredients(i) for i in range(4)]
    expected = expected_texts(model_dir, items, **kwargs)

    async def ask() -> list[tuple[str, object]]:
        loop = asyncio.get_running_loop()
        batcher = Batcher(model, found, max_batch_tokens=4096, max_new_tokens=8, max_waiting=16)
        records = [renderer.render(ingredients=i) for i in items]
        too_long = dict(records[0], source_ids=[5] * (batcher.engine.source_capacity + 1))
        jobs = [Job(r, kwargs, decoding, False, loop) for r in records[:2] + [too_long] + records[2:]]
        for job in jobs:
            assert batcher.submit(job)
        batcher.start()
        answers = []
        for job in jobs:
            while (event := await asyncio.wait_for(job.events.get(), 300))[0] == "token":
                pass
            answers.append(event)
        assert batcher.most_at_once == 4  # the four good ones shared their steps
        return answers

    answers = asyncio.run(ask())
    kinds = [kind for kind, _ in answers]
    assert kinds == ["done", "done", "error", "done", "done"], answers
    assert "generation failed: ValueError: a prompt of" in answers[2][1]
    good = [value["generated"] for kind, value in answers if kind == "done"]
    assert good == expected

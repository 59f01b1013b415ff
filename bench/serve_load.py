"""Load on `trainer serve` from N concurrent clients on 127.0.0.1: latency p50/p95, prompts/s, and for
streamed requests the time to the first token of the recipe.

Two servers of the same model, side by side in one run: ours (continuous batching: requests join the running
decoder steps) and, as the peer, the same server with `--max-batch-tokens 1`: one request at a time, as a
server without batching runs them. Each client sends its requests one after another (a closed loop); the
ingredients are realistic generated recipes' (trainer.data.sample), every client's different. The servers run
in turn, --repeats times each, alternating; the table gives the median run and the spread of prompts/s over
the runs (the noise: other work on the machine moves it).

    python bench/serve_load.py --model outputs/quickstart/final --clients 16 --requests 4
    python bench/serve_load.py --model outputs/quickstart/final --clients 16 --requests 4 --stream
    python bench/serve_load.py --xl --device cuda --clients 16 64 --requests 2 --max-new-tokens 128 --stream
        # FLAN-T5-XL's shape with random weights, written to a temporary model directory first

Bounded: clients x requests per run, each request with a timeout; the servers are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

SERVING = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+) ")


def start_server(model: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "serve", "--model", model, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := SERVING.search(line):
            # Keep reading its output, so that the server never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m[1]
    raise SystemExit(f"trainer serve {model} did not start (exit {proc.wait()})")


def ingredient_lists(n: int) -> list[list[str]]:
    """Ingredients of n generated recipes (RecipeNLG's layout, trainer.data.sample)."""
    import csv
    import json

    from trainer.data.sample import write_sample

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipes.csv"
        write_sample(path, n, seed=7, fmt="recipenlg-csv")
        with open(path, newline="", encoding="utf-8") as f:
            return [json.loads(row["ingredients"]) for row in csv.DictReader(f)]


async def one_run(url: str, lists: list[list[str]], clients: int, requests: int, body: dict) -> dict:
    latencies: list[float] = []
    first_pieces: list[float] = []

    async def client(c: int, http: httpx.AsyncClient) -> None:
        for r in range(requests):
            payload = {"ingredients": lists[(c * requests + r) % len(lists)], **body}
            start = time.perf_counter()
            if body.get("stream"):
                async with http.stream("POST", f"{url}/generate", json=payload) as response:
                    response.raise_for_status()
                    first = True
                    async for line in response.aiter_lines():
                        if first and line.startswith("event: token"):
                            first_pieces.append(time.perf_counter() - start)
                            first = False
                        if line.startswith("event: error"):
                            raise RuntimeError("the server answered an error event")
            else:
                (await http.post(f"{url}/generate", json=payload)).raise_for_status()
            latencies.append(time.perf_counter() - start)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        elapsed = time.perf_counter() - start
    return {"latencies": latencies, "first": first_pieces, "prompts_per_s": len(latencies) / elapsed}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def xl_model_dir(workdir: Path) -> Path:
    """A model directory of FLAN-T5-XL's shape with random bf16 weights and a T5-layout tokenizer trained
    offline (bench/xl_smoke.py's), prompted with the ingredients-to-recipe preset. The head's rows of tokens
    that write no text (past the tokenizer's vocabulary, special, white space) are zeros, so the model writes
    text to stream while every step still reads a head of FLAN-T5-XL's size."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from xl_smoke import write_model_dir, write_random_weights

    from trainer.model.tiny_model import build_tiny_model

    tokenizer_dir = build_tiny_model(workdir / "tokenizer", seed=0)  # only its tokenizer is used
    model_dir = write_model_dir(workdir / "xl", "xl", tokenizer_dir)
    write_random_weights(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # <pad>, </s>, <unk>, the sentinels and pieces of white space alone: tokens that add no text to stream
    silent = [i for i in range(tokenizer.get_vocab_size()) if not tokenizer.decode([i]).strip()]
    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(path)
        # the head; a file that saved it tied to the embedding holds the embedding alone
        head = next((name for name in ("lm_head.weight", "shared.weight") if name in tensors), None)
        if head is not None:
            tensors[head][tokenizer.get_vocab_size() :] = 0
            tensors[head][silent] = 0
            save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="model directory (e.g. outputs/quickstart/final)")
    which.add_argument("--xl", action="store_true", help="FLAN-T5-XL's shape, random weights (a GPU)")
    p.add_argument(
        "--clients", type=int, nargs="+", default=[16], help="concurrent clients (several: a run each)"
    )
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true", help="streamed requests (server-sent events)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        model = str(xl_model_dir(Path(tmp))) if args.xl else args.model
        # Each server's longest answer is what the requests ask for: its slots hold that many tokens.
        common = ("--device", args.device, "--max_new_tokens", str(args.max_new_tokens))
        servers = {
            "ours (continuous batching)": start_server(model, *common),
            "peer (one request at a time)": start_server(model, *common, "--max-batch-tokens", "1"),
        }
        lists = ingredient_lists(max(args.clients) * args.requests)
        body = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "stream": args.stream}
        runs: dict[tuple[int, str], list[dict]] = {}
        try:
            for _, url in servers.values():  # warm-up: first calls allocate, compile and capture
                asyncio.run(one_run(url, lists, 2, 1, body))
            for clients in args.clients:
                for _ in range(args.repeats):
                    for name, (_, url) in servers.items():
                        result = asyncio.run(one_run(url, lists, clients, args.requests, body))
                        runs.setdefault((clients, name), []).append(result)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)

    answers = "streamed" if args.stream else "whole"
    print(
        f"{args.requests} requests per client, max_new_tokens {args.max_new_tokens}, greedy, {answers} "
        f"answers, {'FLAN-T5-XL shape' if args.xl else model} on {args.device}; {args.repeats} runs each, "
        "alternating"
    )
    header = f"{'clients':>7} {'server':<30} {'prompts/s (median, min-max)':>28} {'p50 s':>7} {'p95 s':>7}"
    print(header + (f" {'first token p50 s':>18}" if args.stream else ""))
    for (clients, name), results in runs.items():
        rates = [r["prompts_per_s"] for r in results]
        median = sorted(results, key=lambda r: r["prompts_per_s"])[len(results) // 2]
        lat = median["latencies"]
        line = (
            f"{clients:>7} {name:<30} {statistics.median(rates):>10.2f} ({min(rates):.2f}-{max(rates):.2f})"
            f"{'':>8} {percentile(lat, 0.5):>7.2f} {percentile(lat, 0.95):>7.2f}"
        )
        if args.stream:
            first = median["first"]
            line += f" {percentile(first, 0.5):>18.2f}" if first else f" {'no text streamed':>18}"
        print(line)


if __name__ == "__main__":
    main()

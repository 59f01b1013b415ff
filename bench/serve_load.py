"""Load on `trainer serve` from N concurrent clients on 127.0.0.1: latency p50/p95, prompts/s, and for
streamed requests the time to the first piece of the recipe.

Two servers of the same model, side by side in one run: ours (requests gathered for --batch-window-ms and
batched by length) and, as the peer, the same server with `--max-batch-tokens 1`: every prompt its own
`model.generate` call, one after the other, as a server without batching runs them. Each client sends its
requests one after another (a closed loop); the ingredients are realistic generated recipes'
(trainer.data.sample), every client's different. The servers run in turn, --repeats times each, alternating;
the table gives the median run and the spread of prompts/s over the runs (the noise: other work on the machine
moves it).

    python bench/serve_load.py --model outputs/quickstart/final --clients 16 --requests 4
    python bench/serve_load.py --model outputs/quickstart/final --clients 16 --requests 4 --stream

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (e.g. outputs/quickstart/final)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true", help="streamed requests (server-sent events)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    lists = ingredient_lists(args.clients * args.requests)
    body = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "stream": args.stream}
    servers = {
        "ours (batched)": start_server(args.model, "--device", args.device),
        "peer (one prompt at a time)": start_server(
            args.model, "--device", args.device, "--max-batch-tokens", "1"
        ),
    }
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for _, url in servers.values():  # warm-up: first calls allocate and load kernels
            asyncio.run(one_run(url, lists, 2, 1, body))
        for _ in range(args.repeats):
            for name, (_, url) in servers.items():
                runs[name].append(asyncio.run(one_run(url, lists, args.clients, args.requests, body)))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)

    answers = "streamed" if args.stream else "whole"
    print(
        f"{args.clients} clients x {args.requests} requests, max_new_tokens {args.max_new_tokens}, greedy, "
        f"{answers} answers, {args.device}; {args.repeats} runs each, alternating"
    )
    header = f"{'server':<30} {'prompts/s (median, min-max)':>28} {'p50 s':>7} {'p95 s':>7}"
    print(header + (f" {'first piece p50 s':>18}" if args.stream else ""))
    for name, results in runs.items():
        rates = [r["prompts_per_s"] for r in results]
        median = sorted(results, key=lambda r: r["prompts_per_s"])[len(results) // 2]
        lat = median["latencies"]
        line = (
            f"{name:<30} {statistics.median(rates):>10.2f} ({min(rates):.2f}-{max(rates):.2f})"
            f"{'':>8} {percentile(lat, 0.5):>7.2f} {percentile(lat, 0.95):>7.2f}"
        )
        if args.stream:
            line += f" {percentile(median['first'], 0.5):>18.2f}"
        print(line)


if __name__ == "__main__":
    main()

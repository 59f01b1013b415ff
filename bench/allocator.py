"""The CUDA caching allocator's settings for the rtx5090 preset, chosen by numbers.

    # GPU, an H100 capped at 32 GiB: about 2.5 minutes per candidate, so two calls into one --out folder
    python3 bench/allocator.py --out results/allocator --candidates default,expandable,expandable_gc0.8
    python3 bench/allocator.py --out results/allocator --candidates split128_round16_gc0.7,cuda_malloc_async
    python3 bench/allocator.py --tiny --out /tmp/allocator   # CPU: the same code at a tiny shape

Each candidate PYTORCH_CUDA_ALLOC_CONF runs in its own process (set before CUDA starts) on the rtx5090
preset (configs/flan-t5-xl-rtx5090.yaml: FLAN-T5-XL's shape with random weights, bf16 + Kahan Adafactor,
32k-token micro-batches x 2, the 32 GiB cap) and bench_run's recipe-length data:

1. `trainer.run.train.train` for 8 optimizer steps, with an evaluation after step 5 (2 held-out batches and 2
   greedy generations of 32 tokens), the best-so-far checkpoint it triggers (written under /tmp), and a last
   evaluation at step 8. From torch.cuda.memory_stats() over the run: peak reserved and peak allocated;
   fragmentation at the peak, as peak reserved - peak allocated (a lower bound of reserved - allocated at the
   moment reserved peaked: allocated was at most its peak then); the allocator's retries (a failed cudaMalloc,
   the cache flushed, the allocation retried: slow). Real tokens/s over steps 2-8 without step 6 (the one
   after the evaluation and checkpoint).
2. The largest token budget that trains without running out of memory: one optimizer step on the largest
   batch the loader makes at 32k, 48k, 64k, ... tokens (every decoder block checkpointed, as the memory plan
   does near the limit), up to the first out-of-memory, then 8k above the last that fit; at most
   --search-s seconds.
3. For --empty-cache-candidate only (default: the trainer's expandable_segments:True): what the trainer's
   `empty_cache_steps` costs. The same two 32k batches are trained on again and again, steps alternating
   without and with torch.cuda.empty_cache() before them; the difference is the cost of one clearing (the
   call and the re-growth of the cache in the step after it), and clearing every N steps costs that over N
   steps. Also the memory reserved between steps with and without clearing.

Prints one table (candidate | peak reserved | peak allocated | fragmentation | retries | real tok/s |
largest budget without OOM) and the empty_cache one; writes allocator.json to --out.

Reading torch's allocator source (c10/cuda/CUDACachingAllocator.cpp): garbage_collection_threshold acts only
when a memory fraction is set (torch.cuda.set_per_process_memory_fraction: here the 32 GiB cap; the trainer
sets one only with gpu_memory_limit_gib), and its collection frees only whole cached segments, never blocks of
expandable segments: with expandable_segments:True it does nothing. The expandable_gc0.8 row checks that.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_run import QUIET_RUN, make_records, mean_lengths, read_preset, train_rows, write_data

CANDIDATES = {
    "default": "",  # PyTorch's own settings: neither variable set
    "expandable": "expandable_segments:True",
    "expandable_gc0.8": "expandable_segments:True,garbage_collection_threshold:0.8",
    "split128_round16_gc0.7": (
        "max_split_size_mb:128,roundup_power2_divisions:16,garbage_collection_threshold:0.7"
    ),
    "cuda_malloc_async": "backend:cudaMallocAsync",  # CUDA's own pool allocator instead of PyTorch's
}
EVAL_STEP, STEPS = 5, 8  # evaluation + checkpoint after step 5, a last evaluation after step 8
SEARCH_SIZES = [32768, 49152, 65536, 81920, 98304, 114688, 131072]
EMPTY_CACHE_EVERY = (1, 10, 50)
EMPTY_CACHE_BUDGET = 0.005  # the target: clearing costs at most 0.5% of the step time
GIB = 2**30


# ----------------------------------------------------------------------------------- one candidate (child)


def run_config(work: Path, conf: str, tiny: bool) -> dict:
    """The preset's trainer settings for this benchmark: its data, an evaluation with generations and a
    checkpoint under `work`, this candidate's allocator settings."""
    import torch

    records = make_records(n=512 if tiny else 4096)
    data, model_dir = write_data(work, records, "tiny" if tiny else "xl")
    values = read_preset()
    values.update(
        QUIET_RUN,
        model_name_or_path=str(model_dir),
        random_init=True,
        train_files=[str(data)],
        output_dir=str(work / "out"),
        max_steps=STEPS,
        eval_fraction=0.02,
        eval_steps=EVAL_STEP,
        eval_max_batches=2,
        num_eval_generations=2,
        generation_max_new_tokens=32,
        save_total_limit=1,  # QUIET_RUN saves no other: the evaluation's best-so-far checkpoint is the one
        progress_bar=False,
        discord_progress_minutes=-1.0,
        cuda_alloc_conf=conf,  # "" leaves PyTorch's defaults
        gpu_memory_limit_gib=32.0 if torch.cuda.is_available() else None,
    )
    if tiny:
        values.update(max_tokens=2048, dtype="float32" if not torch.cuda.is_available() else "bfloat16")
    return values


def run_throughput(rows: list[dict]) -> dict:
    """Real tokens/s over steps 2..n, leaving out the step after the evaluation (it includes the evaluation,
    the generations and the checkpoint, whose time is reported apart)."""
    clean, after_eval = [], None
    for prev, cur in zip(rows, rows[1:], strict=False):
        duration = cur["time"] - prev["time"]
        if prev["step"] == EVAL_STEP:
            after_eval = duration
        else:
            clean.append((duration, cur["source_tokens"] + cur["target_tokens"]))
    seconds = sum(d for d, _ in clean)
    median = statistics.median(d for d, _ in clean)
    return {
        "real_tok_s": sum(t for _, t in clean) / seconds,
        "step_s_median": median,
        "eval_and_checkpoint_s": None if after_eval is None else after_eval - median,
    }


def memory_numbers(torch) -> dict:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    return {
        "backend": torch.cuda.memory.get_allocator_backend(),
        "peak_reserved_gib": reserved / GIB,
        "peak_allocated_gib": allocated / GIB,
        "fragmentation_gib": (reserved - allocated) / GIB,
        "inactive_split_peak_gib": stats.get("inactive_split_bytes.all.peak", 0) / GIB,
        "alloc_retries": stats.get("num_alloc_retries"),
        "ooms": stats.get("num_ooms"),
        "device_allocs": stats.get("num_device_alloc"),
        "device_frees": stats.get("num_device_free"),
    }


def build(cfg, device):
    """The trainer's model and optimizer for `cfg`, as trainer.run.train builds them (one process)."""
    from trainer.model.load import load_model
    from trainer.optim import build_optimizer

    model = load_model(cfg, device)
    model.train()
    return model, build_optimizer(model, cfg, device)


def train_step(model, optimizer, group: list[dict], max_grad_norm: float) -> None:
    """One optimizer step over `group` (loader batches on the device), as the trainer's loop runs it."""
    import torch

    from trainer.run.step import accumulate_gradients

    accumulate_gradients(model, group, 1)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache_cost(model, optimizer, group: list[dict], cfg, pairs: int) -> dict:
    """Steps on the same `group`, alternating without and with torch.cuda.empty_cache() before them."""
    import torch

    on_cuda = torch.cuda.is_available()
    for _ in range(2):  # warm-up: the cache grows to what these batches need
        train_step(model, optimizer, group, cfg.max_grad_norm)
    timed = {"never": [], "cleared": []}
    reserved_between = {"never": [], "cleared": []}
    peak_reserved = {"never": [], "cleared": []}
    for _ in range(pairs):
        for kind in ("never", "cleared"):
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if kind == "cleared" and on_cuda:
                torch.cuda.empty_cache()
            if on_cuda:
                reserved_between[kind].append(torch.cuda.memory_reserved() / GIB)
            train_step(model, optimizer, group, cfg.max_grad_norm)
            timed[kind].append(time.perf_counter() - t0)
            if on_cuda:
                peak_reserved[kind].append(torch.cuda.max_memory_reserved() / GIB)
    step_s = statistics.mean(timed["never"])
    costs = [c - n for c, n in zip(timed["cleared"], timed["never"], strict=True)]
    cost = statistics.mean(costs)
    budget_every = math.ceil(max(cost, 0.0) / (EMPTY_CACHE_BUDGET * step_s)) if cost > 0 else 1
    return {
        "step_s": step_s,
        "cost_per_clear_s": cost,
        "cost_spread_s": statistics.stdev(costs) if len(costs) > 1 else 0.0,
        "overhead": {str(n): cost / (n * step_s) for n in EMPTY_CACHE_EVERY},
        "fewest_steps_between_clears_within_budget": budget_every,
        "reserved_between_steps_gib": {k: statistics.mean(v) for k, v in reserved_between.items() if v},
        "peak_reserved_gib": {k: max(v) for k, v in peak_reserved.items() if v},
        "raw_s": timed,
    }


def largest_batch(cfg, tokenizer_file: str, max_tokens: int) -> dict:
    """The loader's biggest batch (rows x longest source + longest target) at `max_tokens` on this data."""
    from trainer.data.loader import stream_for

    stream = stream_for(dataclasses.replace(cfg, max_tokens=max_tokens), tokenizer_file, "train")
    return max(stream, key=lambda b: b["input_ids"].size + b["labels"].size)


def budget_search(model, optimizer, cfg, tokenizer_file: str, sizes: list[int], seconds: float) -> list[dict]:
    """One optimizer step on the largest batch at each budget of `sizes` (ascending) up to the first
    out-of-memory, then one try halfway between the last that fit and it; at most `seconds` in all."""
    import torch

    from trainer.data.loader import to_device
    from trainer.infra import memory

    on_cuda = torch.cuda.is_available()
    device = next(model.parameters()).device
    for block in model.decoder.block:  # every block checkpointed, as the memory plan does near the limit
        if getattr(block, "gradient_checkpointing", None) is False:
            block.gradient_checkpointing = True

    def attempt(size: int) -> dict:
        batch = largest_batch(cfg, tokenizer_file, size)
        entry = {"max_tokens": size, "rows": len(batch["input_ids"])}
        entry["batch_tokens"] = int(batch["input_ids"].size + batch["labels"].size)
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        oom = False
        try:
            train_step(model, optimizer, [to_device(batch, device)], cfg.max_grad_norm)
        except torch.OutOfMemoryError:
            oom = True  # cleaned up outside the except block, so the traceback's tensors can be freed
        if oom:
            model.zero_grad(set_to_none=True)
            memory.free_memory()
        entry.update(ok=not oom, seconds=time.perf_counter() - t0)
        if on_cuda:
            entry["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            entry["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        return entry

    deadline = time.perf_counter() + seconds
    tried: list[dict] = []
    for size in sizes:
        if time.perf_counter() > deadline:
            break
        tried.append(attempt(size))
        if not tried[-1]["ok"]:
            break
    fitted = [t["max_tokens"] for t in tried if t["ok"]]
    if tried and not tried[-1]["ok"] and fitted and time.perf_counter() < deadline:
        between = (max(fitted) + tried[-1]["max_tokens"]) // 2 // 4096 * 4096
        if between > max(fitted):
            tried.append(attempt(between))
    return tried


def one_candidate(
    name: str, conf: str, tiny: bool, empty_cache: bool, search_s: float, result_file: Path
) -> None:
    """Everything measured for one allocator candidate, in this process (its allocator set at start), into
    `result_file` after each part, so that a candidate stopped by its time limit keeps what it measured."""
    import logging

    import torch

    from trainer.config import TrainConfig
    from trainer.infra import memory
    from trainer.plan.memory_plan import with_planned_batch
    from trainer.report.step_meter import SUMMARY
    from trainer.run.train import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result: dict = {"candidate": name, "conf": conf or "(PyTorch defaults)"}
    with tempfile.TemporaryDirectory(prefix=f"allocator-{name}-", dir="/tmp") as tmp:
        work = Path(tmp)
        values = run_config(work, conf, tiny)
        cfg = TrainConfig.from_dict(values, source=f"allocator {name}")
        rc = train(cfg)
        result["alloc_conf_in_force"] = memory.alloc_conf_in_force()
        rows = train_rows(work / "out")
        summary = json.loads((work / "out" / SUMMARY).read_text())
        result.update(ok=rc == 0, oom_split=summary.get("oom_split"), **run_throughput(rows))
        result.update(memory_numbers(torch))
        result["checkpoint_written"] = any((work / "out").glob("checkpoint-*"))
        result_file.write_text(json.dumps(result))

        # The same model and optimizer again, for the empty_cache cost and the budget search.
        gc.collect()
        memory.free_memory()
        result["allocated_after_run_gib"] = (
            torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else None
        )
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        planned = with_planned_batch(cfg)
        model, optimizer = build(planned, device)
        tokenizer_file = str(Path(values["model_name_or_path"]) / "tokenizer.json")
        if empty_cache:
            from trainer.data.loader import stream_for, to_device

            stream = stream_for(planned, tokenizer_file, "train")
            stream.set_epoch(0)
            batches = iter(stream)
            group = [to_device(next(batches), device) for _ in range(planned.gradient_accumulation_steps)]
            result["empty_cache"] = empty_cache_cost(model, optimizer, group, planned, pairs=2 if tiny else 4)
            del group
            result_file.write_text(json.dumps(result))
        sizes = [1024, 2048, 4096] if tiny else SEARCH_SIZES
        result["search"] = budget_search(model, optimizer, planned, tokenizer_file, sizes, search_s)
        fitted = [t["max_tokens"] for t in result["search"] if t["ok"]]
        result["largest_budget"] = max(fitted) if fitted else None
        result["search_hit_oom"] = any(not t["ok"] for t in result["search"])
        result_file.write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------ the comparison


def run_candidate(name: str, conf: str, args, timeout: float, empty_cache: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    with tempfile.NamedTemporaryFile(suffix=".json") as result_file:
        cmd = [sys.executable, __file__, "--out", args.out, "--one", name, "--result", result_file.name]
        cmd += ["--search-s", str(args.search_s)]
        cmd += (["--tiny"] if args.tiny else []) + (["--empty-cache-candidate", name] if empty_cache else [])
        log = Path(args.out) / f"allocator_{name}.log"
        t0 = time.perf_counter()
        with open(log, "w", encoding="utf-8") as f:
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        text = Path(result_file.name).read_text()
    seconds = time.perf_counter() - t0
    result = json.loads(text) if text else {"candidate": name, "conf": conf, "ok": False}
    if rc != 0:  # what it measured before it stopped, and why it stopped
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        result["error"] = f"timed out after {timeout:.0f} s" if rc == 124 else f"exit {rc}"
        result["log_tail"] = lines[-12:]
    return result | {"process_s": seconds}


def gib(v) -> str:
    return "n/a" if v is None else f"{v:.2f} GiB"


def print_tables(results: list[dict], tiny: bool) -> None:
    print(
        "| candidate | PYTORCH_CUDA_ALLOC_CONF | peak reserved | peak allocated | fragmentation | retries "
        "| real tok/s | largest budget without OOM |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "real_tok_s" not in r:
            print(f"| {r['candidate']} | {r['conf'] or '(defaults)'} | failed: {r.get('error')} | | | | | |")
            continue
        budget = "-" if r.get("largest_budget") is None else f"{r['largest_budget'] // 1024}k"
        if r.get("largest_budget") is not None and not r.get("search_hit_oom"):
            budget = f">= {budget} (no OOM up to the largest tried)"
        if "search" not in r:
            budget = f"not measured ({r.get('error', 'no search')})"
        backoff = f" ({r['oom_split']}x split: OOM back-off)" if (r.get("oom_split") or 1) > 1 else ""
        cells = [
            r["candidate"],
            r["conf"],
            gib(r.get("peak_reserved_gib")),
            gib(r.get("peak_allocated_gib")),
            gib(r.get("fragmentation_gib")),
            "-" if r.get("alloc_retries") is None else str(r["alloc_retries"]),
            f"{r['real_tok_s']:,.0f}{backoff}",
            budget,
        ]
        print("| " + " | ".join(cells) + " |")
    cleared = next((r for r in results if r.get("empty_cache")), None)
    if cleared:
        e = cleared["empty_cache"]
        print(
            f"\nempty_cache_steps ({cleared['candidate']}): one clearing costs "
            f"{1000 * e['cost_per_clear_s']:.0f} ms (spread {1000 * e['cost_spread_s']:.0f} ms) "
            f"on a {e['step_s']:.2f} s step"
        )
        print("| clear every N steps | cost per step | reserved between steps |")
        print("|---|---|---|")
        between = e["reserved_between_steps_gib"]
        print(f"| never | 0 | {gib(between.get('never'))} |")
        for n, share in e["overhead"].items():
            print(f"| {n} | {100 * share:.2f}% | {gib(between.get('cleared'))} after each clearing |")
        print(
            f"fewest steps between clearings for <= {100 * EMPTY_CACHE_BUDGET:.1f}% of the step time: "
            f"{e['fewest_steps_between_clears_within_budget']}"
        )
    ran = [r for r in results if "real_tok_s" in r and (r.get("oom_split") or 1) == 1]
    if ran and not tiny:
        best = max(
            ran,
            key=lambda r: (
                r.get("largest_budget") or 0,
                round(r["real_tok_s"], -2),
                -(r.get("peak_reserved_gib") or 0),
            ),
        )
        print(f"\nby these numbers (largest budget, then tokens/s, then least reserved): {best['candidate']}")


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", required=True, help="directory for allocator.json and each candidate's log")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (checks the script)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"of {', '.join(CANDIDATES)}")
    parser.add_argument(
        "--empty-cache-candidate", default="expandable", help="measure empty_cache_steps here"
    )
    parser.add_argument("--search-s", type=float, default=35.0, help="time bound of each budget search")
    parser.add_argument("--candidate-s", type=float, default=170.0, help="time limit of each candidate")
    parser.add_argument("--budget-s", type=float, default=450.0, help="no candidate runs past this (s)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one candidate
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        empty_cache = args.empty_cache_candidate == args.one
        one_candidate(
            args.one, CANDIDATES[args.one], args.tiny, empty_cache, args.search_s, Path(args.result)
        )
        return 0

    Path(args.out).mkdir(parents=True, exist_ok=True)
    names = [c for c in args.candidates.split(",") if c]
    unknown = [c for c in names if c not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidates {unknown}; known: {', '.join(CANDIDATES)}")
    src, tgt = mean_lengths(make_records())
    print(f"data: bench_run.make_records, mean {src:.0f} source + {tgt:.0f} target tokens", flush=True)
    started = time.perf_counter()
    results = []
    for name in names:
        left = args.budget_s - (time.perf_counter() - started)
        if left < 60 and not args.tiny:
            results.append(
                {"candidate": name, "conf": CANDIDATES[name], "ok": False, "error": "skipped: time"}
            )
            continue
        timeout = min(args.candidate_s, left) if not args.tiny else 1200
        r = run_candidate(
            name, CANDIDATES[name], args, timeout, empty_cache=name == args.empty_cache_candidate
        )
        results.append(r)
        print(
            f"{name}: {r['process_s']:.0f} s {json.dumps({k: v for k, v in r.items() if k != 'search'})}",
            flush=True,
        )
    # Results accumulate in --out: one call per few candidates fits a 10-minute job limit, one table for all.
    saved = Path(args.out) / "allocator.json"
    earlier = json.loads(saved.read_text()) if saved.exists() else []
    ran_now = {r["candidate"] for r in results}
    results = [r for r in earlier if r["candidate"] not in ran_now] + results
    results.sort(key=lambda r: list(CANDIDATES).index(r["candidate"]))
    print()
    print_tables(results, args.tiny)
    saved.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {Path(args.out) / 'allocator.json'}; {time.perf_counter() - started:.0f} s in all")
    return 0 if all("real_tok_s" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Several GPUs through torchrun: the preset under ddp on 1, 2 (and 4) GPUs, the same on packed 8k-token
micro-batches replayed as CUDA graphs, FSDP2 on packed and padded rows and where its time goes, the losses
of ddp and FSDP2 on the same global batches, and the memory plan against every measured peak.

    python3 bench/multi_gpu.py --out results/multi_gpu_2x            # the runs for the GPUs this machine has
    python3 bench/multi_gpu.py --set max_tokens=8192 gradient_accumulation_steps=8   # the preset changed
    python3 bench/multi_gpu.py --runs ddp1 ddp2 --steps 12           # some runs only (names: --list)
    python3 bench/multi_gpu.py --shape xxl --cap 48 --runs fsdp2 \
        --preset configs/flan-t5-xxl-fsdp-2x-rtx6000ada.yaml         # XXL's shape and preset, 48 GiB each
    python3 bench/multi_gpu.py --shape xxl --runs fsdp4 --preset configs/flan-t5-xxl-fsdp-4x-rtx5090.yaml \
        --resume-on 2 --resume-cap 48                                 # saved on 4 GPUs, resumed on 2
    python3 bench/multi_gpu.py --tiny --device cpu --out /tmp/mg     # tiny shape, gloo on the CPU: the script
    python3 bench/multi_gpu.py --runs ddp2 fsdp2 --steps 8 --set profile_steps=2 profile_start_step=5
        # rank 0's profile of two steps per run: the head of its kernels.txt printed (collectives' time, and
        # how much of it no computation hid), the whole under --out's <run>/profile/
    python3 bench/multi_gpu.py --runs fsdp2 --steps 7 --set profile_steps=1 profile_memory=true
        # and the memory allocated at the peak, by source line (memory.txt), against the plan's prediction

Every run is `torchrun --standalone --nproc_per_node=N` over the trainer's own loop
(`trainer.run.train.train`, as `torchrun -m trainer train` runs it) with configs/flan-t5-xl-rtx5090.yaml as
it is (`--preset`: another config; `--set` changes it for every run), FLAN-T5-XL's shape (`--shape xxl`:
XXL's) with random weights (nothing downloads), on bench_run's recipe-length records read by the Rust
loader, every process capped at 32 GiB (`--cap`; `gpu_memory_limit_gib`). The runs (`--list`):

- `ddpN`: the preset on N GPUs (`distributed_strategy: ddp`, the same per-GPU micro-batch on every N).
- `graphsN` (when the preset does not already replay CUDA graphs): the preset on packed rows of 8k-token
  micro-batches replayed as CUDA graphs (`cuda_graphs`), accumulating as many tokens per step as the preset.
- `fsdpN` (N = 2 and all the GPUs): the preset under FSDP2, eager (`cuda_graphs: false`);
  `fsdpN_graphs`: the same on packed rows with each micro-step, FSDP2's all-gathers and reduce-scatters
  included, replayed as a CUDA graph (`cuda_graphs: true`); `fsdpN_two_micro`: eager, the same tokens per
  optimizer step in two micro-batches (large micro-batches hide an eager step's host time). On all the GPUs
  only:
  `fsdpN_padded` / `fsdpN_packed`: on the rows the preset does not use;
  `fsdpN_one_reduce`: gradients reduce-scattered once per step (`fsdp_sync_each_micro_batch: false`);
  `fsdpN_kept_weights`: gathered weights kept from forward to backward (`fsdp_reshard_after_forward: false`);
  `fsdpN_fp32_reduce`: gradients reduce-scattered in fp32 rather than the bf16 weights' dtype;
  `fsdpN_kahan_8bit`: the Kahan buffer in one byte per weight (`bf16_update: kahan_8bit`: the memory it frees
  keeps more blocks un-checkpointed).

Measured per run: real (non-pad) tokens/s of all GPUs over the steps after `--warmup` (train log, rank 0's
clock) and how much one step's rate varies (standard deviation over mean: the noise), MFU (the training FLOPs
of those tokens, trainer.plan.gpu_specs.flops_per_token, over the GPUs' dense bf16 peak), scaling efficiency
(tokens/s over N x the same run's on one GPU; FSDP2's over ddp1's), each GPU's peak allocated and reserved
memory and what the device holds outside PyTorch's allocator (CUDA context, NCCL's buffers), the plan's
predicted peak (run_summary.json) and its error against the largest reserved peak, the optimizer step's and
ddp's gradient all-reduce's GPU time per step (CUDA events around them, rank 0), and for FSDP2 the largest
per-step loss difference from ddpN on the same global batches (bf16: ~1e-3 expected).
`--resume-on M`: the first run also saves a checkpoint at its last step, which `<run>_resumed_on_M` resumes on
M processes (capped at `--resume-cap` GiB) for two more steps: the checkpoint reshards to another process
count, and the table shows the resumed run's memory against its plan.
The whole set stops starting runs when `--time-limit` would be passed, and prints its table either way.
NCCL's NVLink multicast is off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1): some multi-GPU hosts
cannot use it. Results: `--out`/results.json (every number), `--out`/table.md, and each run's train log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from bench_run import PRESET, QUIET_RUN, VOCAB, make_records, train_rows, write_data

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

REPO = Path(__file__).resolve().parents[1]
GPU_CAP_GIB = 32.0
# A run's key, not the trainer's: the dtype FSDP2 reduce-scatters in (trainer.run.parallel.FSDP_REDUCE_DTYPE).
REDUCE_DTYPE_KEY = "bench_fsdp_reduce_dtype"
GRAPH_TOKENS = 8192  # graphsN's micro-batch (512 with --tiny)
GIB = 2**30


# --------------------------------------------------------------------------------------------- the runs


def preset_values(preset: Path, overrides: list[str], tiny: bool, device: str, cap_gib: float) -> dict:
    """The preset's config with `--set` applied, then what a timing run changes: the bench's model and data
    (filled in later), random weights, no evaluation, checkpoints or reporting, the memory cap."""
    values = yaml.safe_load(preset.read_text(encoding="utf-8"))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        values[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    values.update(QUIET_RUN, random_init=True, progress_bar=False)
    values["gpu_memory_limit_gib"] = cap_gib if device == "cuda" else None
    if tiny:  # the script's own check: short rows, small micro-batches
        values.update(max_source_length=64, max_target_length=96, max_tokens=1024, pad_to_multiple_of=8)
    return values


def all_runs(gpus: int, preset: dict, graph_tokens: int) -> dict[str, tuple[int, dict]]:
    """name -> (processes, config overrides on top of the preset) for a machine of `gpus` GPUs; graphsN's
    micro-batches have `graph_tokens` tokens, as many per step in all as the preset's."""
    step_tokens = (preset.get("max_tokens") or graph_tokens) * preset.get("gradient_accumulation_steps", 1)
    graphs = dict(
        packing=True,
        cuda_graphs=True,
        max_tokens=graph_tokens,
        gradient_accumulation_steps=max(1, round(step_tokens / graph_tokens)),
    )
    runs: dict[str, tuple[int, dict]] = {}
    preset_is_graphs = preset.get("cuda_graphs") and preset.get("packing")
    for n in sorted({1, 2, gpus} & set(range(1, gpus + 1))):
        runs[f"ddp{n}"] = (n, dict(distributed_strategy="ddp"))
        if not preset_is_graphs:
            runs[f"graphs{n}"] = (n, dict(graphs, distributed_strategy="ddp"))
    fsdp = dict(distributed_strategy="fsdp", cuda_graphs=False)
    two_micro = dict(fsdp, max_tokens=step_tokens // 2, gradient_accumulation_steps=2)
    for n in sorted({2, gpus} & set(range(2, gpus + 1))):
        runs[f"fsdp{n}"] = (n, fsdp)
        runs[f"fsdp{n}_graphs"] = (n, dict(fsdp, packing=True, cuda_graphs=True))
        if preset.get("max_tokens") and preset.get("gradient_accumulation_steps", 1) > 2:
            runs[f"fsdp{n}_two_micro"] = (n, two_micro)
    if gpus >= 2:
        other = "padded" if preset.get("packing") else "packed"
        runs[f"fsdp{gpus}_{other}"] = (gpus, dict(fsdp, packing=not preset.get("packing")))
        runs[f"fsdp{gpus}_one_reduce"] = (gpus, dict(fsdp, fsdp_sync_each_micro_batch=False))
        runs[f"fsdp{gpus}_kept_weights"] = (gpus, dict(fsdp, fsdp_reshard_after_forward=False))
        runs[f"fsdp{gpus}_fp32_reduce"] = (gpus, dict(fsdp, **{REDUCE_DTYPE_KEY: "float32"}))
        runs[f"fsdp{gpus}_kahan_8bit"] = (gpus, dict(fsdp, bf16_update="kahan_8bit"))
    return runs


def default_runs(gpus: int, runs: dict) -> list[str]:
    """What one call of a few minutes measures: on 2 GPUs every run; on more, ddp and graphs on 1, 2 and all
    of them, and FSDP2 on 2 and all of them, on the preset's micro-batches and on two per step."""
    if gpus <= 2:
        return list(runs)
    kept = ("ddp", "graphs", "fsdp")
    return [name for name in runs if name.rstrip("0123456789") in kept or name.endswith("_two_micro")]


# ----------------------------------------------------------------------------------- one rank (torchrun)


def worker(config: Path) -> int:
    """One rank: train with CUDA events around the optimizer step and ddp's gradient all-reduce, then record
    this rank's memory and those times."""
    import logging

    import torch

    import trainer.run.train as loop
    from trainer.config import TrainConfig
    from trainer.infra import distributed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cuda = torch.cuda.is_available()
    spans: dict[str, list] = {"optimizer": [], "all_reduce": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if not cuda:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                spans[name].append(time.perf_counter() - start)
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            spans[name].append((start, end))
            return out

        return wrapper

    loop.optimizer_step = timed("optimizer", loop.optimizer_step)
    distributed.GradientBuffer.all_reduce = timed("all_reduce", distributed.GradientBuffer.all_reduce)
    values = yaml.safe_load(config.read_text())
    from trainer.run import parallel

    if REDUCE_DTYPE_KEY in values:
        parallel.FSDP_REDUCE_DTYPE = getattr(torch, values.pop(REDUCE_DTYPE_KEY))
    cfg = TrainConfig.from_dict(values, source=str(config))
    rc = loop.train(cfg)
    rank = int(os.environ.get("RANK", 0))
    record = {"rank": rank, "exit_code": rc}
    if cuda:
        torch.cuda.synchronize()
        for name, pairs in spans.items():
            spans[name] = [start.elapsed_time(end) / 1000 for start, end in pairs]
        free, total = torch.cuda.mem_get_info()
        record.update(
            peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            outside_allocator_gib=(total - free - torch.cuda.memory_reserved()) / GIB,
        )
    record.update({f"{name}_s": values for name, values in spans.items()})
    (Path(cfg.output_dir) / f"rank-{rank}.json").write_text(json.dumps(record))
    return rc


# ---------------------------------------------------------------------------------------------- a run


def steady_tokens_per_s(rows: list[dict], warmup: int) -> float:
    """Real tokens of all ranks per second over the steps after `warmup` (train log, rank 0's clock)."""
    timed = rows[warmup:]  # warmup >= 1: the first timed step starts at the end of the one before
    tokens = sum(r["source_tokens"] + r["target_tokens"] for r in timed)
    return tokens / (timed[-1]["time"] - rows[warmup - 1]["time"])


def steady_flops_per_s(rows: list[dict], warmup: int, flops: tuple[float, float]) -> float:
    """Training FLOPs of all ranks per second over the steps after `warmup` (`flops`: per real source and
    target token)."""
    timed = rows[warmup:]
    total = sum(flops[0] * r["source_tokens"] + flops[1] * r["target_tokens"] for r in timed)
    return total / (timed[-1]["time"] - rows[warmup - 1]["time"])


def peak_flops() -> float:
    """This GPU's dense bf16 FLOP/s (trainer.plan.gpu_specs; an H100's for a GPU it does not know)."""
    import torch

    from trainer.plan.gpu_specs import gpu_spec

    try:
        return gpu_spec(torch.cuda.get_device_name()).bf16_flops
    except ValueError:
        return 989e12


def step_spread(rows: list[dict], warmup: int) -> float | None:
    """The standard deviation of the timed steps' tokens/s over their mean: how much one step varies (the
    run's tokens/s is over all of them)."""
    rates = [
        (r["source_tokens"] + r["target_tokens"]) / (r["time"] - before["time"])
        for before, r in zip(rows[warmup - 1 :], rows[warmup:], strict=False)
    ]
    if len(rates) < 2:
        return None
    mean = sum(rates) / len(rates)
    return (sum((x - mean) ** 2 for x in rates) / (len(rates) - 1)) ** 0.5 / mean


def mean_after(values: list[float], warmup: int) -> float | None:
    timed = values[warmup:]
    return sum(timed) / len(timed) if timed else None


def launch(
    name: str, nproc: int, values: dict, out: Path, device: str, warmup: int, flops: tuple[float, float]
) -> dict:
    """One run through torchrun; its numbers (or why it failed). `flops`: training FLOPs per real source and
    target token of the model (for MFU, against each GPU's dense bf16 rate)."""
    run_dir = out / name
    values = dict(values, output_dir=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    config = out / f"{name}.yaml"
    config.write_text(yaml.safe_dump(values))
    env = dict(os.environ)
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # gloo on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [__file__, "--worker", str(config)]
    print(f"--- {name}: {nproc} process(es): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd, env=env).returncode
    result: dict = {
        "run": name,
        "processes": nproc,
        "strategy": values.get("distributed_strategy", "ddp"),
        "rows": "packed" if values.get("packing") else "padded",
        "micro_batch": f"{values.get('max_tokens')} tokens x {values.get('gradient_accumulation_steps', 1)}",
        "cuda_graphs": bool(values.get("cuda_graphs")),
        "wall_s": time.time() - t0,
        "exit_code": rc,
    }
    if rc != 0:
        return result
    profile = run_dir / "profile" / "kernels.txt"
    if profile.is_file():  # --set profile_steps=N: rank 0's report's head (trainer.report.profiling)
        print(f"{name}, rank 0's profile:", *profile.read_text().splitlines()[:18], sep="\n  ", flush=True)
    memory = run_dir / "profile" / "memory.txt"
    if memory.is_file():  # --set profile_memory=true as well: what is allocated at the peak
        print(f"{name}, rank 0's memory at the peak:", *memory.read_text().splitlines()[:30], sep="\n  ")
    summary = json.loads((run_dir / "run_summary.json").read_text())
    ranks = [json.loads((run_dir / f"rank-{r}.json").read_text()) for r in range(nproc)]
    rows = train_rows(run_dir)
    warm = max(1, min(warmup, len(rows) - 1))
    reserved = [r.get("peak_reserved_gib") for r in ranks]
    planned = summary.get("planned_peak_gib")
    result.update(
        steps=summary["steps"],
        tokens_per_s=steady_tokens_per_s(rows, warm),
        mfu=steady_flops_per_s(rows, warm, flops) / (nproc * peak_flops()) if device == "cuda" else None,
        step_spread=step_spread(rows, warm),
        real_token_share=sum(r["source_tokens"] + r["target_tokens"] for r in rows)
        / sum(r["padded_tokens"] for r in rows),
        losses=[r["loss"] for r in rows],
        oom_split=summary.get("oom_split"),
        blocks_without_checkpointing=[
            summary.get("decoder_blocks_without_checkpointing"),
            summary.get("encoder_blocks_without_checkpointing"),
        ],
        packed_rows=summary.get("packed_rows"),
        peak_allocated_gib=[r.get("peak_allocated_gib") for r in ranks],
        peak_reserved_gib=reserved,
        outside_allocator_gib=[r.get("outside_allocator_gib") for r in ranks],
        planned_peak_gib=planned,
        plan_error=planned / max(reserved) - 1 if planned and all(reserved) else None,
        optimizer_step_s=mean_after(ranks[0]["optimizer_s"], warm),
        all_reduce_s=mean_after(ranks[0]["all_reduce_s"], warm) if nproc > 1 else None,
    )
    return result


# ---------------------------------------------------------------------------------------------- summary


def add_comparisons(results: list[dict]) -> None:
    """Scaling efficiency against the same run on one GPU (FSDP2 against ddp1), and FSDP2's largest per-step
    loss difference from ddp on the same GPUs, rows and micro-batches."""
    by_name = {r["run"]: r for r in results if r["exit_code"] == 0}
    for r in by_name.values():
        family = r["run"].split("_")[0].rstrip("0123456789")  # ddp, graphs or fsdp
        one = by_name.get(f"{'ddp' if family == 'fsdp' else family}1")
        if one is not None and r["processes"] > 1 and r["rows"] == one["rows"]:
            r["scaling"] = r["tokens_per_s"] / (r["processes"] * one["tokens_per_s"])
        peer = by_name.get(f"ddp{r['processes']}")
        same_batches = peer is not None and all(peer[k] == r[k] for k in ("rows", "micro_batch"))
        if r["strategy"] == "fsdp" and same_batches:
            pairs = list(zip(peer["losses"], r["losses"], strict=False))
            r["loss_vs_ddp"] = max(abs(f - d) / abs(d) for d, f in pairs)


def table(results: list[dict], header: str) -> str:
    def num(value, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    def ms(seconds) -> str:
        return "n/a" if seconds is None else f"{1000 * seconds:.0f} ms"

    def gib(values) -> str:
        return "n/a" if not values or None in values else "/".join(f"{v:.1f}" for v in values)

    lines = [
        header,
        "",
        "| run | GPUs | strategy | rows | micro-batch | real tok/s (step spread) | MFU | scaling | "
        "peak alloc / reserved per GPU (GiB) | outside allocator | plan (error) | optimizer step | "
        "all-reduce | loss vs ddp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["exit_code"] != 0:
            lines.append(
                f"| {r['run']} | {r['processes']} | failed: exit code {r['exit_code']} |" + " |" * 11
            )
            continue
        plan = "n/a"
        if r.get("planned_peak_gib") is not None:
            plan = f"{r['planned_peak_gib']:.1f} ({num(r.get('plan_error'), '+.1%')})"
        graphs = ", graphs" if r["cuda_graphs"] else ""
        lines.append(
            f"| {r['run']} | {r['processes']} | {r['strategy']} | {r['rows']}{graphs} | {r['micro_batch']} | "
            f"{r['tokens_per_s']:,.0f} ({num(r.get('step_spread'), '.1%')}) | {num(r.get('mfu'), '.1%')} | "
            f"{num(r.get('scaling'), '.1%')} | "
            f"{gib(r['peak_allocated_gib'])} / {gib(r['peak_reserved_gib'])} | "
            f"{gib(r['outside_allocator_gib'])} | {plan} | {ms(r.get('optimizer_step_s'))} | "
            f"{ms(r.get('all_reduce_s'))} | {num(r.get('loss_vs_ddp'), '.2%')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one rank, under torchrun
    parser.add_argument(
        "--out", type=Path, required=False, help="results folder (default: a new temporary one)"
    )
    parser.add_argument("--runs", nargs="+", help="run names (default: what one call measures; see --list)")
    parser.add_argument("--list", action="store_true", help="print the runs this machine offers and exit")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="change the preset, every run"
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timings (default 2)")
    parser.add_argument("--records", type=int, default=16384, help="synthetic recipes (default 16384)")
    parser.add_argument("--time-limit", type=float, default=540.0, help="start no run past this many seconds")
    parser.add_argument(
        "--shape", choices=["xl", "xxl"], default="xl", help="the model's shape (default xl: FLAN-T5-XL's)"
    )
    parser.add_argument(
        "--cap", type=float, default=GPU_CAP_GIB, help=f"GiB each process may use (default {GPU_CAP_GIB:g})"
    )
    parser.add_argument(
        "--preset",
        type=Path,
        default=PRESET,
        help=f"the config every run starts from (default {PRESET.name})",
    )
    parser.add_argument(
        "--resume-on",
        type=int,
        metavar="M",
        help="save the first run's last step and resume it on M processes for two more steps",
    )
    parser.add_argument("--resume-cap", type=float, help="GiB each resumed process may use (default: --cap)")
    parser.add_argument("--tiny", action="store_true", help="tiny shape (checks the script)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)

    gpus = 2
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("no CUDA GPU here: --device cpu --tiny checks the script on the CPU")
    from trainer.model.tiny_model import flan_t5_config
    from trainer.plan.gpu_specs import flops_per_token

    preset = preset_values(args.preset, args.set, args.tiny, args.device, args.cap)
    shape = "tiny" if args.tiny else args.shape
    runs = all_runs(gpus, preset, 512 if args.tiny else GRAPH_TOKENS)
    if args.list:
        for name, (nproc, overrides) in runs.items():
            print(f"{name}: {nproc} process(es), {overrides or 'the preset'}")
        return 0
    names = args.runs or default_runs(gpus, runs)
    unknown = [n for n in names if n not in runs]
    if unknown:
        raise SystemExit(f"unknown runs {unknown} on {gpus} GPU(s); these exist: {', '.join(runs)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="multi-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    data_dir = out / "data"
    data, model_dir = write_data(data_dir, make_records(args.records), shape)
    flops = flops_per_token(flan_t5_config(shape, vocab_size=VOCAB))
    preset.update(model_name_or_path=str(model_dir), train_files=[str(data)], max_steps=args.steps)
    results, skipped = [], []
    for index, name in enumerate(names):
        longest = max((r["wall_s"] for r in results), default=0.0)
        if results and time.time() - start + longest > args.time_limit:
            skipped.append(name)
            continue
        nproc, overrides = runs[name]
        values = dict(preset, **overrides)
        if args.resume_on and index == 0:
            values["save_steps"] = args.steps  # the checkpoint the resumed run starts from
        results.append(launch(name, nproc, values, out, args.device, args.warmup, flops))
        add_comparisons(results)
        (out / "results.json").write_text(
            json.dumps(results, indent=2) + "\n"
        )  # a cut-short call keeps these
    if args.resume_on and results and results[0]["exit_code"] == 0:
        saved = results[0]
        cap = args.resume_cap or args.cap
        values = dict(
            preset,
            **runs[saved["run"]][1],
            resume=str(out / saved["run"] / f"checkpoint-{args.steps}"),
            max_steps=args.steps + 2,
            gpu_memory_limit_gib=cap if args.device == "cuda" else None,
        )
        name = f"{saved['run']}_resumed_on_{args.resume_on}"
        resumed = launch(name, args.resume_on, values, out, args.device, 1, flops)
        results.append(resumed)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        if resumed["exit_code"] == 0:
            print(
                f"resumed: {saved['run']}'s checkpoint-{args.steps} ({saved['processes']} processes) on "
                f"{args.resume_on} processes capped at {cap:g} GiB: "
                f"steps {args.steps + 1}-{resumed['steps']}, "
                f"losses {', '.join(f'{x:.4f}' for x in resumed['losses'])} (the saved run's last "
                f"{saved['losses'][-1]:.4f})",
                flush=True,
            )
    where = (
        f"{gpus} GPUs, each process capped at {args.cap:g} GiB"
        if args.device == "cuda"
        else "gloo on the CPU"
    )
    changed = f" with {' '.join(args.set)}" if args.set else ""
    model = "tiny" if args.tiny else f"FLAN-T5-{shape.upper()}"
    header = (
        f"{model} shape, random weights, {where}; {args.preset.resolve().name}{changed}; "
        f"{args.steps} steps per run, the first {args.warmup} left out of the timings; "
        f"{time.time() - start:.0f} s in all"
    )
    if args.resume_on:
        header += f"; the resumed run capped at {args.resume_cap or args.cap:g} GiB"
    if skipped:
        header += f"; not run (--time-limit {args.time_limit:g} s): {', '.join(skipped)}"
    text = table(results, header)
    (out / "table.md").write_text(text + "\n")
    print("\n" + text)
    print(f"\nresults: {out / 'results.json'}")
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

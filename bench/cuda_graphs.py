"""Whether CUDA graphs pay for the training step on packed batches (every micro-batch one shape), and whether
smaller micro-batches with fewer checkpointed blocks, whose launches a graph makes cheap, beat the preset's.

    python3 bench/cuda_graphs.py                                  # GPU: the configurations below
    python3 bench/cuda_graphs.py --configs 32k_plan,8k_decoder    # some of them
    python3 bench/cuda_graphs.py --tiny                           # CPU: a tiny shape, eager only

A configuration is `<micro-batch tokens>k_<checkpointing>`: `plan` (what the trainer does: every block
checkpointed but the last blocks the memory plan fits), `decoder` (encoder blocks checkpointed, no
decoder block), `none` (no checkpointing). Each runs in its own process on the FLAN-T5-XL shape (random
weights, bf16, Adafactor with Kahan updates, capped at 32 GiB as bench/train_throughput.py), on packed batches
of bench_run's synthetic recipe records read through the real loader, and times optimizer steps of ~64k tokens
(accumulation 65536 / micro-batch tokens), the update included, two ways:
- eager: the trainer's accumulation (trainer.run.step.accumulate_gradients), clipping and update;
- graph: as `cuda_graphs: true` trains (trainer.run.cuda_graphs.MicroStepGraph): the micro-step's forward,
  backward and gradient accumulation captured once in a CUDA graph over static input tensors, each
  micro-batch copied in and the graph replayed; the update replayed from a second graph in the first one's
  memory pool (gradients zeroed in place).
Reported: real tokens/s, ms per micro-step, peak memory, and graph against eager.
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

from bench_run import QUIET_RUN, make_records, write_data

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

STEP_TOKENS = 65536  # tokens per optimizer step, as the preset's 32k x 2
CONFIGS = "32k_plan,16k_plan,8k_decoder,4k_none"


def parse(name: str) -> tuple[int, str]:
    tokens, checkpointing = name.split("_")
    if checkpointing not in ("plan", "decoder", "none") or not tokens.endswith("k"):
        raise SystemExit(f"bad configuration {name!r}: <tokens>k_<plan|decoder|none>")
    return int(tokens[:-1]) * 1024, checkpointing


def run_config(name: str, work: Path, steps: int, warmup: int, tiny: bool) -> list[dict]:
    """Eager, then (on CUDA) graph timing of one configuration in this process."""
    import torch

    from trainer.config import TrainConfig
    from trainer.data.loader import stream_for, to_device
    from trainer.infra.distributed import grad_norm
    from trainer.kernels.projections import accumulate_weight_grads_in_place
    from trainer.model.load import load_model
    from trainer.model.loss import Seq2SeqLMLoss
    from trainer.model.model_files import resolve_tokenizer_file
    from trainer.optim import build_optimizer
    from trainer.plan.memory_plan import plan_packed_rows, plan_run
    from trainer.run.schedule import clip_coefficient
    from trainer.run.setup import setup_device
    from trainer.run.step import accumulate_gradients

    tokens, checkpointing = parse(name)
    cuda = torch.cuda.is_available()
    if tiny:  # checks the code path only
        tokens, steps, warmup = 2048, 1, 1
    records = make_records(n=512 if tiny else 4096)
    data, model_dir = write_data(work, records, "tiny" if tiny else "xl")
    values = dict(
        model_name_or_path=str(model_dir),
        random_init=True,
        train_files=[str(data)],
        dtype="bfloat16" if cuda else "float32",
        optimizer="adafactor",
        bf16_update="kahan",
        learning_rate=1e-3,
        packing=True,
        max_tokens=tokens,
        max_source_length=512,
        max_target_length=512,
        gradient_checkpointing=checkpointing != "none",
        decoder_blocks_without_checkpointing={"plan": None, "decoder": 10**6, "none": 0}[checkpointing],
        encoder_blocks_without_checkpointing={"plan": None, "decoder": 0, "none": 0}[checkpointing],
        output_dir=str(work / "out"),
        gpu_memory_limit_gib=32.0 if cuda else None,
        **QUIET_RUN,
    )
    # Planned as the trainer plans: the budget, then the blocks kept on the rows the loader packs.
    cfg = TrainConfig.from_dict(values, source=name)
    tokenizer_file = resolve_tokenizer_file(str(model_dir))
    packed_shape = stream_for(cfg, tokenizer_file, "train").stats()["packed_shape"]
    cfg = plan_packed_rows(plan_run(cfg), cfg, packed_shape).applied_to(cfg)
    device = setup_device(cfg, 0)
    torch.manual_seed(0)
    blocks = (cfg.decoder_blocks_without_checkpointing, cfg.encoder_blocks_without_checkpointing)
    model = load_model(cfg, device, blocks_without_checkpointing=blocks)
    model.train()
    accumulate_weight_grads_in_place(model)  # as the trainer does in one process
    module = Seq2SeqLMLoss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg, device)
    stream = stream_for(cfg, tokenizer_file, "train")
    accumulation = 2 if tiny else max(1, round(STEP_TOKENS / tokens))
    batches, it = [], iter(stream)
    for _ in range((warmup + steps) * accumulation):
        try:
            batches.append(next(it))
        except StopIteration:
            it = iter(stream)
            batches.append(next(it))
    groups = [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]
    real = [sum(int(b["attention_mask"].sum() + (b["labels"] != -100).sum()) for b in g) for g in groups]
    targets = [sum(int((b["labels"] != -100).sum()) for b in g) for g in groups]
    groups = [[to_device(b, device) for b in g] for g in groups]
    first = groups[0][0]
    common = dict(
        config=name,
        micro_batch=f"{first['input_ids'].shape[0]} rows x ({first['input_ids'].shape[1]} + "
        f"{first['labels'].shape[1]})",
        accumulation=accumulation,
        blocks_without_checkpointing=f"{min(blocks[0], 10**3)} decoder, {blocks[1]} encoder"
        if cfg.gradient_checkpointing
        else "all (no checkpointing)",
    )

    def optimizer_step(group: list[dict], n_target: int, graph=None) -> float:
        """The loop's step: its accumulation (eagerly, or through `graph`), clipping and update."""
        total, _ = accumulate_gradients(module, group, 1, n_target=n_target, graph=graph)
        norm = grad_norm(params)
        layout = optimizer.advance(grad_scale=clip_coefficient(norm, 1.0))  # Adafactor, as configured
        loss_sum, _ = torch.stack([total.float(), norm.float()]).tolist()
        if graph is not None:  # the update replayed too, in the graph's memory pool
            graph.update(optimizer, layout)
        else:
            optimizer.apply()
        optimizer.zero_grad(set_to_none=graph is None)  # a graph adds into gradients that stay
        return loss_sum

    def timed(step_fn) -> dict:
        losses = []
        for i, (group, n_target) in enumerate(zip(groups, targets, strict=True)):
            if i == warmup:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
            losses.append(step_fn(group, n_target))
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return dict(
            real_tok_s=sum(real[warmup:]) / seconds,
            ms_per_micro_step=1000 * seconds / (steps * accumulation),
            peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            losses=losses,
        )

    results = [common | {"mode": "eager"} | timed(optimizer_step)]
    if not cuda:
        return results

    # Graph: the trainer's MicroStepGraph (warm-up micro-steps, one capture, replays).
    from trainer.run.cuda_graphs import MicroStepGraph

    graph = MicroStepGraph(lambda **batch: module(**batch), params)
    try:
        results.append(common | {"mode": "graph"} | timed(lambda g, n: optimizer_step(g, n, graph)))
    except Exception as e:  # noqa: BLE001 (the bench reports why capture or replay failed)
        results.append(common | {"mode": "graph", "error": f"{type(e).__name__}: {e}"[:500]})
    return results


def in_subprocess(args: list[str], timeout: float) -> list[dict]:
    """This script with `args` in a fresh process (clean memory counters); its JSON results."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, *args, "--result", out.name]
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return [{"config": args[1], "error": f"timed out after {timeout:.0f} s"}]
        text = Path(out.name).read_text()
        if proc.returncode != 0 or not text:
            return [{"config": args[1], "error": (proc.stdout + proc.stderr)[-1500:]}]
        return json.loads(text)


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timing")
    parser.add_argument("--tiny", action="store_true", help="tiny shape (CPU check of the script)")
    parser.add_argument("--out", help="directory for the full results (cuda_graphs.json)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        with tempfile.TemporaryDirectory(prefix="cuda-graphs-") as tmp:
            result = run_config(args.one, Path(tmp), args.steps, args.warmup, args.tiny)
        Path(args.result).write_text(json.dumps(result))
        return 0

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}; torch {torch.__version__}", flush=True)
    results = []
    for name in [c for c in args.configs.split(",") if c]:
        parse(name)
        t0 = time.time()
        extra = ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
        results += in_subprocess(["--one", name, *extra], timeout=400)
        print(f"{name}: {time.time() - t0:.0f} s {json.dumps(results[-1])[:400]}", flush=True)

    baseline = next((r for r in results if r.get("config") == "32k_plan" and r.get("mode") == "eager"), None)
    print()
    print(
        "| config | micro-batch | accumulation | blocks kept | mode | real tok/s | ms / micro-step "
        "| peak alloc | vs eager | vs 32k_plan eager |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | | | | {r.get('mode', '')} | failed: {r['error'][-300:]!r} | | | | |")
            continue
        eager = next(e for e in results if e.get("config") == r["config"] and e.get("mode") == "eager")
        vs_eager = f"{r['real_tok_s'] / eager['real_tok_s']:.3f}x"
        vs_base = f"{r['real_tok_s'] / baseline['real_tok_s']:.3f}x" if baseline else "-"
        peak = f"{r['peak_alloc_gib']:.1f} GiB" if r["peak_alloc_gib"] is not None else "n/a (CPU)"
        print(
            f"| {r['config']} | {r['micro_batch']} | {r['accumulation']} | "
            f"{r['blocks_without_checkpointing']} | {r['mode']} | {r['real_tok_s']:,.0f} | "
            f"{r['ms_per_micro_step']:.1f} | {peak} | {vs_eager} | {vs_base} |"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        everything = {"device": device, "results": results}
        (Path(args.out) / "cuda_graphs.json").write_text(json.dumps(everything, indent=2) + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""One optimizer step over FLAN-T5-XL's parameters (2.85B, bf16, random gradients) on the GPU.

    python3 bench/optimizer_step.py [--optimizers adafactor,adafactor_graph,adafactor_torch,adamw_kahan]

adafactor: trainer.optim.adafactor_optimizer.Adafactor with Kahan updates as the trainer runs it on a GPU
(same-shape weights together, trainer.kernels.adafactor_kernels); adafactor_graph: the same captured in a CUDA
graph and replayed, as with `cuda_graphs: true` (trainer.run.cuda_graphs); adafactor_torch: the torch ops it
runs off a GPU, one weight at a time; adamw_kahan: torch-optimi AdamW(kahan_sum=True); adamw_fused: torch's
fused AdamW (no compensation). Prints ms per step (and the host's part of it), the optimizer states' size and
the step's scratch memory. `--sweep` times trainer.kernels.adafactor_kernels' tilings instead (GPU time per
kernel, profiled)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.model.tiny_model import flan_t5_config  # noqa: E402
from trainer.optim import adafactor_optimizer as optim  # noqa: E402


def xl_parameters() -> list[torch.nn.Parameter]:
    """Parameters with FLAN-T5-XL's shapes (bf16, CUDA), each with a random bf16 gradient."""
    from transformers import AutoModelForSeq2SeqLM

    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(flan_t5_config("xl"))
    params = []
    for _, p in model.named_parameters():
        q = torch.nn.Parameter(torch.randn(p.shape, device="cuda", dtype=torch.bfloat16) * 0.02)
        q.grad = torch.randn_like(q) * 1e-3
        params.append(q)
    return params


class TorchOpsAdafactor(optim.Adafactor):
    """trainer.optim.adafactor_optimizer.Adafactor without its GPU kernels: what it runs on CPU, timed on the
    GPU."""

    def advance(self, grad_scale=None):
        layout = super().advance(grad_scale)
        self._work = [(params, scalars, group, None) for params, scalars, group, _ in self._work]
        return layout


def build(name: str, params):
    if name == "adafactor_torch":
        return TorchOpsAdafactor(params, lr=1e-3)
    if name.startswith("adafactor"):
        return optim.Adafactor(params, lr=1e-3)
    if name == "adamw_kahan":
        import optimi

        return optimi.AdamW(params, lr=1e-4, kahan_sum=True)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def captured_step(opt: optim.Adafactor):
    """opt's step as trainer.run.cuda_graphs runs it: the host's `advance`, then the captured `apply`
    replayed."""
    opt.advance()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        opt.apply()

    def step():
        opt.advance()
        graph.replay()

    return step


# (rows, columns, warps, pipeline stages) of the kernels' tiles
SWEEP = [(64, 64, 8, 1), (64, 128, 8, 1), (32, 128, 8, 2), (16, 256, 8, 1), (16, 256, 8, 3), (16, 256, 4, 2)]
SWEEP += [(8, 512, 8, 1), (32, 256, 8, 2)]


def sweep(params) -> None:
    """GPU time of each Adafactor kernel per step, for each tiling of SWEEP (the module's constants set)."""
    from trainer.kernels import adafactor_kernels as kernels

    defaults = kernels.BLOCK_ROWS, kernels.BLOCK_COLS, kernels.NUM_WARPS, kernels.STAGES
    for tiling in SWEEP:
        kernels.BLOCK_ROWS, kernels.BLOCK_COLS, kernels.NUM_WARPS, kernels.STAGES = tiling
        opt = optim.Adafactor(params, lr=1e-3)
        for _ in range(3):  # states, compilation
            opt.step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                opt.step()
            torch.cuda.synchronize()
        ms = {e.key: e.device_time_total / 3e3 for e in prof.key_averages() if e.key.startswith("_")}
        mark = " (the default)" if tiling == defaults else ""
        per_kernel = "  ".join(f"{k} {v:.2f}" for k, v in sorted(ms.items()))
        print(
            f"  {tiling[0]} x {tiling[1]}, {tiling[2]} warps, {tiling[3]} stages: {sum(ms.values()):6.2f} ms "
            f"({per_kernel}){mark}"
        )
        del opt
        torch.cuda.empty_cache()
    kernels.BLOCK_ROWS, kernels.BLOCK_COLS, kernels.NUM_WARPS, kernels.STAGES = defaults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--optimizers", default="adafactor,adafactor_graph,adafactor_torch,adamw_kahan,adamw_fused"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="time the Adafactor kernels' tilings")
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    params = xl_parameters()
    n = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {n / 1e9:.2f}B parameters")
    if args.sweep:
        sweep(params)
        return 0
    for name in args.optimizers.split(","):
        opt = build(name, params)
        for _ in range(3):  # states, compilation
            opt.step()
        step = captured_step(opt) if name == "adafactor_graph" else opt.step
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host_start = time.perf_counter()
        for _ in range(args.steps):
            step()
        host_ms = (time.perf_counter() - host_start) * 1e3 / args.steps
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.steps
        scratch = (torch.cuda.max_memory_allocated() - before) / 2**30
        state_gib = sum(
            t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        )
        print(
            f"  {name:<16} {ms:8.1f} ms per step ({host_ms:.1f} ms of it launching), "
            f"states {state_gib / 2**30:.1f} GiB, step scratch {scratch:.2f} GiB"
        )
        del opt
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

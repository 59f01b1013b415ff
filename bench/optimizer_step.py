"""One optimizer step over FLAN-T5-XL's parameters (2.85B, bf16, random gradients) on the GPU.

    python3 bench/optimizer_step.py [--optimizers adafactor,adafactor_eager,adamw_kahan,adamw_fused]

adafactor: trainer.optim.Adafactor with Kahan updates as the trainer runs it (weights stacked by shape,
update compiled on CUDA); adafactor_eager: the same update uncompiled; adamw_kahan: torch-optimi
AdamW(kahan_sum=True); adamw_fused: torch's fused AdamW (no compensation). Prints ms per step (and the
host's part of it), the optimizer states' size and the step's scratch memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import optim  # noqa: E402
from trainer.tiny_model import flan_t5_config  # noqa: E402


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


def build(name: str, params):
    if name.startswith("adafactor"):
        return optim.Adafactor(params, lr=1e-3, kahan=True, compile=name == "adafactor")
    if name == "adamw_kahan":
        import optimi

        return optimi.AdamW(params, lr=1e-4, kahan_sum=True)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--optimizers", default="adafactor,adafactor_eager,adamw_kahan,adamw_fused")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    params = xl_parameters()
    n = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {n / 1e9:.2f}B parameters")
    for name in args.optimizers.split(","):
        opt = build(name, params)
        for _ in range(3):  # states, compilation
            opt.step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host_start = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
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

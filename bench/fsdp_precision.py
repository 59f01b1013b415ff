"""FSDP2's bf16 gradients against one process's: is FSDP2's arithmetic (each micro-batch's gradients
reduce-scattered in fp32, then added into bf16 shards) as accurate as one process's (each micro-batch's weight
gradients added into bf16 `.grad` by the matmuls)?

    python3 bench/fsdp_precision.py                      # CPU: the tiny model, 2 gloo ranks (~1 minute)
    python3 bench/fsdp_precision.py --device cuda        # 2 GPUs: the trainer's kernels, 2 NCCL ranks

Three gradients of the same 16 micro-batches (random ids, padded rows, dropout off) from the same weights,
each through the trainer's own model (trainer.model.load.load_model) and loss:

- fp32: one process, fp32 weights: the reference;
- one_process: one process, bf16 weights, in-place weight gradients, as the trainer runs one process or ddp;
- fsdp: FSDP2 over 2 ranks (trainer.run.parallel.wrap), bf16 weights and compute, 8 micro-batches each.

Prints each bf16 gradient's relative L2 error against fp32 (over all weights) and their distance from each
other. FSDP2 is as accurate when its error is at most 1.1x one process's; then the two differ only as two
equally good bf16 computations do, which is what their losses do after a few steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_run import without_dropout

REPO = Path(__file__).resolve().parent.parent
MICRO_BATCHES = 16  # in all; 8 per rank under FSDP2
ROWS, SOURCE, TARGET = 4, 48, 64
WITHIN = 1.1


def batches(vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(3, vocab, (ROWS, SOURCE), generator=g)
        labels = torch.randint(3, vocab, (ROWS, TARGET), generator=g)
        out.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels))
    return out


def gradients(model_dir: str, mode: str, device_name: str, out: str) -> None:
    """One of the three gradients (`mode`), saved to `out` as {name: fp32 tensor} (rank 0 under FSDP2)."""
    import torch

    from trainer.config import TrainConfig
    from trainer.infra import distributed
    from trainer.kernels.projections import accumulate_weight_grads_in_place
    from trainer.model.load import load_model
    from trainer.model.loss import token_loss_sum
    from trainer.run import parallel

    fsdp = mode == "fsdp"
    rank, world_size, local_rank = distributed.env()
    device = torch.device(f"cuda:{local_rank}") if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = TrainConfig(
        model_name_or_path=model_dir,
        dtype="float32" if mode == "fp32" else "bfloat16",
        gradient_checkpointing=False,
        distributed_strategy="fsdp" if fsdp else "ddp",
    )
    distributed.init(device, 300)
    model = load_model(cfg, device).train()
    module = parallel.wrap(model, cfg, device) if fsdp else model
    if not fsdp:
        accumulate_weight_grads_in_place(model)
    data = batches(model.config.vocab_size)
    tokens = sum(int((b["labels"] != -100).sum()) for b in data)
    for batch in data[rank::world_size]:
        batch = {k: v.to(device) for k, v in batch.items()}
        # FSDP2 averages over ranks where the loop's sum of token losses wants a sum: scaled back here.
        (token_loss_sum(module, batch) * world_size / tokens).backward()
    grads = {
        name: (p.grad.full_tensor() if fsdp else p.grad).float().cpu() for name, p in model.named_parameters()
    }
    if rank == 0:
        torch.save(grads, out)
    distributed.destroy()


def relative_error(got: dict, want: dict) -> float:
    squared = sum(float((got[k] - want[k]).square().sum()) for k in want)
    return (squared / sum(float(want[k].square().sum()) for k in want)) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", help="a T5 model directory (default: the tiny model, built here)")
    parser.add_argument("--gradients", nargs=3, help=argparse.SUPPRESS)  # internal: MODEL MODE OUT
    args = parser.parse_args()
    if args.gradients:
        gradients(*args.gradients[:2], args.device, args.gradients[2])
        return 0

    import torch

    from trainer.model.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny", seed=0)
        model_dir = str(without_dropout(source, Path(tmp) / "model"))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        saved = {}
        for mode in ("fp32", "one_process", "fsdp"):
            launcher = [sys.executable]
            if mode == "fsdp":
                launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            saved[mode] = str(Path(tmp) / f"{mode}.pt")
            cmd = [*launcher, __file__, "--device", args.device, "--gradients", model_dir, mode, saved[mode]]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{mode} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
                return 1
        grads = {mode: torch.load(path) for mode, path in saved.items()}
    one, fsdp = (relative_error(grads[m], grads["fp32"]) for m in ("one_process", "fsdp"))
    print(f"{MICRO_BATCHES} micro-batches of {ROWS} x ({SOURCE} + {TARGET}) tokens, {args.device}")
    print(f"one process, bf16, relative error against fp32: {one:.3e}")
    print(f"FSDP2 on 2 ranks, bf16, relative error against fp32: {fsdp:.3e} ({fsdp / one:.2f}x)")
    print(f"FSDP2 against one process: {relative_error(grads['fsdp'], grads['one_process']):.3e}")
    verdict = "as accurate" if fsdp <= WITHIN * one else "LESS accurate"
    print(f"verdict: FSDP2's bf16 gradients are {verdict} as one process's (pass: at most {WITHIN}x)")
    return 0 if fsdp <= WITHIN * one else 1


if __name__ == "__main__":
    sys.exit(main())

"""How much a checkpoint written in a background thread slows a loop that waits once per step, as the decoding
engine waits on the GPU once per generated token (CPU; no GPU needed).

    python3 bench/writer_gil.py [--gib 1] [--steps 400]

The loop sleeps 1 ms per step (the wait, the interpreter lock released, as during a CUDA synchronisation) and
runs a little Python (the host's share of a step). A thread meanwhile writes --gib GiB of tensors over and
over, as trainer.checkpoint.writer's thread does: through torch.distributed.checkpoint (dcp/) and safetensors
(model.safetensors). Printed: ms per step alone, and during each kind of write under the interpreter's
default switch interval (5 ms) and under trainer.checkpoint.writer.WRITING_SWITCH_INTERVAL_S, which the writer
sets while it writes. On a busy machine the numbers include the cores' contention too: compare the rows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.checkpoint.writer import WRITING_SWITCH_INTERVAL_S  # noqa: E402


def loop_ms(steps: int) -> float:
    """Milliseconds per step of a loop that waits 1 ms and then runs a little Python."""
    start = time.perf_counter()
    for _ in range(steps):
        time.sleep(0.001)
        sum(range(300))
    return (time.perf_counter() - start) / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0, help="size of the tensors written, GiB")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    count = 64
    tensors = {f"w{i}": torch.randn(int(args.gib * (1 << 30)) // (4 * count)) for i in range(count)}
    alone = loop_ms(args.steps)
    print(f"alone: {alone:.2f} ms per step")
    default = sys.getswitchinterval()
    with tempfile.TemporaryDirectory() as work:
        for interval in (default, WRITING_SWITCH_INTERVAL_S):
            sys.setswitchinterval(interval)
            for kind in ("dcp", "safetensors"):
                done = threading.Event()

                def write(kind=kind, done=done):
                    while not done.is_set():
                        if kind == "dcp":
                            dcp.save(tensors, checkpoint_id=f"{work}/dcp", no_dist=True)
                        else:
                            save_file(tensors, f"{work}/model.safetensors")

                writer = threading.Thread(target=write, daemon=True)
                writer.start()
                time.sleep(0.5)
                ms = loop_ms(args.steps)
                done.set()
                writer.join()
                print(
                    f"switch interval {interval * 1e3:.1f} ms, during a {kind} write: {ms:.2f} ms per step "
                    f"({ms / alone:.2f}x)"
                )
    sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

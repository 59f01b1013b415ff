"""The attention kernels' dropout random numbers, timed per kernel: the shipped hash against Philox (GPU).

    python3 bench/dropout_rng.py [--rows 68 --query 352 --key 352 --causal] [--dropout 0.1]

trainer.kernels.attention draws one 16-bit number per attention probability from `uniform16` (a hash of the
probability's index). The alternatives swapped in here for comparison, in separate processes (a Triton kernel
compiles against the `attention_keep` it finds first):
- philox10: Triton's Philox4x32 with its default 10 rounds, eight 16-bit numbers per call, moved into the
  tile with `join` + `reshape` (what the kernels used before the hash);
- philox7: the same with 7 rounds (Philox4x32-7 still passes BigCrush; Salmon et al., 2011);
- none: no dropout, the floor.
Prints ms per call of each kernel (bench/attention_kernels.py --kernels).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


@triton.jit
def _keep_philox(seed, bh, rows, cols, T, S, dropout_p, N_ROUNDS: tl.constexpr):
    """Keys j..j+7 (j a multiple of 8) of query i share Philox counter i x ceil(S / 8) + j // 8 (key:
    seed + bh)."""
    BLOCK_M: tl.constexpr = rows.shape[0]
    BLOCK_N: tl.constexpr = cols.shape[0]
    groups = tl.min(tl.reshape(cols, (BLOCK_N // 8, 8)), axis=1) // 8
    r0, r1, r2, r3 = tl.randint4x(seed + bh, rows[:, None] * ((S + 7) // 8) + groups[None, :], N_ROUNDS)
    r = tl.join(tl.join(r0, r1), tl.join(r2, r3))
    u = tl.join(r & 0xFFFF, r >> 16)
    return tl.reshape(u, (BLOCK_M, BLOCK_N)).to(tl.float32) >= dropout_p * 65536.0


@triton.jit
def _keep_philox10(seed, bh, rows, cols, T, S, dropout_p):
    return _keep_philox(seed, bh, rows, cols, T, S, dropout_p, 10)


@triton.jit
def _keep_philox7(seed, bh, rows, cols, T, S, dropout_p):
    return _keep_philox(seed, bh, rows, cols, T, S, dropout_p, 7)


VARIANTS = {"hash": None, "philox10": _keep_philox10, "philox7": _keep_philox7, "none": None}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=68)
    parser.add_argument("--query", type=int, default=352)
    parser.add_argument("--key", type=int, default=352)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant
    args = parser.parse_args()
    shape = ["--rows", str(args.rows), "--query", str(args.query), "--key", str(args.key)]
    shape += ["--causal"] if args.causal else []
    if args.one:
        from trainer.kernels import attention

        if VARIANTS[args.one] is not None:
            attention.attention_keep = VARIANTS[args.one]
        import attention_kernels

        p = 0.0 if args.one == "none" else args.dropout
        sys.argv = ["attention_kernels.py", *shape, "--dropout", str(p), "--kernels"]
        return attention_kernels.main()
    for name in VARIANTS:
        print(f"== {name}", flush=True)
        cmd = [sys.executable, __file__, *shape, "--dropout", str(args.dropout), "--one", name]
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

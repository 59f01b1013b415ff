"""What FP8 matmuls with row-wise scales could give FLAN-T5-XL's projections on this GPU: forward and
backward of one projection at the training step's shapes, bf16 against FP8, casts counted.

    python3 bench/fp8_matmul.py [--tokens 8192,24576] [--shapes 2048x2048,2048x5120,5120x2048]

A projection of K to N features over M tokens runs three matmuls a step: y = x W^T, dx = dy W, dW = dy^T x.
FP8 here is e4m3 with one fp32 scale per row of each operand along the reduced dimension (torchao's
"rowwise" float8 training recipe; `torch._scaled_mm`, bf16 output). Each operand is cast in the layout its
matmul reads, so x, W and dy are each cast twice (rows, and the transpose's rows). The casts are
torch.compile'd: the absolute maximum, the scale and the cast of a row in one kernel. Columns, GPU ms per
forward + backward (CUDA events, after warm-up):

    bf16          the three matmuls in bf16 (the trainer today);
    fp8 mm        the three in FP8, operands cast beforehand: the ceiling;
    fp8 +casts    the three in FP8 with their six casts;
    fwd+dx        y and dx in FP8 with their casts (x, W, W^T, dy), dW in bf16: no transposed activation;
    fwd+dx, x in  as fwd+dx without x's cast, as if the kernel producing x (RMSNorm, the gated GELU, the
                  attention output) wrote it in FP8 too.

Each FP8 column's time over bf16's follows it (below 1: faster), and the relative error (Frobenius norm) of
y, dx and dW against bf16's on random data of T5's scale is printed per shape. The physical bound: FP8 runs
at twice bf16's rate on Hopper, Ada and Blackwell, so 0.5 is the floor of `fp8 mm`.
"""

from __future__ import annotations

import argparse

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` (2-D, bf16) in e4m3 with one scale per row, and each row's inverse scale (fp32, a column)."""
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def _transposed_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of t^T (one scale per column of `t`), written row-major."""
    return _rows(t.t().contiguous())


cast_rows = torch.compile(_rows, dynamic=False)
cast_transposed_rows = torch.compile(_transposed_rows, dynamic=False)


def mm(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """a @ b^T for a (M x K) and b (N x K), each e4m3 with one scale per row: bf16 (M x N)."""
    (aq, sa), (bq, sb) = a, b
    return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)


def timed(fn, steps: int) -> float:
    """GPU ms per call of `fn`, after 3 untimed calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def measure(m: int, k: int, n: int, steps: int) -> tuple[str, str]:
    """One shape: the timing row and the error row."""
    bf = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=bf)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(bf)
    dy = (torch.randn(m, n, device="cuda") * 1e-4).to(bf)

    def bf16():
        return x @ w.t(), dy @ w, dy.t() @ x

    xr, xt, wr, wt, dyr, dyt = (
        cast_rows(x),
        cast_transposed_rows(x),
        cast_rows(w),
        cast_transposed_rows(w),
        cast_rows(dy),
        cast_transposed_rows(dy),
    )

    def fp8_mm():
        return mm(xr, wr), mm(dyr, wt), mm(dyt, xt)

    def fp8_casts():
        xr_, wr_ = cast_rows(x), cast_rows(w)
        y = mm(xr_, wr_)
        dyr_, wt_ = cast_rows(dy), cast_transposed_rows(w)
        dx = mm(dyr_, wt_)
        return y, dx, mm(cast_transposed_rows(dy), cast_transposed_rows(x))

    def fwd_dx():
        y = mm(cast_rows(x), cast_rows(w))
        return y, mm(cast_rows(dy), cast_transposed_rows(w)), dy.t() @ x

    def fwd_dx_x_in():
        y = mm(xr, cast_rows(w))
        return y, mm(cast_rows(dy), cast_transposed_rows(w)), dy.t() @ x

    want = bf16()
    errors = " ".join(f"{relative_error(g, r):.1e}" for g, r in zip(fp8_casts(), want, strict=True))
    times = [timed(f, steps) for f in (bf16, fp8_mm, fp8_casts, fwd_dx, fwd_dx_x_in)]
    base = times[0]
    cells = " ".join(f"{t:7.3f} {t / base:5.2f}" for t in times[1:])
    return f"{m:>6} {k:>5} {n:>5} | {base:7.3f} | {cells}", f"{m:>6} {k:>5} {n:>5} | y dx dW: {errors}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens", default="8192,24576", help="rows of the activations (tokens per micro-batch)"
    )
    parser.add_argument(
        "--shapes",
        default="2048x2048,2048x5120,5120x2048",
        help="in x out features: the attention's projections, wi_0 and wi_1, wo",
    )
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("FP8 matmuls need a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell)")
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU ms a forward + backward, and / bf16"
    )
    head = ("fp8 mm", "fp8 +casts", "fwd+dx", "fwd+dx, x in")
    print(f"{'M':>6} {'K':>5} {'N':>5} | {'bf16':>7} | " + " ".join(f"{h:>13}" for h in head))
    errors = []
    for m in (int(t) for t in args.tokens.split(",")):
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            row, error = measure(m, k, n, args.steps)
            print(row, flush=True)
            errors.append(error)
    print("relative error of FP8 (all three matmuls) against bf16, random data:")
    print("\n".join(errors))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

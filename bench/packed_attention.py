"""T5 attention (trainer.kernels.packed_attention) over packed rows against the same records in padded rows
(GPU).

    python3 bench/packed_attention.py [--shapes 16x1024x512,8x2048x1024] [--dropout 0.1] [--sweep]
    python3 bench/packed_attention.py --tiny        # this script's code paths on CPU (Triton's interpreter)

Records with recipe-like lengths (source ~ lognormal(median 96, sigma 0.35), target ~ lognormal(median 256,
sigma 0.45)) are packed in order into R rows of Lt decoder and Ls encoder positions (a shape RxLtxLs); the
same records, sorted by target length and cut into padded batches of at most R x Lt decoder positions (the
loop's length bucketing), go through the same kernels, each padded row one segment.
FLAN-T5-XL heads (32 x 64), bf16. For each attention kind it prints forward and forward+backward ms (median of
triton.testing.do_bench) of both, the share of 64 x 64 tiles the packed kernels visit, and their useful
TFLOP/s (matmul FLOPs of the attended pairs only: forward 4 x D per pair and head, backward 2.5x that).

First it checks the packed kernels (dropout off) against fp32 dense math on two rows: output and gradients
(q, k, v, bias table) within ||x - ref|| / ||ref|| < 1e-2. Last, the shared memory of each packed kernel as
compiled for this GPU and for an RTX 5090 (sm_120, compiled here without one): at most 99 KiB each.
Exit status 1 if a check fails. About 2 minutes on an H100, ~40 kernel compiles included.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # before Triton is imported: the interpreter runs the kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.kernels import packed_attention as packed  # noqa: E402
from trainer.kernels.packed_attention import (
    PackedAttentionLayout,
    RelativeBias,
    dense_position_bias,
    packed_attention,
)
from trainer.model.packed_t5 import reference_attention

SHARED_LIMIT = 99 * 1024  # bytes of shared memory per block on an RTX 5090 (sm_120)
TOLERANCE = 1e-2  # ||x - ref|| / ||ref|| for bf16
SWEEP = [(4, 2), (4, 3), (8, 2), (8, 3), (4, 1), (8, 1)]  # (num_warps, num_stages)


def record_lengths(n: int, source_median: float, target_median: float, gen: torch.Generator):
    """n (source, target) lengths: lognormal around the medians (sigma 0.35 and 0.45), at least 1."""
    src = (math.log(source_median) + 0.35 * torch.randn(n, generator=gen)).exp().round().clamp_min(1)
    tgt = (math.log(target_median) + 0.45 * torch.randn(n, generator=gen)).exp().round().clamp_min(1)
    return list(zip(src.int().tolist(), tgt.int().tolist(), strict=True))


def pack_rows(lengths, rows: int, source_len: int, target_len: int):
    """Records in order into `rows` rows while they fit (a record goes to the next row when either side is
    full; a record longer than a row is skipped): per row, its list of (source, target) lengths."""
    packed_rows, row, used = [[]], 0, (0, 0)
    for s, t in lengths:
        if s > source_len or t > target_len:
            continue
        if used[0] + s > source_len or used[1] + t > target_len:
            row, used = row + 1, (0, 0)
            if row == rows:
                break
            packed_rows.append([])
        packed_rows[row].append((s, t))
        used = (used[0] + s, used[1] + t)
    return packed_rows + [[] for _ in range(rows - len(packed_rows))]


def segment_ids(rows, length: int, side: int, device) -> torch.Tensor:
    ids = torch.zeros(len(rows), length, dtype=torch.int32)
    for r, records in enumerate(rows):
        start = 0
        for seg, lens in enumerate(records, start=1):
            ids[r, start : start + lens[side]] = seg
            start += lens[side]
    return ids.to(device)


def projections(rows, length, heads, head_dim, device, dtype, gen):
    """(R, H, L, D) views of (R, L, H, D) tensors, as T5's projections hand them over."""
    x = torch.randn(rows, length, heads, head_dim, generator=gen).to(device, dtype)
    return x.transpose(1, 2).requires_grad_()


def attended_pairs(kind: str, records) -> int:
    """(query, key) pairs the records attend: all of a record's source pairs (encoder), its causal target
    pairs (decoder), target x source (cross)."""
    if kind == "encoder":
        return sum(s * s for s, _ in records)
    if kind == "cross":
        return sum(s * t for s, t in records)
    return sum(t * (t + 1) // 2 for _, t in records)


class Timer:
    """triton.testing.do_bench's median on a GPU; one plain run on CPU (--tiny: the code paths only)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn, grad_to_none=None) -> float:
        if self.cuda:
            return triton.testing.do_bench(
                fn, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median"
            )
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def rel_err(x, ref) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).norm() / ref.norm())


def check(kind, layout, q, k, v, table, bias) -> list[str]:
    """The packed kernels (dropout off) against fp32 dense math; returns the failures."""
    inputs = [q, k, v] + ([table] if bias is not None else [])
    for x in inputs:
        x.grad = None
    if bias is not None:
        layout.use_bias_table(table)
    out = packed_attention(q, k, v, layout)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.device)
    grads = torch.autograd.grad(out.float(), inputs, grad_out)
    exact = [x.detach().float().requires_grad_() for x in inputs]
    t, s = q.size(2), k.size(2)
    dense = dense_position_bias(exact[3], bias, t, s) if bias is not None else None
    ref = reference_attention(
        *exact[:3], layout.query_segments, layout.key_segments, causal=layout.causal, bias=dense
    )
    ref_grads = torch.autograd.grad(ref, exact, grad_out)
    errors = {"out": rel_err(out, ref)}
    errors.update({n: rel_err(g, r) for n, g, r in zip("qkv", grads, ref_grads, strict=False)})
    if bias is not None:
        errors["bias table"] = rel_err(grads[3], ref_grads[3])
    print(f"  {kind:<22} " + "  ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    return [f"{kind} {n}: {e:.2e} >= {TOLERANCE}" for n, e in errors.items() if not e < TOLERANCE]


def tiles_visited(layout: PackedAttentionLayout, keys: int) -> tuple[int, int]:
    """(tiles the packed forward computes, tiles of dense rows: causal halves counted as whole tiles)."""
    block = packed.BLOCK
    lo, hi = layout.key_ranges[..., 0].long(), layout.key_ranges[..., 1].long()
    visited = (hi - lo + block - 1) // block
    blocks = layout.key_ranges.size(1)
    key_blocks = triton.cdiv(keys, block)
    dense = layout.key_ranges.size(0) * (blocks * (blocks + 1) // 2 if layout.causal else blocks * key_blocks)
    return int(visited.sum()), dense


def bucketed(records, budget: int, multiple: int = 8):
    """The loop's padded batches of the same records: sorted by target length, cut where the padded
    decoder size would pass `budget` positions. Per batch: (records, padded source, padded target)."""
    batches, current = [], []
    for rec in sorted(records, key=lambda r: r[1]):
        longest = max(rec[1], max((r[1] for r in current), default=0))
        if current and (len(current) + 1) * (-(-longest // multiple) * multiple) > budget:
            batches.append(current)
            current = []
        current.append(rec)
    batches.append(current)

    def padded(n):
        return -(-n // multiple) * multiple

    return [(b, padded(max(r[0] for r in b)), padded(max(r[1] for r in b))) for b in batches]


def unpacked_times(kind, batches, heads, head_dim, table, bias, dropout, timer, device, dtype, gen):
    """Forward and forward+backward ms of the kernels over the padded batches (each padded row one segment),
    summed."""
    fwd = total = 0.0
    for records, src_len, tgt_len in batches:
        b = len(records)
        q_len = src_len if kind == "encoder" else tgt_len
        k_len = tgt_len if kind == "decoder" else src_len
        q = projections(b, q_len, heads, head_dim, device, dtype, gen)
        k, v = (projections(b, k_len, heads, head_dim, device, dtype, gen) for _ in range(2))
        k_lengths = torch.tensor([r[1] if kind == "decoder" else r[0] for r in records], device=device)
        q_lengths = torch.tensor([r[0] if kind == "encoder" else r[1] for r in records], device=device)
        query_segments = (torch.arange(q_len, device=device)[None, :] < q_lengths[:, None]).int()
        key_segments = (torch.arange(k_len, device=device)[None, :] < k_lengths[:, None]).int()
        layout = PackedAttentionLayout.build(
            query_segments, key_segments, causal=kind == "decoder", position_bias=bias
        )
        inputs = [q, k, v]
        if bias is not None:
            layout.use_bias_table(table)
            inputs.append(table)

        def forward(q=q, k=k, v=v, layout=layout):
            return packed_attention(q, k, v, layout, dropout_p=dropout)

        grad_out = torch.randn(b, q_len, heads, head_dim, generator=gen).to(device, dtype)
        fwd += timer(forward)
        total += timer(lambda forward=forward, g=grad_out: forward().backward(g), grad_to_none=inputs)
    return fwd, total


def compiled_kernels(fn):
    """This process's compiled variants of a Triton kernel (Triton 3.x: device_caches[device][0])."""
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        yield from cache.values()


POINTER_TYPES = {
    "QSeg": "*i32",
    "KSeg": "*i32",
    "KeyRanges": "*i32",
    "QueryRanges": "*i32",
    "Dist": "*fp32",
    "LSE": "*fp32",
    "Delta": "*fp32",
    "DBias": "*fp32",
    "Seed": "*i64",
}


def compile_for_rtx5090(fn, constexprs: dict, options: dict):
    """`fn` compiled ahead of time for sm_120 (no such GPU needed): bf16 q/k/v, the packed kernels' types."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTER_TYPES:
            signature[name] = POINTER_TYPES[name]
        elif name[0].isupper() and name not in ("B", "H", "T", "S"):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name == "dropout_p" else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 120, 32), options=options)


def shared_memory_report(cuda: bool) -> list[str]:
    """Shared memory (and registers, spills) of each packed kernel: the variants compiled in this run on
    this GPU, and the largest variant compiled for sm_120. Returns the kernels over SHARED_LIMIT."""
    failures = []
    kernels = [
        (packed.fwd_kernel, {}, packed.FWD_CONFIG),
        (packed.bwd_kv_kernel, dict(FAR_TILES=3, GRADIENT_ROWS=8), packed.BWD_CONFIG),
        (packed.bwd_q_kernel, {}, packed.BWD_CONFIG),
    ]
    flags = dict(HAS_BIAS=True, CAUSAL=True, DROPOUT=True, MAX_DISTANCE=128, BLOCK_M=64, BLOCK_N=64, D=64)
    print("\nshared memory per block (limit 99 KiB on an RTX 5090):")
    for fn, extra, options in kernels:
        name = fn.__name__.strip("_")
        if cuda:
            for kernel in compiled_kernels(fn):
                shared = kernel.metadata.shared
                regs, spills = getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?")
                print(f"  {name:<14} this GPU: {shared / 1024:5.1f} KiB, {regs} registers, {spills} spilled")
                if shared > SHARED_LIMIT:
                    failures.append(f"{name}: {shared} bytes of shared memory on this GPU")
        try:
            shared = compile_for_rtx5090(fn, {**flags, **extra}, options).metadata.shared
        except Exception as e:  # noqa: BLE001 - another Triton's compile API: this GPU's numbers remain
            print(f"  {name:<14} sm_120: not compiled here ({type(e).__name__}: {e})")
            continue
        print(f"  {name:<14} sm_120 (bias, causal, dropout): {shared / 1024:5.1f} KiB")
        if shared > SHARED_LIMIT:
            failures.append(f"{name}: {shared} bytes of shared memory on sm_120")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="16x1024x512,8x2048x1024", help="rows x Lt x Ls, comma-separated")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--sweep", action="store_true", help="time the packed kernels' num_warps/num_stages")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in Triton's interpreter")
    parser.add_argument("--shared-memory", action="store_true", help="only the sm_120 shared-memory check")
    args = parser.parse_args()
    if args.shared_memory:
        return 1 if shared_memory_report(cuda=False) else 0
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("no CUDA GPU: run with --tiny for the CPU check of this script", file=sys.stderr)
        return 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)  # interpreter: no bf16 dot
    heads, head_dim = (args.heads, 64) if cuda else (2, 16)
    shapes = args.shapes if cuda else "2x128x64"
    medians = (96, 256) if cuda else (12, 30)
    timer = Timer(cuda)
    gen = torch.Generator().manual_seed(0)
    encoder_bias, decoder_bias = RelativeBias(bidirectional=True), RelativeBias(bidirectional=False)
    table = (torch.randn(32, heads, generator=gen) * 2).to(device, dtype).requires_grad_()
    failures = []
    for shape in shapes.split(","):
        rows, lt, ls = (int(x) for x in shape.split("x"))
        packed_rows = pack_rows(record_lengths(rows * 20, *medians, gen), rows, ls, lt)
        records = [r for row in packed_rows for r in row]
        enc_seg = segment_ids(packed_rows, ls, 0, device)
        dec_seg = segment_ids(packed_rows, lt, 1, device)
        real = sum(s + t for s, t in records)
        print(
            f"\n{rows} rows x (decoder {lt}, encoder {ls}): {len(records)} records, "
            f"{len(records) / rows:.1f} per row, {real} real tokens "
            f"({100 * real / (rows * (lt + ls)):.1f}% of the rows), "
            f"{heads} heads x {head_dim}, {dtype}, dropout {args.dropout}"
        )
        kinds = {  # kind: (query segments, key segments, causal, position bias)
            "encoder": (enc_seg, enc_seg, False, encoder_bias),
            "decoder": (dec_seg, dec_seg, True, decoder_bias),
            "decoder, no bias": (dec_seg, dec_seg, True, None),
            "cross": (dec_seg, enc_seg, False, None),
        }
        tensors = {}
        for kind, (qseg, kseg, _, _) in kinds.items():
            q = projections(rows, qseg.size(1), heads, head_dim, device, dtype, gen)
            k, v = (projections(rows, kseg.size(1), heads, head_dim, device, dtype, gen) for _ in range(2))
            tensors[kind] = (q, k, v)

        if shape == shapes.split(",")[0]:  # the kernels do not depend on the shape: check once
            print("check against fp32 dense math, two rows, dropout off (||x - ref|| / ||ref||):")
            for kind, (qseg, kseg, causal, bias) in kinds.items():
                q, k, v = (x.detach()[:2].requires_grad_() for x in tensors[kind])
                layout = PackedAttentionLayout.build(qseg[:2], kseg[:2], causal=causal, position_bias=bias)
                failures += check(kind, layout, q, k, v, table, bias)

        batches = bucketed(records, rows * lt)
        padded = sum(len(b) * (s + t) for b, s, t in batches)
        print(
            f"unpacked: {len(batches)} padded batches of the same records, {100 * (1 - real / padded):.1f}% "
            f"padding\n  {'kind':<17} {'packed fwd':>10} {'fwd+bwd':>9} {'unpacked fwd':>13} {'fwd+bwd':>9} "
            f"{'speedup':>8} {'tiles':>7} {'TFLOP/s':>8}"
        )
        for kind, (qseg, kseg, causal, bias) in kinds.items():
            q, k, v = tensors[kind]
            layout = PackedAttentionLayout.build(qseg, kseg, causal=causal, position_bias=bias)
            inputs = [q, k, v]
            if bias is not None:
                layout.use_bias_table(table)
                inputs.append(table)
            grad_out = torch.randn(rows, qseg.size(1), heads, head_dim, generator=gen).to(device, dtype)

            def forward(q=q, k=k, v=v, layout=layout):
                return packed_attention(q, k, v, layout, dropout_p=args.dropout)

            fwd = timer(forward)
            total = timer(lambda forward=forward, g=grad_out: forward().backward(g), grad_to_none=inputs)
            unpacked_kind = "cross" if kind == "cross" else kind.split(",")[0]
            u_fwd, u_total = unpacked_times(
                unpacked_kind, batches, heads, head_dim, table, bias, args.dropout, timer, device, dtype, gen
            )
            visited, dense = tiles_visited(layout, kseg.size(1))
            # useful FLOPs: forward 4 x D per attended pair and head (two matmuls), backward 2.5x that
            flops = 3.5 * 4.0 * head_dim * heads * attended_pairs(unpacked_kind, records)
            tflops = flops / (total * 1e-3) / 1e12
            print(
                f"  {kind:<17} {fwd:10.3f} {total:9.3f} {u_fwd:13.3f} {u_total:9.3f} {u_total / total:7.2f}x "
                f"{100 * visited / dense:6.1f}% {tflops:8.1f}"
            )
        if args.sweep and cuda:
            sweep(tensors["decoder"], dec_seg, decoder_bias, table, args.dropout, heads, head_dim, timer, gen)
    if cuda:
        failures += shared_memory_report(cuda=True)
    else:  # the interpreter's kernels cannot be compiled: compile them in a process without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, __file__, "--shared-memory"], env=env)
        failures += [] if done.returncode == 0 else ["shared memory check"]
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


def sweep(qkv, seg, bias, table, dropout, heads, head_dim, timer, gen) -> None:
    """Decoder self-attention forward per FWD_CONFIG, forward+backward per BWD_CONFIG (the other default)."""
    q, k, v = qkv
    layout = PackedAttentionLayout.build(seg, seg, causal=True, position_bias=bias)
    layout.use_bias_table(table)
    grad_out = torch.randn(seg.size(0), seg.size(1), heads, head_dim, generator=gen).to(q.device, q.dtype)
    defaults = dict(packed.FWD_CONFIG), dict(packed.BWD_CONFIG)

    def forward():
        return packed_attention(q, k, v, layout, dropout_p=dropout)

    print("  sweep, decoder self-attention (num_warps, num_stages):")
    for warps, stages in SWEEP:
        config = dict(num_warps=warps, num_stages=stages)
        packed.FWD_CONFIG.update(config)
        fwd = timer(forward)
        packed.FWD_CONFIG.update(defaults[0])
        packed.BWD_CONFIG.update(config)
        total = timer(lambda: forward().backward(grad_out), grad_to_none=[q, k, v, table])
        packed.BWD_CONFIG.update(defaults[1])
        print(
            f"    {warps} warps, {stages} stages: fwd {fwd:7.3f} ms (as FWD_CONFIG), "
            f"fwd+bwd {total:7.3f} ms (as BWD_CONFIG)"
        )


if __name__ == "__main__":
    raise SystemExit(main())

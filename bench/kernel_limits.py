"""Every Triton kernel a short training compiles, and whether it fits in an RTX 5090's shared memory.

    python3 bench/kernel_limits.py            # GPU machine: 3-6 minutes on an H100 (estimate)
    python3 bench/kernel_limits.py --tiny     # no GPU: checks the script (and the checker) on the CPU
    python3 bench/kernel_limits.py --set packing=true   # the packed path (trainer.kernels.packed_attention)

An RTX 5090 (sm_120) gives one block at most 99 KiB (101,376 bytes) of shared memory, an H100 227 KiB: a
kernel that needs more compiles and runs on the H100 and fails on the 5090 at its first launch (Triton's
OutOfResources). The trainer's kernels have fixed tile sizes, so nothing would pick a smaller one there.

1. Fresh, empty TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR.
2. A short training through trainer.run.train.train, the code path of `trainer train`: a T5 of FLAN-T5-XL's
   width (d_model 2048, 32 heads x 64, d_ff 5120, gated-GELU, dropout 0.1, vocabulary 32128) with 2+2 layers
   and random weights, bf16, the rtx5090 preset's optimizer and batching, on recipes from `trainer data
   sample`, with one evaluation and generation at the end. So every kernel the training path launches is
   compiled: the Triton attention (encoder self-attention with T5's bias, decoder causal self-attention with
   bias, cross-attention), the fused gated-GELU and residual-dropout kernels, the Adafactor update compiled by
   torch.compile, and whatever kernels the trainer adds later.
3. Every @triton.jit kernel compiled in this process is compiled again for sm_120 (triton.compile with the
   same source, specialisation and options, target cuda:120): Triton lays a kernel out per architecture, so
   this is the 5090's own number. torch.compile's kernels are compiled on the user's card at run time, with
   configurations chosen for it; they are listed as compiled here.
4. Every kernel's metadata file in TRITON_CACHE_DIR (name, architecture, shared bytes, warps, stages) makes
   the table. Exit 1 naming each kernel over 101,376 bytes: on sm_120 where it was compiled for it, else as
   compiled here. Also exit 1 if a kernel fails to compile for sm_120.

Before the training, a self-check compiles two kernels of this script for sm_120, one small and one too
large, and the collection must flag exactly the large one. Compiling for sm_120 needs no GPU, so --tiny
runs the self-check and a tiny CPU training (where the trainer uses no Triton kernel: nothing of its own can
be checked without a GPU, and the script says so). Needs torch, triton, transformers and the trainer; no
network.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
import yaml
from bench_run import QUIET_RUN

REPO = Path(__file__).resolve().parent.parent
SM120_SHARED_LIMIT = 101376  # bytes of shared memory one block may use on sm_120 (99 KiB)
SM120 = 120
# Options a launch passes (kernel[grid](..., num_warps=...)); everything else is the target's own.
LAUNCH_OPTIONS = (
    "num_warps",
    "num_ctas",
    "num_stages",
    "maxnreg",
    "enable_fp_fusion",
    "enable_reflect_ftz",
    "launch_cooperative_grid",
    "launch_pdl",
    "default_dot_input_precision",
    "debug",
    "sanitize_overflow",
)
log = logging.getLogger("kernel_limits")


def read_kernels(cache_dir: Path) -> list[dict]:
    """Every compiled kernel in a Triton cache folder: its metadata file's name, arch, shared bytes, warps
    and stages (launcher modules and group files are not kernels)."""
    kernels = []
    for path in sorted(cache_dir.rglob("*.json")):
        if path.name.startswith("__grp__"):
            continue
        meta = json.loads(path.read_text())
        if "shared" not in meta or "name" not in meta:
            continue
        kernels.append(
            {
                "name": meta["name"],
                "arch": int(meta["target"]["arch"]),
                "shared": int(meta["shared"]),
                "num_warps": meta.get("num_warps"),
                "num_stages": meta.get("num_stages"),
            }
        )
    return kernels


def over_limit(kernels: list[dict]) -> list[dict]:
    """Kernels over the 5090's limit: judged by their sm_120 build where there is one, else as compiled."""
    on_sm120 = {k["name"] for k in kernels if k["arch"] == SM120}
    judged = [k for k in kernels if k["arch"] == SM120 or k["name"] not in on_sm120]
    return [k for k in judged if k["shared"] > SM120_SHARED_LIMIT]


def table(kernels: list[dict], modules: dict[str, str], top: int) -> str:
    """The largest kernels, one row per name and architecture (the largest of its specialisations)."""
    rows: dict[tuple[str, int], dict] = {}
    for k in kernels:
        key = (k["name"], k["arch"])
        row = rows.setdefault(key, {**k, "variants": 0})
        row["variants"] += 1
        if k["shared"] > row["shared"]:
            row.update(shared=k["shared"], num_warps=k["num_warps"], num_stages=k["num_stages"])
    ordered = sorted(rows.values(), key=lambda r: (-r["shared"], r["name"], r["arch"]))[:top]
    lines = [
        "| kernel | from | arch | shared bytes | KiB | fits sm_120 | warps | stages | specialisations |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        fits = "yes" if r["shared"] <= SM120_SHARED_LIMIT else "NO"
        lines.append(
            f"| {r['name']} | {origin(r['name'], modules)} | sm_{r['arch']} | {r['shared']:,} | "
            f"{r['shared'] / 1024:.1f} | {fits} | {r['num_warps']} | {r['num_stages']} | {r['variants']} |"
        )
    return "\n".join(lines)


def jit_functions() -> list:
    from triton.runtime.jit import JITFunction

    # type(), not isinstance(): isinstance would touch lazy module attributes (and their warnings)
    return [o for o in gc.get_objects() if issubclass(type(o), JITFunction)]


def compiled_specialisations() -> list:
    """(JITFunction, CompiledKernel) for every kernel this process compiled through a launch."""
    found = []
    for fn in jit_functions():
        for cache in fn.device_caches.values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for kernel in list(kernels.values()):
                found.append((fn, kernel.result() if hasattr(kernel, "result") else kernel))
    return found


def compile_for_sm120(src, options: dict):
    from triton.backends.compiler import GPUTarget

    return triton.compile(src, target=GPUTarget("cuda", SM120, 32), options=options)


def recompile_for_sm120() -> tuple[int, list[str]]:
    """Compile every launched specialisation again for sm_120; returns (count, failures)."""
    done, failures = 0, []
    for _, kernel in compiled_specialisations():
        options = {k: getattr(kernel.metadata, k) for k in LAUNCH_OPTIONS if hasattr(kernel.metadata, k)}
        try:
            compile_for_sm120(kernel.src, options)
            done += 1
        except Exception as e:  # a kernel that cannot be built for the 5090 is a finding, not a crash
            failures.append(f"{kernel.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return done, failures


def origin(name: str, modules: dict[str, str]) -> str:
    """Where a kernel comes from: the module of its @triton.jit function, or torch.compile's generated code
    (whose kernels are named triton_*)."""
    if name.startswith("triton_"):
        return "torch.compile"
    return modules.get(name, "?")


def jit_modules() -> dict[str, str]:
    # Some JIT objects (torch.compile's own wrappers) hold no Python function.
    return {
        fn.fn.__name__: getattr(fn, "module", "?")
        for fn in jit_functions()
        if getattr(getattr(fn, "fn", None), "__name__", None)
    }


@triton.jit
def _tile_product(A, B, C, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C = A @ B for one BM x BN tile (the self-check's kernel: its shared memory grows with the tiles and
    the pipeline's stages)."""
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(A + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(B + (k + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(C + rm[:, None] * BN + rn[None, :], acc)


def self_check(cache_dir: Path) -> tuple[bool, str]:
    """Compile a small and a too-large kernel for sm_120 into cache_dir; the checker must flag only the
    large one."""
    from triton.compiler import ASTSource

    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    signature = {"A": "*bf16", "B": "*bf16", "C": "*fp32", "K": "i32", "BM": "constexpr", "BN": "constexpr"}
    signature["BK"] = "constexpr"
    # 64x64 tiles of 32: 16 KiB; 256x128 tiles of 256: the A tile alone is 128 KiB.
    for bm, bn, bk in ((64, 64, 32), (256, 128, 256)):
        constexprs = {(4,): bm, (5,): bn, (6,): bk}
        compile_for_sm120(ASTSource(_tile_product, signature, constexprs), {"num_warps": 8, "num_stages": 2})
    found = sorted(read_kernels(cache_dir), key=lambda k: k["shared"])
    flagged = over_limit(found)
    ok = (
        len(found) == 2
        and all(k["arch"] == SM120 for k in found)
        and 0 < found[0]["shared"] <= SM120_SHARED_LIMIT
        and flagged == [found[1]]
    )
    sizes = ", ".join(f"{k['shared']:,} bytes" for k in found)
    return ok, f"2 kernels compiled for sm_120 ({sizes}); flagged {len(flagged)}, expected the large one"


def write_model_dir(out: Path, tokenizer_dir: Path, tiny: bool) -> Path:
    """config.json: FLAN-T5-XL's width and heads with 2+2 layers (or the tiny shape), and the tokenizer."""
    from trainer.model.tiny_model import flan_t5_config

    config = flan_t5_config("tiny" if tiny else "xl")
    config.update(dict(num_layers=2, num_decoder_layers=2))
    out.mkdir(parents=True)
    config.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def run_training(tmp: Path, tiny: bool, steps: int, overrides: list[str]) -> int:
    """A short run of the trainer's own loop (what `trainer train` calls) on generated recipes."""
    from trainer.config import TrainConfig
    from trainer.data.sample import write_sample
    from trainer.model.tiny_model import build_tiny_model
    from trainer.run.train import train

    preset = REPO / "configs" / "flan-t5-xl-rtx5090.yaml"
    values = yaml.safe_load(preset.read_text()) if preset.is_file() else {"optimizer": "adafactor"}
    data = tmp / "recipes.csv"
    write_sample(data, 400 if tiny else 2000, seed=0, fmt="recipenlg-csv")
    model_dir = write_model_dir(tmp / "model", build_tiny_model(tmp / "tokenizer", seed=0), tiny)
    values.update(
        QUIET_RUN,
        model_name_or_path=str(model_dir),
        random_init=True,
        train_files=[str(data)],
        output_dir=str(tmp / "out"),
        max_steps=steps,
        eval_fraction=0.02,
        eval_steps=steps,
        eval_max_batches=1,
        num_eval_generations=1,
        generation_max_new_tokens=8,
        discord_progress_minutes=-1,
    )
    if tiny:
        values.update(dtype="float32", max_tokens=1024, gradient_accumulation_steps=1)
    for item in overrides:
        key, _, raw = item.partition("=")
        values[key] = yaml.safe_load(raw)
    return train(TrainConfig.from_dict(values, source="kernel_limits"))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks the script itself")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of the training")
    parser.add_argument("--top", type=int, default=15, help="rows in the table")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        import trainer  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO))
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA GPU here: --tiny checks the script on the CPU", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="kernel-limits-"))
    try:
        return check(root, args, torch)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def check(root: Path, args: argparse.Namespace, torch) -> int:
    failed = False
    ok, detail = self_check(root / "self-check")
    print(f"[{'PASS' if ok else 'FAIL'}] self-check: {detail}", flush=True)
    failed |= not ok

    # Fresh caches: every kernel the training compiles, and only those, lands in kernels_dir (Triton and
    # torch.compile read these variables when they compile, not at import).
    kernels_dir = root / "triton"
    os.environ["TRITON_CACHE_DIR"] = str(kernels_dir)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    rc = run_training(root / "run", args.tiny, args.steps, args.set)
    if rc != 0:
        print(f"[FAIL] training: exit {rc}")
        return 1
    launched = len(compiled_specialisations())
    recompiled, failures = recompile_for_sm120()
    for failure in failures:
        print(f"[FAIL] does not compile for sm_120: {failure}")
    failed |= bool(failures)

    kernels = read_kernels(kernels_dir) if kernels_dir.exists() else []
    here = [k for k in kernels if k["arch"] != SM120]
    arches = ", ".join(sorted({f"sm_{k['arch']}" for k in here})) or "-"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"\n{device}: the training compiled {len(here)} kernels ({arches}); {launched} were launched through "
        f"@triton.jit and compiled again for sm_120 ({recompiled} built). Limit on sm_120: "
        f"{SM120_SHARED_LIMIT:,} bytes (99 KiB) of shared memory per block.\n"
    )
    if not args.tiny and launched == 0:
        print(
            "[FAIL] the training launched none of the trainer's Triton kernels: it did not take its GPU path"
        )
        return 1
    if not kernels:
        print(
            "No kernel was compiled: on the CPU the trainer runs no Triton kernel (attention, the fused ops "
            "and the compiled optimizer update are CUDA-only), so nothing of the trainer's could be checked "
            "here. Run it on a GPU."
        )
        return 1 if failed else 0
    print(table(kernels, jit_modules(), args.top))
    too_large = over_limit(kernels)
    for k in sorted(too_large, key=lambda k: -k["shared"]):
        print(f"[FAIL] {k['name']} (sm_{k['arch']}): {k['shared']:,} bytes > {SM120_SHARED_LIMIT:,}")
    failed |= bool(too_large)
    if not failed:
        print(f"\nPASS: every kernel fits in an RTX 5090's {SM120_SHARED_LIMIT:,} bytes of shared memory")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The README's first hour on a GPU: the quickstart's commands as a user runs them, on CUDA, then the same
tiny run with the rtx5090 preset's settings (bf16 weights, Adafactor + Kahan, packed rows, the best model by
ROUGE-L kept as final/), and those with `cuda_graphs: true` (the graph dropped for each evaluation, captured
again after it). Each command must exit 0 and leave what the README says it leaves.

    python3 bench/quickstart_gpu.py            # on a GPU machine, from the repository root (~2 minutes)

It runs `python -m trainer` from this checkout in a temporary directory (configs/quickstart.yaml makes its own
data and tiny model there), so it checks what `make quickstart` does without the install step, on the GPU:
the model loads once (the load-peak check), the Triton kernels train, evaluation generates and scores, and
`trainer generate` / `trainer evaluate` use final/. Prints PASS or FAIL per command; exit 1 on any FAIL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_run

REPO = Path(__file__).resolve().parent.parent
# The preset's optimizer, learning rate, schedule, Kahan updates and clipping, as the file sets them.
PRESET_SETTINGS = [
    "dtype=bfloat16",
    *(f"{key}={value}" for key, value in bench_run.preset_optimization().items()),
    "packing=true",
    "eval_steps=100",
    "save_steps=100",
    "load_best_model_at_end=true",
    "metric_for_best_model=rougeL",
]
INGREDIENTS = "2 eggs; 1 cup all-purpose flour; 1 cup milk; 2 tablespoons butter, melted; 1 pinch salt"


def run(name: str, args: list[str], cwd: Path, env: dict) -> tuple[bool, str]:
    """`python -m trainer ARGS` in `cwd`; (exit 0, its output)."""
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    print(f"{'PASS' if proc.returncode == 0 else 'FAIL'}: {name} (exit {proc.returncode})", flush=True)
    if proc.returncode != 0:
        print("\n".join(out.splitlines()[-25:]), flush=True)
    return proc.returncode == 0, out


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("FAIL: no CUDA device: run this on a GPU machine")
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="quickstart-gpu-") as tmp:
        work = Path(tmp)
        shutil.copytree(REPO / "configs", work / "configs")
        # The checkout's package (and its built loader) wherever the commands run.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        config = ["--config", "configs/quickstart.yaml"]
        for name, out_dir, extra in [
            ("quickstart", "outputs/quickstart", []),
            ("quickstart with the preset's settings", "outputs/preset", ["--set", *PRESET_SETTINGS]),
            (
                "the preset's settings, micro-steps as CUDA graphs",
                "outputs/graphs",
                ["--set", *PRESET_SETTINGS, "cuda_graphs=true"],
            ),
        ]:
            sets = ["--set", f"output_dir={out_dir}"] if not extra else [*extra, f"output_dir={out_dir}"]
            trained, log = run(f"{name}: trainer train", ["train", *config, *sets], work, env)
            final = work / out_dir / "final"
            ok &= trained
            if not trained:
                continue
            summary = json.loads((work / out_dir / "run_summary.json").read_text())
            print(
                f"  {summary.get('steps')} steps, loss {summary.get('final_loss'):.4f}, "
                f"{summary.get('tokens_per_s', 0):,.0f} tokens/s; "
                + "; ".join(line.split("INFO ")[-1] for line in log.splitlines() if "eval loss" in line)[
                    :400
                ],
                flush=True,
            )
            generated, out = run(
                f"{name}: trainer generate",
                ["generate", "--model", str(final), "--ingredients", INGREDIENTS],
                work,
                env,
            )
            ok &= generated and '"generated"' in out
            report = work / out_dir / "eval_report.json"
            evaluated, _ = run(
                f"{name}: trainer evaluate",
                [
                    "evaluate",
                    "--model",
                    str(final),
                    "--data",
                    "data/quickstart/recipes.csv",
                    "--split",
                    "eval",
                ]
                + ["--output", str(report)],
                work,
                env,
            )
            ok &= evaluated and report.exists()
            if report.exists():
                metrics = json.loads(report.read_text()).get("metrics", {})
                print(f"  evaluate: {json.dumps(metrics)[:300]}", flush=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

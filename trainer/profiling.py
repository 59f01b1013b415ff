"""torch.profiler over a window of optimizer steps: where a step's time goes, on the GPU and on the host.

`profile_steps: N` (with `profile_start_step: S`, default 5: after compilation and allocator warm-up)
records optimizer steps S+1 .. S+N and writes to output_dir/profile/:
- kernels.txt: CUDA kernels by self time, and the loop's phases (data, forward_backward, optimizer) as host
  time; the head says how busy the GPU was (kernel time / wall time).
- trace.json: the Chrome/Perfetto trace (open in https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PHASES = ("data", "forward_backward", "optimizer")


class StepProfiler:
    """Call `before_step(step)` and `after_step(step)` (completed steps) around each optimizer step."""

    def __init__(self, start_step: int, steps: int, output_dir: str | Path, enabled: bool = True):
        self.start_step, self.steps = start_step, steps
        self.out = Path(output_dir) / "profile"
        self.enabled = enabled and steps > 0
        self.prof: torch.profiler.profile | None = None
        self.started_at = 0.0

    def before_step(self, step: int) -> None:
        if not self.enabled or self.prof is not None or step != self.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.__enter__()
        self.started_at = time.perf_counter()

    def after_step(self, step: int) -> dict | None:
        """Stops and writes the report after the last profiled step; returns its summary then."""
        if self.prof is None or step < self.start_step + self.steps:
            return None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started_at
        prof, self.prof, self.enabled = self.prof, None, False
        prof.__exit__(None, None, None)
        return self._write(prof, wall)

    def _write(self, prof, wall: float) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        events = prof.key_averages()
        # Kernels are the device-side events; ops and annotations carry their kernels' time as well.
        cuda = torch.autograd.DeviceType.CUDA
        kernels = [e for e in events if e.device_type == cuda and e.self_device_time_total > 0]
        gpu_s = sum(e.self_device_time_total for e in kernels) / 1e6
        if not kernels:
            log.info("profile: no CUDA kernels recorded (CPU run); the trace has the host side")
        phases = {e.key: e.cpu_time_total / 1e6 for e in events if e.key in PHASES and e.device_type != cuda}
        gpu_phases = {
            e.key: e.device_time_total / 1e6 for e in events if e.key in PHASES and e.device_type == cuda
        }
        summary = {
            "steps": self.steps,
            "wall_s_per_step": wall / self.steps,
            "gpu_busy": gpu_s / wall,
            "host_s_per_step": {k: v / self.steps for k, v in phases.items()},
            "gpu_s_per_step": {k: v / self.steps for k, v in gpu_phases.items()},
        }
        lines = [
            f"{self.steps} optimizer steps from step {self.start_step + 1}: "
            f"{wall / self.steps:.3f} s per step, "
            f"GPU busy {100 * summary['gpu_busy']:.1f}% (kernel time / wall time)",
            "host time per step: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in summary["host_s_per_step"].items()),
            "GPU time per step: " + ", ".join(f"{k} {v:.3f} s" for k, v in summary["gpu_s_per_step"].items()),
            "",
            f"{'CUDA kernel':<90} {'ms/step':>9} {'share':>6} {'calls':>7}",
        ]
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:60]:
            ms = e.self_device_time_total / 1e3 / self.steps
            share = e.self_device_time_total / 1e6 / max(gpu_s, 1e-12)
            lines.append(f"{e.key[:90]:<90} {ms:9.2f} {100 * share:5.1f}% {e.count // self.steps:7d}")
        (self.out / "kernels.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        prof.export_chrome_trace(str(self.out / "trace.json"))
        log.info("profile: %s; written to %s", lines[0], self.out)
        return summary

"""torch.profiler over a window of optimizer steps: where a step's time goes, on the GPU and on the host.

`profile_steps: N` (with `profile_start_step: S`, default 5: after compilation and allocator warm-up)
records optimizer steps S+1 .. S+N and writes to output_dir/profile/:
- kernels.txt: CUDA kernels by self time, and the loop's phases (data, forward_backward, optimizer) as host
  time; the head says how busy the GPU was (kernel time / wall time), along the profiled window in equal
  slices what share of each slice had a kernel running (where the host left the GPU waiting), and under
  torchrun how long the collectives ran and how much of that no computation hid (ddp's all-reduce, FSDP2's
  all-gathers and reduce-scatters waited for).
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
    """Call `before_step(step)` and `after_step(step)` (completed steps) around each optimizer step. As a
    context manager it stops a profiler still running when the block ends (a run stopped or failing inside
    the profiled window), without a report."""

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

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof, self.enabled = self.prof, None, False
            prof.__exit__(None, None, None)
            log.info("profile: the run ended inside the profiled window; no report written")

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, prof, wall: float) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        events = prof.key_averages()
        # Kernels are the device-side events; ops and annotations carry their kernels' time as well.
        cuda = torch.autograd.DeviceType.CUDA
        host = [e for e in events if e.device_type != cuda]
        # record_function annotations show on the GPU too, as the span of their kernels: not kernels
        annotations = {e.key for e in host}
        kernels = [
            e
            for e in events
            if e.device_type == cuda and e.self_device_time_total > 0 and e.key not in annotations
        ]
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
            f"kernel time {100 * summary['gpu_busy']:.1f}% of it",
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
        lines += ["", f"{'host op (self time)':<90} {'ms/step':>9} {'calls':>7}"]
        for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:30]:
            if e.key not in PHASES:
                ms = e.self_cpu_time_total / 1e3 / self.steps
                lines.append(f"{e.key[:90]:<90} {ms:9.2f} {e.count // self.steps:7d}")
        prof.export_chrome_trace(str(self.out / "trace.json"))
        timeline = kernel_timeline(self.out / "trace.json")
        if timeline:
            summary["kernel_busy"] = timeline["busy"]
            lines[1:1] = [
                f"kernels running {100 * timeline['busy']:.1f}% of the span from first to last kernel; "
                f"by {len(timeline['slices'])} equal slices: "
                + " ".join(f"{100 * x:.0f}" for x in timeline["slices"])
            ]
            if timeline["collective_s"] > 0:
                summary["collective_s_per_step"] = timeline["collective_s"] / self.steps
                summary["exposed_collective_s_per_step"] = timeline["exposed_collective_s"] / self.steps
                lines[2:2] = [
                    f"collectives (NCCL kernels) {1e3 * summary['collective_s_per_step']:.1f} ms per step, "
                    f"{1e3 * summary['exposed_collective_s_per_step']:.1f} ms of it with no other kernel "
                    "running (not hidden behind compute)"
                ]
        (self.out / "kernels.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        log.info("profile: %s; written to %s", lines[0], self.out)
        return summary


def kernel_timeline(trace_path: Path, slices: int = 40) -> dict | None:
    """Share of time with a GPU kernel running (overlaps merged), over the span of the trace's kernels and per
    equal slice of it; and the collectives' (NCCL kernels') time, all of it and the part with no other kernel
    running (communication not hidden behind compute), in the trace's seconds. None without kernels."""
    events = json.loads(Path(trace_path).read_text(encoding="utf-8")).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels)
    if not spans:
        return None
    by_kind: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for e in kernels:  # collectives (NCCL's kernels) and compute
        by_kind["nccl" in e.get("name", "").lower()].append((e["ts"], e["ts"] + e.get("dur", 0)))
    collectives, compute = _merged(by_kind[True]), _merged(by_kind[False])
    collective_us = sum(e - s for s, e in collectives)
    hidden_us = _overlap(collectives, compute)
    start, end = spans[0][0], max(e for _, e in spans)
    width = max(end - start, 1e-9) / slices
    busy = [0.0] * slices
    for s, e in _merged(spans):  # each merged interval added to the slices it covers
        i = int((s - start) / width)
        while s < e and i < slices:
            edge = start + (i + 1) * width
            busy[i] += min(e, edge) - s
            s, i = min(e, edge), i + 1
    return {
        "busy": sum(busy) / (end - start),
        "slices": [b / width for b in busy],
        "collective_s": collective_us / 1e6,
        "exposed_collective_s": (collective_us - hidden_us) / 1e6,
    }


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the intersection of two unions of sorted, disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total

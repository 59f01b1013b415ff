"""torch.profiler over a window of optimizer steps: where a step's time goes, on the GPU and on the host.

`profile_steps: N` (with `profile_start_step: S`, default 5: after compilation and allocator warm-up)
records optimizer steps S+1 .. S+N and writes to output_dir/profile/:
- kernels.txt: CUDA kernels by self time, and the loop's phases (data, forward_backward, optimizer) as host
  time; the head says how busy the GPU was (kernel time / wall time), along the profiled window in equal
  slices what share of each slice had a kernel running (where the host left the GPU waiting), and under
  torchrun how long the collectives ran and how much of that no computation hid (ddp's all-reduce, FSDP2's
  all-gathers and reduce-scatters waited for).
- trace.json: the Chrome/Perfetto trace (open in https://ui.perfetto.dev).
With `profile_memory: true` (CUDA) every allocation of the window is recorded as well:
- memory.txt: the memory allocated at the window's peak, by the source line that allocated it (the trainer's,
  FSDP2's or the model's code nearest the allocation) and the allocation that reached the peak; then what the
  allocator holds reserved at the window's end by memory pool (its own, or a CUDA graph's) and stream, with
  how much of it is allocated and its largest free block (reserved beyond allocated: cached, or fragmented);
- memory_snapshot.pickle: the allocator's history (open in https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from pathlib import Path

import torch

from trainer.infra.memory import GIB

log = logging.getLogger(__name__)

PHASES = ("data", "forward_backward", "optimizer")
MEMORY_HISTORY_ENTRIES = 2_000_000  # allocator events kept: a few optimizer steps of a 48-block model


class StepProfiler:
    """Call `before_step(step)` and `after_step(step)` (completed steps) around each optimizer step. As a
    context manager it stops a profiler still running when the block ends (a run stopped or failing inside
    the profiled window), without a report."""

    def __init__(
        self,
        start_step: int,
        steps: int,
        output_dir: str | Path,
        enabled: bool = True,
        memory: bool = False,
    ):
        self.start_step, self.steps = start_step, steps
        self.out = Path(output_dir) / "profile"
        self.enabled = enabled and steps > 0
        self.memory = memory and torch.cuda.is_available()
        if memory and self.enabled and not self.memory:
            log.info("profile_memory: no CUDA device, no allocations to record; the kernel report only")
        self.prof: torch.profiler.profile | None = None
        self.started_at = 0.0
        self.allocated_at_start = 0

    def before_step(self, step: int) -> None:
        if not self.enabled or self.prof is not None or step != self.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        if self.memory:
            self.allocated_at_start = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(
                context="alloc", stacks="python", max_entries=MEMORY_HISTORY_ENTRIES
            )
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
        snapshot = None
        if self.memory:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        return self._write(prof, wall, snapshot)

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof, self.enabled = self.prof, None, False
            prof.__exit__(None, None, None)
            if self.memory:
                torch.cuda.memory._record_memory_history(enabled=None)
            log.info("profile: the run ended inside the profiled window; no report written")

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, prof, wall: float, memory_snapshot: dict | None) -> dict:
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
        if memory_snapshot is not None:
            summary["memory_peak_bytes"] = self._write_memory(memory_snapshot)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        log.info("profile: %s; written to %s", lines[0], self.out)
        return summary

    def _write_memory(self, snapshot: dict) -> int:
        with open(self.out / "memory_snapshot.pickle", "wb") as f:
            pickle.dump(snapshot, f)
        device = torch.cuda.current_device()
        peak = memory_at_peak(snapshot["device_traces"][device], self.allocated_at_start)
        lines = [
            f"allocated at the peak of the {self.steps} profiled steps: {peak['peak'] / GIB:.2f} GiB "
            f"(the run's peak so far: {torch.cuda.max_memory_allocated() / GIB:.2f} GiB; "
            f"{peak['events']} allocator events recorded)",
            f"of it allocated before the window (weights, optimizer states, ...): "
            f"{peak['before_window'] / GIB:.2f} GiB",
            "the allocation that reached the peak: "
            + " <- ".join(_frame_name(f) for f in peak["peak_frames"][:6]),
            "",
            f"{'live at the peak, allocated in the window by':<90} {'GiB':>8} {'tensors':>8}",
        ]
        for where, (size, count) in sorted(peak["by_source"].items(), key=lambda kv: -kv[1][0])[:40]:
            lines.append(f"{where[:90]:<90} {size / GIB:8.3f} {count:8d}")
        lines += [
            "",
            "reserved at the window's end, by memory pool ((0, 0): the allocator's own; others: CUDA "
            "graphs') and stream",
            f"{'pool':<12} {'stream':>16} {'reserved GiB':>13} {'allocated GiB':>14} {'awaiting GiB':>14} "
            f"{'segments':>9} {'largest free GiB':>17}",
        ]
        for row in reserved_by_pool(snapshot["segments"], device):
            lines.append(
                f"{str(row['pool']):<12} {row['stream']:>16x} {row['reserved'] / GIB:13.2f} "
                f"{row['allocated'] / GIB:14.2f} {row['awaiting_free'] / GIB:14.2f} {row['segments']:9d} "
                f"{row['largest_free'] / GIB:17.3f}"
            )
        (self.out / "memory.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        log.info("profile: %s; written to %s", lines[0], self.out / "memory.txt")
        return peak["peak"]


def memory_at_peak(trace: list[dict], allocated_at_start: int) -> dict:
    """Replays one device's allocator trace (torch.cuda.memory._snapshot()["device_traces"][device]) from
    `allocated_at_start` bytes: the peak of allocated bytes, how much of it was allocated before the trace
    began, the live allocations at the peak summed by source (`allocation_source`: bytes, count), and the
    frames of the allocation that reached the peak."""
    live: dict[int, tuple[int, str]] = {}
    before = allocated_at_start
    total = peak = allocated_at_start
    peak_live: dict[int, tuple[int, str]] = {}
    peak_before, peak_frames = before, []
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], allocation_source(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, peak_live, peak_before = total, dict(live), before
                peak_frames = event.get("frames", [])
        elif action == "free_completed":
            total -= event["size"]
            if live.pop(event["addr"], None) is None:  # allocated before the trace began
                before -= event["size"]
    by_source: dict[str, tuple[int, int]] = {}
    for size, where in peak_live.values():
        bytes_, count = by_source.get(where, (0, 0))
        by_source[where] = (bytes_ + size, count + 1)
    return {
        "peak": peak,
        "before_window": peak_before,
        "by_source": by_source,
        "peak_frames": peak_frames,
        "events": len(trace),
    }


def reserved_by_pool(segments: list[dict], device: int) -> list[dict]:
    """The allocator's segments on `device` (torch.cuda.memory._snapshot()["segments"]) summed by memory pool
    and stream: reserved and allocated bytes, bytes freed but held until another stream is done with them
    (`record_stream`), segments, and the largest block no tensor holds; the largest reserve first."""
    rows: dict[tuple, dict] = {}
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        key = (tuple(seg.get("segment_pool_id", (0, 0))), seg["stream"])
        row = rows.setdefault(
            key,
            {
                "pool": key[0],
                "stream": key[1],
                "reserved": 0,
                "allocated": 0,
                "awaiting_free": 0,
                "segments": 0,
                "largest_free": 0,
            },
        )
        row["reserved"] += seg["total_size"]
        row["allocated"] += seg["allocated_size"]
        row["segments"] += 1
        blocks = seg.get("blocks", [])
        row["awaiting_free"] += sum(b["size"] for b in blocks if b["state"] == "active_awaiting_free")
        free = [b["size"] for b in blocks if b["state"] == "inactive"]
        row["largest_free"] = max([row["largest_free"], *free])
    return sorted(rows.values(), key=lambda r: -r["reserved"])


# Frames in these packages say what an allocation is for; torch's generic layers (autograd, nn.Module's call,
# functional wrappers) do not.
_TELLING_PACKAGES = ("trainer/", "torch/distributed/", "transformers/", "torch/utils/checkpoint")


def allocation_source(frames: list[dict]) -> str:
    """The innermost frame of the trainer, FSDP2 or the model code (or the innermost of all) as
    'path:line function', the path from the package down; a library's with its caller (FSDP2's helpers are
    shared by its gathers and its reductions)."""
    for i, frame in enumerate(frames):
        path = _package_path(frame["filename"])
        if path.startswith(_TELLING_PACKAGES):
            if path.startswith("trainer/") or i + 1 == len(frames):
                return _frame_name(frame)
            return f"{_frame_name(frame)} <- {_frame_name(frames[i + 1])}"
    return _frame_name(frames[0]) if frames else "(no Python frame)"


def _package_path(path: str) -> str:
    """A source file's path from its package down: after site-packages/, or from this package's folder."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if "/trainer/" in path:
        return "trainer/" + path.rsplit("/trainer/", 1)[1]
    return path


def _frame_name(frame: dict) -> str:
    return f"{_package_path(frame['filename'])}:{frame['line']} {frame['name']}"


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

"""Kernel tables from the torch profiler: what one step launches, how often and for how long.

Used by the GPU rows (issue 54: where the FP8 step's time goes, how many kernels a decode step
launches) and runnable on the CPU, where the rows are the aten operators instead of CUDA kernels.

    table = profile_steps(step, steps=3)            # run ``step`` three times under the profiler
    per_step = difference(long_run, short_run, n)   # the rows of n extra steps (decode steps
                                                    # without the prefill both runs share)
    print(markdown(table, top=25))

A row is one kernel (GPU) or operator (CPU) name with its calls and time per step, its share of
the step's kernel time and a category (``category``) so a reader sees at a glance whether the
time is in matrix multiplies, FP8 casts and amax reductions, attention, copies or the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile

# First match wins: the order puts the specific names before the generic ones.
CATEGORIES = [
    ("attention", ("flash", "attention", "sdpa", "fmha", "softmax")),
    ("fp8 gemm", ("_scaled_mm", "e4m3", "e5m2", "f8f8")),
    ("gemm", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "cutlass", "xmma",
              "ampere_", "cublas", "nvjet")),
    ("fp8 cast/amax", ("amax", "float8", "fp8")),
    ("collective", ("nccl", "allreduce", "all_gather", "reduce_scatter", "gloo")),
    ("copy", ("copy", "memcpy", "memset", "cat", "index_put", "scatter", "gather")),
    ("fused (triton)", ("triton_",)),
    ("norm/rope/activation", ("norm", "rotary", "rope", "silu", "gelu", "mul", "add", "exp", "rsqrt", "mean", "pow")),
]


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


@dataclass(frozen=True)
class KernelRow:
    name: str
    calls_per_step: float
    ms_per_step: float
    share: float  # of the step's total kernel (or operator self) time
    category: str


def _rows(totals: dict[str, tuple[int, float]], steps: int) -> list[KernelRow]:
    all_us = sum(us for _, us in totals.values()) or 1.0
    rows = [KernelRow(name, calls / steps, us / steps / 1e3, us / all_us, category(name))
            for name, (calls, us) in totals.items() if calls > 0]
    return sorted(rows, key=lambda row: (-row.ms_per_step, -row.calls_per_step, row.name))


def _totals(prof, on_gpu: bool) -> dict[str, tuple[int, float]]:
    """name -> (calls, microseconds): device kernels on a GPU, else the CPU operators' self time
    (self time, so a parent operator and the children it calls are not counted twice)."""
    totals: dict[str, tuple[int, float]] = {}
    for event in prof.key_averages():
        if on_gpu:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.self_device_time_total
        else:
            if not event.key.startswith("aten::") or event.self_cpu_time_total <= 0:
                continue
            us = event.self_cpu_time_total
        totals[event.key] = (event.count, us)
    return totals


class StepProfiler:
    """The profiler started and stopped around steps that someone else's loop runs (a training
    callback at the end of steps k and k + n)."""

    def __init__(self, on_gpu: bool | None = None):
        self.on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        self._prof = None

    def start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def stop(self, steps: int) -> list[KernelRow]:
        """The rows per step of the ``steps`` steps since :meth:`start`."""
        if self.on_gpu:
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        return _rows(_totals(self._prof, self.on_gpu), steps)


def profile_steps(step: Callable[[], object], steps: int = 3, on_gpu: bool | None = None) -> list[KernelRow]:
    """Run ``step`` ``steps`` times under the profiler; the rows per step (warm ``step`` up first:
    compilation and autotuning would otherwise be in the table)."""
    profiler = StepProfiler(on_gpu)
    profiler.start()
    for _ in range(steps):
        step()
    return profiler.stop(steps)


def difference(longer: list[KernelRow], shorter: list[KernelRow], extra_steps: int) -> list[KernelRow]:
    """The rows of the ``extra_steps`` steps one run did beyond another, both profiled as one step
    (``profile_steps(..., steps=1)``): the decode steps of a long generation beyond a one-token
    one, whose shared prefill cancels."""
    totals: dict[str, list[float]] = {}
    for sign, rows in ((1, longer), (-1, shorter)):
        for row in rows:
            entry = totals.setdefault(row.name, [0.0, 0.0])
            entry[0] += sign * row.calls_per_step
            entry[1] += sign * row.ms_per_step * 1e3
    kept = {name: (round(calls), max(us, 0.0)) for name, (calls, us) in totals.items() if round(calls) > 0}
    return _rows(kept, extra_steps)


def summary(rows: list[KernelRow]) -> dict:
    """Calls and milliseconds per step, in total and by category."""
    by_category: dict[str, dict[str, float]] = {}
    for row in rows:
        entry = by_category.setdefault(row.category, {"calls": 0.0, "ms": 0.0})
        entry["calls"] += row.calls_per_step
        entry["ms"] += row.ms_per_step
    return {"calls_per_step": sum(r.calls_per_step for r in rows), "ms_per_step": sum(r.ms_per_step for r in rows),
            "by_category": by_category}


def as_json(rows: list[KernelRow], top: int = 40) -> dict:
    return {**summary(rows), "top": [asdict(row) for row in rows[:top]]}


def markdown(rows: list[KernelRow], top: int = 25) -> str:
    """The table by time, then the totals by category."""
    lines = ["| kernel | category | calls/step | ms/step | share |", "|---|---|---:|---:|---:|"]
    for row in rows[:top]:
        name = row.name if len(row.name) <= 70 else row.name[:67] + "..."
        lines.append(f"| `{name}` | {row.category} | {row.calls_per_step:.1f} | {row.ms_per_step:.3f} "
                     f"| {100 * row.share:.1f}% |")
    totals = summary(rows)
    lines.append(f"\n{totals['calls_per_step']:.0f} launches, {totals['ms_per_step']:.3f} ms per step; by category: "
                 + ", ".join(f"{name} {entry['ms']:.3f} ms ({entry['calls']:.0f})"
                             for name, entry in sorted(totals["by_category"].items(), key=lambda kv: -kv[1]["ms"])))
    return "\n".join(lines)

"""The most CPU (or GPU) memory a step holds at once, from the allocator's own record of every
allocation and free: torch's profiler with ``profile_memory`` reports each one with its size.

Only what the step allocates counts (tensors that existed before it are left out, as the
profiler does), so the figure is the step's own working set: activations saved for backward,
what a zero-bubble W holds, gradients, messages between stages, temporaries. Read from the
profiler's events (not an exported trace), it costs about as much as the profiled step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(step: Callable[[], object], device: str = "cpu") -> int:
    """Run ``step()``; the largest sum, at any moment, of the bytes it allocated on ``device``'s
    type and had not freed yet."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as profiler:
        step()
    wanted = torch.device(device).type
    changes = sorted((event.start_ns(), event.nbytes()) for event in profiler.profiler.kineto_results.events()
                     if event.name() == "[memory]" and str(event.device_type()).split(".")[-1].lower() == wanted)
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return peak

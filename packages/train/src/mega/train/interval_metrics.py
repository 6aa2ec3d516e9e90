"""The numbers of one log line: step metrics averaged over the ``--log-interval`` since the last.

Megatron averages the loss and the step time over the interval and reports the rest as of the
logged iteration. The console line, W&B and the straggler report read the same
:class:`~mega.train.log_line.LogRecord`, so every sink shows the same values.
"""

from __future__ import annotations

import math
import resource

import torch

from mega.train.device_peaks import peak_tflops
from mega.train.log_line import LogRecord
from mega.train.precision import model_dtype


class IntervalMetrics:
    def __init__(self, log_interval: int, peak_override: float | None = None):
        self.log_interval = log_interval
        self.peak_override = peak_override
        self._reset()

    def _reset(self) -> None:
        self._losses: list[float] = []
        self._other_losses: dict[str, list[float]] = {}
        self._seconds = 0.0
        self._steps = 0

    def is_log_iteration(self, run, iteration: int) -> bool:
        return iteration % self.log_interval == 0 or iteration == run.config.training.train_iters

    def add(self, run, iteration: int, metrics: dict) -> LogRecord | None:
        """Count one step; at a log iteration, the record of the interval (and start the next)."""
        if math.isfinite(metrics["loss"]):
            self._losses.append(metrics["loss"])
        for name, value in metrics.get("losses", {}).items():
            if name != "lm loss" and math.isfinite(value):
                self._other_losses.setdefault(name, []).append(value)
        self._seconds += metrics["elapsed_s"]
        self._steps += 1
        if not self.is_log_iteration(run, iteration):
            return None
        record = self._record(run, iteration, metrics, self._seconds / self._steps)
        self._reset()
        return record

    def _record(self, run, iteration, metrics, elapsed) -> LogRecord:
        world = run.groups.world_size
        tflops = run.flops_per_iteration / elapsed / world / 1e12
        tokens = run.derived.global_batch_size * run.config.model.seq_length / elapsed / world
        peak = peak_tflops(run.groups.device, model_dtype(run.config.precision), self.peak_override)
        return LogRecord(
            iteration=iteration, train_iters=run.config.training.train_iters,
            consumed_samples=run.consumed_samples, elapsed_ms=1000 * elapsed,
            learning_rate=metrics["lr"], global_batch_size=run.derived.global_batch_size,
            loss=sum(self._losses) / len(self._losses) if self._losses else float("nan"),
            loss_scale=metrics["loss_scale"],
            other_losses={name: sum(values) / len(values) for name, values in self._other_losses.items()},
            grad_norm=metrics["grad_norm"] if math.isfinite(metrics["grad_norm"]) else None,
            skipped_iterations=run.skipped_iterations, nan_iterations=run.nan_iterations,
            tflops_per_gpu=tflops, tokens_per_second_per_gpu=tokens,
            mfu=tflops / peak if peak else None, peak_memory_gb=peak_memory_gb(run.groups.device),
        )


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or this process's peak resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB

"""The console logger: Megatron's log line every ``--log-interval`` iterations, on rank 0.

Throughput (TFLOP/s and tokens/s per GPU) comes from the family's FLOPs formula and the measured
step time; MFU is printed where the device's peak is known (see device_peaks), never on a CPU.
"""

from __future__ import annotations

import math
import resource
import sys
import time

import torch

from mega.core.plugins import hookimpl
from mega.core.training.device_peaks import peak_tflops
from mega.core.training.log_line import LogRecord, format_log_line
from mega.core.training.precision import model_dtype


class ConsoleLogger:
    def __init__(self, log_interval: int, peak_override: float | None, stream=None):
        self.log_interval = log_interval
        self.peak_override = peak_override
        self.stream = stream or sys.stdout
        # Since the last printed line: averaged over the interval, as Megatron does.
        self._losses: list[float] = []
        self._other_losses: dict[str, list[float]] = {}
        self._seconds = 0.0
        self._steps = 0
        self._started = time.perf_counter()

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        if math.isfinite(metrics["loss"]):
            self._losses.append(metrics["loss"])
        for name, value in metrics.get("losses", {}).items():
            if name != "lm loss" and math.isfinite(value):
                self._other_losses.setdefault(name, []).append(value)
        self._seconds += metrics["elapsed_s"]
        self._steps += 1
        last = iteration == run.config.training.train_iters
        if iteration % self.log_interval and not last:
            return
        if run.is_logging_rank:
            self._print(format_log_line(self._record(run, iteration, metrics, self._seconds / self._steps)))
        self._losses, self._other_losses, self._seconds, self._steps = [], {}, 0.0, 0

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

    @hookimpl
    def on_train_start(self, run):
        self._started = time.perf_counter()
        if run.is_logging_rank and run.config.training.global_batch_size is None:
            # Megatron's default, which grows with the data-parallel size: a layout with more
            # data-parallel ranks then trains on other batches than one process (same weights).
            self._print(f" setting global batch size to {run.derived.global_batch_size} (--micro-batch-size "
                        f"{run.config.training.micro_batch_size} x data-parallel size {run.derived.data_parallel_size}; "
                        "give --global-batch-size to train on the same batches at every layout)")

    @hookimpl
    def on_train_end(self, run):
        if run.is_logging_rank and run.losses and run.finished:
            seconds = time.perf_counter() - self._started
            self._print(f" training finished: {len(run.losses)} iterations in {seconds:.1f} s, "
                        f"lm loss {run.losses[0]:.3f} (first) -> {run.losses[-1]:.3f} (last)")

    @hookimpl
    def on_eval(self, run, iteration, metrics):
        if not run.is_logging_rank:
            return
        line = (f" validation loss at iteration {iteration} | lm loss value: {metrics['loss']:.6E} | "
                f"lm loss PPL: {metrics['perplexity']:.6E} | ")
        rule = "-" * len(line)
        self._print(f"{rule}\n{line}\n{rule}")


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or this process's peak resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB


def console_logger(run_config) -> ConsoleLogger:
    return ConsoleLogger(run_config.logging.log_interval, run_config.logging.peak_tflops)

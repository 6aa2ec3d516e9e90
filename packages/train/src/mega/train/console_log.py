"""The console logger: Megatron's log line every ``--log-interval`` iterations, on rank 0.

Throughput (TFLOP/s and tokens/s per GPU) comes from the family's FLOPs formula and the measured
step time; MFU is printed where the device's peak is known (see device_peaks), never on a CPU.
"""

from __future__ import annotations

import sys
import time

from mega.core.checkpoint.layout_text import layout_text
from mega.core.plugins import hookimpl
from mega.train.checkpoint.checkpointer import layout_of
from mega.train.interval_metrics import IntervalMetrics
from mega.train.log_line import format_log_line


class ConsoleLogger:
    def __init__(self, log_interval: int, peak_override: float | None, stream=None):
        self.interval = IntervalMetrics(log_interval, peak_override)
        self.stream = stream or sys.stdout
        self._started = time.perf_counter()

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        record = self.interval.add(run, iteration, metrics)
        if record is not None and run.is_logging_rank:
            self._print(format_log_line(record))

    @hookimpl
    def on_train_start(self, run):
        self._started = time.perf_counter()
        if run.is_logging_rank:
            self._print(f" layout: {layout_text(layout_of(run.config, run.groups))}")
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


def console_logger(run_config) -> ConsoleLogger:
    return ConsoleLogger(run_config.logging.log_interval, run_config.logging.peak_tflops)

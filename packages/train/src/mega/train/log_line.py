"""Megatron's training log line, so tools that parse Megatron logs parse ours.

    iteration       10/     100 | consumed samples:          320 | elapsed time per iteration (ms):
    123.4 | throughput per GPU (TFLOP/s/GPU): 1.2 | learning rate: 3.000000E-04 | global batch size:
       32 | lm loss: 7.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped
    iterations:   0 | number of nan iterations:   0 |

mega appends tokens per second per GPU, MFU (only where the device's peak is known) and peak
memory after Megatron's fields.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LogRecord:
    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    loss: float
    loss_scale: float
    grad_norm: float | None
    skipped_iterations: int
    nan_iterations: int
    tflops_per_gpu: float | None = None
    tokens_per_second_per_gpu: float | None = None
    mfu: float | None = None
    peak_memory_gb: float | None = None
    other_losses: dict[str, float] | None = None  # the family's losses besides lm loss


def format_log_line(record: LogRecord) -> str:
    parts = [
        f" iteration {record.iteration:8d}/{record.train_iters:8d} |",
        f" consumed samples: {record.consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {record.elapsed_ms:.1f} |",
    ]
    if record.tflops_per_gpu is not None:
        # Megatron prints one decimal; a CPU's fraction of a TFLOP/s needs three to show at all.
        digits = 1 if record.tflops_per_gpu >= 10 else 3
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {record.tflops_per_gpu:.{digits}f} |")
    parts += [
        f" learning rate: {record.learning_rate:.6E} |",
        f" global batch size: {record.global_batch_size:5d} |",
        f" lm loss: {record.loss:.6E} |",
        *(f" {name}: {value:.6E} |" for name, value in (record.other_losses or {}).items()),
        f" loss scale: {record.loss_scale:.1f} |",
    ]
    if record.grad_norm is not None:
        parts.append(f" grad norm: {record.grad_norm:.3f} |")
    parts += [
        f" number of skipped iterations: {record.skipped_iterations:3d} |",
        f" number of nan iterations: {record.nan_iterations:3d} |",
    ]
    if record.tokens_per_second_per_gpu is not None:
        parts.append(f" tokens per second per GPU: {record.tokens_per_second_per_gpu:.1f} |")
    if record.mfu is not None:
        parts.append(f" MFU: {100 * record.mfu:.1f}% |")
    if record.peak_memory_gb is not None:
        parts.append(f" peak memory (GB): {record.peak_memory_gb:.2f} |")
    return "".join(parts)

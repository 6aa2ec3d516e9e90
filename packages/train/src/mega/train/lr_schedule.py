"""Learning rate by iteration: linear warm-up, then constant, linear or cosine decay to min_lr.

Megatron's OptimizerParamScheduler rules: warm-up rises linearly from 0 to ``lr`` over
``warmup`` steps; decay runs from the end of warm-up to ``decay_iters``; afterwards ``min_lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LearningRateSchedule:
    lr: float
    min_lr: float
    style: str  # constant | linear | cosine
    warmup_iters: int
    decay_iters: int

    def __post_init__(self) -> None:
        if self.style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown --lr-decay-style {self.style!r}; known: constant, linear, cosine")
        if self.decay_iters < self.warmup_iters:
            raise ValueError(
                f"--lr-decay-iters ({self.decay_iters}) must be >= --lr-warmup-iters ({self.warmup_iters})"
            )

    def __call__(self, iteration: int) -> float:
        """The learning rate of the optimizer step that completes ``iteration`` (1-based)."""
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if iteration >= self.decay_iters:
            return self.min_lr
        progress = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + (self.lr - self.min_lr) * factor

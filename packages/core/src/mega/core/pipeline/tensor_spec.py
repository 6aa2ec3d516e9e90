"""``TensorSpec``: shape and dtype of a tensor that crosses a pipeline-stage boundary.

A model family declares them (``ModelFamily.boundary``); the schedules allocate the receive
buffers from them. It sits in the pipeline package, which the family contract builds on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one named tensor that crosses a stage boundary. Floating tensors carry
    a gradient back; others (masks, ids) travel forward only."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def has_gradient(self) -> bool:
        return self.dtype.is_floating_point

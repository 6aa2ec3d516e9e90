"""Megatron's train/valid/test split strings ("969,30,1") and the document ranges they select."""

from __future__ import annotations

import re

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> ``[0.969, 0.03, 0.001]`` (missing parts are 0; normalised to sum 1)."""
    numbers = [float(part) for part in re.findall(r"[.0-9]+", split)]
    if not numbers or len(numbers) > len(SPLIT_NAMES):
        raise ValueError(f"--split {split!r}: expected up to three comma-separated weights, e.g. 969,30,1")
    numbers += [0.0] * (len(SPLIT_NAMES) - len(numbers))
    weights = np.array(numbers, dtype=np.float64)
    total = np.sum(weights)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the weights must not all be zero")
    return (weights / total).tolist()


def split_bounds(fractions: list[float]) -> list[tuple[float, float] | None]:
    """Each split's ``(begin, end)`` as fractions of the dataset, ``None`` for an empty split.

    The running sum is accumulated left to right in Python floats, as Megatron does, so that the
    bounds (and hence the document ranges) agree with it to the last bit.
    """
    edges = [0.0]
    for fraction in fractions:
        edges.append(edges[-1] + fraction)
    return [(begin, end) if end > begin else None for begin, end in zip(edges[:-1], edges[1:], strict=True)]


def split_documents(bounds: tuple[float, float], num_documents: int) -> np.ndarray:
    """The document indices of one split: ``round(begin * N) .. round(end * N)`` (Python rounding)."""
    begin = int(round(bounds[0] * float(num_documents)))
    end = int(round(bounds[1] * float(num_documents)))
    return np.arange(begin, end, dtype=np.int32)

"""Sequence packing: documents into rows of a fixed length, and what a packed row tells the model.

:func:`first_fit_decreasing` bins documents (longest first, each into the first bin with room),
deterministic for the same lengths: ties keep document order. A packed row carries
``document_ids`` (``[seq]``: 0, 1, ... per document of the row, padding one more id), from which
the model builds its per-document attention (:func:`mega.core.kernels.AttentionMask` ``cu_seqlens``)
and positions restart with :func:`positions_within_documents`.
"""

from __future__ import annotations

import numpy as np


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """``(items, offsets)``: bin ``b`` holds the indices ``items[offsets[b]:offsets[b + 1]]`` of
    ``lengths``, longest first; bins are numbered in the order they were opened.

    A segment tree over the bins' free space finds the first bin with room in O(log bins).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > capacity:
        raise ValueError(f"an item of {int(lengths.max())} does not fit a bin of {capacity}")
    order = np.argsort(-lengths, kind="stable")
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [0] * (2 * size)  # leaves size..2*size-1: the bins' free space (unopened bins: capacity)
    for leaf in range(size, 2 * size):
        free[leaf] = capacity
    for node in range(size - 1, 0, -1):
        free[node] = capacity
    bin_of = np.empty(len(lengths), dtype=np.int64)
    opened = 0
    for item in order.tolist():
        need = int(lengths[item])
        node = 1
        while node < size:  # descend to the leftmost leaf with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        chosen = node - size
        bin_of[item] = chosen
        opened = max(opened, chosen + 1)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    # Items of a bin in the order they were placed (longest first), bins by number.
    placed = order[np.argsort(bin_of[order], kind="stable")]
    counts = np.bincount(bin_of, minlength=opened) if len(lengths) else np.zeros(0, np.int64)
    offsets = np.zeros(opened + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return placed.astype(np.int64), offsets


def positions_within_documents(document_ids: np.ndarray) -> np.ndarray:
    """Position ids restarting at 0 where ``document_ids`` (non-decreasing) changes."""
    positions = np.arange(len(document_ids), dtype=np.int64)
    starts = np.zeros(len(document_ids), dtype=np.int64)
    change = np.flatnonzero(np.diff(document_ids)) + 1
    starts[change] = change
    return positions - np.maximum.accumulate(starts)


def document_ids_after_eod(tokens: np.ndarray, eod: int) -> np.ndarray:
    """Megatron's ``--reset-attention-mask`` documents: each ends with (includes) an EOD token."""
    ends = (tokens == eod).astype(np.int64)
    return np.concatenate(([0], np.cumsum(ends[:-1])))

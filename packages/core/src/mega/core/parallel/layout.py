"""Which global ranks form each parallel group, in Megatron's rank order.

Ranks are laid out over the dimensions in the order ``tp-cp-ep-dp-pp``: tensor-parallel
neighbours are adjacent ranks (so they share a node and its fast links) and pipeline stages are
farthest apart. Megatron uses the same order, so a layout, its logs and its checkpoints line up.

This module is pure arithmetic (numpy, no process groups), so tests and the layout planner can use
it without starting any process.
"""

from __future__ import annotations

import numpy as np

ORDER = ("tp", "cp", "ep", "dp", "pp")


def rank_groups(sizes: dict[str, int], dims: str) -> list[list[int]]:
    """The rank groups spanning ``dims`` (e.g. ``"dp-cp"``), given each dimension's size.

    Dimensions missing from ``sizes`` have size 1. Within a group, and across groups, the
    dimension earlier in :data:`ORDER` varies fastest, as in Megatron's ``RankGenerator``.
    """
    wanted = set(dims.split("-"))
    unknown = wanted - set(ORDER)
    if unknown:
        raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)}; known: {'-'.join(ORDER)}")
    shape = [sizes.get(name, 1) for name in ORDER]
    world = int(np.prod(shape))
    # C order puts the last axis fastest, so reverse: axes become (pp, dp, ep, cp, tp).
    grid = np.arange(world).reshape(shape[::-1])
    axes = list(ORDER[::-1])
    outside = [axes.index(name) for name in axes if name not in wanted]
    inside = [axes.index(name) for name in axes if name in wanted]
    group_size = int(np.prod([grid.shape[i] for i in inside]))
    return grid.transpose(outside + inside).reshape(-1, group_size).tolist()


def embedding_ranks(pipeline_ranks: list[int]) -> list[int]:
    """Ranks that hold the word embeddings: the first and the last pipeline stage."""
    if len(pipeline_ranks) == 1:
        return list(pipeline_ranks)
    return [pipeline_ranks[0], pipeline_ranks[-1]]

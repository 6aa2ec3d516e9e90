"""Where this rank's shards sit inside the layout-free global tensors (the whole model's, as one
process would hold them): what a checkpoint stores and what initialisation fills (build.py).

A checkpoint stores every tensor at its global shape, written as the rectangular pieces ranks hold. Saving at one layout and loading at
another is then only a matter of overlapping pieces, which ``torch.distributed.checkpoint``
resolves. This module computes the pieces:

* a tensor-parallel shard sits at ``tp_rank * size`` along its ``partition_dim``; with
  ``partition_chunks`` > 1 (SwiGLU's gate and up) each block sits in its own part of the global
  tensor, so the global tensor is the one-device layout ``[gate; up]``;
* an expert-parallel shard (``expert_shard`` = (ep rank, ep size), see
  :mod:`mega.core.parallel.param_attrs`) holds whole experts along dimension 0, so it sits at
  ``ep_rank * local_experts`` there (composed with any tensor-parallel split of another dimension,
  over the experts' own tensor group under ``--expert-tensor-parallel-size``);
* a distributed optimizer's state covers a flat range of a parameter, which is cut into the
  rectangular boxes it is made of (a partial first row, whole rows, a partial last row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mega.core.parallel.param_attrs import expert_shard, is_tensor_parallel, tensor_shard


@dataclass(frozen=True)
class Piece:
    data: torch.Tensor  # this rank's values (a view where possible)
    offsets: tuple[int, ...]  # of ``data``'s first element in the global tensor


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a parameter is split over the tensor group (nothing when ``dim`` is None)."""

    dim: int | None = None
    chunks: int = 1
    rank: int = 0
    size: int = 1
    expert_rank: int = 0  # whole experts along dimension 0, split over the expert group
    expert_size: int = 1

    @classmethod
    def of(cls, param: torch.Tensor, tp_rank: int, tp_size: int) -> TensorParallelSplit:
        expert_rank, expert_size = expert_shard(param)
        tp_rank, tp_size = tensor_shard(param, tp_rank, tp_size)  # (an expert's own tensor group)
        if tp_size == 1 or not is_tensor_parallel(param):
            return cls(expert_rank=expert_rank, expert_size=expert_size)
        return cls(param.partition_dim, getattr(param, "partition_chunks", 1), tp_rank, tp_size,
                   expert_rank, expert_size)

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= self.size
        if self.expert_size > 1:
            shape[0] *= self.expert_size
        return tuple(shape)

    def pieces(self, local: torch.Tensor, local_offsets: tuple[int, ...], local_shape: tuple[int, ...]) -> list[Piece]:
        """The global pieces of ``local``, a box at ``local_offsets`` of a shard shaped ``local_shape``."""
        pieces = self._tensor_parallel_pieces(local, local_offsets, local_shape)
        if self.expert_size == 1:
            return pieces
        first_expert = self.expert_rank * local_shape[0]
        return [Piece(p.data, (p.offsets[0] + first_expert, *p.offsets[1:])) for p in pieces]

    def _tensor_parallel_pieces(self, local: torch.Tensor, local_offsets: tuple[int, ...],
                                local_shape: tuple[int, ...]) -> list[Piece]:
        if self.dim is None:
            return [Piece(local, tuple(local_offsets))]
        d = self.dim
        block = local_shape[d] // self.chunks
        start, stop = local_offsets[d], local_offsets[d] + local.shape[d]
        pieces = []
        for b in range(self.chunks):
            lo, hi = max(start, b * block), min(stop, (b + 1) * block)
            if lo >= hi:
                continue
            offsets = list(local_offsets)
            offsets[d] = b * block * self.size + self.rank * block + (lo - b * block)
            pieces.append(Piece(local.narrow(d, lo - start, hi - lo), tuple(offsets)))
        return pieces


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """The boxes the elements ``[start, stop)`` of a row-major tensor of ``shape`` make up.

    Each box is ``(flat_start, flat_stop, offsets, sizes)``; its elements are contiguous, so
    ``flat[flat_start:flat_stop].view(sizes)`` holds it.
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(start, stop, (start,) * len(shape), (stop - start,) * len(shape))]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row:
        return [(first_row * inner + a, first_row * inner + b, (first_row, *offs), (1, *sizes))
                for a, b, offs, sizes in flat_range_boxes(shape[1:], start - first_row * inner, stop - first_row * inner)]
    boxes = []
    whole_from, whole_to = -(-start // inner), stop // inner  # rows entirely inside the range
    if start % inner:
        boxes += flat_range_boxes(shape, start, whole_from * inner)
    if whole_to > whole_from:
        boxes.append((whole_from * inner, whole_to * inner, (whole_from, *[0] * (len(shape) - 1)),
                      (whole_to - whole_from, *shape[1:])))
    if stop % inner:
        boxes += flat_range_boxes(shape, whole_to * inner, stop)
    return boxes


def tensor_pieces(local: torch.Tensor, split: TensorParallelSplit, shape: tuple[int, ...],
                  flat_range: tuple[int, int] | None = None) -> list[Piece]:
    """Global pieces of a tensor holding a whole tp shard of ``shape`` (``flat_range`` None), or
    the elements ``flat_range`` of the flattened shard (``local`` is then 1-D)."""
    if flat_range is None:
        return split.pieces(local, (0,) * len(shape), shape)
    pieces = []
    for flat_start, flat_stop, offsets, sizes in flat_range_boxes(shape, *flat_range):
        box = local[flat_start - flat_range[0]:flat_stop - flat_range[0]].view(sizes)
        pieces += split.pieces(box, offsets, shape)
    return pieces

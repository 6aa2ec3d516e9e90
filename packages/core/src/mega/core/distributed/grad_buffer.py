"""Contiguous gradient (and parameter) buffers split into buckets, one collective per bucket.

Every parameter's gradient is a view into one flat buffer (``param.main_grad``), so a bucket of
many parameters is reduced by one collective on one contiguous tensor. Parameters are laid out in
reverse order of ``module.parameters()``, roughly the order in which backward produces their
gradients, so the first bucket is complete first and its reduction overlaps the rest of backward.

With the distributed optimizer the parameters themselves also live in a flat buffer of the same
layout (``param.data`` is a view), each bucket is padded to a multiple of the data-parallel size,
and rank ``r`` owns the ``r``-th equal slice of every bucket: gradients are reduce-scattered into
that slice and updated parameters are all-gathered from it. A weight tied across pipeline stages
(``shared_embedding``) then has a bucket of its own, as in Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from mega.core.parallel.collectives import all_gather_into, all_reduce, reduce_scatter_into
from mega.core.parallel.groups import Group
from mega.core.parallel.param_attrs import is_shared_embedding

# Pad buckets of the distributed optimizer to multiples of this many elements per rank, so every
# rank's slice starts on an aligned address (Megatron uses the same 128).
SHARD_ALIGNMENT = 128


@dataclass
class Bucket:
    """A run of parameters reduced by one collective; offsets are relative to the buffer."""

    params: list[nn.Parameter]
    offsets: list[tuple[int, int]]  # each param's [start, end) in the buffer
    start: int
    end: int  # padded end
    grad_data: torch.Tensor = field(repr=False, default=None)
    param_data: torch.Tensor | None = field(repr=False, default=None)
    pending: set = field(default_factory=set, repr=False)  # ids of params whose grads are not in yet
    grad_launched: bool = False
    grad_work: object = field(default=None, repr=False)  # handle of an asynchronous reduction
    param_work: object = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, group: Group) -> tuple[int, int]:
        """This rank's ``[start, end)`` slice of the bucket, relative to the buffer."""
        size = self.numel // group.size
        return self.start + group.rank * size, self.start + (group.rank + 1) * size


class GradBuffer:
    """The gradients of parameters of one (param dtype, grad dtype) kind, reduced over ``group``."""

    def __init__(self, params: list[nn.Parameter], grad_dtype: torch.dtype, group: Group,
                 scaling: float, bucket_size: int | None, shard_for_optimizer: bool):
        self.params, self.grad_dtype, self.group = params, grad_dtype, group
        self.scaling, self.shard_for_optimizer = scaling, shard_for_optimizer
        self.param_dtype = params[0].dtype
        device = params[0].device
        self.buckets = self._plan_buckets(bucket_size)
        numel = self.buckets[-1].end
        self.grad_data = torch.zeros(numel, dtype=grad_dtype, device=device)
        self.param_data = torch.zeros(numel, dtype=self.param_dtype, device=device) if shard_for_optimizer else None

        for bucket in self.buckets:
            bucket.grad_data = self.grad_data[bucket.start:bucket.end]
            if self.param_data is not None:
                bucket.param_data = self.param_data[bucket.start:bucket.end]
            for param, (start, end) in zip(bucket.params, bucket.offsets, strict=True):
                param.main_grad = self.grad_data[start:end].view(param.shape)
                if self.param_data is not None:
                    view = self.param_data[start:end].view(param.shape)
                    view.copy_(param.data)
                    param.data = view
        self.reset()

    def _plan_buckets(self, bucket_size: int | None) -> list[Bucket]:
        alignment = SHARD_ALIGNMENT * self.group.size if self.shard_for_optimizer else 1
        buckets, current, offsets, start, cursor = [], [], [], 0, 0

        def close():
            nonlocal start, cursor, current, offsets
            end = math.ceil(cursor / alignment) * alignment
            buckets.append(Bucket(current, offsets, start, end))
            start = cursor = end
            current, offsets = [], []

        for param in self.params:
            # Sharded, a weight tied across pipeline stages must be split the same way on both.
            alone = self.shard_for_optimizer and is_shared_embedding(param)
            if alone and current:
                close()
            current.append(param)
            offsets.append((cursor, cursor + param.numel()))
            cursor += param.numel()
            if alone or (bucket_size is not None and cursor - start >= bucket_size):
                close()
        if current:
            close()
        return buckets

    # ------------------------------------------------------------------ gradient reduction

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.grad_launched, bucket.grad_work = False, None

    def start_grad_sync(self, bucket: Bucket, async_op: bool) -> None:
        """Average the bucket's gradients over the group (all-reduce, or reduce-scatter to the owner)."""
        if self.scaling != 1.0:
            bucket.grad_data.mul_(self.scaling)
        if self.shard_for_optimizer:
            start, end = bucket.shard_range(self.group)
            shard = self.grad_data[start:end]
            bucket.grad_work = reduce_scatter_into(shard, bucket.grad_data, self.group, async_op=async_op)
        else:
            bucket.grad_work = all_reduce(bucket.grad_data, self.group, async_op=async_op)
        bucket.grad_launched = True

    def finish_grad_sync(self) -> None:
        for bucket in self.buckets:
            if not bucket.grad_launched:
                self.start_grad_sync(bucket, async_op=False)
            if bucket.grad_work is not None:
                bucket.grad_work.wait()
        self.reset()

    def zero(self) -> None:
        self.grad_data.zero_()
        self.reset()

    # ------------------------------------------------------------------ parameter gathering

    def start_param_gather(self, bucket: Bucket, async_op: bool) -> None:
        start, end = bucket.shard_range(self.group)
        work = all_gather_into(bucket.param_data, self.param_data[start:end], self.group, async_op=async_op)
        bucket.param_work = work if async_op else None

    def wait_param_gather(self, bucket: Bucket) -> None:
        if bucket.param_work is not None:
            bucket.param_work.wait()
            bucket.param_work = None

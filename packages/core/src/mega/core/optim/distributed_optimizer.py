"""ZeRO-1: fp32 main parameters and optimizer state sharded over the data-parallel ranks.

It works on the buffers of :class:`~mega.core.distributed.ddp.DistributedDataParallel` built
with ``use_distributed_optimizer=True``: every bucket is split into ``dp`` equal slices and rank
``r`` owns slice ``r``. DDP reduce-scatters the gradients, so this rank receives exactly the
summed gradients of its slice; the optimizer keeps fp32 main parameters and Adam moments for that
slice only (a parameter crossing a slice boundary is split between ranks), updates them, writes
them into the model's parameter buffer, and all-gathers every bucket so each rank again holds the
whole model. Memory for optimizer state (main params + moments: 12 bytes per parameter with
Adam) falls as ``1/dp``.

With ``overlap_param_gather`` the all-gathers run asynchronously after the step and each module
waits, in a forward pre-hook, only for the buckets holding its own parameters. Call
``finish_param_sync()`` before reading parameters outside a forward (e.g. to save them).
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.distributed.ddp import DistributedDataParallel
from mega.core.distributed.grad_buffer import Bucket, GradBuffer
from mega.core.optim.optimizer import MainParam, MixedPrecisionOptimizer, OptimizerFactory, StepResult
from mega.core.parallel.groups import ParallelGroups


class DistributedOptimizer(MixedPrecisionOptimizer):
    dp_sharded = True

    def __init__(self, param_groups: list[dict], groups: ParallelGroups, make_optimizer: OptimizerFactory,
                 models: list[DistributedDataParallel], *, overlap_param_gather: bool = False, **options):
        self.models, self.overlap_param_gather = models, overlap_param_gather
        self._where: dict[int, tuple[GradBuffer, Bucket, tuple[int, int]]] = {}
        for model in models:
            if not model.config.use_distributed_optimizer:
                raise ValueError("DistributedOptimizer needs DistributedDataParallel built with "
                                 "DDPConfig(use_distributed_optimizer=True)")
            for buffer in model.grad_buffers:
                for bucket in buffer.buckets:
                    for param, offsets in zip(bucket.params, bucket.offsets, strict=True):
                        self._where[id(param)] = (buffer, bucket, offsets)
        super().__init__(param_groups, groups, make_optimizer, **options)
        if overlap_param_gather:
            for model in models:
                for module in model.module.modules():
                    if any(True for _ in module.parameters(recurse=False)):
                        module.register_forward_pre_hook(self._wait_for_params)

    def _main_params_of(self, param: nn.Parameter) -> list[MainParam]:
        if id(param) not in self._where:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is in no DistributedDataParallel "
                             "buffer given to the DistributedOptimizer")
        buffer, bucket, (start, end) = self._where[id(param)]
        shard_start, shard_end = bucket.shard_range(buffer.group)
        lo, hi = max(start, shard_start), min(end, shard_end)
        if lo >= hi:  # another rank owns all of this parameter
            return []
        model_view = buffer.param_data[lo:hi]
        grad_view = buffer.grad_data[lo:hi]
        flat_range = (lo - start, hi - start)
        if model_view.dtype == torch.float32:
            # fp32: the owned slice of the model parameter is itself the main parameter.
            return [MainParam(param, nn.Parameter(model_view), lambda: grad_view, None, flat_range)]
        main = nn.Parameter(model_view.float().clone())
        return [MainParam(param, main, lambda: grad_view, model_view, flat_range)]

    def step(self) -> StepResult:
        result = super().step()
        if result.applied:
            for buffer in self._buffers():
                for bucket in buffer.buckets:
                    buffer.start_param_gather(bucket, async_op=self.overlap_param_gather)
        return result

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather."""
        for buffer in self._buffers():
            for bucket in buffer.buckets:
                buffer.wait_param_gather(bucket)

    def _wait_for_params(self, module: nn.Module, args) -> None:
        for param in module.parameters(recurse=False):
            where = self._where.get(id(param))
            if where is not None:
                where[0].wait_param_gather(where[1])

    def _buffers(self) -> list[GradBuffer]:
        return [buffer for model in self.models for buffer in model.grad_buffers]

"""Data parallelism: average gradients over the data-parallel ranks, bucket by bucket.

``DistributedDataParallel(module, groups, config)`` puts every gradient in a contiguous buffer
(``param.main_grad``, optionally fp32 whatever the parameter dtype) split into buckets. During
backward a hook moves each fresh ``param.grad`` into ``main_grad``; with ``overlap_grad_reduce``
a bucket's asynchronous all-reduce (reduce-scatter with the distributed optimizer) starts as
soon as its last gradient arrives, overlapping the rest of backward.

The contract with the schedules (stable; the pipeline schedules rely on it):

* ``with ddp.no_sync():`` - backward passes inside accumulate into ``main_grad`` and communicate
  nothing. Run every micro-batch but the last of a step inside it.
* ``ddp.finish_grad_sync()`` - after the last micro-batch's backward: starts the reductions not
  yet started, waits for all, then sums the gradients of ``sequence_parallel`` parameters over
  the tensor group. Fires ``on_grad_sync_start`` / ``on_grad_sync_end`` when given ``events``.
* ``ddp.zero_grad_buffer()`` - before a step's first micro-batch.

Wrap the model once it is on its device, in its dtype and split by
:func:`~mega.core.parallel.tensor_parallel.apply_tensor_parallel`: the buffers are built from
the parameters as they are then (with the distributed optimizer ``param.data`` becomes a view
into the parameter buffer).

Dense gradients are averaged over ``groups.dp_cp``; expert gradients (``expert_parallel``
parameters) are summed over ``groups.expert_dp`` with the same ``1/dp_cp`` scaling, since every
expert already sees the tokens of its expert-parallel peers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from mega.core.distributed.grad_buffer import GradBuffer
from mega.core.parallel.collectives import all_reduce
from mega.core.parallel.groups import ParallelGroups
from mega.core.parallel.param_attrs import is_expert_parallel, is_padded_vocab, is_sequence_parallel


@dataclass(frozen=True)
class DDPConfig:
    """``bucket_size`` in elements (``None``: one bucket per buffer), as Megatron's ``--ddp-bucket-size``."""

    bucket_size: int | None = 40_000_000
    overlap_grad_reduce: bool = False
    grad_reduce_in_fp32: bool = False
    use_distributed_optimizer: bool = False
    # Linear layers accumulate weight gradients straight into main_grad (see
    # mega.core.parallel.grad_accumulation_fusion); this marks the weights they may do it for.
    gradient_accumulation_fusion: bool = False


class DistributedDataParallel(nn.Module):
    """Wraps ``module``; ``forward`` and ``state_dict`` are the module's own."""

    def __init__(self, module: nn.Module, groups: ParallelGroups, config: DDPConfig = DDPConfig(),
                 events=None):
        super().__init__()
        self.module, self.groups, self.config, self.events = module, groups, config, events
        self._sync_enabled = True

        params = [p for p in module.parameters() if p.requires_grad]
        kinds: dict[tuple, list[nn.Parameter]] = {}
        for param in reversed(params):  # roughly the order backward produces gradients
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
            kinds.setdefault((param.dtype, grad_dtype, is_expert_parallel(param)), []).append(param)
        scaling = 1.0 / groups.dp_cp.size
        self.grad_buffers: list[GradBuffer] = [
            GradBuffer(kind_params, grad_dtype, groups.expert_dp if expert else groups.dp_cp, scaling,
                       config.bucket_size, config.use_distributed_optimizer)
            for (_, grad_dtype, expert), kind_params in kinds.items()
        ]
        self._bucket_of = {id(p): (buffer, bucket) for buffer in self.grad_buffers
                           for bucket in buffer.buckets for p in bucket.params}
        self._sequence_parallel_params = [p for p in params if is_sequence_parallel(p)]
        if config.gradient_accumulation_fusion:
            for param in params:  # not a vocabulary weight: its lookup's gradient is an ordinary one
                param.fuse_grad_accumulation = param.dim() == 2 and not is_padded_vocab(param)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if getattr(param, "grad_added_to_main_grad", False):  # fused: param.grad is a placeholder
            param.grad_added_to_main_grad = False
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
        if not (self._sync_enabled and self.config.overlap_grad_reduce):
            return
        buffer, bucket = self._bucket_of[id(param)]
        if bucket.grad_launched:
            raise RuntimeError(
                "a gradient arrived for a bucket that is already being reduced: run every micro-batch "
                "but the last inside no_sync() and call finish_grad_sync() before the next step"
            )
        bucket.pending.discard(id(param))
        if not bucket.pending and not bucket.grad_launched:
            buffer.start_grad_sync(bucket, async_op=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; nothing is communicated."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Complete the gradient reduction of this step (call after the last micro-batch)."""
        if self.events is not None:
            self.events.hook.on_grad_sync_start()
        for buffer in self.grad_buffers:
            buffer.finish_grad_sync()
        self._reduce_sequence_parallel_grads()
        if self.events is not None:
            self.events.hook.on_grad_sync_end()

    def _reduce_sequence_parallel_grads(self) -> None:
        # Norms and row-parallel biases under sequence parallelism saw only their sequence shard.
        # With the distributed optimizer only the owned slice of main_grad is reduced over dp;
        # the tensor-parallel peers own the same slice (same layout), so summing the whole view
        # is right where it matters.
        grads = [p.main_grad for p in self._sequence_parallel_params]
        if not grads or self.groups.tp.size == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, self.groups.tp)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def zero_grad_buffer(self) -> None:
        """Zero every gradient, ready for the first micro-batch of a step."""
        for buffer in self.grad_buffers:
            buffer.zero()
        for param in self.module.parameters():
            param.grad = None

"""The optimizer of a model sharded by FSDP2: it steps the sharded fp32 parameters themselves.

FSDP keeps each rank's shard of every parameter in fp32 (:mod:`mega.core.parallel.fsdp`), and its
gradient arrives reduce-scattered into ``param.grad``, a DTensor of the same shard: the shards are
the main parameters, the inner optimizer's state is DTensors of the same placement (which is what
lets checkpoints reshard it), and nothing is copied back. The global gradient norm counts each
rank's local shard once; under HSDP only the first replica's shards (the others hold the same),
and a tensor-parallel replica only on tensor rank 0, as everywhere (:mod:`mega.core.optim.clip_grads`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from mega.core.optim.clip_grads import owns_gradient
from mega.core.optim.optimizer import MainParam, MixedPrecisionOptimizer
from mega.core.parallel.local_shard import local


def first_replica(tensor: torch.Tensor) -> bool:
    """Whether this rank is the first of the replicas of a DTensor (or it has none)."""
    if not isinstance(tensor, DTensor):
        return True
    coordinate = tensor.device_mesh.get_coordinate()
    return all(coordinate[dim] == 0 for dim, placement in enumerate(tensor.placements)
               if isinstance(placement, Replicate))


class FullyShardedOptimizer(MixedPrecisionOptimizer):
    """``mixed_precision``: the model computes in bf16/fp16 (FSDP's MixedPrecisionPolicy); its
    checkpoints then also store the shards as the fp32 main parameters, as a bf16 DDP run's do, so
    either resumes from the other without rounding the weights to bf16."""

    dp_sharded = True
    params_are_main_params = True  # a checkpoint's main parameters load into the parameters themselves

    def __init__(self, *args, mixed_precision: bool = False, **options):
        self.saves_main_params = mixed_precision
        super().__init__(*args, **options)

    def _main_params_of(self, param: nn.Parameter) -> list[MainParam]:
        if param.dtype != torch.float32:
            raise ValueError(f"FSDP keeps parameters in fp32 (got {param.dtype}): build the stage in fp32 and "
                             "give the compute dtype to shard_stage")
        return [MainParam(param, param, lambda: param.grad, None)]

    def _owned_grads(self, with_grads: list[MainParam]) -> list[torch.Tensor]:
        return [local(e.main.grad) for e in with_grads
                if owns_gradient(e.model, self.groups, dp_sharded=True) and first_replica(e.main.grad)]

    def state_bytes(self) -> int:
        """This rank's bytes of optimizer state (the local shards of the inner state)."""
        return sum(local(t).numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if torch.is_tensor(t) and t.dim() > 0)

"""Fully sharded data parallelism on torch's FSDP2 (``fully_shard``, DTensor): a pass over a
built stage, and the data-parallel wrapper the schedules drive.

    stage (tensor/sequence/expert parallel, recompute applied) -> shard_stage -> FullyShardedDataParallel

:func:`shard_stage` makes every transformer layer of the stage (``family.compile_units``) its own
FSDP unit and the stage itself the root unit (embedding, final norm, output layer and anything
else left), over the data-parallel ranks (``groups.dp_cp``: context-parallel ranks share the
weights and average the gradients as data-parallel ones do), or over a (replicate, shard) mesh for
HSDP. Modules whose parameters are all experts are units of their own over ``groups.expert_dp``,
their gradients divided by ``dp_cp`` as the dense ones (every expert already sees the tokens of
its expert-parallel peers; DDP scales them the same way). Each layer's forward prefetches the next
layer's all-gather; backward prefetches the previous one (FSDP2's default).

mega's tensor parallelism holds plain local tensors, so FSDP2 shards a tensor-parallel shard
again along dimension 0 and the 1-D data-parallel mesh composes with any tp/sp/cp/ep layout. The
marks the parallel passes set on parameters (:mod:`mega.core.parallel.param_attrs`) are copied onto
FSDP's sharded parameters, so clipping, tied weights and checkpoints still read them.

Mixed precision is FSDP's ``MixedPrecisionPolicy``: the sharded parameters stay fp32 (they are the
optimizer's main parameters), are all-gathered in bf16/fp16 for compute, and gradients are
reduce-scattered in fp32. Build the stage in fp32 and pass the compute dtype here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mega.core.parallel.collectives import all_reduce
from mega.core.parallel.groups import ParallelGroups
from mega.core.parallel.layout import rank_groups
from mega.core.parallel.local_shard import local
from mega.core.parallel.param_attrs import is_expert_parallel, is_sequence_parallel
from mega.core.parallel.pieces import Piece, TensorParallelSplit
from mega.core.process_group import collective_timeout


def shard_pieces(tensor: DTensor, split: TensorParallelSplit) -> list[Piece]:
    """The global pieces of this rank's FSDP shard of ``tensor`` (a DTensor over the data-parallel
    mesh whose global shape is a tensor-parallel shard that ``split`` places): the rows FSDP gave
    this rank, placed in the tensor-parallel shard, placed in the global tensor. An empty shard
    (more ranks than rows) has none."""
    shard = tensor.detach().to_local()
    if shard.numel() == 0:
        return []
    shape = tuple(tensor.shape)
    _, offsets = compute_local_shape_and_global_offset(shape, tensor.device_mesh, tensor.placements)
    return split.pieces(shard, tuple(offsets), shape)


def data_parallel_mesh(groups: ParallelGroups, replicas: int = 1) -> DeviceMesh:
    """The mesh FSDP shards dense parameters over: ``dp_cp`` (1-D), or ``(replicas, dp_cp /
    replicas)`` for HSDP, shard groups of neighbouring ranks. Collective: every rank calls it."""
    device_type = groups.device.type
    dp = groups.dp_cp
    if replicas == 1:
        return _mesh_of(dp.group, device_type)
    shard = dp.size // replicas
    all_dp = rank_groups({"tp": groups.tp.size, "cp": groups.cp.size, "dp": groups.dp.size, "pp": groups.pp.size},
                         "dp-cp")
    handles = {}
    for ranks in all_dp:  # every rank creates every group, in the same order
        for r in range(replicas):
            sub = tuple(ranks[r * shard:(r + 1) * shard])
            handles[sub] = dist.new_group(list(sub), timeout=collective_timeout())
        for s in range(shard):
            sub = tuple(ranks[s::shard])
            handles[sub] = dist.new_group(list(sub), timeout=collective_timeout())
    mine = torch.tensor(dp.ranks).view(replicas, shard)
    row, column = divmod(dp.rank, shard)
    return DeviceMesh.from_group([handles[tuple(mine[:, column].tolist())], handles[tuple(mine[row].tolist())]],
                                 device_type, mesh=mine, mesh_dim_names=("dp_replicate", "dp_shard"))


def _mesh_of(group, device_type: str) -> DeviceMesh:
    # A world of one process builds no groups (ParallelGroups): its one group is the world.
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)


def expert_units(module: nn.Module) -> list[nn.Module]:
    """The outermost submodules whose parameters are all experts' (each becomes its own unit)."""
    units: list[nn.Module] = []

    def visit(owner: nn.Module) -> None:
        params = list(owner.parameters())
        if params and all(is_expert_parallel(p) for p in params) and owner is not module:
            units.append(owner)
            return
        for child in owner.children():
            visit(child)

    visit(module)
    return units


def shard_stage(module: nn.Module, layers: Iterable[nn.Module], groups: ParallelGroups, *, mesh: DeviceMesh,
                compute_dtype: torch.dtype = torch.float32, reshard_after_forward: str = "default",
                shard_params: bool = True, cpu_offload: bool = False, reduce_in_fp32: bool = True) -> nn.Module:
    """Shard ``module`` (a built stage, fp32) with FSDP2: each of ``layers`` a unit, experts units
    over ``groups.expert_dp``, the stage the root unit. ``shard_params=False`` (ZeRO-2) keeps
    gathered weights from forward to backward; ``reshard_after_forward``: ``default``,
    ``always`` or ``never`` (see :class:`~mega.core.parallel.fsdp_config.DataParallelConfig`);
    ``reduce_in_fp32``: reduce-scatter gradients in fp32 under a low-precision ``compute_dtype``."""
    layers = list(layers)
    marks = {name: dict(param.__dict__) for name, param in module.named_parameters()}
    mixed = MixedPrecisionPolicy() if compute_dtype == torch.float32 else MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=torch.float32 if reduce_in_fp32 else None)
    # Pinned host memory needs an accelerator; on a CPU run the policy only keeps the step on the CPU.
    offload = CPUOffloadPolicy(pin_memory=groups.device.type != "cpu") if cpu_offload else OffloadPolicy()

    def reshard(index: int) -> bool:
        if not shard_params or reshard_after_forward == "never":
            return False
        if reshard_after_forward == "always":
            return True
        # torchtitan's default: under pipeline parallelism a unit's forward and backward are
        # far apart but frequent (every micro-batch), so keep it; the last layer's backward
        # comes right after its forward, so gathering it again would be wasted.
        return groups.pp.size == 1 and index < len(layers) - 1

    options = {"mp_policy": mixed, "offload_policy": offload}
    if compute_dtype != torch.float32:
        # Start where a bf16/fp16 model starts: its fp32 main weights are copies of the
        # initialised weights cast to that dtype (mega's DDP, as Megatron), not the fp32 draw.
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(param.to(compute_dtype))
    for unit in expert_units(module):
        expert_mesh = _mesh_of(groups.expert_dp.group, groups.device.type)
        fully_shard(unit, mesh=expert_mesh, reshard_after_forward=shard_params, **options)
        if groups.expert_dp.size != groups.dp_cp.size:
            unit.set_gradient_divide_factor(float(groups.dp_cp.size))
            if groups.device.type == "cpu":  # gloo has no pre-multiplied sum: sum, then divide
                unit.set_force_sum_reduction_for_comms(True)
    for index, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard(index), **options)
    fully_shard(module, mesh=mesh, reshard_after_forward=shard_params, **options)
    for layer, following in zip(layers, layers[1:], strict=False):
        layer.set_modules_to_forward_prefetch([following])
    for name, param in module.named_parameters():
        param.__dict__.update(marks[name])
    if compute_dtype != torch.float32:  # buffers (rotary tables...) in the compute dtype, as module.to(dtype) does
        for owner in module.modules():
            for key, buffer in owner._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    owner._buffers[key] = buffer.to(compute_dtype)
    return module


class FullyShardedDataParallel(nn.Module):
    """Wraps a stage sharded by :func:`shard_stage`, with the contract of
    :class:`~mega.core.distributed.ddp.DistributedDataParallel` that the schedules use:
    ``no_sync()`` (gradients accumulate unsharded, nothing is reduced), ``finish_grad_sync()``
    (FSDP has reduce-scattered during backward; sequence-parallel gradients are summed over the
    tensor group here) and ``zero_grad_buffer()``."""

    fully_sharded = True  # what build_optimizer asks (without importing this module: start-up cost)

    def __init__(self, module: nn.Module, groups: ParallelGroups, compute_dtype: torch.dtype = torch.float32,
                 events=None):
        super().__init__()
        if not isinstance(module, FSDPModule):
            raise TypeError("FullyShardedDataParallel wraps a module sharded by shard_stage (fully_shard)")
        self.module, self.groups, self.events = module, groups, events
        self.compute_dtype = compute_dtype  # the parameters stay fp32
        self._sequence_parallel_params = [p for p in module.parameters() if is_sequence_parallel(p)]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish_grad_sync(self) -> None:
        if self.events is not None:
            self.events.hook.on_grad_sync_start()
        grads = [local(p.grad) for p in self._sequence_parallel_params if p.grad is not None]
        if grads and self.groups.tp.size > 1:
            # Tensor-parallel peers hold the same FSDP shard of a replicated norm: sum the shards.
            flat = torch.cat([g.reshape(-1) for g in grads]).to(self.groups.device)  # (from host memory: --cpu-offload)
            all_reduce(flat, self.groups.tp)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        if self.events is not None:
            self.events.hook.on_grad_sync_end()

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    def reshard(self) -> None:
        """Free every unit's gathered weights and register its sharded parameters again.

        A forward without backward (an evaluation) leaves the units that do not reshard after
        forward gathered, with their plain unsharded tensors in place of the sharded parameters
        the optimizer steps; whatever reads the parameters by module (a checkpoint) must see the
        sharded ones. The next forward gathers again."""
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def fully_shard_chunks(chunks: list[nn.Module], layers_of, groups: ParallelGroups, *, strategy: str,
                       replicas: int = 1, compute_dtype: torch.dtype = torch.float32,
                       reshard_after_forward: str = "default", cpu_offload: bool = False,
                       reduce_in_fp32: bool = True) -> list[FullyShardedDataParallel]:
    """Every model chunk of this rank sharded over its data-parallel ranks (one mesh for all) and
    wrapped; ``layers_of(chunk)``: the chunk's transformer layers (its FSDP units)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"--data-parallel-sharding-strategy {strategy} (FSDP2) needs torch.distributed: "
                           "launch with torchrun (one process is fine)")
    mesh = data_parallel_mesh(groups, replicas)
    wrapped = []
    for chunk in chunks:
        shard_stage(chunk, layers_of(chunk), groups, mesh=mesh, compute_dtype=compute_dtype,
                    reshard_after_forward=reshard_after_forward, shard_params=strategy == "optim_grads_params",
                    cpu_offload=cpu_offload, reduce_in_fp32=reduce_in_fp32)
        wrapped.append(FullyShardedDataParallel(chunk, groups, compute_dtype))
    return wrapped

"""Which parameters Muon takes, and how a rank's piece of one becomes whole matrices and back.

Muon takes the hidden weight matrices: 2-D weights, and 3-D grouped expert weights (one matrix
per expert). Embeddings, the output layer, the MoE router, norms and biases go to AdamW.

Newton-Schulz needs each logical matrix whole. mega *gathers* (Megatron's ``duplicated`` mode)
rather than running a distributed Newton-Schulz: per Muon parameter and step,

1. ZeRO-1 (the distributed optimizer): this rank's flat slice of the update is placed in a zeroed
   tensor of the (tensor-parallel) parameter's size and all-reduced over the parameter's
   data-parallel group (``dp_cp``, or ``expert_dp`` for experts): one all-reduce of the whole
   parameter, 2x the bytes of an all-gather, on every rank (a rank owning none of it adds zeros).
   FSDP2: the DTensor update's ``full_tensor()`` (an all-gather over the shard mesh);
2. tensor parallelism: the shards are all-gathered over the tensor group (the experts' own group
   for experts; SwiGLU's gate and up blocks regrouped), the full matrix's bytes on every rank;
3. the whole matrix is split into its logical matrices (fused QKV per query group into Q, K, V
   as Megatron's ``--muon-split-qkv``; fused gate/up into gate and up; grouped experts per
   expert), each orthogonalised and scaled by its own shape;
4. this rank keeps its part (tensor shard, flat slice or FSDP shard): no communication.

Every rank of the tp x dp group computes the same Newton-Schulz (compute duplicated, tp x dp
times, ~``steps * 3 * 2 * m * n * min(m, n)`` flops per matrix); it is exact - the matrices are
those one process holds - and costs no extra memory beyond one full matrix at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mega.core.optim.config import OptimizerConfig
from mega.core.parallel.groups import Group, ParallelGroups
from mega.core.parallel.layers import gather_shards, shard_of
from mega.core.parallel.param_attrs import is_expert_parallel, is_tensor_parallel

# Name parts of parameters Muon never takes (Megatron: embedding and output parameters; the router).
ADAMW_ONLY = ("embedding", "output_layer", "lm_head", "router")


def takes_muon(name: str, param: torch.Tensor) -> bool:
    if any(part in name for part in ADAMW_ONLY) or name.endswith(".bias"):
        return False
    return param.dim() == 2 or (param.dim() == 3 and "experts" in name)


def muon_param_groups(models: list[nn.Module], config: OptimizerConfig) -> list[dict]:
    """Muon's matrices (``--muon-lr``/``--muon-weight-decay``, default ``--lr``/``--weight-decay``),
    then AdamW's weights (decayed: embeddings, output layer, router) and 1-D parameters and biases
    (not decayed). ``lr_ratio`` keeps Muon's learning rate a fixed multiple of the scheduled one."""
    matrices, decay, no_decay = [], [], []
    for model in models:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            if takes_muon(name, param):
                matrices.append(param)
            else:
                (no_decay if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    muon_lr = config.muon_lr if config.muon_lr is not None else config.lr
    muon_wd = config.muon_weight_decay if config.muon_weight_decay is not None else config.weight_decay
    return [
        {"params": matrices, "muon": True, "weight_decay": muon_wd, "lr_ratio": muon_lr / config.lr},
        {"params": decay, "muon": False, "weight_decay": config.weight_decay},
        {"params": no_decay, "muon": False, "weight_decay": 0.0},
    ]


@dataclass(frozen=True)
class RowBlocks:
    """A matrix whose rows repeat a unit of ``sizes`` rows, one block per logical matrix (fused
    QKV per query group: (queries * head_dim, head_dim, head_dim); [gate; up]: (ffn, ffn))."""

    sizes: tuple[int, ...]

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        unit = sum(self.sizes)
        if matrix.size(0) % unit:
            raise ValueError(f"{matrix.size(0)} rows do not split into blocks of {self.sizes}")
        rows = matrix.view(matrix.size(0) // unit, unit, matrix.size(1)).split(self.sizes, dim=1)
        return [block.reshape(-1, matrix.size(1)) for block in rows]

    def merge(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        repeats = blocks[0].size(0) // self.sizes[0]
        cols = blocks[0].size(1)
        return torch.cat([b.reshape(repeats, s, cols) for b, s in zip(blocks, self.sizes, strict=True)],
                         dim=1).reshape(-1, cols)


def _full_rows(param: torch.Tensor, tensor_group: Group) -> int:
    rows_dim = param.dim() - 2
    rows = param.shape[rows_dim]
    if is_tensor_parallel(param) and param.partition_dim == rows_dim:
        rows *= tensor_group.size
    return rows


def row_blocks(name: str, param: torch.Tensor, model: nn.Module, tensor_group: Group,
               config: OptimizerConfig) -> RowBlocks | None:
    """How ``param``'s (whole) matrix splits into logical matrices, read from its module."""
    owner_name, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return None
    parent_name, _, linear = owner_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if linear == "linear_qkv" and config.muon_split_qkv and hasattr(parent, "queries_per_group"):
        head = parent.head_dim
        return RowBlocks((parent.queries_per_group * head, head, head))
    if linear == "linear_fc1" and config.muon_split_gate_up and hasattr(parent, "linear_fc2"):
        fc2 = parent.linear_fc2.weight
        if param.shape[-2] == 2 * fc2.shape[-1]:  # SwiGLU: [gate; up] (both split alike over tp)
            half = _full_rows(param, tensor_group) // 2
            return RowBlocks((half, half))
    return None


@dataclass
class MuonSlot:
    """One Muon parameter of the model and this rank's main parameter for it (if any)."""

    model: nn.Parameter
    main: torch.Tensor | None  # None: under ZeRO-1 other data-parallel ranks own all of it
    flat_range: tuple[int, int] | None  # ZeRO-1's slice of the flattened parameter
    dp_group: Group | None  # ZeRO-1: the group whose ranks hold the other slices
    tensor_group: Group | None  # set when the parameter is a tensor-parallel shard
    blocks: RowBlocks | None


Orthogonalize = Callable[[torch.Tensor, RowBlocks | None], tuple[torch.Tensor, float]]


class MuonLayout:
    """This rank's Muon parameters in a fixed order (every rank walks the collectives alike)."""

    def __init__(self, slots: list[MuonSlot]):
        self.slots = slots

    @classmethod
    def of(cls, models: list[nn.Module], wrapper, groups: ParallelGroups, config: OptimizerConfig) -> MuonLayout:
        """``wrapper``: the MixedPrecisionOptimizer (or ZeRO-1 / FSDP one) holding the main parameters."""
        entries = {id(entry.model): entry for entry in wrapper.main_params}
        where = getattr(wrapper, "_where", None)  # ZeRO-1: parameter -> (buffer, bucket, offsets)
        slots = []
        for model in models:
            for name, param in model.named_parameters():
                if not param.requires_grad or not takes_muon(name, param):
                    continue
                tensor_group = groups.etp if is_expert_parallel(param) else groups.tp
                if not (is_tensor_parallel(param) and tensor_group.size > 1):
                    tensor_group = None
                entry = entries.get(id(param))
                dp_group = where[id(param)][0].group if where is not None else None
                blocks = row_blocks(name, param, model, tensor_group or groups.tp, config)
                slots.append(MuonSlot(param, entry.main if entry else None, entry.flat_range if entry else None,
                                      dp_group if dp_group is not None and dp_group.size > 1 else None,
                                      tensor_group, blocks))
        return cls(slots)

    def orthogonalize(self, updates: dict[torch.Tensor, torch.Tensor],
                      orthogonalize: Orthogonalize) -> dict[torch.Tensor, tuple[torch.Tensor, float]]:
        results = {}
        for slot in self.slots:
            update = updates.get(slot.main) if slot.main is not None else None
            whole = self._assemble(slot, update)
            ortho, scale = orthogonalize(whole, slot.blocks)
            if slot.main is not None and update is not None:
                results[slot.main] = (self._this_ranks_part(slot, ortho), scale)
        return results

    @staticmethod
    def _assemble(slot: MuonSlot, update: torch.Tensor | None) -> torch.Tensor:
        model = slot.model
        if slot.dp_group is not None:  # ZeRO-1 slices: sum zero-padded slices over the group
            flat = torch.zeros(model.numel(), dtype=torch.float32, device=model.device)
            if update is not None:
                lo, hi = slot.flat_range
                flat[lo:hi] = update.reshape(-1)
            dist.all_reduce(flat, group=slot.dp_group.group)
            whole = flat.view(model.shape)
        elif update is None:
            whole = torch.zeros(model.shape, dtype=torch.float32, device=model.device)
        elif hasattr(update, "full_tensor"):  # FSDP2's DTensor shard
            whole = update.full_tensor()
        else:
            whole = update.reshape(model.shape)  # ZeRO-1 on one rank: a flat slice of all of it
        if slot.tensor_group is not None:
            whole = gather_shards(whole, slot.tensor_group, model.partition_dim, model.partition_chunks)
        return whole

    @staticmethod
    def _this_ranks_part(slot: MuonSlot, ortho: torch.Tensor) -> torch.Tensor:
        model = slot.model
        if slot.tensor_group is not None:
            ortho = shard_of(ortho, slot.tensor_group, model.partition_dim, model.partition_chunks)
        if hasattr(slot.main, "device_mesh"):  # FSDP2: this rank's rows, as a DTensor like the parameter
            # Start-up cost: DTensor's import takes a second; only FSDP runs, which have it, get here.
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(ortho, slot.main.device_mesh, slot.main.placements, src_data_rank=None)
        if slot.flat_range is not None:
            lo, hi = slot.flat_range
            return ortho.reshape(-1)[lo:hi].view_as(slot.main)
        return ortho

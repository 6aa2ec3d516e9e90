"""The global gradient norm of a model split over tp/pp/dp/ep ranks, and clipping by it.

Every rank sums the squares of the gradient elements it *owns* and one all-reduce over all ranks
adds them up, so each element of the whole model counts exactly once:

* a parameter replicated over the tensor group (norms, row-parallel biases) is owned by tensor
  rank 0; a tensor-parallel shard by its holder (for expert parameters the tensor group is the
  experts' own, ``etp``);
* a ``shared`` copy (tied embeddings on the last pipeline stage) is owned by the other stage;
* data-parallel replicas are owned by replica 0 (rank 0 of ``dp_cp``, or of ``expert_dp`` for
  expert parameters), unless the gradients are sharded over data parallelism (distributed
  optimizer), where each rank owns its shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mega.core.parallel.collectives import all_reduce
from mega.core.parallel.groups import Group, ParallelGroups
from mega.core.parallel.param_attrs import is_expert_parallel, is_shared_copy, is_tensor_parallel


def owns_gradient(param: torch.Tensor, groups: ParallelGroups, dp_sharded: bool = False) -> bool:
    """Whether this rank counts ``param``'s gradient in the global norm."""
    if is_shared_copy(param):
        return False
    tensor_group = groups.etp if is_expert_parallel(param) else groups.tp
    if not is_tensor_parallel(param) and tensor_group.rank != 0:
        return False
    if dp_sharded:
        return True
    replicas = groups.expert_dp if is_expert_parallel(param) else groups.dp_cp
    return replicas.rank == 0


def world_group(groups: ParallelGroups) -> Group:
    handle = dist.group.WORLD if groups.world_size > 1 else None
    return Group("world", tuple(range(groups.world_size)), groups.global_rank, handle)


def global_norm(owned: Iterable[torch.Tensor], groups: ParallelGroups) -> float:
    """L2 norm over every rank's ``owned`` tensors (a collective: all ranks must call it)."""
    owned = [t.float() for t in owned]  # no copy for fp32 (the usual main gradients)
    if owned:
        # One fused kernel over all tensors (as torch's own clip_grad_norm_ does).
        # (on the groups' device: FSDP's --cpu-offload keeps gradients in host memory)
        total = (torch.nn.utils.get_total_norm(owned, norm_type=2.0, foreach=True) ** 2).to(groups.device)
    else:
        total = torch.zeros((), device=groups.device)
    all_reduce(total, world_group(groups))
    value = total.item()
    return math.sqrt(value) if math.isfinite(value) else value  # inf and nan stay what they are


def clip_by_norm_(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place so that a global norm of ``total_norm`` becomes ``max_norm``."""
    coefficient = max_norm / (total_norm + 1e-6)
    if coefficient < 1.0:
        torch._foreach_mul_(list(grads), coefficient)


def _grad(param: nn.Parameter) -> torch.Tensor | None:
    return getattr(param, "main_grad", None) if getattr(param, "main_grad", None) is not None else param.grad


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, groups: ParallelGroups) -> float:
    """Clip the (``main_grad`` or ``grad``) gradients of a split model; returns the norm before.

    For code that steps its own optimizer; mega's optimizers clip their main gradients themselves.
    """
    params = [p for p in params if _grad(p) is not None]
    total = global_norm([_grad(p) for p in params if owns_gradient(p, groups)], groups)
    if max_norm > 0 and math.isfinite(total):
        clip_by_norm_([_grad(p) for p in params], max_norm, total)
    return total

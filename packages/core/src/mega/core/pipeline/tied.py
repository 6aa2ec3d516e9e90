"""Weights tied across pipeline stages: the input embedding and the output layer of an LM.

On one process they are one parameter. Split over a pipeline, the first stage holds it for the
embedding and the last for the output layer; each copy gets the gradient of its own use, and the
true gradient is their sum over the embedding group (first and last stage of one pipeline).

A tied parameter is marked with Megatron's attribute ``shared_embedding = True``
(:mod:`mega.core.parallel.param_attrs`); the data-parallel wrapper gives it a bucket of its own
under the distributed optimizer, so both stages own the same slices of it and the sum after the
reduce-scatter is right.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mega.core.parallel import ParallelGroups
from mega.core.parallel.local_shard import local
from mega.core.parallel.param_attrs import is_shared_embedding


def tie_across_stages(parameter: nn.Parameter) -> nn.Parameter:
    """Mark ``parameter`` as one weight used by the first and by the last pipeline stage."""
    parameter.shared_embedding = True
    return parameter


def tied_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The marked parameters of ``modules`` (each once), in module order."""
    found: dict[int, nn.Parameter] = {}
    for module in modules:
        for parameter in module.parameters():
            if is_shared_embedding(parameter):
                found.setdefault(id(parameter), parameter)
    return list(found.values())


def _in_embedding_group(groups: ParallelGroups) -> bool:
    # Middle stages are in no embedding group; with pp = 1 the group is this rank alone.
    return groups.embedding.size > 1


def sum_tied_grads(modules: Iterable[nn.Module], groups: ParallelGroups) -> None:
    """Add up the gradients of the tied copies on the first and the last stage.

    Both stages must mark the same tied parameters, in the same order. A data-parallel
    wrapper's ``main_grad`` buffer is used where it exists, else ``.grad`` (FSDP's local shard).
    """
    if not _in_embedding_group(groups):
        return
    for parameter in tied_parameters(modules):
        grad = getattr(parameter, "main_grad", None)
        if grad is None:
            if parameter.grad is None:  # this stage did not use it: contribute zeros
                parameter.grad = torch.zeros_like(parameter)
            grad = parameter.grad
        # Under FSDP the gradient is this rank's shard, sharded alike on both stages.
        dist.all_reduce(local(grad), group=groups.embedding.group)


def setup_tied_weights(modules: Iterable[nn.Module], groups: ParallelGroups) -> None:
    """At initialisation: copy the first stage's tied weights to the last stage, and mark the
    last stage's copies ``shared`` (gradient norms and parameter counts then count them once)."""
    if not _in_embedding_group(groups):
        return
    with torch.no_grad():
        for parameter in tied_parameters(modules):
            dist.broadcast(parameter.data, src=groups.embedding.ranks[0], group=groups.embedding.group)
            if not groups.embedding.is_first:
                parameter.shared = True

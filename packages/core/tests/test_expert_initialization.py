"""The sharded initialisation places expert shards however a family holds its experts: a rank's
shard starts as its part of the one-process parameter, for the same seed.

Two ways a family may hold experts (mega.core.build's docstring): stacked in one tensor whose
dimension 0 is the experts (marked ``expert_shard``, Mixtral's), or one module per expert whose
global names the sharding pass keeps through ``parameter_aliases``. Each rank's shard is built
here in one process (the marks are what a rank of ep2 would carry), and compared with the
one-process model's, bit for bit, also where an initialisation block straddles the shards.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mega.core.build as build
from mega.core.build import initialize_parameters
from mega.core.parallel.param_attrs import mark_expert_shard, mark_tensor_parallel

EXPERTS, OUT, IN, SEED = 4, 6, 5, 11
FAMILY = SimpleNamespace(init_parameter=lambda config, name: lambda tensor, generator: tensor.normal_(
    0.0, 0.02, generator=generator))


class StackedExperts(nn.Module):
    def __init__(self, experts: int, out_features: int = OUT):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, IN))


class ExpertModules(nn.Module):
    def __init__(self, experts: int, first: int = 0):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(IN, OUT, bias=False) for _ in range(experts))
        if first:  # a rank's local expert i is global expert first + i
            self.parameter_aliases = {f"experts.{i}.weight": f"experts.{first + i}.weight" for i in range(experts)}


@pytest.fixture(params=[None, 3], ids=["one block", "blocks of 3 experts"])
def row_block(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(build, "ROW_BLOCK_ELEMENTS", request.param * OUT * IN)


def initialized(module: nn.Module) -> nn.Module:
    initialize_parameters(module, FAMILY, None, SEED)
    return module


@pytest.mark.usefixtures("row_block")
def test_stacked_expert_shards_start_as_their_rows_of_one_process():
    whole = initialized(StackedExperts(EXPERTS)).weight
    per_rank = EXPERTS // 2
    for rank in range(2):
        shard = StackedExperts(per_rank)
        mark_expert_shard(shard.weight, rank, 2)
        assert torch.equal(initialized(shard).weight, whole[rank * per_rank:(rank + 1) * per_rank])


@pytest.mark.usefixtures("row_block")
def test_expert_and_tensor_parallel_shards_start_as_their_block_of_one_process():
    whole = initialized(StackedExperts(EXPERTS)).weight
    for ep_rank in range(2):
        for tp_rank in range(2):  # each expert's output rows split over a tensor group of 2
            shard = StackedExperts(EXPERTS // 2, OUT // 2)
            mark_expert_shard(shard.weight, ep_rank, 2)
            mark_tensor_parallel(shard.weight, dim=1)
            initialize_parameters(shard, FAMILY, None, SEED, SimpleNamespace(rank=tp_rank, size=2))
            expected = whole[2 * ep_rank:2 * ep_rank + 2, 3 * tp_rank:3 * tp_rank + 3]
            assert torch.equal(shard.weight, expected), (ep_rank, tp_rank)


def test_expert_modules_keep_their_global_names_through_aliases():
    whole = initialized(ExpertModules(EXPERTS))
    for rank in range(2):
        shard = initialized(ExpertModules(EXPERTS // 2, first=rank * EXPERTS // 2))
        for local, expert in enumerate(shard.experts):
            assert torch.equal(expert.weight, whole.experts[rank * EXPERTS // 2 + local].weight), (rank, local)

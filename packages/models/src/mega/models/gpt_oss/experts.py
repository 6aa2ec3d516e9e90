"""gpt-oss's mixture of experts: a router with a bias, and experts with biases whose SwiGLU is
clamped and offset.

    linear_fc1.weight [experts, 2 * ffn, hidden]   linear_fc1.bias [experts, 2 * ffn]   ([gate; up])
    linear_fc2.weight [experts, hidden, ffn]       linear_fc2.bias [experts, hidden]

    gate <- min(gate, limit),  up <- clamp(up, -limit, limit)
    out  =  (up + 1) * gate * sigmoid(alpha * gate)

Routing is mega's default, a softmax over the top-k logits, which is gpt-oss's (its router takes
the top k of the biased logits, then their softmax). Expert parallelism keeps whole experts,
biases with them. The experts are not split over a tensor group (``--expert-tensor-parallel-size
1``): their output biases would otherwise be added once per rank of the partial sums.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ParallelContext
from mega.core.parallel import ParallelGroups
from mega.core.parallel.param_attrs import mark_expert_shard
from mega.models.moe.experts import GroupedLinear
from mega.models.moe.layer import MoELayer


def clamped_swiglu(projected: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of fc1's output ``[gate; up]`` (halves of the last dimension)."""
    gate, up = projected.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class BiasedGroupedLinear(GroupedLinear):
    """``experts`` linear maps with a bias each."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__(experts, in_features, out_features)
        self.bias = nn.Parameter(torch.empty(experts, out_features))


class GptOssExperts(nn.Module):
    """``forward(tokens, counts)`` runs expert ``e`` on the ``counts[e]`` rows that follow those
    of expert ``e - 1`` (the dispatcher's contract, :mod:`mega.models.moe.dispatch`)."""

    def __init__(self, config):
        super().__init__()
        experts, hidden, ffn = config.num_experts, config.hidden_size, config.moe_ffn_hidden_size
        self.linear_fc1 = BiasedGroupedLinear(experts, hidden, 2 * ffn)
        self.linear_fc2 = BiasedGroupedLinear(experts, ffn, hidden)
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    @property
    def num_local_experts(self) -> int:
        return self.linear_fc1.weight.shape[0]

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        outputs = []
        for e, rows in enumerate(tokens.split(counts)):
            projected = torch.addmm(fc1.bias[e], rows, fc1.weight[e].t())
            outputs.append(torch.addmm(fc2.bias[e], clamped_swiglu(projected, self.limit, self.alpha), fc2.weight[e].t()))
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, fc2.weight.shape[1])


class GptOssMoE(MoELayer):
    """:class:`~mega.models.moe.layer.MoELayer` (routing, dispatch, tensor and sequence
    parallelism, statistics) with gpt-oss's biased router and experts."""

    def __init__(self, config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__(config, kernels, context)
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = GptOssExperts(config)


def shard_gpt_oss_experts(experts: GptOssExperts, groups: ParallelGroups) -> None:
    """Keep this rank's block of whole experts (weights and biases) over the expert group."""
    ep = groups.ep
    ep_rank, ep_size = max(ep.rank, 0), max(ep.size, 1)
    for linear in (experts.linear_fc1, experts.linear_fc2):
        for kind in ("weight", "bias"):
            tensor = getattr(linear, kind).data
            per_rank = tensor.shape[0] // ep_size
            shard = nn.Parameter(tensor[ep_rank * per_rank:(ep_rank + 1) * per_rank].clone())
            mark_expert_shard(shard, ep_rank, ep_size)
            setattr(linear, kind, shard)

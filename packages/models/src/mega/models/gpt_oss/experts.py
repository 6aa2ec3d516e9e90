"""gpt-oss's mixture of experts: a router with a bias, and experts with biases whose SwiGLU is
clamped and offset.

    linear_fc1.weight [experts, 2 * ffn, hidden]   linear_fc1.bias [experts, 2 * ffn]   ([gate; up])
    linear_fc2.weight [experts, hidden, ffn]       linear_fc2.bias [experts, hidden]

    gate <- min(gate, limit),  up <- clamp(up, -limit, limit)
    out  =  (up + 1) * gate * sigmoid(alpha * gate)

Routing is mega's default, a softmax over the top-k logits, which is gpt-oss's (its router takes
the top k of the biased logits, then their softmax). Expert parallelism keeps whole experts,
biases with them. Split over the experts' tensor group (``--expert-tensor-parallel-size``, 1 or
the tensor-parallel size), fc1's bias splits with its rows; fc2's bias stays whole on every rank,
which adds ``bias / etp`` to its partial sum (the sum over the group then holds it once), so each
rank's gradient of it is ``1 / etp`` of the whole and the ranks' gradients are summed over the
tensor group (marked as the sequence-parallel norms are).
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ParallelContext
from mega.core.parallel import ParallelGroups
from mega.core.parallel.param_attrs import (
    mark_expert_shard,
    mark_expert_tensor_shard,
    mark_sequence_parallel,
    mark_tensor_parallel,
)
from mega.models.mixtral.model import shard_experts
from mega.models.moe.experts import GroupedLinear
from mega.models.moe.layer import MoELayer


def clamped_swiglu_ops(projected: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of fc1's output ``[gate; up]`` (halves of the last dimension)."""
    gate, up = projected.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu(projected: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """:func:`clamped_swiglu_ops` keeping only ``projected`` for the backward, which runs the same
    ops again (so its gradients are autograd's): the clamps, sigmoid and products would keep four
    more ``ffn``-wide rows a routed slot."""
    if not (torch.is_grad_enabled() and projected.requires_grad):
        return clamped_swiglu_ops(projected, limit, alpha)
    return _RecomputedClampedSwiGLU.apply(projected, limit, alpha)


class _RecomputedClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, projected, limit, alpha):
        ctx.save_for_backward(projected)
        ctx.limit, ctx.alpha = limit, alpha
        return clamped_swiglu_ops(projected, limit, alpha)

    @staticmethod
    def backward(ctx, grad):
        (projected,) = ctx.saved_tensors
        with torch.enable_grad():
            again = projected.detach().requires_grad_()
            (grad_projected,) = torch.autograd.grad(clamped_swiglu_ops(again, ctx.limit, ctx.alpha), again, grad)
        return grad_projected, None, None


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
        self.output_bias_share = 1.0  # 1 / the experts' tensor-parallel size (set where they are split)

    @property
    def num_local_experts(self) -> int:
        return self.linear_fc1.weight.shape[0]

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        outputs = []
        for e, rows in enumerate(tokens.split(counts)):
            projected = torch.addmm(fc1.bias[e], rows, fc1.weight[e].t())
            activation = clamped_swiglu(projected, self.limit, self.alpha)
            outputs.append(torch.addmm(fc2.bias[e] * self.output_bias_share if self.output_bias_share != 1.0
                                       else fc2.bias[e], activation, fc2.weight[e].t()))
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, fc2.weight.shape[1])


class GptOssMoE(MoELayer):
    """:class:`~mega.models.moe.layer.MoELayer` (routing, dispatch, tensor and sequence
    parallelism, statistics) with gpt-oss's biased router and experts."""

    def __init__(self, config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__(config, kernels, context)
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = GptOssExperts(config)


def shard_gpt_oss_experts(experts: GptOssExperts, groups: ParallelGroups) -> None:
    """Keep this rank's block of experts over the expert group, the weights (and fc1's bias) split
    over the experts' tensor group as :func:`~mega.models.mixtral.model.shard_experts` splits them,
    fc2's bias whole (see the module)."""
    shard_experts(experts, groups)
    ep, tp = groups.ep, groups.etp
    ep_rank, ep_size = max(ep.rank, 0), max(ep.size, 1)
    for linear, split in ((experts.linear_fc1, True), (experts.linear_fc2, False)):
        bias = linear.bias.data
        per_rank = bias.shape[0] // ep_size
        bias = bias[ep_rank * per_rank:(ep_rank + 1) * per_rank]
        if split and tp.size > 1:
            bias = torch.cat([block.chunk(tp.size, 1)[tp.rank] for block in bias.chunk(2, 1)], 1)
        shard = nn.Parameter(bias.clone())
        mark_expert_shard(shard, ep_rank, ep_size)
        if tp.size > 1 and split:
            mark_tensor_parallel(shard, 1, 2)
            if tp is not groups.tp:
                mark_expert_tensor_shard(shard, tp.rank, tp.size)
        elif tp.size > 1:
            mark_sequence_parallel(shard)
        linear.bias = shard
    experts.output_bias_share = 1.0 / tp.size

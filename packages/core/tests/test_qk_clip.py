"""QK-clip (``--qk-clip``) on one process against the rule written out by hand (CPU, fp32)."""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import CAUSAL
from mega.core.optim import OptimizerConfig, build_optimizer
from mega.core.parallel import ParallelConfig, ParallelGroups

S, B, HIDDEN, GROUPS, PER_GROUP, D = 5, 2, 8, 2, 2, 4


class CoreAttention(nn.Module):
    softmax_scale = None

    def forward(self, query, key, value, mask):
        return (query.sum(-1, keepdim=True) * key.repeat_interleave(PER_GROUP, dim=2)).sum()


class Attention(nn.Module):
    """The fused per-group QKV layout of mega's (and Megatron's) self-attention."""

    def __init__(self):
        super().__init__()
        self.head_dim, self.queries_per_group = D, PER_GROUP
        self.linear_qkv = nn.Linear(HIDDEN, GROUPS * (PER_GROUP + 2) * D, bias=False)
        self.core_attention = CoreAttention()

    def forward(self, x):
        qkv = self.linear_qkv(x).view(S, B, GROUPS, (PER_GROUP + 2) * D)
        q, k, v = qkv.split([PER_GROUP * D, D, D], dim=-1)
        return self.core_attention(q.reshape(S, B, GROUPS * PER_GROUP, D), k, v, CAUSAL)


def expected_clip(weight: torch.Tensor, x: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """Megatron's rule, computed head by head with plain loops."""
    w = weight.view(GROUPS, (PER_GROUP + 2) * D, HIDDEN).clone()
    for g in range(GROUPS):
        key = x @ w[g, PER_GROUP * D:(PER_GROUP + 1) * D].T  # [s, b, d]
        largest = -float("inf")
        for p in range(PER_GROUP):
            query = x @ w[g, p * D:(p + 1) * D].T
            for i in range(S):
                for j in range(i + 1):  # causal
                    largest = max(largest, ((query[i] * key[j]).sum(-1) / D ** 0.5).max().item())
        eta = min(threshold / largest, 1.0)
        w[g, :PER_GROUP * D] *= eta ** alpha
        w[g, PER_GROUP * D:(PER_GROUP + 1) * D] *= eta ** (1 - alpha)
    return w.view_as(weight)


def test_qk_clip_scales_queries_and_keys_per_group():
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(S, B, HIDDEN)
    threshold, alpha = 0.2, 0.3
    before = model.linear_qkv.weight.detach().clone()
    # SGD with a learning rate far below fp32's resolution: the step leaves the weights, the clip acts.
    config = OptimizerConfig(optimizer="sgd", lr=1e-30, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0,
                             qk_clip=True, qk_clip_threshold=threshold, qk_clip_alpha=alpha)
    optimizer = build_optimizer([model], ParallelGroups(ParallelConfig()), config)
    model(x).backward()
    optimizer.step()
    expected = expected_clip(before, x, threshold, alpha)
    assert not torch.allclose(expected, before), "the threshold should clip"
    torch.testing.assert_close(model.linear_qkv.weight.detach(), expected, rtol=1e-6, atol=1e-7)
    # Nothing recorded in evaluation: the next step leaves the weights alone.
    model.eval()
    clipped = model.linear_qkv.weight.detach().clone()
    model(x).backward()
    optimizer.step()
    torch.testing.assert_close(model.linear_qkv.weight.detach(), clipped, rtol=0, atol=1e-25)

"""A norm kernel backend: the norms written out in plain torch (a stand-in for a fused kernel)."""

import torch
from torch import nn


class HandNorm(nn.Module):
    calls = 0  # forward calls over all instances: lets a test see the backend was used

    def __init__(self, kind: str, hidden_size: int, eps: float):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if kind == "LayerNorm" else None

    def forward(self, x):
        type(self).calls += 1
        if self.kind == "LayerNorm":
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + (self.bias if self.bias is not None else 0)


class HandNormBackend:
    name = "hand-norm"
    kinds = frozenset({"norm"})

    def is_available(self):
        return True, ""

    def component(self, kind):
        return HandNorm


BACKEND = HandNormBackend()

"""Qwen3-Next's two norms, computed in fp32 as transformers computes them.

* :class:`ZeroCenteredRMSNorm`: RMSNorm scaled by ``1 + weight`` (the weight starts at zero, so
  weight decay pulls the scale towards 1; Megatron's ``--apply-layernorm-1p``). Every layer norm,
  the final norm and the attention's QK-norms are these.
* :class:`GatedRMSNorm`: the linear attention's output norm, RMSNorm over each head's value
  channels, scaled by ``weight`` (not zero-centred), then multiplied by ``silu(gate)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalized(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * _rms_normalized(x, self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)

"""The feed-forward block: GELU (exact or tanh-approximated) or SwiGLU.

With SwiGLU ``linear_fc1`` holds the gate and up projections stacked ``[gate; up]`` (Megatron's
layout); tensor parallelism splits each half on its own, so ``chunk(2)`` separates them on a
sharded layer too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega.models.config import TransformerConfig


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.swiglu = config.swiglu
        self.gelu_approximation = "tanh" if config.openai_gelu else "none"
        fc1_size = config.ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_size, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.linear_fc1(hidden)
        if self.swiglu:
            hidden = _SwiGLU.apply(hidden)
        else:
            hidden = F.gelu(hidden, approximate=self.gelu_approximation)
        return self.linear_fc2(hidden)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of the stacked ``[gate; up]`` output.

    Autograd would keep ``gate``, ``silu(gate)`` and ``up`` and concatenate the two gradients
    in the backward; this keeps only the input and writes both gradients straight into one
    buffer (less memory, one copy fewer, the same numbers).
    """

    @staticmethod
    def forward(ctx, stacked: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(stacked)
        gate, up = stacked.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (stacked,) = ctx.saved_tensors
        gate, up = stacked.chunk(2, dim=-1)
        grad_stacked = torch.empty_like(stacked)
        grad_gate, grad_up = grad_stacked.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, F.silu(gate), out=grad_up)
        return grad_stacked

"""The shared experts of a mixture-of-experts layer (DeepSeek's): one SwiGLU MLP of
``--moe-shared-expert-intermediate-size`` that every token passes through beside its routed
experts, its output added to theirs. Names are megatron-core's ``SharedExpertMLP``'s:
``mlp.shared_experts.linear_fc1.weight`` ``[2F, hidden]`` (``[gate; up]``) and
``mlp.shared_experts.linear_fc2.weight`` ``[hidden, F]``; tensor parallelism splits them as a
dense MLP (the family's plan), sequence parallelism included.

With ``gate`` (``--moe-shared-expert-gate``, Qwen2-MoE's and Qwen3-Next's) the output is scaled per
token by ``sigmoid(gate_weight . x)``: ``mlp.shared_experts.gate_weight`` ``[1, hidden]``
(megatron-core's name), whole on every tensor rank.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels


class SharedExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels, gate: bool = False):
        super().__init__()
        self.gate_weight = nn.Parameter(torch.zeros(1, hidden_size)) if gate else None
        self.linear_fc1 = kernels.linear(hidden_size, 2 * intermediate_size, bias=False)
        self.activation = kernels.activation("swiglu")
        self.linear_fc2 = kernels.linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.linear_fc2(self.activation(self.linear_fc1(hidden)))
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(torch.nn.functional.linear(hidden, self.gate_weight))

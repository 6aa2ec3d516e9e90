"""The shared experts of a mixture-of-experts layer (DeepSeek's): one SwiGLU MLP of
``--moe-shared-expert-intermediate-size`` that every token passes through beside its routed
experts, its output added to theirs. Names are megatron-core's ``SharedExpertMLP``'s:
``mlp.shared_experts.linear_fc1.weight`` ``[2F, hidden]`` (``[gate; up]``) and
``mlp.shared_experts.linear_fc2.weight`` ``[hidden, F]``; tensor parallelism splits them as a
dense MLP (the family's plan), sequence parallelism included.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels


class SharedExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels):
        super().__init__()
        self.linear_fc1 = kernels.linear(hidden_size, 2 * intermediate_size, bias=False)
        self.activation = kernels.activation("swiglu")
        self.linear_fc2 = kernels.linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))

"""The experts of one MoE layer as grouped weights: one tensor per projection, experts first.

    linear_fc1.weight  [experts, 2 * moe_ffn_hidden, hidden]   each expert's [gate; up] (SwiGLU)
    linear_fc2.weight  [experts, hidden, moe_ffn_hidden]       each expert's down projection

Expert ``e``'s weights are row ``e``: the per-expert matrices of a dense SwiGLU MLP
(``mlp.linear_fc1.weight`` / ``mlp.linear_fc2.weight``) stacked. Expert parallelism gives each
rank whole experts (a block of rows); tensor parallelism splits each expert as a dense MLP is
split (fc1 column-parallel with gate and up split on their own, fc2 row-parallel), so the
partial outputs are summed over the tensor group by the layer.

``grouped_gemm``: on a device with torch's grouped matmul (``torch._grouped_mm``, CUDA bf16) the
experts run as two grouped GEMMs around the kernels' activation; elsewhere (and without the flag)
as :func:`~mega.models.moe.grouped_mlp.grouped_swiglu_mlp`, a fused loop over experts computing
the same products.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.models.moe.grouped_mlp import grouped_swiglu_mlp
from mega.models.moe.grouped_mm import grouped_mm


class GroupedLinear(nn.Module):
    """``experts`` linear maps ``in_features -> out_features`` (no bias), applied to
    consecutive groups of rows."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One grouped GEMM (a device where :func:`has_grouped_mm`)."""
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        return grouped_mm(tokens, self.weight, offsets)  # its weight gradient deferred under zero bubble


def has_grouped_mm(tokens: torch.Tensor) -> bool:
    return hasattr(torch, "_grouped_mm") and tokens.is_cuda and tokens.dtype == torch.bfloat16


class GroupedExperts(nn.Module):
    """SwiGLU experts; ``forward(tokens, counts)`` runs expert ``e`` on the ``counts[e]`` rows
    that follow those of expert ``e - 1``."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, kernels: Kernels,
                 grouped_gemm: bool = False):
        super().__init__()
        self.linear_fc1 = GroupedLinear(num_experts, hidden_size, 2 * ffn_hidden_size)
        self.linear_fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size)
        self.activation = kernels.activation("swiglu")
        self.grouped_gemm = grouped_gemm

    @property
    def num_local_experts(self) -> int:
        return self.linear_fc1.weight.shape[0]

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.grouped_gemm and has_grouped_mm(tokens):
            return self.linear_fc2(self.activation(self.linear_fc1(tokens, counts)), counts)
        return grouped_swiglu_mlp(tokens, self.linear_fc1.weight, self.linear_fc2.weight, counts)

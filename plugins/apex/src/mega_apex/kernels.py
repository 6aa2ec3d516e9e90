"""mega's component kinds on apex's fused kernels.

* ``norm`` (backend ``apex``): ``fused_layer_norm_affine`` / ``fused_rms_norm_affine`` in a
  module holding ``weight`` (and ``bias``) as torch's norms do, so checkpoints do not depend on
  the backend.
* ``attention`` (backend ``apex-softmax``): Megatron's unfused attention, ``softmax(q k^T *
  scale) v`` as two batched matmuls around apex's fused scale + causal mask + softmax kernel.
  It materialises the scores, so it applies only where Megatron's ``FusedScaleMaskSoftmax``
  would use the kernel (causal self-attention, fp16/bf16, 16 < keys <= 4096, sizes divisible
  by 4 and by the kernel's batch per block); everything else runs torch's sdpa.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.kernels import AttentionMask
from mega.models.torch_kernels import sdpa_attention

MAX_KEYS = 4096  # the longest rows apex's softmax kernels take (Megatron's bound)


def _module(name: str):
    """An apex module, looked up at call time (tests put stand-ins in ``sys.modules``)."""
    return importlib.import_module(name)


class ApexNorm(nn.Module):
    def __init__(self, kind: str, hidden_size: int, eps: float):
        super().__init__()
        if kind not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"no normalization {kind!r}; choose LayerNorm or RMSNorm")
        self.kind, self.eps, self.shape = kind, eps, (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if kind == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _module("apex.normalization.fused_layer_norm")
        if self.kind == "RMSNorm":
            return fused.fused_rms_norm_affine(x, self.weight, self.shape, eps=self.eps)
        return fused.fused_layer_norm_affine(x, self.weight, self.bias, self.shape, eps=self.eps)


class _ScaledCausalSoftmax(torch.autograd.Function):
    """apex's ``scaled_upper_triang_masked_softmax_cuda`` over ``[batches, s, s]`` scores."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, scale: float) -> torch.Tensor:
        scale_t = torch.tensor([scale])
        probs = _module("scaled_upper_triang_masked_softmax_cuda").forward(scores, scale_t[0])
        ctx.save_for_backward(probs, scale_t)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, scale_t = ctx.saved_tensors
        return _module("scaled_upper_triang_masked_softmax_cuda").backward(grad.contiguous(), probs, scale_t[0]), None


def _kernel_applies(query, key, mask: AttentionMask) -> bool:
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    plain_causal = mask.causal and mask.padding is None and mask.cu_seqlens is None and mask.bias is None
    if not (plain_causal and q_len == k_len and query.dtype in (torch.float16, torch.bfloat16)):
        return False
    if not (16 < k_len <= MAX_KEYS and k_len % 4 == 0 and (batch * heads) % 4 == 0):
        return False
    per_block = _module("scaled_masked_softmax_cuda").get_batch_per_block(q_len, k_len, batch, heads)
    return (batch * heads) % per_block == 0


def fused_softmax_attention(query, key, value, *, mask: AttentionMask, dropout_p: float = 0.0,
                            softmax_scale: float | None = None):
    """The ``attention`` kind: ``[batch, heads, seq, d]`` in and out (see the module docstring)."""
    if not _kernel_applies(query, key, mask):
        return sdpa_attention(query, key, value, mask=mask, dropout_p=dropout_p, softmax_scale=softmax_scale)
    batch, heads, seq, head_dim = query.shape
    repeats = heads // key.shape[1]
    if repeats > 1:  # the matmuls need a key per query head
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    scores = torch.matmul(query, key.transpose(-1, -2)).view(batch * heads, seq, seq)  # scaled by the kernel
    probs = _ScaledCausalSoftmax.apply(scores, scale).view(batch, heads, seq, seq)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, value)

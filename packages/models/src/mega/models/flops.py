"""Floating-point operations of one training iteration, by Megatron's formula (for MFU).

Per token, forward: 2 FLOPs per weight of every matmul, plus the attention scores and their
product with V (2*s*q each); backward costs twice the forward, hence the factor 3 * 2. Megatron
counts only the causal half of the attention matrix; ``causal=False`` counts all of it, which
gives the classic closed form 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) for a plain GPT.

V is the real vocabulary: unlike Megatron, the padded rows of the output layer (which no token
uses) count as no useful work, so MFU does not depend on the padding or the layout.
"""

from __future__ import annotations

from mega.models.config import TransformerConfig


def num_floating_point_operations(config: TransformerConfig, batch_size: int, *, causal: bool = True) -> float:
    """FLOPs of forward + backward over ``batch_size`` sequences of ``config.seq_length`` tokens."""
    tokens = batch_size * config.seq_length
    h, s = config.hidden_size, config.seq_length
    q, kv = config.query_projection_size, config.kv_projection_size
    mlp_matrices = 3 if config.swiglu else 2  # fc1 is two matrices (gate, up) with SwiGLU
    forward_backward = 3 * 2  # 2 FLOPs per multiply-add; backward is twice the forward

    projections = h * (q + 2 * kv) + q * h + mlp_matrices * h * config.ffn_hidden_size
    attention = 2 * s * q * (0.5 if causal else 1.0)  # scores and scores @ V, per token
    per_layer = forward_backward * tokens * (projections + attention)
    logits = forward_backward * tokens * h * config.vocab_size
    return float(config.num_layers * per_layer + logits)

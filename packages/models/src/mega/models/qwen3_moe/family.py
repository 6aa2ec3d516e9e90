"""The ``qwen3-moe`` family: Qwen3's attention (QK-norm, grouped-query, head size 128) with a
routed mixture of SwiGLU experts as every layer's MLP: softmax over the experts, top-k,
renormalised, no shared expert (the ``mixtral`` stage module, :mod:`mega.models.mixtral.model`).

Presets are the released models' Hugging Face configs: Qwen3-30B-A3B (48 layers, hidden 2048,
128 experts of 768, top-8, 32 heads over 4 key/value heads) and Qwen3-235B-A22B (94 layers,
hidden 4096, 128 experts of 1536, top-8, 64 heads over 4); untied, RoPE theta 10^6, aux-loss
coefficient 0.001. ``tiny`` is a 2-layer, 4-expert top-2 model for tests and demos.
"""

from __future__ import annotations

import dataclasses

from mega.models.mixtral.family import FAMILY as MIXTRAL
from mega.models.moe.config import MoETransformerConfig
from mega.models.qwen3_moe.config import Qwen3MoEConfig
from mega.models.qwen3_moe.hf_qwen3_moe import QWEN3_MOE


def qwen3_moe_config(num_layers: int, hidden_size: int, moe_ffn_hidden_size: int, num_attention_heads: int,
                     num_experts: int, **overrides) -> MoETransformerConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=3 * hidden_size,
        moe_ffn_hidden_size=moe_ffn_hidden_size, num_attention_heads=num_attention_heads, num_query_groups=4,
        kv_channels=128, num_experts=num_experts, moe_router_topk=8, seq_length=4096, max_position_embeddings=40960,
        vocab_size=151936, rotary_base=1e6, position_embedding_type="rope", normalization="RMSNorm",
        layernorm_epsilon=1e-6, swiglu=True, qk_layernorm=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        moe_aux_loss_coeff=0.001,
    )
    settings.update(overrides)
    return Qwen3MoEConfig(**settings)


PRESETS = {
    "tiny": qwen3_moe_config(2, 64, 64, 4, 4, num_query_groups=2, kv_channels=32, moe_router_topk=2,
                             seq_length=128, max_position_embeddings=128, vocab_size=32000),
    "30b-a3b": qwen3_moe_config(48, 2048, 768, 32, 128),
    "235b-a22b": qwen3_moe_config(94, 4096, 1536, 64, 128),
}

FAMILY = dataclasses.replace(
    MIXTRAL, name="qwen3-moe", presets=PRESETS, hf_mapping=QWEN3_MOE, config_class=Qwen3MoEConfig,
    description="Qwen3-MoE: Qwen3 attention (QK-norm) with a top-k mixture of SwiGLU experts in every layer",
)

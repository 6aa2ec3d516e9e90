"""The ``mixtral`` family: LLaMA's attention, norms and RoPE with a mixture of SwiGLU experts as
every layer's MLP (see :mod:`mega.models.moe`; parameter names in :mod:`mega.models.mixtral.model`).

Presets are the released models' Hugging Face configs: Mixtral-8x7B (v0.1: 32 layers, hidden
4096, 8 experts of 14336, top-2, 8 key/value heads, 32000-token vocabulary, RoPE theta 10^6) and
Mixtral-8x22B (v0.1: 56 layers, hidden 6144, 8 experts of 16384, 48 heads, 32768 tokens).
``tiny`` is a 2-layer, 4-expert model for tests and demos.
"""

from __future__ import annotations

from mega.core.model_family import ModelFamily
from mega.models.initialization import init_parameter
from mega.models.mixtral.config import MixtralConfig
from mega.models.mixtral.hf_mixtral import MIXTRAL
from mega.models.mixtral.memory import moe_stage_footprint
from mega.models.mixtral.model import (
    MOE_PASSES,
    build_moe_model,
    moe_boundary,
    moe_loss,
    moe_tensor_parallel_plan,
    num_moe_floating_point_operations,
    num_moe_parameters,
)
from mega.models.moe.config import MoETransformerConfig


def mixtral_config(num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                   num_query_groups: int, num_experts: int, **overrides) -> MoETransformerConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
        moe_ffn_hidden_size=ffn_hidden_size, num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups, num_experts=num_experts, moe_router_topk=2,
        seq_length=4096, max_position_embeddings=4096, vocab_size=32000, rotary_base=1e6,
        position_embedding_type="rope", normalization="RMSNorm", layernorm_epsilon=1e-5, swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, moe_aux_loss_coeff=0.01,  # Megatron's Mixtral recipe (Hugging Face: 0.001)
    )
    settings.update(overrides)
    return MixtralConfig(**settings)


PRESETS = {
    "tiny": mixtral_config(2, 64, 128, 4, 2, 4, seq_length=128, max_position_embeddings=128),
    "8x7b": mixtral_config(32, 4096, 14336, 32, 8, 8, max_position_embeddings=32768),
    "8x22b": mixtral_config(56, 6144, 16384, 48, 8, 8, max_position_embeddings=65536),
}

FAMILY = ModelFamily(
    name="mixtral",
    config_class=MixtralConfig,
    presets=PRESETS,
    build=build_moe_model,
    init_parameter=init_parameter,
    loss=moe_loss,
    num_parameters=num_moe_parameters,
    num_floating_point_operations=num_moe_floating_point_operations,
    tensor_parallel_plan=moe_tensor_parallel_plan,
    setup_passes=MOE_PASSES,
    boundary=moe_boundary,
    features=frozenset({"moe"}),
    memory_model=moe_stage_footprint,
    description="Mixtral: LLaMA attention with a top-k mixture of SwiGLU experts in every layer",
    hf_mapping=MIXTRAL,
)

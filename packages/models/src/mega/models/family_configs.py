"""Each decoder family's config class: the shared config with the family's architecture as its
defaults (see :mod:`mega.models.family_defaults`). Sizes keep the shared small defaults; presets
give the released models' sizes; flags override either.

Values are the released models' Hugging Face configs (and what transformers' config classes
default to where they differ by model): LLaMA-3's RoPE base; Qwen3's QK-norm, epsilon and base;
Mixtral's base; DeepSeek-V3's multi-latent attention and sigmoid routing with its correction
bias. Every decoder family trained with no architecture flag exports to its Hugging Face class.
"""

from __future__ import annotations

from mega.models.config import TransformerConfig
from mega.models.deepseek_config import MLATransformerConfig
from mega.models.family_defaults import with_defaults
from mega.models.moe.config import MoETransformerConfig

# LLaMA's layers, which Qwen3 and Mixtral share.
LLAMA = dict(
    position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm", layernorm_epsilon=1e-5,
    swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0, attention_dropout=0.0,
)
QWEN3 = dict(LLAMA, rotary_base=1e6, layernorm_epsilon=1e-6, qk_layernorm=True)

LlamaConfig = with_defaults(TransformerConfig, "LlamaConfig", module=__name__, doc="LLaMA-3: RoPE (base 500000), RMSNorm, SwiGLU, no "
                            "biases, untied embeddings, no dropout.", **LLAMA)
Qwen3Config = with_defaults(TransformerConfig, "Qwen3Config", module=__name__, doc="Qwen3: LLaMA's layers with QK-norm, RoPE base 10^6, "
                            "norm epsilon 1e-6.", **QWEN3)
MixtralConfig = with_defaults(MoETransformerConfig, "MixtralConfig", module=__name__, doc="Mixtral: LLaMA's layers (RoPE base 10^6) with "
                              "a top-2 mixture of SwiGLU experts.", **dict(LLAMA, rotary_base=1e6))
Qwen3MoEConfig = with_defaults(MoETransformerConfig, "Qwen3MoEConfig", module=__name__, doc="Qwen3-MoE: Qwen3's attention with a "
                               "mixture of SwiGLU experts.", **QWEN3)
DeepSeekV3Config = with_defaults(
    MLATransformerConfig, "DeepSeekV3Config", module=__name__, doc="DeepSeek-V3: multi-latent attention with YaRN RoPE, RMSNorm "
    "(epsilon 1e-6), SwiGLU experts routed by sigmoid with a correction bias, no biases, untied.",
    **dict(LLAMA, rotary_base=10000.0, layernorm_epsilon=1e-6), moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True)

"""``LlamaConfig``: the shared config with LLaMA-3's architecture as its defaults (see
:mod:`mega.models.family_defaults`); ``LLAMA``, those defaults, which Qwen3, Mixtral and DeepSeek-V3
start from. Each decoder family's config class lives in its folder (``qwen3/config.py``,
``mixtral/config.py``, ``qwen3_moe/config.py``, ``deepseek_v3/config.py``). Sizes keep the shared
small defaults; presets give the released models' sizes; flags override either.

Values are the released models' Hugging Face configs (and what transformers' config classes
default to where they differ by model): LLaMA-3's RoPE base; Qwen3's QK-norm, epsilon and base;
Mixtral's base; DeepSeek-V3's multi-latent attention and sigmoid routing with its correction
bias. Every decoder family trained with no architecture flag exports to its Hugging Face class.
"""

from __future__ import annotations

from mega.models.config import TransformerConfig
from mega.models.family_defaults import with_defaults

# LLaMA's layers, which Qwen3 and Mixtral share.
LLAMA = dict(
    position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm", layernorm_epsilon=1e-5,
    swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0, attention_dropout=0.0,
)

LlamaConfig = with_defaults(TransformerConfig, "LlamaConfig", module=__name__, doc="LLaMA-3: RoPE (base 500000), RMSNorm, SwiGLU, no "
                            "biases, untied embeddings, no dropout.", **LLAMA)

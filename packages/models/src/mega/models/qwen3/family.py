"""The ``qwen3`` family: LLaMA's layers (RoPE, RMSNorm, SwiGLU, grouped-query attention, no
biases) with QK-norm (``--qk-layernorm``: an RMSNorm over each query and key head before RoPE).

Presets are the released dense Qwen3 models' Hugging Face configs: head size 128 throughout (so
``kv_channels`` is not hidden/heads), 8 key/value heads, RoPE theta 10^6, the 151936-token
vocabulary, embeddings tied up to 4B and untied from 8B. Sequence length 4096 (their pretraining
length before the long-context stage); ``max_position_embeddings`` is the released 40960.
"""

from __future__ import annotations

from mega.models.config import TransformerConfig
from mega.models.family import transformer_family
from mega.models.qwen3.config import Qwen3Config
from mega.models.qwen3.hf_qwen3 import QWEN3


def qwen3_config(num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 *, tied: bool, **overrides) -> TransformerConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads, num_query_groups=8, kv_channels=128,
        seq_length=4096, max_position_embeddings=40960, vocab_size=151936, rotary_base=1e6,
        position_embedding_type="rope", normalization="RMSNorm", layernorm_epsilon=1e-6, swiglu=True,
        qk_layernorm=True, add_bias_linear=False, untie_embeddings_and_output_weights=not tied,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
    )
    settings.update(overrides)
    return Qwen3Config(**settings)


PRESETS = {
    "tiny": qwen3_config(2, 64, 128, 4, tied=True, num_query_groups=2, kv_channels=32, seq_length=128,
                         max_position_embeddings=128, vocab_size=32000),
    "0.6b": qwen3_config(28, 1024, 3072, 16, tied=True),
    "1.7b": qwen3_config(28, 2048, 6144, 16, tied=True),
    "4b": qwen3_config(36, 2560, 9728, 32, tied=True),
    "8b": qwen3_config(36, 4096, 12288, 32, tied=False),
    "14b": qwen3_config(40, 5120, 17408, 40, tied=False),
    "32b": qwen3_config(64, 5120, 25600, 64, tied=False),
}

FAMILY = transformer_family("qwen3", PRESETS, "Qwen3: LLaMA's layers with QK-norm (per-head RMSNorm of queries "
                            "and keys)", hf_mapping=QWEN3,
                            config_class=Qwen3Config)

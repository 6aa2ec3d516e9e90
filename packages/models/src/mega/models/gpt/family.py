"""The ``gpt`` family: GPT-2/GPT-3 style (learned positions, LayerNorm, GELU, biases, tied).

Shapes are the GPT-3 paper's (Brown et al. 2020, table 2.1) with its two typos fixed as everyone
trains them: 1.3B has 16 heads of 128 (the table says 24 heads of 128 for a 2048 hidden size) and
13B a hidden size of 5120 (the table says 5140). Vocabulary: GPT-2's BPE, 50257 tokens, padded
to 50304; the training command replaces ``vocab_size`` with its tokenizer's.
"""

from __future__ import annotations

from mega.models.config import TransformerConfig
from mega.models.family import transformer_family
from mega.models.gpt.hf_gpt2 import GPT2


def gpt_config(num_layers: int, hidden_size: int, num_attention_heads: int, **overrides) -> TransformerConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        seq_length=2048, max_position_embeddings=2048, vocab_size=50257,
        position_embedding_type="learned_absolute", normalization="LayerNorm", layernorm_epsilon=1e-5,
        hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


PRESETS = {
    "tiny": gpt_config(2, 64, 4, seq_length=128, max_position_embeddings=128),
    "125m": gpt_config(12, 768, 12),
    "350m": gpt_config(24, 1024, 16),
    "760m": gpt_config(24, 1536, 16),
    "1.3b": gpt_config(24, 2048, 16),
    "2.7b": gpt_config(32, 2560, 32),
    "6.7b": gpt_config(32, 4096, 32),
    "13b": gpt_config(40, 5120, 40),
    "175b": gpt_config(96, 12288, 96, init_method_std=0.006),  # Megatron's GPT-3 175B recipe
}

FAMILY = transformer_family("gpt", PRESETS, "GPT-2/GPT-3: learned positions, LayerNorm, GELU, tied embeddings",
                            hf_mapping=GPT2)

"""The ``llama`` family: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied.

Shapes are those of the released checkpoints (their Hugging Face configs): LLaMA-2 with the
32000-token SentencePiece vocabulary and RoPE theta 10^4; LLaMA-3 with the 128256-token
tiktoken vocabulary and theta 5*10^5; the 405B model exists only as LLaMA-3.1, with its RoPE
frequency scaling.
"""

from __future__ import annotations

from mega.models.config import TransformerConfig
from mega.models.family import transformer_family
from mega.models.llama.config import LlamaConfig
from mega.models.llama.hf_llama import LLAMA


def llama_config(num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_query_groups: int, *, llama3: bool, **overrides) -> TransformerConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
        seq_length=8192 if llama3 else 4096, vocab_size=128256 if llama3 else 32000,
        rotary_base=500000.0 if llama3 else 10000.0,
        position_embedding_type="rope", normalization="RMSNorm", layernorm_epsilon=1e-5, swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


PRESETS = {
    "tiny": llama_config(2, 64, 128, 4, 2, llama3=True, seq_length=128, vocab_size=32000),
    "llama2-7b": llama_config(32, 4096, 11008, 32, 32, llama3=False),
    "llama2-13b": llama_config(40, 5120, 13824, 40, 40, llama3=False),
    "llama2-70b": llama_config(80, 8192, 28672, 64, 8, llama3=False),
    "llama3-8b": llama_config(32, 4096, 14336, 32, 8, llama3=True),
    "llama3-70b": llama_config(80, 8192, 28672, 64, 8, llama3=True),
    "llama3-405b": llama_config(126, 16384, 53248, 128, 8, llama3=True, use_rope_scaling=True,
                                rope_scaling_factor=8.0),
}

FAMILY = transformer_family("llama", PRESETS, "LLaMA-2/3: RoPE, RMSNorm, SwiGLU, grouped-query attention",
                            hf_mapping=LLAMA, config_class=LlamaConfig)

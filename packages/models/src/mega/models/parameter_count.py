"""The size of a model from its config alone, without allocating it."""

from __future__ import annotations

from mega.models.config import TransformerConfig


def num_parameters(config: TransformerConfig, tensor_parallel_size: int = 1) -> int:
    """Parameters of the whole model (each tied weight once), vocabulary padded for that tp."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    qkv = config.query_projection_size + 2 * config.kv_projection_size
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    fc1 = ffn * (2 if config.swiglu else 1)
    bias = config.add_bias_linear

    attention = h * qkv + config.query_projection_size * h
    attention += qkv if (bias or config.add_qkv_bias) else 0
    attention += h if bias else 0
    mlp = h * fc1 + ffn * h + ((fc1 + h) if bias else 0)
    layer = 2 * norm + attention + mlp
    if config.qk_layernorm:  # one norm over a head's channels (or the whole projection) for the queries, one for the keys
        widths = (qkv - config.kv_projection_size if config.qk_layernorm_scope == "projection"
                  else 2 * config.kv_channels)
        layer += widths * (2 if config.normalization == "LayerNorm" else 1)

    vocab = config.padded_vocab_size(tensor_parallel_size)
    embeddings = vocab * h
    if config.position_embedding_type == "learned_absolute":
        embeddings += config.max_position_embeddings * h
    output = vocab * h if config.untie_embeddings_and_output_weights else 0
    return embeddings + config.num_layers * layer + norm + output

"""The ``gpt`` family as Hugging Face's ``GPT2LMHeadModel``: config.json and weights, both ways.

GPT-2 differs from Megatron's layout in two ways besides the names: its linears are ``Conv1D``,
stored ``[in, out]`` (transposed), and its ``c_attn`` holds ``[q; k; v]`` concatenated, which
Megatron interleaves per head (GPT-2 has one query group per head).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from mega.core.model_family import HFMapping, TensorMap
from mega.models.config import TransformerConfig
from mega.models.hf_mapping import interleave_qkv, read_field, same, split_qkv, tied_lm_head

# GPT2Config's defaults for the keys read here (config.json may leave them out).
DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "resid_pdrop": 0.1, "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False, "tie_word_embeddings": True,
}
# Hugging Face activation -> mega's openai_gelu (tanh approximation); "gelu" is the exact erf form.
ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


def gpt2_config(hf_config: Mapping[str, Any], **overrides) -> TransformerConfig:
    """The mega config computing what ``GPT2LMHeadModel`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    if get("activation_function") not in ACTIVATIONS:
        raise ValueError(f"GPT-2 activation_function {get('activation_function')!r} has no mega equivalent "
                         f"(mega has {', '.join(ACTIVATIONS)})")
    if get("scale_attn_by_inverse_layer_idx") or not get("scale_attn_weights"):
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) (scale_attn_weights, "
                         "scale_attn_by_inverse_layer_idx) has no mega equivalent")
    if get("add_cross_attention"):
        raise ValueError("GPT-2 with add_cross_attention (an encoder-decoder) has no mega equivalent")
    settings = dict(
        num_layers=get("n_layer"), hidden_size=get("n_embd"), ffn_hidden_size=get("n_inner") or 4 * get("n_embd"),
        num_attention_heads=get("n_head"), seq_length=get("n_positions"), max_position_embeddings=get("n_positions"),
        vocab_size=get("vocab_size"), position_embedding_type="learned_absolute", normalization="LayerNorm",
        layernorm_epsilon=get("layer_norm_epsilon"), openai_gelu=ACTIVATIONS[get("activation_function")],
        add_bias_linear=True, untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        hidden_dropout=get("resid_pdrop"), attention_dropout=get("attn_pdrop"),
        init_method_std=get("initializer_range"),
    )
    return TransformerConfig(**{**settings, **overrides})


def gpt2_hf_config(config: TransformerConfig) -> dict:
    """config.json of the ``GPT2LMHeadModel`` computing what ``config`` computes."""
    differences = {
        "position_embedding_type (GPT-2 learns absolute positions)": config.position_embedding_type != "learned_absolute",
        "normalization (GPT-2 uses LayerNorm)": config.normalization != "LayerNorm",
        "swiglu (GPT-2 has a GELU MLP)": config.swiglu,
        f"--activation {config.mlp_activation} (GPT-2 has a GELU MLP)": config.mlp_activation in ("relu", "squared_relu"),
        "add_bias_linear (GPT-2 linears have biases)": not config.add_bias_linear,
        "num_query_groups (GPT-2 has one key/value head per query head)":
            config.num_query_groups != config.num_attention_heads,
        "kv_channels (GPT-2 heads split hidden_size)":
            config.kv_channels * config.num_attention_heads != config.hidden_size,
        "sliding_window (GPT-2 attends to every earlier position)": config.sliding_window is not None,
        "softmax_scale (GPT-2 scales by 1/sqrt(head size))":
            not math.isclose(config.attention_softmax_scale, 1 / math.sqrt(config.kv_channels)),
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"GPT2LMHeadModel cannot express this model: {'; '.join(unsupported)}")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size, "activation_function": "gelu_new" if config.openai_gelu else "gelu",
        "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout, "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std, "scale_attn_weights": True,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
    }


# --- Weights --------------------------------------------------------------------------------------

def _transpose_weight(kind: str, tensor: torch.Tensor) -> tuple[torch.Tensor]:
    """Conv1D weights are ``[in, out]``, nn.Linear's ``[out, in]`` (either way round); biases agree."""
    return (tensor.t() if kind == "weight" else tensor,)


def _c_attn_to_qkv(kind: str, heads: int, c_attn: torch.Tensor) -> tuple[torch.Tensor]:
    (qkv,) = _transpose_weight(kind, c_attn)
    return (interleave_qkv(*qkv.chunk(3, dim=0), heads),)


def _qkv_to_c_attn(kind: str, config: TransformerConfig, qkv: torch.Tensor) -> tuple[torch.Tensor]:
    return _transpose_weight(kind, torch.cat(split_qkv(qkv, config), dim=0))


def gpt2_tensor_maps(config: TransformerConfig) -> list[TensorMap]:
    maps = [same("embedding.word_embeddings.weight", "transformer.wte.weight", vocab=True),
            same("embedding.position_embeddings.weight", "transformer.wpe.weight")]
    for n in range(config.num_layers):
        mega, hf = f"decoder.layers.{n}.", f"transformer.h.{n}."
        for kind in ("weight", "bias"):
            maps += [
                same(mega + f"input_layernorm.{kind}", hf + f"ln_1.{kind}"),
                TensorMap((mega + f"self_attention.linear_qkv.{kind}",), (hf + f"attn.c_attn.{kind}",),
                          partial(_c_attn_to_qkv, kind, config.num_attention_heads),
                          partial(_qkv_to_c_attn, kind, config)),
                _conv1d(mega + f"self_attention.linear_proj.{kind}", hf + f"attn.c_proj.{kind}", kind),
                same(mega + f"pre_mlp_layernorm.{kind}", hf + f"ln_2.{kind}"),
                _conv1d(mega + f"mlp.linear_fc1.{kind}", hf + f"mlp.c_fc.{kind}", kind),
                _conv1d(mega + f"mlp.linear_fc2.{kind}", hf + f"mlp.c_proj.{kind}", kind),
            ]
    maps += [same(f"decoder.final_layernorm.{kind}", f"transformer.ln_f.{kind}") for kind in ("weight", "bias")]
    if config.untie_embeddings_and_output_weights:
        maps.append(same("output_layer.weight", "lm_head.weight", vocab=True))
    return maps


def _conv1d(mega: str, hf: str, kind: str) -> TensorMap:
    transpose = partial(_transpose_weight, kind)
    return TensorMap((mega,), (hf,), transpose, transpose)


def gpt2_buffers(config: TransformerConfig) -> dict[str, torch.Tensor]:
    """The causal-mask buffers transformers 4.x before 4.36 saved (one per layer)."""
    positions = config.max_position_embeddings
    mask = torch.tril(torch.ones((positions, positions), dtype=torch.bool)).view(1, 1, positions, positions)
    buffers = {}
    for n in range(config.num_layers):
        buffers[f"transformer.h.{n}.attn.bias"] = mask
        buffers[f"transformer.h.{n}.attn.masked_bias"] = torch.tensor(-1e4)
    return buffers


GPT2 = HFMapping(
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    base_model_prefix="transformer.",
    config_from_hf=gpt2_config,
    config_to_hf=gpt2_hf_config,
    tensor_maps=gpt2_tensor_maps,
    copies=tied_lm_head("transformer.wte.weight"),
    buffers=gpt2_buffers,
    # The causal-mask buffers older transformers saved, when not what transformers computes.
    ignored=(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",),
    also_reads=("GPT2Model",),
)

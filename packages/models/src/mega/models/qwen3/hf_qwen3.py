"""The ``qwen3`` family as Hugging Face's ``Qwen3ForCausalLM``: config.json and weights, both ways.

Qwen3 is LLaMA (:mod:`mega.models.llama.hf_llama`: separate q/k/v projections interleaved per query
group in mega, SwiGLU's ``[gate; up]``, rotate-half RoPE) with QK-norm: an RMSNorm over each
query and key head's channels before RoPE, one weight per side for all heads:

    model.layers.N.self_attn.q_norm.weight  <->  decoder.layers.N.self_attention.q_layernorm.weight
    model.layers.N.self_attn.k_norm.weight  <->  decoder.layers.N.self_attention.k_layernorm.weight

Sliding-window layers (``use_sliding_window``) and attention biases (Qwen3's ``attention_bias``
also biases ``o_proj``, not the MLP) have no mega equivalent and are refused; no released Qwen3
uses either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mega.core.model_family import TensorMap
from mega.models.config import TransformerConfig
from mega.models.hf_mapping import causal_lm_mapping, read_field, refuse_headless, same
from mega.models.llama.hf_llama import llama_config, llama_hf_config, llama_tensor_maps
from mega.models.qwen3.config import Qwen3Config

# Qwen3Config's defaults for the keys read here (config.json may leave them out).
DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False,
}


def refuse_qwen3_extras(hf_config: Mapping[str, Any], defaults: Mapping[str, Any], architecture: str) -> None:
    """What Qwen3 (dense and MoE) may ask for that mega does not compute."""
    if read_field(hf_config, defaults, "use_sliding_window"):
        raise ValueError(f"{architecture} with use_sliding_window: sliding-window attention has no mega equivalent")
    if read_field(hf_config, defaults, "attention_bias"):
        raise ValueError(f"{architecture} with attention_bias (q, k, v and o_proj biased, the MLP not) "
                         "has no mega equivalent")


def qwen3_config(hf_config: Mapping[str, Any], **overrides) -> TransformerConfig:
    """The mega config computing what ``Qwen3ForCausalLM`` computes with this config.json."""
    refuse_headless(hf_config, "Qwen3Model", "Qwen3ForCausalLM")
    refuse_qwen3_extras(hf_config, DEFAULTS, "Qwen3ForCausalLM")
    keys = {key: read_field(hf_config, DEFAULTS, key) for key in DEFAULTS}
    return llama_config({**hf_config, **keys, "architectures": []}, Qwen3Config, qk_layernorm=True, **overrides)


def check_qwen3_attention(config: TransformerConfig, architecture: str) -> None:
    differences = {
        "qk_layernorm (Qwen3 normalises every query and key head)": not config.qk_layernorm,
        "qk_layernorm_scope (Qwen3 normalises each head, not the whole projection)":
            config.qk_layernorm_scope != "head",
        "add_bias_linear / add_qkv_bias (Qwen3 has no linear biases)": config.add_bias_linear or config.add_qkv_bias,
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"{architecture} cannot express this model: {'; '.join(unsupported)}")


def qwen3_hf_config(config: TransformerConfig) -> dict:
    """config.json of the ``Qwen3ForCausalLM`` computing what ``config`` computes."""
    check_qwen3_attention(config, "Qwen3ForCausalLM")
    hf = llama_hf_config(dataclasses.replace(config, qk_layernorm=False))
    hf.pop("mlp_bias")
    hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False)
    return hf


def qk_norm_maps(config: TransformerConfig, layer: int) -> list[TensorMap]:
    mega, hf = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.self_attn."
    return [same(mega + "q_layernorm.weight", hf + "q_norm.weight"),
            same(mega + "k_layernorm.weight", hf + "k_norm.weight")]


def with_qk_norms(maps: list[TensorMap], config: TransformerConfig) -> list[TensorMap]:
    """``maps`` with each layer's QK-norm weights after its input norm."""
    out = []
    for tensor_map in maps:
        out.append(tensor_map)
        if tensor_map.mega[0].endswith("input_layernorm.weight"):
            out += qk_norm_maps(config, int(tensor_map.mega[0].split(".")[2]))
    return out


def qwen3_tensor_maps(config: TransformerConfig) -> list[TensorMap]:
    return with_qk_norms(llama_tensor_maps(config), config)


QWEN3 = causal_lm_mapping("Qwen3ForCausalLM", "qwen3", qwen3_config, qwen3_hf_config, qwen3_tensor_maps)

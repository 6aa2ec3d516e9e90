"""The ``llama`` family as Hugging Face's ``LlamaForCausalLM``: config.json and weights, both ways.

* QKV: separate ``q/k/v_proj`` in Hugging Face, interleaved per query group in Megatron.
* SwiGLU: ``linear_fc1`` is ``[gate; up]``.
* RoPE: Hugging Face LLaMA rotates halves (``rotate_half``) as mega does, so q and k rows need no
  permutation (Meta's original checkpoints rotate interleaved pairs; Hugging Face's own
  conversion script already permuted those).
* config.json: RoPE settings (every ``rope_type`` the shared blocks compute) are read and written
  by :mod:`mega.models.hf_rope`, as ``rope_theta``/``rope_scaling``, the keys every transformers
  version reads (5.x also reads its newer ``rope_parameters``, accepted too).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from mega.core.model_family import TensorMap
from mega.models.config import TransformerConfig
from mega.models.hf_mapping import (
    causal_lm_mapping,
    interleave_qkv,
    linear_kinds,
    read_field,
    refuse_headless,
    same,
    split_qkv,
)
from mega.models.hf_rope import hf_max_position_embeddings, hf_rope_scaling, rope_settings
from mega.models.llama.config import LlamaConfig

# LlamaConfig's defaults for the keys read here (config.json may leave them out).
DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
}


def llama_config(hf_config: Mapping[str, Any], config_class: type = LlamaConfig, **overrides) -> TransformerConfig:
    """The mega config computing what ``LlamaForCausalLM`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    refuse_headless(hf_config, "LlamaModel", "LlamaForCausalLM")
    if get("hidden_act") != "silu":
        raise ValueError(f"LLaMA hidden_act {get('hidden_act')!r} is not SwiGLU's silu")
    if get("attention_bias") != get("mlp_bias"):
        raise ValueError("LLaMA with attention_bias != mlp_bias has no mega equivalent")
    heads = get("num_attention_heads")
    settings = dict(
        num_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=heads, num_query_groups=get("num_key_value_heads") or heads,
        kv_channels=get("head_dim") or get("hidden_size") // heads,
        seq_length=get("max_position_embeddings"), max_position_embeddings=get("max_position_embeddings"),
        vocab_size=get("vocab_size"), position_embedding_type="rope",
        normalization="RMSNorm", layernorm_epsilon=get("rms_norm_eps"), swiglu=True,
        add_bias_linear=get("attention_bias"),
        untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        hidden_dropout=0.0, attention_dropout=get("attention_dropout"), init_method_std=get("initializer_range"),
    )
    settings.update(rope_settings(hf_config, get("max_position_embeddings"), "LlamaForCausalLM"))
    return config_class(**{**settings, **overrides})


def llama_hf_config(config: TransformerConfig) -> dict:
    """config.json of the ``LlamaForCausalLM`` computing what ``config`` computes."""
    differences = {
        "position_embedding_type (LLaMA uses RoPE)": config.position_embedding_type != "rope",
        "normalization (LLaMA uses RMSNorm)": config.normalization != "RMSNorm",
        "swiglu (LLaMA's MLP is SwiGLU)": not config.swiglu,
        "add_qkv_bias without add_bias_linear (LLaMA's attention_bias also biases o_proj)":
            config.add_qkv_bias and not config.add_bias_linear,
        "softmax_scale (LLaMA scales by 1/sqrt(head_dim))": config.softmax_scale is not None,
        "sliding_window (LLaMA attends to every earlier position; MistralForCausalLM has the window)":
            config.sliding_window is not None,
        "qk_layernorm (LLaMA has no QK-norm)": config.qk_layernorm,
        "layernorm_placement (LLaMA normalises each sublayer's input)": config.layernorm_placement != "pre",
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"LlamaForCausalLM cannot express this model: {'; '.join(unsupported)}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels, "max_position_embeddings": hf_max_position_embeddings(config),
        "hidden_act": "silu", "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": config.rotary_base, "rope_scaling": hf_rope_scaling(config),
        "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout, "initializer_range": config.init_method_std,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
    }


# --- Weights --------------------------------------------------------------------------------------

def _fuse_qkv(groups: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
    return (interleave_qkv(q, k, v, groups),)


def _fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.cat([gate, up], dim=0),)


def _split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(fc1.chunk(2, dim=0))


def llama_tensor_maps(config: TransformerConfig) -> list[TensorMap]:
    maps = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab=True)]
    for n in range(config.num_layers):
        mega, hf = f"decoder.layers.{n}.", f"model.layers.{n}."
        maps.append(same(mega + "input_layernorm.weight", hf + "input_layernorm.weight"))
        for kind in linear_kinds(config):
            maps += [
                TensorMap((mega + f"self_attention.linear_qkv.{kind}",),
                          tuple(hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"),
                          partial(_fuse_qkv, config.num_query_groups), partial(split_qkv, config=config)),
                same(mega + f"self_attention.linear_proj.{kind}", hf + f"self_attn.o_proj.{kind}"),
            ]
        maps.append(same(mega + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"))
        for kind in linear_kinds(config):
            maps += [
                TensorMap((mega + f"mlp.linear_fc1.{kind}",), (hf + f"mlp.gate_proj.{kind}", hf + f"mlp.up_proj.{kind}"),
                          _fuse_gate_up, _split_gate_up),
                same(mega + f"mlp.linear_fc2.{kind}", hf + f"mlp.down_proj.{kind}"),
            ]
    maps.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if config.untie_embeddings_and_output_weights:
        maps.append(same("output_layer.weight", "lm_head.weight", vocab=True))
    return maps


LLAMA = causal_lm_mapping(
    "LlamaForCausalLM", "llama", llama_config, llama_hf_config, llama_tensor_maps,
    # Rotary frequencies older transformers saved as buffers (derived from the config, not weights).
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))

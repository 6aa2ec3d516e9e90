"""The ``gpt-oss`` family as Hugging Face's ``GptOssForCausalLM``: config.json and weights, both ways.

Embeddings, norms and the q/k/v/o projections (with biases) are LLaMA's layout
(:mod:`mega.models.llama.hf_llama`); gpt-oss's own tensors:

    model.layers.N.self_attn.sinks                   -> self_attention.core_attention.softmax_offset
    model.layers.N.mlp.router.{weight,bias}          -> mlp.router.{weight,bias}
    model.layers.N.mlp.experts.gate_up_proj          [E, hidden, 2 ffn], gate and up interleaved by column
        -> mlp.experts.linear_fc1.weight[e] = [gate; up] = [gate_up[e][:, 0::2]^T; gate_up[e][:, 1::2]^T]
    model.layers.N.mlp.experts.gate_up_proj_bias     [E, 2 ffn] interleaved -> linear_fc1.bias [gate; up]
    model.layers.N.mlp.experts.down_proj             [E, ffn, hidden] -> linear_fc2.weight[e] = down_proj[e]^T
    model.layers.N.mlp.experts.down_proj_bias        -> linear_fc2.bias

config.json: ``layer_types`` must alternate as ``--window-attn-skip-freq`` says (every N-th layer
full); ``rope_parameters`` is YaRN (``factor``, ``beta_fast``/``beta_slow``,
``original_max_position_embeddings``, ``truncate``) or default RoPE. Checkpoints whose experts are
stored as MXFP4 blocks and scales are dequantized by the converter on the way in
(:mod:`mega.ckpt_convert.mxfp4`); they are written back unquantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mega.core.model_family import TensorMap
from mega.models.gpt_oss.config import GptOssConfig
from mega.models.hf_mapping import causal_lm_mapping, read_field, refuse_headless, same
from mega.models.llama.hf_llama import llama_tensor_maps
from mega.models.mixtral.hf_mixtral import with_expert_maps

# transformers' GptOssConfig defaults for the keys read here.
DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "initializer_range": 0.02,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_dropout": 0.0, "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "layer_types": None,
    "attention_bias": True,
}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def _layer_types(window_attn_skip_freq: int | None, layers: int) -> list[str]:
    return ["full_attention" if window_attn_skip_freq and (n + 1) % window_attn_skip_freq == 0
            else "sliding_attention" for n in range(layers)]


def _skip_freq(layer_types: list[str] | None, layers: int) -> tuple[int | None, bool]:
    """(--window-attn-skip-freq, whether any layer slides) of config.json's ``layer_types``."""
    if layer_types is None:  # transformers' default: every other layer full
        return 2, True
    if all(kind == "full_attention" for kind in layer_types):
        return None, False
    for freq in (None, *range(1, layers + 1)):
        if _layer_types(freq, layers) == list(layer_types):
            return freq, True
    raise ValueError(f"GptOssForCausalLM layer_types {layer_types} has no mega equivalent: the full-attention "
                     "layers must be every N-th (--window-attn-skip-freq N)")


def _rope(hf_config: Mapping[str, Any]) -> dict:
    rope = dict(hf_config.get("rope_parameters") or {})
    if not rope:  # transformers 4.x keys
        rope = dict(hf_config.get("rope_scaling") or DEFAULT_ROPE)
        rope.setdefault("rope_theta", hf_config.get("rope_theta", DEFAULT_ROPE["rope_theta"]))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"GptOssForCausalLM rope_type {rope['rope_type']!r} has no mega equivalent (yarn and "
                         "default do)")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if rope.get(key) is not None:
            raise ValueError(f"GptOssForCausalLM rope_parameters {key} has no mega equivalent (gpt-oss's YaRN "
                             "scales attention by mscale(factor))")
    return rope


def gpt_oss_config(hf_config: Mapping[str, Any], **overrides) -> GptOssConfig:
    """The mega config computing what ``GptOssForCausalLM`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    refuse_headless(hf_config, "GptOssModel", "GptOssForCausalLM")
    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    freq, slides = _skip_freq(get("layer_types"), layers)
    rope = _rope(hf_config)
    yarn = rope["rope_type"] == "yarn"
    settings = dict(
        num_layers=layers, hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        moe_ffn_hidden_size=get("intermediate_size"), num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads, kv_channels=get("head_dim") or get("hidden_size") // heads,
        seq_length=min(get("max_position_embeddings"), 4096), max_position_embeddings=get("max_position_embeddings"),
        vocab_size=get("vocab_size"), rotary_base=float(rope.get("rope_theta", DEFAULT_ROPE["rope_theta"])),
        rope_type="yarn" if yarn else "rope", layernorm_epsilon=get("rms_norm_eps"),
        add_bias_linear=get("attention_bias"), untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        attention_dropout=get("attention_dropout"), init_method_std=get("initializer_range"),
        sliding_window=get("sliding_window") if slides else None, window_attn_skip_freq=freq,
        num_experts=get("num_local_experts"), moe_router_topk=get("num_experts_per_tok"),
        moe_aux_loss_coeff=get("router_aux_loss_coef"), swiglu_limit=float(get("swiglu_limit")),
        swiglu_alpha=float(get("swiglu_alpha")), softmax_type="learnable",
    )
    if yarn:
        settings.update(rotary_scaling_factor=float(rope["factor"]), beta_fast=float(rope.get("beta_fast") or 32.0),
                        beta_slow=float(rope.get("beta_slow") or 1.0),
                        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                        yarn_truncate=bool(rope.get("truncate", True)))
    return GptOssConfig(**{**settings, **overrides})


def gpt_oss_hf_config(config: GptOssConfig) -> dict:
    """config.json of the ``GptOssForCausalLM`` computing what ``config`` computes."""
    differences = {
        "softmax_type vanilla (gpt-oss's attention has sinks)": config.softmax_type != "learnable",
        "normalization (gpt-oss uses RMSNorm)": config.normalization != "RMSNorm",
        "softmax_scale (gpt-oss scales by 1/sqrt(head_dim))": config.softmax_scale is not None,
        "moe_expert_capacity_factor (gpt-oss is dropless)": config.moe_expert_capacity_factor is not None,
        "moe_ffn_hidden_size differs from ffn_hidden_size": config.moe_ffn_hidden_size != config.ffn_hidden_size,
        "qk_layernorm (gpt-oss has no QK-norm)": config.qk_layernorm,
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"GptOssForCausalLM cannot express this model: {'; '.join(unsupported)}")
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=config.rotary_scaling_factor, beta_fast=config.beta_fast,
                    beta_slow=config.beta_slow, truncate=config.yarn_truncate,
                    original_max_position_embeddings=config.original_max_position_embeddings)
    window = config.sliding_window
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.moe_ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, "rope_parameters": rope, "hidden_act": "silu",
        "attention_bias": config.add_bias_linear, "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "sliding_window": window,
        "layer_types": (_layer_types(config.window_attn_skip_freq, config.num_layers) if window is not None
                        else ["full_attention"] * config.num_layers),
        "num_local_experts": config.num_experts, "num_experts_per_tok": config.moe_router_topk,
        "router_aux_loss_coef": config.moe_aux_loss_coeff, "output_router_logits": False,
        "swiglu_limit": config.swiglu_limit, "swiglu_alpha": config.swiglu_alpha,
    }


def deinterleave_columns(interleaved: torch.Tensor) -> torch.Tensor:
    """``[..., 2 ffn]`` with gate and up alternating -> ``[..., 2 ffn]`` as ``[gate, up]``."""
    return torch.cat([interleaved[..., 0::2], interleaved[..., 1::2]], dim=-1)


def interleave_columns(gate_up: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`deinterleave_columns`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _fc1_weight_to_mega(gate_up: torch.Tensor) -> tuple[torch.Tensor]:
    return (deinterleave_columns(gate_up).transpose(1, 2),)


def _fc1_weight_to_hf(fc1: torch.Tensor) -> tuple[torch.Tensor]:
    return (interleave_columns(fc1.transpose(1, 2)),)


def _fc1_bias_to_mega(bias: torch.Tensor) -> tuple[torch.Tensor]:
    return (deinterleave_columns(bias),)


def _fc1_bias_to_hf(bias: torch.Tensor) -> tuple[torch.Tensor]:
    return (interleave_columns(bias),)


def _transposed(weight: torch.Tensor) -> tuple[torch.Tensor]:
    return (weight.transpose(1, 2),)


def expert_maps(mega: str, hf: str) -> list[TensorMap]:
    """One layer's router and experts (``mega``/``hf``: the MLP's prefixes)."""
    return [
        same(mega + "router.weight", hf + "router.weight"),
        same(mega + "router.bias", hf + "router.bias"),
        TensorMap((mega + "experts.linear_fc1.weight",), (hf + "experts.gate_up_proj",),
                  _fc1_weight_to_mega, _fc1_weight_to_hf),
        TensorMap((mega + "experts.linear_fc1.bias",), (hf + "experts.gate_up_proj_bias",),
                  _fc1_bias_to_mega, _fc1_bias_to_hf),
        TensorMap((mega + "experts.linear_fc2.weight",), (hf + "experts.down_proj",), _transposed, _transposed),
        same(mega + "experts.linear_fc2.bias", hf + "experts.down_proj_bias"),
    ]


def gpt_oss_tensor_maps(config: GptOssConfig) -> list[TensorMap]:
    maps = []
    for tensor_map in with_expert_maps(llama_tensor_maps(config), lambda n: expert_maps(
            f"decoder.layers.{n}.mlp.", f"model.layers.{n}.mlp.")):
        maps.append(tensor_map)
        name = tensor_map.mega[0]
        if name.endswith("input_layernorm.weight"):  # the layer's attention comes next: its sinks first
            n = name.split(".")[2]
            maps.append(same(f"decoder.layers.{n}.self_attention.core_attention.softmax_offset",
                             f"model.layers.{n}.self_attn.sinks"))
    return maps


GPT_OSS = causal_lm_mapping("GptOssForCausalLM", "gpt_oss", gpt_oss_config, gpt_oss_hf_config, gpt_oss_tensor_maps)

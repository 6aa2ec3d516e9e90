"""The ``qwen3-next`` family as Hugging Face's ``Qwen3NextForCausalLM``: config.json and weights, both ways.

Layer ``N`` of ``layer_types`` is ``linear_attention`` (``model.layers.N.linear_attn.*``) or
``full_attention`` (``model.layers.N.self_attn.*``); the pattern must be every
``full_attention_interval``-th layer full, which is ``--linear-attention-freq``. The tensors:

    linear_attn.in_proj_qkvz / in_proj_ba / A_log / dt_bias / out_proj -> self_attention.same names
    linear_attn.norm.weight                 -> self_attention.out_norm.weight
    linear_attn.conv1d.weight [q all; k all; v all] -> self_attention.conv1d.weight, grouped by key head
    self_attn.q_proj (per head [query; gate]), k_proj, v_proj -> self_attention.linear_qkv (per query group)
    self_attn.q_norm / k_norm / o_proj      -> self_attention.q_layernorm / k_layernorm / linear_proj
    mlp.gate, mlp.experts.E.{gate,up,down}_proj -> mlp.router, mlp.experts (as Qwen3-MoE)
    mlp.shared_expert.{gate,up,down}_proj   -> mlp.shared_experts.linear_fc1 ([gate; up]) / linear_fc2
    mlp.shared_expert_gate.weight           -> mlp.shared_experts.gate_weight
    input_layernorm / post_attention_layernorm / model.norm -> input_layernorm / pre_mlp_layernorm /
                                               decoder.final_layernorm (zero-centred on both sides)

Dense layers (``mlp_only_layers``, ``decoder_sparse_step`` > 1), attention biases and a router
without renormalised top-k weights have no mega equivalent here and are refused by name.

Multi-token prediction: the released checkpoints (``mtp_num_hidden_layers: 1`` in config.json)
hold one MTP module that transformers' class does not load (it ignores ``mtp.*``); here it is
mega's MTP module (``--mtp-num-layers 1``, DeepSeek-V3's, :mod:`mega.models.deepseek_v3.mtp`):

    mtp.pre_fc_norm_embedding.weight / pre_fc_norm_hidden.weight -> mtp.layers.0.enorm / hnorm.weight
    mtp.fc.weight  [h, 2h] (the normalised embedding's columns first) -> mtp.layers.0.eh_proj.weight
    mtp.layers.0.* (a full-attention layer)                         -> mtp.layers.0.transformer_layer.*
    mtp.norm.weight                                                 -> mtp.layers.0.final_layernorm.weight

(the names vLLM and SGLang load; their norms zero-centred like the model's). More than one MTP
layer (whose ``fc`` and norms Qwen3-Next shares) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from mega.core.model_family import TensorMap
from mega.models.hf_mapping import causal_lm_mapping, interleave_qkv, read_field, refuse_headless, same
from mega.models.llama.hf_llama import _fuse_gate_up, _rope, _split_gate_up
from mega.models.qwen3_moe.hf_qwen3_moe import routed_expert_maps
from mega.models.qwen3_next.config import HybridLinearAttentionConfig, Qwen3NextConfig

# Qwen3NextConfig's defaults for the keys read here.
DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu",
    "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [], "layer_types": None, "full_attention_interval": 4, "mtp_num_hidden_layers": 0,
}
ARCHITECTURE = "Qwen3NextForCausalLM"


def _layer_types(num_layers: int, interval: int) -> list[str]:
    return ["full_attention" if (n + 1) % interval == 0 else "linear_attention" for n in range(num_layers)]


def _attention_interval(hf_config: Mapping[str, Any], num_layers: int) -> int:
    """``full_attention_interval`` from ``layer_types`` (refused where no interval gives them)."""
    types = read_field(hf_config, DEFAULTS, "layer_types")
    interval = read_field(hf_config, DEFAULTS, "full_attention_interval")
    if types is None:
        return interval
    full = [n for n, kind in enumerate(types) if kind == "full_attention"]
    candidate = full[0] + 1 if full else num_layers + 1
    if list(types) != _layer_types(num_layers, candidate):
        raise ValueError(f"{ARCHITECTURE} layer_types {list(types)} is not every Nth layer full attention "
                         "(--linear-attention-freq); mega cannot express this pattern")
    return candidate


def qwen3_next_config(hf_config: Mapping[str, Any], **overrides) -> HybridLinearAttentionConfig:
    """The mega config computing what ``Qwen3NextForCausalLM`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    refuse_headless(hf_config, "Qwen3NextModel", ARCHITECTURE)
    refusals = {
        "hidden_act (the experts are SwiGLU: silu)": get("hidden_act") != "silu",
        "attention_bias": get("attention_bias"),
        "mlp_only_layers / decoder_sparse_step (every layer's MLP must be the experts)":
            bool(get("mlp_only_layers")) or get("decoder_sparse_step") != 1,
        "norm_topk_prob false (mega renormalises the top-k weights)": not get("norm_topk_prob"),
    }
    refusals["mtp_num_hidden_layers above 1 (their fc and norms are shared)"] = get("mtp_num_hidden_layers") > 1
    rope = _rope(hf_config)
    refusals[f"rope_type {rope['rope_type']!r} (default RoPE only)"] = rope["rope_type"] != "default"
    refused = [field for field, differs in refusals.items() if differs]
    if refused:
        raise ValueError(f"{ARCHITECTURE} with {'; '.join(refused)} has no mega equivalent")
    num_layers = get("num_hidden_layers")
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // heads
    rotary = float(rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 0.25)))
    experts = hf_config["num_local_experts"] if "num_local_experts" in hf_config else get("num_experts")
    settings = dict(
        num_layers=num_layers, hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=heads, num_query_groups=get("num_key_value_heads"), kv_channels=head_dim,
        seq_length=get("max_position_embeddings"), max_position_embeddings=get("max_position_embeddings"),
        vocab_size=get("vocab_size"), rotary_base=float(rope["rope_theta"]), rotary_percent=rotary,
        layernorm_epsilon=get("rms_norm_eps"), untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        attention_dropout=get("attention_dropout"), init_method_std=get("initializer_range"),
        linear_attention_freq=_attention_interval(hf_config, num_layers),
        linear_conv_kernel_dim=get("linear_conv_kernel_dim"), linear_key_head_dim=get("linear_key_head_dim"),
        linear_value_head_dim=get("linear_value_head_dim"), linear_num_key_heads=get("linear_num_key_heads"),
        linear_num_value_heads=get("linear_num_value_heads"), num_experts=experts,
        moe_router_topk=get("num_experts_per_tok"), moe_ffn_hidden_size=get("moe_intermediate_size"),
        moe_shared_expert_intermediate_size=get("shared_expert_intermediate_size"), moe_shared_expert_gate=True,
        moe_aux_loss_coeff=get("router_aux_loss_coef"), mtp_num_layers=get("mtp_num_hidden_layers") or None,
    )
    return Qwen3NextConfig(**{**settings, **overrides})


def qwen3_next_hf_config(config: HybridLinearAttentionConfig) -> dict:
    """config.json of the ``Qwen3NextForCausalLM`` computing what ``config`` computes."""
    differences = {
        "moe_shared_expert_intermediate_size / moe_shared_expert_gate (a gated shared expert)":
            not config.moe_shared_expert_intermediate_size or not config.moe_shared_expert_gate,
        "moe_layer_freq (experts in every layer)": config.num_moe_layers != config.num_layers,
        "moe_router_pre_softmax / moe_router_score_function (softmax, top-k renormalised)":
            config.moe_router_pre_softmax or config.moe_router_score_function != "softmax",
        "moe_router_num_groups / moe_router_topk_scaling_factor / moe_router_enable_expert_bias":
            config.moe_router_num_groups is not None or config.moe_router_topk_scaling_factor is not None
            or config.moe_router_enable_expert_bias,
        "moe_expert_capacity_factor (dropless)": config.moe_expert_capacity_factor is not None,
        "add_bias_linear / add_qkv_bias": config.add_bias_linear or config.add_qkv_bias,
        "use_rope_scaling": config.use_rope_scaling,
        "softmax_scale": config.softmax_scale is not None,
        "sliding_window": config.sliding_window is not None,
        "mtp_num_layers above 1 (Qwen3-Next shares one MTP fc and its norms)": (config.mtp_num_layers or 0) > 1,
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"{ARCHITECTURE} cannot express this model: {'; '.join(unsupported)}")
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3_next",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels, "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.init_method_std, "rms_norm_eps": config.layernorm_epsilon,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base,
                            "partial_rotary_factor": config.rotary_percent},
        "attention_bias": False, "attention_dropout": config.attention_dropout,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim, "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim, "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads, "decoder_sparse_step": 1,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
        "num_experts_per_tok": config.moe_router_topk, "num_experts": config.num_experts, "norm_topk_prob": True,
        "router_aux_loss_coef": config.moe_aux_loss_coeff, "mlp_only_layers": [],
        "layer_types": _layer_types(config.num_layers, config.linear_attention_freq),
        "mtp_num_hidden_layers": config.mtp_num_layers or 0,
    }


# --- Weights --------------------------------------------------------------------------------------

def _conv_grouped(config: HybridLinearAttentionConfig, conv: torch.Tensor) -> tuple[torch.Tensor]:
    """Hugging Face's conv1d channels [q all; k all; v all] -> per key head [q; k; v]."""
    keys, dk = config.linear_num_key_heads, config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    q, k, v = conv.split([keys * dk, keys * dk, value_dim])
    return (torch.cat([t.reshape(keys, -1, *conv.shape[1:]) for t in (q, k, v)], dim=1).reshape(conv.shape),)


def _conv_ungrouped(config: HybridLinearAttentionConfig, conv: torch.Tensor) -> tuple[torch.Tensor]:
    keys, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_key = config.linear_num_value_heads // keys * config.linear_value_head_dim
    q, k, v = conv.reshape(keys, 2 * dk + per_key, *conv.shape[1:]).split([dk, dk, per_key], dim=1)
    return (torch.cat([t.reshape(-1, *conv.shape[1:]) for t in (q, k, v)]),)


def _fuse_gated_qkv(groups: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
    return (interleave_qkv(q, k, v, groups),)  # q_proj's rows are per head [query; gate]: whole in each group


def _split_gated_qkv(config: HybridLinearAttentionConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, groups = config.kv_channels, config.num_query_groups
    per_group = 2 * config.num_attention_heads // groups * d
    q, k, v = qkv.reshape(groups, per_group + 2 * d, *qkv.shape[1:]).split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def _linear_attention_maps(config: HybridLinearAttentionConfig, mega: str, hf: str) -> list[TensorMap]:
    maps = [same(mega + f"{name}.weight", hf + f"{name}.weight") for name in ("in_proj_qkvz", "in_proj_ba")]
    maps.append(TensorMap((mega + "conv1d.weight",), (hf + "conv1d.weight",), partial(_conv_grouped, config),
                          partial(_conv_ungrouped, config)))
    maps += [same(mega + "A_log", hf + "A_log"), same(mega + "dt_bias", hf + "dt_bias"),
             same(mega + "out_norm.weight", hf + "norm.weight"), same(mega + "out_proj.weight", hf + "out_proj.weight")]
    return maps


def _full_attention_maps(config: HybridLinearAttentionConfig, mega: str, hf: str) -> list[TensorMap]:
    return [
        TensorMap((mega + "linear_qkv.weight",), tuple(hf + f"{p}_proj.weight" for p in "qkv"),
                  partial(_fuse_gated_qkv, config.num_query_groups), partial(_split_gated_qkv, config)),
        same(mega + "q_layernorm.weight", hf + "q_norm.weight"),
        same(mega + "k_layernorm.weight", hf + "k_norm.weight"),
        same(mega + "linear_proj.weight", hf + "o_proj.weight"),
    ]


def _layer_maps(config: HybridLinearAttentionConfig, linear: bool, mega: str, hf: str) -> list[TensorMap]:
    """One decoder layer's tensors (``mega``/``hf``: the layer's prefixes)."""
    maps = [same(mega + "input_layernorm.weight", hf + "input_layernorm.weight")]
    if linear:
        maps += _linear_attention_maps(config, mega + "self_attention.", hf + "linear_attn.")
    else:
        maps += _full_attention_maps(config, mega + "self_attention.", hf + "self_attn.")
    maps.append(same(mega + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"))
    maps += routed_expert_maps(config.num_experts, mega + "mlp.", hf + "mlp.")
    shared, hf_shared = mega + "mlp.shared_experts.", hf + "mlp.shared_expert."
    return maps + [
        TensorMap((shared + "linear_fc1.weight",), (hf_shared + "gate_proj.weight", hf_shared + "up_proj.weight"),
                  _fuse_gate_up, _split_gate_up),
        same(shared + "linear_fc2.weight", hf_shared + "down_proj.weight"),
        same(shared + "gate_weight", hf + "mlp.shared_expert_gate.weight"),
    ]


def _mtp_maps(config: HybridLinearAttentionConfig) -> list[TensorMap]:
    mega = "mtp.layers.0."
    return [same(mega + "enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
            same(mega + "hnorm.weight", "mtp.pre_fc_norm_hidden.weight"),
            same(mega + "eh_proj.weight", "mtp.fc.weight"),
            *_layer_maps(config, False, mega + "transformer_layer.", "mtp.layers.0."),
            same(mega + "final_layernorm.weight", "mtp.norm.weight")]


def qwen3_next_tensor_maps(config: HybridLinearAttentionConfig) -> list[TensorMap]:
    maps = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab=True)]
    for n in range(config.num_layers):
        maps += _layer_maps(config, config.is_linear_layer(n), f"decoder.layers.{n}.", f"model.layers.{n}.")
    maps.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if config.untie_embeddings_and_output_weights:
        maps.append(same("output_layer.weight", "lm_head.weight", vocab=True))
    return maps + (_mtp_maps(config) if config.mtp_num_layers else [])


QWEN3_NEXT = causal_lm_mapping(ARCHITECTURE, "qwen3_next", qwen3_next_config, qwen3_next_hf_config,
                               qwen3_next_tensor_maps)

"""The ``mixtral`` family as Hugging Face's ``MixtralForCausalLM``: config.json and weights, both ways.

Attention, norms and embeddings are LLaMA's (:mod:`mega.models.llama.hf_llama`). The checkpoint files
hold each expert's projections on their own (transformers 5 fuses them in memory only):

    model.layers.N.block_sparse_moe.gate.weight            -> decoder.layers.N.mlp.router.weight
    model.layers.N.block_sparse_moe.experts.E.w1.weight    (gate)  \\
    model.layers.N.block_sparse_moe.experts.E.w3.weight    (up)    -> mlp.experts.linear_fc1.weight[E] = [w1; w3]
    model.layers.N.block_sparse_moe.experts.E.w2.weight    (down)  -> mlp.experts.linear_fc2.weight[E]

Mixtral's router takes the softmax over all experts, keeps the top k and renormalises them,
which equals mega's default softmax over the top-k logits; its sliding window is not modelled
(a config with ``sliding_window`` shorter than the sequence is refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from mega.core.model_family import TensorMap
from mega.models.hf_mapping import causal_lm_mapping, read_field, refuse_headless, same
from mega.models.llama.hf_llama import llama_config, llama_hf_config, llama_tensor_maps
from mega.models.mixtral.config import MixtralConfig
from mega.models.moe.config import MoETransformerConfig

# MixtralConfig's defaults for the keys read here beyond LLaMA's.
DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "attention_dropout": 0.0, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "router_jitter_noise": 0.0,
}


def mixtral_config(hf_config: Mapping[str, Any], **overrides) -> MoETransformerConfig:
    """The mega config computing what ``MixtralForCausalLM`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    refuse_headless(hf_config, "MixtralModel", "MixtralForCausalLM")
    window, positions = get("sliding_window"), get("max_position_embeddings")
    if window is not None and window < positions:
        raise ValueError(f"Mixtral sliding_window {window} < max_position_embeddings {positions}: "
                         "sliding-window attention has no mega equivalent")
    if get("router_jitter_noise"):
        raise ValueError("Mixtral router_jitter_noise has no mega equivalent (it must be 0)")
    llama_keys = {**{k: v for k, v in DEFAULTS.items() if k != "num_local_experts"},
                  "attention_bias": False, "mlp_bias": False, "rope_theta": 1e6}
    dense = llama_config({**llama_keys, **hf_config})
    settings = {field.name: getattr(dense, field.name) for field in dataclasses.fields(dense) if field.init}
    settings.update(num_experts=get("num_local_experts"), moe_router_topk=get("num_experts_per_tok"),
                    moe_ffn_hidden_size=get("intermediate_size"), moe_aux_loss_coeff=get("router_aux_loss_coef"))
    return MixtralConfig(**{**settings, **overrides})


def mixtral_hf_config(config: MoETransformerConfig) -> dict:
    """config.json of the ``MixtralForCausalLM`` computing what ``config`` computes."""
    differences = {
        "add_bias_linear (Mixtral has no biases)": config.add_bias_linear or config.add_qkv_bias,
        "moe_router_pre_softmax (Mixtral renormalises the top-k weights)": config.moe_router_pre_softmax,
        "moe_expert_capacity_factor (Mixtral is dropless)": config.moe_expert_capacity_factor is not None,
        "moe_ffn_hidden_size differs from ffn_hidden_size": config.moe_ffn_hidden_size != config.ffn_hidden_size,
        **plain_routing_differences(config),
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"MixtralForCausalLM cannot express this model: {'; '.join(unsupported)}")
    hf = llama_hf_config(config)
    for key in ("attention_bias", "mlp_bias"):
        hf.pop(key)
    hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=config.num_experts,
              num_experts_per_tok=config.moe_router_topk, router_aux_loss_coef=config.moe_aux_loss_coeff,
              sliding_window=None, router_jitter_noise=0.0)
    return hf


def plain_routing_differences(config: MoETransformerConfig) -> dict[str, bool]:
    """What a softmax top-k router without extras (Mixtral's, Qwen3-MoE's) cannot compute."""
    return {
        "moe_router_score_function sigmoid": config.moe_router_score_function != "softmax",
        "moe_router_num_groups (group-limited routing)": config.moe_router_num_groups is not None,
        "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor not in (None, 1.0),
        "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
    }


def _stack_experts(*w1_w3_pairs: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.stack([torch.cat(w1_w3_pairs[i:i + 2]) for i in range(0, len(w1_w3_pairs), 2)]),)


def _unstack_experts(fc1: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(half for expert in fc1 for half in expert.chunk(2, dim=0))


def _stack(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.stack(tensors),)


def _unstack(stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(stacked.unbind(0))


def mixtral_tensor_maps(config: MoETransformerConfig) -> list[TensorMap]:
    return with_expert_maps(llama_tensor_maps(config), lambda n: expert_maps(
        config.num_experts, f"decoder.layers.{n}.mlp.", f"model.layers.{n}.block_sparse_moe.", "w1", "w3", "w2"))


def with_expert_maps(maps: list[TensorMap], experts_of) -> list[TensorMap]:
    """``maps`` of a dense decoder with each layer's MLP maps replaced by ``experts_of(layer)``."""
    out = []
    for tensor_map in maps:
        if ".mlp." not in tensor_map.mega[0]:
            out.append(tensor_map)
        if tensor_map.mega[0].endswith("pre_mlp_layernorm.weight"):  # the layer's MLP comes next
            out += experts_of(int(tensor_map.mega[0].split(".")[2]))
    return out


def expert_maps(num_experts: int, mega: str, hf: str, gate: str, up: str, down: str) -> list[TensorMap]:
    """The router (``gate.weight``) and the experts of one layer (``mega``/``hf``: the MLP's
    prefixes), each expert's projections in files of their own: ``experts.E.{gate,up,down}.weight``."""
    experts = range(num_experts)
    return [
        same(mega + "router.weight", hf + "gate.weight"),
        TensorMap((mega + "experts.linear_fc1.weight",),
                  tuple(hf + f"experts.{e}.{w}.weight" for e in experts for w in (gate, up)),
                  _stack_experts, _unstack_experts),
        TensorMap((mega + "experts.linear_fc2.weight",), tuple(hf + f"experts.{e}.{down}.weight" for e in experts),
                  _stack, _unstack),
    ]


MIXTRAL = causal_lm_mapping(
    "MixtralForCausalLM", "mixtral", mixtral_config, mixtral_hf_config, mixtral_tensor_maps, copies=None,
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))

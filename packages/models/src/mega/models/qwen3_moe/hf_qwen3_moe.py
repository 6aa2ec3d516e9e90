"""The ``qwen3-moe`` family as Hugging Face's ``Qwen3MoeForCausalLM``: config.json and weights, both ways.

Attention, norms and embeddings are Qwen3's (:mod:`mega.models.qwen3.hf_qwen3`: LLaMA's with QK-norm).
Every layer's MLP is a mixture of SwiGLU experts; the checkpoint files hold each expert's
projections on their own (transformers 5 fuses them in memory only):

    model.layers.N.mlp.gate.weight                        -> decoder.layers.N.mlp.router.weight
    model.layers.N.mlp.experts.E.gate_proj.weight  \\
    model.layers.N.mlp.experts.E.up_proj.weight    -> mlp.experts.linear_fc1.weight[E] = [gate; up]
    model.layers.N.mlp.experts.E.down_proj.weight  -> mlp.experts.linear_fc2.weight[E]

The router is a softmax over all experts, then the top k; ``norm_topk_prob`` (every released
Qwen3-MoE) renormalises them, which is mega's default softmax over the top-k logits; without it the
weights are the top-k probabilities as they are (``--moe-router-pre-softmax``). Dense layers among
the sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` > 1) have no mega equivalent here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mega.core.model_family import TensorMap
from mega.models.hf_mapping import causal_lm_mapping, read_field, refuse_headless
from mega.models.llama.hf_llama import llama_tensor_maps
from mega.models.mixtral.hf_mixtral import expert_maps, plain_routing_differences, with_expert_maps
from mega.models.moe.config import MoETransformerConfig
from mega.models.qwen3.hf_qwen3 import check_qwen3_attention, qwen3_config, qwen3_hf_config, with_qk_norms
from mega.models.qwen3_moe.config import Qwen3MoEConfig

# Qwen3MoeConfig's defaults for the keys read here.
DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
    "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
    "mlp_only_layers": None,
}


def qwen3_moe_config(hf_config: Mapping[str, Any], **overrides) -> MoETransformerConfig:
    """The mega config computing what ``Qwen3MoeForCausalLM`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    refuse_headless(hf_config, "Qwen3MoeModel", "Qwen3MoeForCausalLM")
    if get("mlp_only_layers") or get("decoder_sparse_step") != 1:
        raise ValueError(f"Qwen3MoeForCausalLM with dense layers (mlp_only_layers {get('mlp_only_layers')}, "
                         f"decoder_sparse_step {get('decoder_sparse_step')}) has no mega equivalent: "
                         "every layer's MLP must be a mixture of experts")
    dense = qwen3_config({**{key: get(key) for key in DEFAULTS}, **hf_config, "architectures": []})
    settings = {field.name: getattr(dense, field.name) for field in dataclasses.fields(dense) if field.init}
    # Released config.json files say num_experts; transformers 5 writes it as num_local_experts.
    experts = hf_config["num_local_experts"] if "num_local_experts" in hf_config else get("num_experts")
    settings.update(num_experts=experts, moe_router_topk=get("num_experts_per_tok"),
                    moe_ffn_hidden_size=get("moe_intermediate_size"), moe_router_pre_softmax=not get("norm_topk_prob"),
                    moe_aux_loss_coeff=get("router_aux_loss_coef"))
    return Qwen3MoEConfig(**{**settings, **overrides})


def qwen3_moe_hf_config(config: MoETransformerConfig) -> dict:
    """config.json of the ``Qwen3MoeForCausalLM`` computing what ``config`` computes."""
    check_qwen3_attention(config, "Qwen3MoeForCausalLM")
    differences = {"moe_expert_capacity_factor (Qwen3-MoE is dropless)": config.moe_expert_capacity_factor is not None,
                   **plain_routing_differences(config)}
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"Qwen3MoeForCausalLM cannot express this model: {'; '.join(unsupported)}")
    hf = qwen3_hf_config(config)
    hf.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=config.num_experts,
              num_experts_per_tok=config.moe_router_topk, moe_intermediate_size=config.moe_ffn_hidden_size,
              norm_topk_prob=not config.moe_router_pre_softmax, router_aux_loss_coef=config.moe_aux_loss_coeff,
              decoder_sparse_step=1, mlp_only_layers=[])
    return hf


def routed_expert_maps(num_experts: int, mega: str, hf: str) -> list[TensorMap]:
    """The router and the experts of one layer in Qwen2/3-MoE's and DeepSeek-V3's files."""
    return expert_maps(num_experts, mega, hf, "gate_proj", "up_proj", "down_proj")


def qwen3_moe_tensor_maps(config: MoETransformerConfig) -> list[TensorMap]:
    return with_expert_maps(with_qk_norms(llama_tensor_maps(config), config), lambda n: routed_expert_maps(
        config.num_experts, f"decoder.layers.{n}.mlp.", f"model.layers.{n}.mlp."))


QWEN3_MOE = causal_lm_mapping("Qwen3MoeForCausalLM", "qwen3_moe", qwen3_moe_config, qwen3_moe_hf_config,
                              qwen3_moe_tensor_maps)

"""The ``deepseek-v3`` family as Hugging Face's ``DeepseekV3ForCausalLM``: config.json and weights,
both ways. Per layer N (``mega`` <- Hugging Face):

    self_attention.linear_q_down_proj / q_layernorm / linear_q_up_proj  <- self_attn.q_a_proj / q_a_layernorm / q_b_proj
      (self_attention.linear_q_proj <- self_attn.q_proj without a query bottleneck)
    self_attention.linear_kv_down_proj / kv_layernorm / linear_kv_up_proj
                                       <- self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
    self_attention.linear_proj         <- self_attn.o_proj
    mlp.linear_fc1 = [gate; up], mlp.linear_fc2       <- mlp.gate_proj, up_proj, down_proj (dense layers)
    mlp.router.weight, mlp.router.expert_bias         <- mlp.gate.weight, mlp.gate.e_score_correction_bias
    mlp.experts.linear_fc1[E] = [gate; up], linear_fc2[E]  <- mlp.experts.E.gate_proj, up_proj, down_proj
    mlp.shared_experts.linear_fc1 = [gate; up], linear_fc2 <- mlp.shared_experts.gate_proj, up_proj, down_proj

No layout changes: transformers' ``rope_interleave`` (the rope channels as pairs) is what mega's
multi-latent attention computes, and q/kv_b_proj hold each head's [nope; rope] and [k_nope; v]
rows as megatron-core does. Group-limited routing in transformers ranks groups by their best two
scores, megatron-core by their best topk/group-topk: configs where these differ are refused, as are
unnormalised top-k weights, ``rope_interleave: false`` and latent norms whose epsilon is not the
1e-6 transformers gives them. The multi-token-prediction layers a released checkpoint holds after
the last layer (``model.layers.61.*``) are not computed by transformers and not converted: a
converted model has no MTP module (``--mtp-num-layers`` trains a fresh one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mega.core.model_family import TensorMap
from mega.models.deepseek_v3.config import DeepSeekV3Config
from mega.models.hf_mapping import causal_lm_mapping, read_field, refuse_headless, same
from mega.models.hf_rope import hf_rope_parameters
from mega.models.llama.hf_llama import _fuse_gate_up, _split_gate_up
from mega.models.moe.config import moe_layer_pattern
from mega.models.qwen3_moe.hf_qwen3_moe import routed_expert_maps

DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
}
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its default epsilon
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def deepseek_v3_config(hf_config: Mapping[str, Any], **overrides) -> DeepSeekV3Config:
    """The mega config computing what ``DeepseekV3ForCausalLM`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    refuse_headless(hf_config, "DeepseekV3Model", "DeepseekV3ForCausalLM")
    problems = {
        f"hidden_act {get('hidden_act')!r} (the MLPs are SwiGLU: silu)": get("hidden_act") != "silu",
        "attention_bias": get("attention_bias"),
        "rope_interleave false": not get("rope_interleave"),
        "norm_topk_prob false (megatron-core renormalises sigmoid top-k weights)": not get("norm_topk_prob"),
        f"rms_norm_eps {get('rms_norm_eps')} (the latent norms use {LATENT_NORM_EPS})":
            get("rms_norm_eps") != LATENT_NORM_EPS,
        "num_key_value_heads != num_attention_heads": get("num_key_value_heads") not in (None, get("num_attention_heads")),
    }
    groups, group_topk, topk = get("n_group") or 1, get("topk_group") or 1, get("num_experts_per_tok")
    if groups > 1:
        problems[f"num_experts_per_tok {topk} / topk_group {group_topk} != 2 (transformers ranks groups by their "
                 "best 2 experts, megatron-core by their best topk/group-topk)"] = topk // group_topk != 2 or topk % group_topk
    unsupported = [what for what, bad in problems.items() if bad]
    if unsupported:
        raise ValueError(f"DeepseekV3ForCausalLM with {'; '.join(unsupported)} has no mega equivalent")
    rope = hf_rope_parameters(hf_config)
    if rope["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"DeepseekV3ForCausalLM RoPE type {rope['rope_type']!r} has no mega equivalent (default and yarn do)")
    yarn = {key: float(rope.get(key) or value) for key, value in YARN_DEFAULTS.items()}
    layers, dense = get("num_hidden_layers"), get("first_k_dense_replace")
    experts = hf_config.get("n_routed_experts", hf_config.get("num_local_experts", DEFAULTS["n_routed_experts"]))
    shared = get("n_shared_experts") * get("moe_intermediate_size")
    settings = dict(
        num_layers=layers, hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=get("num_attention_heads"), num_experts=experts,
        moe_ffn_hidden_size=get("moe_intermediate_size"), moe_router_topk=topk,
        moe_layer_freq=f"[0]*{dense}+[1]*{layers - dense}", moe_shared_expert_intermediate_size=shared or None,
        moe_router_score_function="sigmoid", moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=get("routed_scaling_factor"), moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
        q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"), qk_head_dim=get("qk_nope_head_dim"),
        qk_pos_emb_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
        rope_type="yarn" if rope["rope_type"] == "yarn" else "rope", rotary_base=float(rope["rope_theta"]),
        rotary_scaling_factor=float(rope.get("factor", 1.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings") or get("max_position_embeddings")),
        beta_fast=yarn["beta_fast"], beta_slow=yarn["beta_slow"], mscale=yarn["mscale"],
        mscale_all_dim=yarn["mscale_all_dim"], mtp_num_layers=None,
        seq_length=get("max_position_embeddings"), max_position_embeddings=get("max_position_embeddings"),
        vocab_size=get("vocab_size"), position_embedding_type="rope", normalization="RMSNorm",
        layernorm_epsilon=get("rms_norm_eps"), swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=not get("tie_word_embeddings"), hidden_dropout=0.0,
        attention_dropout=get("attention_dropout"), init_method_std=get("initializer_range"),
    )
    return DeepSeekV3Config(**{**settings, **overrides})


def first_dense_layers(config: DeepSeekV3Config) -> int | None:
    """k where the layers are k dense then MoE (Hugging Face's first_k_dense_replace), else None."""
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    k = pattern.index(True) if True in pattern else config.num_layers
    return k if all(pattern[k:]) else None


def deepseek_v3_hf_config(config: DeepSeekV3Config) -> dict:
    """config.json of the ``DeepseekV3ForCausalLM`` computing what ``config`` computes."""
    groups = config.moe_router_num_groups
    shared = config.moe_shared_expert_intermediate_size or 0
    differences = {
        "moe_layer_freq (Hugging Face: the first k layers dense, then all MoE)": first_dense_layers(config) is None,
        "moe_router_score_function softmax (DeepSeek-V3 routes by sigmoid)": config.moe_router_score_function != "sigmoid",
        "moe_router_enable_expert_bias off (DeepSeek-V3's router has its correction bias)":
            not config.moe_router_enable_expert_bias,
        "moe_router_group_topk (transformers ranks groups by their best 2 experts)":
            groups is not None and config.moe_router_topk // config.moe_router_group_topk != 2,
        "moe_shared_expert_intermediate_size not a multiple of moe_ffn_hidden_size": shared % config.moe_ffn_hidden_size,
        "moe_expert_capacity_factor (DeepSeek-V3 is dropless)": config.moe_expert_capacity_factor is not None,
        f"layernorm_epsilon {config.layernorm_epsilon} (the latent norms use {LATENT_NORM_EPS})":
            config.layernorm_epsilon != LATENT_NORM_EPS,
        "add_bias_linear (DeepSeek-V3 has no biases)": config.add_bias_linear or config.add_qkv_bias,
        "mtp_num_layers (transformers computes no MTP module)": bool(config.mtp_num_layers),
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"DeepseekV3ForCausalLM cannot express this model: {'; '.join(unsupported)}")
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": config.rotary_base, "factor": config.rotary_scaling_factor,
                "original_max_position_embeddings": config.original_max_position_embeddings,
                "beta_fast": config.beta_fast, "beta_slow": config.beta_slow, "mscale": config.mscale,
                "mscale_all_dim": config.mscale_all_dim}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "moe_intermediate_size": config.moe_ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_attention_heads,
        "n_shared_experts": shared // config.moe_ffn_hidden_size, "n_routed_experts": config.num_experts,
        "routed_scaling_factor": config.moe_router_topk_scaling_factor or 1.0,
        "kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank,
        "qk_rope_head_dim": config.qk_pos_emb_head_dim, "v_head_dim": config.v_head_dim,
        "qk_nope_head_dim": config.qk_head_dim, "n_group": groups or 1, "topk_group": config.moe_router_group_topk or 1,
        "num_experts_per_tok": config.moe_router_topk, "first_k_dense_replace": first_dense_layers(config),
        "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.init_method_std, "rms_norm_eps": config.layernorm_epsilon,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights, "rope_parameters": rope,
        "rope_theta": config.rotary_base, "rope_scaling": rope if config.rope_type == "yarn" else None,
        "rope_interleave": True, "attention_bias": False, "attention_dropout": config.attention_dropout,
        "num_nextn_predict_layers": 0,
    }


def _swiglu_maps(mega: str, hf: str) -> list[TensorMap]:
    return [TensorMap((mega + "linear_fc1.weight",), (hf + "gate_proj.weight", hf + "up_proj.weight"),
                      _fuse_gate_up, _split_gate_up),
            same(mega + "linear_fc2.weight", hf + "down_proj.weight")]


def _attention_maps(config: DeepSeekV3Config, mega: str, hf: str) -> list[TensorMap]:
    names = [("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"), ("kv_layernorm.weight", "kv_a_layernorm.weight"),
             ("linear_kv_up_proj.weight", "kv_b_proj.weight"), ("linear_proj.weight", "o_proj.weight")]
    if config.q_lora_rank is None:
        names.insert(0, ("linear_q_proj.weight", "q_proj.weight"))
    else:
        names[:0] = [("linear_q_down_proj.weight", "q_a_proj.weight"), ("q_layernorm.weight", "q_a_layernorm.weight"),
                     ("linear_q_up_proj.weight", "q_b_proj.weight")]
    return [same(mega + ours, hf + theirs) for ours, theirs in names]


def deepseek_v3_tensor_maps(config: DeepSeekV3Config) -> list[TensorMap]:
    maps = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab=True)]
    for n in range(config.num_layers):
        mega, hf = f"decoder.layers.{n}.", f"model.layers.{n}."
        maps.append(same(mega + "input_layernorm.weight", hf + "input_layernorm.weight"))
        maps += _attention_maps(config, mega + "self_attention.", hf + "self_attn.")
        maps.append(same(mega + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"))
        if not config.is_moe_layer(n):
            maps += _swiglu_maps(mega + "mlp.", hf + "mlp.")
            continue
        maps += routed_expert_maps(config.num_experts, mega + "mlp.", hf + "mlp.")
        maps.append(same(mega + "mlp.router.expert_bias", hf + "mlp.gate.e_score_correction_bias"))
        if config.moe_shared_expert_intermediate_size:
            maps += _swiglu_maps(mega + "mlp.shared_experts.", hf + "mlp.shared_experts.")
    maps.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if config.untie_embeddings_and_output_weights:
        maps.append(same("output_layer.weight", "lm_head.weight", vocab=True))
    return maps


DEEPSEEK_V3 = causal_lm_mapping("DeepseekV3ForCausalLM", "deepseek_v3", deepseek_v3_config, deepseek_v3_hf_config,
                                deepseek_v3_tensor_maps)

"""The decoder-only families' names in Megatron-LM's files: GPT, LLaMA and Qwen3 share one table,
Mixtral and Qwen3-MoE (a mixture of experts in every layer) add the per-expert names, DeepSeek-V3
(multi-latent attention, shared experts, the router's expert bias, MTP modules) its own."""

from __future__ import annotations

import re
from dataclasses import replace

from mega.ckpt_convert.megatron.names.table import MegatronNames, register

DECODER_ONLY = MegatronNames(
    layer_aliases={
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    },
    legacy_names={
        "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
        "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
        "language_model.encoder.final_norm.weight": "decoder.final_layernorm.weight",
        "language_model.encoder.final_norm.bias": "decoder.final_layernorm.bias",
        "language_model.encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
        "language_model.encoder.final_layernorm.bias": "decoder.final_layernorm.bias",
        "language_model.output_layer.weight": "output_layer.weight",
    },
    legacy_layer_parts={
        "input_norm.": "input_layernorm.",
        "input_layernorm.": "input_layernorm.",
        "self_attention.query_key_value.": "self_attention.linear_qkv.",
        "self_attention.dense.": "self_attention.linear_proj.",
        "post_attention_norm.": "pre_mlp_layernorm.",
        "post_attention_layernorm.": "pre_mlp_layernorm.",
        "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
        "mlp.dense_4h_to_h.": "mlp.linear_fc2.",
    },
    # Megatron-Core's last stage holds output_layer.weight as a copy of the tied embedding; older
    # models name that copy word_embeddings_for_head.
    tied_copies=("output_layer.weight", "word_embeddings_for_head.weight"),
    extra_state_layer_modules=("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                               "mlp.linear_fc2"),
    extra_state_modules=("output_layer",),
)

MIXTURE_OF_EXPERTS = replace(
    DECODER_ONLY,
    layer_aliases={**DECODER_ONLY.layer_aliases,
                   "mlp.experts.experts.linear_fc1.weight": "mlp.experts.linear_fc1.weight",
                   "mlp.experts.experts.linear_fc2.weight": "mlp.experts.linear_fc2.weight"},
    extra_state_layer_modules=("self_attention.linear_proj", "self_attention.linear_qkv"),
    expert_patterns=(re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)"),
                     re.compile(r"mlp\.experts\.(linear_fc[12]\.weight)(\d+)")),
    expert_extra_state_parts=("linear_fc1", "linear_fc2"),
)

_EXPERTS = {"mlp.experts.experts.linear_fc1.weight": "mlp.experts.linear_fc1.weight",
            "mlp.experts.experts.linear_fc2.weight": "mlp.experts.linear_fc2.weight"}
_MLA_LINEARS = tuple(f"self_attention.{name}" for name in (
    "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
    "linear_proj"))

# megatron-core's names are mega's: linear_q_down_proj, q_layernorm, linear_kv_up_proj, ...,
# mlp.shared_experts.linear_fc1, mlp.router.expert_bias (a buffer there), mtp.layers.N.eh_proj...
# Its local spec saves them as they are; its Transformer Engine spec fuses the latents' norms and
# a dense layer's pre-MLP norm into the linear layer after them (read here, never written).
DEEPSEEK = MegatronNames(
    layer_aliases={
        "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        **_EXPERTS,
    },
    legacy_layer_prefix=None,
    written_layer_names={mega: file for file, mega in _EXPERTS.items()},
    legacy_files=False,
    extra_state_layer_modules=(*_MLA_LINEARS, "mlp.linear_fc1", "mlp.linear_fc2", "mlp.shared_experts.linear_fc1",
                               "mlp.shared_experts.linear_fc2", "eh_proj"),
    extra_state_modules=("output_layer",),
    expert_patterns=MIXTURE_OF_EXPERTS.expert_patterns,
    expert_extra_state_parts=("linear_fc1", "linear_fc2"),
)

# Qwen3's QK-norm is self_attention.q_layernorm / k_layernorm in megatron-core (local and TE specs) and in mega.
register(DECODER_ONLY, "gpt", "llama", "qwen3")
register(MIXTURE_OF_EXPERTS, "mixtral", "qwen3-moe")
register(DEEPSEEK, "deepseek-v3")

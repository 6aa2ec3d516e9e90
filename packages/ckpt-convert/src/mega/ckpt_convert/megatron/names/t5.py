"""Megatron-LM's T5 names: mega's ``t5`` family already uses megatron-core's T5 names
(``encoder.layers.N...``, ``decoder.layers.N...cross_attention...``, ``encoder_relative_pos_emb``...);
its two stacks are stacked on their own in torch_dist files, and megatron-core registers the output
layer (and a learned position table) under second names too."""

from __future__ import annotations

from mega.ckpt_convert.megatron.names.table import MegatronNames, register

T5_NAMES = MegatronNames(
    layer_aliases={  # Transformer Engine's spec fuses the self-attention and MLP norms
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
        "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    },
    legacy_layer_prefix=None,
    extra_state_layer_modules=("self_attention.linear_proj", "self_attention.linear_qkv",
                               "cross_attention.linear_proj", "cross_attention.linear_q", "cross_attention.linear_kv",
                               "mlp.linear_fc1", "mlp.linear_fc2"),
    extra_state_modules=("lm_head.output_layer", "output_layer"),
    stacks=("encoder.layers.", "decoder.layers."),
    duplicate_keys={"output_layer.weight": "lm_head.output_layer.weight",
                    "output_layer.bias": "lm_head.output_layer.bias",
                    "position_embeddings.weight": "embedding.position_embeddings.weight"},
)

register(T5_NAMES, "t5")

"""Megatron-LM's DeepSeek-V3 runs (``--multi-latent-attention``): their args <-> the deepseek-v3
family's config (its names are in :mod:`mega.ckpt_convert.megatron.names.decoder`).

The fields are megatron-core's ``MLATransformerConfig``'s and Megatron-LM's flags under the same
names (``--q-lora-rank``, ``--kv-lora-rank``, ``--qk-head-dim``, ``--qk-pos-emb-head-dim``,
``--v-head-dim``, ``--rope-type``, ``--rotary-scaling-factor``, ``--mscale``, ``--mscale-all-dim``,
``--mtp-num-layers``, ``--moe-shared-expert-intermediate-size``...). megatron-core builds the
latents' norms (``q_layernorm``, ``kv_layernorm``) only with ``--qk-layernorm``, which DeepSeek's
recipes set: a run without it has no such norms and is refused. ``--moe-layer-freq`` is a list
of 0/1 per layer in the saved args (Megatron-LM evaluates ``'[0]*3+[1]*58'``), or an integer.
"""

from __future__ import annotations

import argparse
from typing import Any

from mega.ckpt_convert.errors import ConversionError
from mega.models.moe.config import moe_layer_pattern

MLA_SAME = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
            "v_head_dim", "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
            "beta_slow", "mscale", "mscale_all_dim", "mtp_num_layers", "mtp_loss_scaling_factor",
            "moe_shared_expert_intermediate_size", "moe_layer_freq")


def is_deepseek_args(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "multi_latent_attention", False))


def deepseek_settings(args: argparse.Namespace, where: str) -> dict[str, Any]:
    """What a multi-latent-attention run's args say beside the MoE transformer's settings."""
    if not getattr(args, "qk_layernorm", False):
        raise ConversionError(f"{where}: args.multi_latent_attention without qk_layernorm: megatron-core's "
                              "multi-latent attention then has no norms on its latents, which DeepSeek-V3's has")
    if not getattr(args, "num_experts", None):
        raise ConversionError(f"{where}: args.multi_latent_attention without num_experts; mega's deepseek-v3 "
                              "family is a mixture of experts")
    settings = {name: getattr(args, name) for name in MLA_SAME if getattr(args, name, None) is not None}
    if "moe_layer_freq" in settings:  # mega keeps Megatron's expression as text; a list reads back the same
        settings["moe_layer_freq"] = str(settings["moe_layer_freq"])
    return settings


def deepseek_args(config, args: argparse.Namespace) -> None:
    """Add a DeepSeek-V3 run's arguments to ``args`` (the MoE transformer's)."""
    for name in MLA_SAME:
        setattr(args, name, getattr(config, name))
    freq = config.moe_layer_freq.replace(" ", "")
    args.moe_layer_freq = [int(moe) for moe in moe_layer_pattern(freq, config.num_layers)] if "[" in freq \
        else int(freq.strip("()"))
    args.qk_layernorm = True  # megatron-core's MLA has its latents' norms only with it

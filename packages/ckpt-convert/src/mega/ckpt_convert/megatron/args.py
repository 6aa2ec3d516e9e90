"""Megatron-LM's saved ``args`` (an ``argparse.Namespace``) <-> mega's model config.

Megatron checkpoints say what model they hold only through the arguments of the run that saved
them, so the config is read from there, never guessed from the tensors; the tensors are then
checked against it (:mod:`mega.ckpt_convert.megatron.layout`). Exports write the arguments
Megatron-LM's ``load_checkpoint`` and ``--use-checkpoint-args`` read back.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.bert_args import bert_args
from mega.ckpt_convert.megatron.deepseek_args import deepseek_args, deepseek_settings, is_deepseek_args
from mega.ckpt_convert.megatron.t5_args import is_t5_args, t5_args, t5_settings
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec

# Megatron argument -> mega TransformerConfig field, where both mean the same.
SAME = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "seq_length",
        "max_position_embeddings", "make_vocab_size_divisible_by", "rotary_base", "swiglu", "openai_gelu",
        "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights", "init_method_std",
        "hidden_dropout", "attention_dropout", "normalization", "use_rope_scaling", "rope_scaling_factor",
        "squared_relu", "qk_layernorm")
# Megatron features mega's GPT/LLaMA models do not have: argument -> the value that means "off".
UNSUPPORTED = {
    "apply_residual_connection_post_layernorm": False,
    "rotary_interleaved": False, "multi_latent_attention": False,
    "apply_layernorm_1p": False, "mtp_num_layers": None,
}
# Megatron's MoE arguments, which the mixtral family's config names the same (``--num-experts`` too).
MOE_SAME = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
            "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
            "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type", "moe_grouped_gemm",
            "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
            "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_bias_update_rate")
ARGS_OF_SHAPES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "padded_vocab_size", "max_position_embeddings", "swiglu", "add_bias_linear",
                  "add_qkv_bias", "untie_embeddings_and_output_weights", "normalization",
                  "position_embedding_type", "num_experts", "moe_ffn_hidden_size")


def _arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def model_settings(args: argparse.Namespace, where: str, model_family: str | None = None) -> dict[str, Any]:
    """mega model-config fields from Megatron args (``where`` names the file in errors): a T5's
    when ``model_family`` or the args say T5, else a TransformerConfig's."""
    if model_family == "t5" or (model_family is None and is_t5_args(args)):
        return t5_settings(args, where)
    deepseek = is_deepseek_args(args)
    for name, off in UNSUPPORTED.items():
        value = _arg(args, name, off)
        if deepseek and name in ("multi_latent_attention", "mtp_num_layers"):
            continue
        if value not in (off, None, False, 0):
            raise ConversionError(f"{where}: args.{name} is {value!r}; mega's GPT/LLaMA models have no such "
                                  "feature, so this checkpoint cannot be converted")
    if _arg(args, "rotary_percent", 1.0) not in (None, 1.0):
        raise ConversionError(f"{where}: args.rotary_percent is {args.rotary_percent}; mega rotates whole heads")
    missing = [name for name in ("num_layers", "hidden_size", "num_attention_heads") if _arg(args, name) is None]
    if missing:
        raise ConversionError(f"{where}: args lack {', '.join(missing)}; the model cannot be known")
    settings = {name: getattr(args, name) for name in SAME if _arg(args, name) is not None}
    if deepseek:  # its own MoE layers: first dense ones, shared experts
        settings.update({name: getattr(args, name) for name in MOE_SAME if _arg(args, name) is not None})
        settings.update(deepseek_settings(args, where))
        settings.pop("qk_layernorm", None)  # the latents' norms, always there in mega's multi-latent attention
    elif _arg(args, "num_experts"):  # every layer's MLP a mixture of experts: the mixtral family's model
        settings.update({name: getattr(args, name) for name in MOE_SAME if _arg(args, name) is not None})
        if (_arg(args, "moe_layer_freq") or 1) != 1:
            raise ConversionError(f"{where}: args.moe_layer_freq is {args.moe_layer_freq}; mega's MoE models have "
                                  "experts in every layer")
        if _arg(args, "moe_shared_expert_intermediate_size"):
            raise ConversionError(f"{where}: args.moe_shared_expert_intermediate_size is set; mega's MoE models "
                                  "have no shared experts")
    heads = args.num_attention_heads
    settings["num_query_groups"] = (_arg(args, "num_query_groups") or heads) if _arg(args, "group_query_attention") \
        else heads
    position = _arg(args, "position_embedding_type") or (
        "rope" if _arg(args, "use_rotary_position_embeddings") else "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise ConversionError(f"{where}: args.position_embedding_type {position!r} has no mega equivalent")
    settings["position_embedding_type"] = position
    epsilon = _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon"))
    if epsilon is not None:
        settings["layernorm_epsilon"] = epsilon
    # The tokenizer's size when the run recorded it, else the padded size (the padding rows then
    # count as tokens, which changes nothing the model computes for real tokens).
    settings["vocab_size"] = _arg(args, "vocab_size") or _arg(args, "padded_vocab_size")
    if settings["vocab_size"] is None:
        raise ConversionError(f"{where}: args have neither vocab_size nor padded_vocab_size")
    if settings.get("max_position_embeddings") is None:
        settings["max_position_embeddings"] = settings.get("seq_length")
    return {name: value for name, value in settings.items() if value is not None}


def family_of(settings: dict[str, Any]) -> str:
    """Multi-latent attention makes DeepSeek-V3; experts make Mixtral (Qwen3-MoE with QK-norm); LLaMA is the RMSNorm + SwiGLU + RoPE decoder
    (Qwen3 with QK-norm); everything else is GPT (the two share one model); a decoder stack besides
    the encoder's is T5."""
    if "decoder_num_layers" in settings:
        return "t5"
    qk_norm = settings.get("qk_layernorm")
    if settings.get("multi_latent_attention"):
        return "deepseek-v3"
    if settings.get("num_experts"):
        return "qwen3-moe" if qk_norm else "mixtral"
    llama = (settings.get("normalization") == "RMSNorm" and settings.get("swiglu")
             and settings.get("position_embedding_type") == "rope")
    if llama and qk_norm:
        return "qwen3"
    return "llama" if llama else "gpt"


def layout_of(args: argparse.Namespace) -> tuple[int, int]:
    return (_arg(args, "tensor_model_parallel_size") or 1, _arg(args, "pipeline_model_parallel_size") or 1)


def shape_args(args: argparse.Namespace) -> str:
    """The arguments that decide the tensors' shapes, for an error message."""
    return ", ".join(f"{name}={_arg(args, name)!r}" for name in ARGS_OF_SHAPES if hasattr(args, name))


def tokenizer_from_args(args: argparse.Namespace) -> tuple[TokenizerSpec | None, list[str]]:
    """The run's tokenizer when its files are still where the args say; else None and a warning."""
    kind = _arg(args, "tokenizer_type")
    if kind is None:
        return None, []
    files = {key: _arg(args, key) for key in ("vocab_file", "merge_file", "tokenizer_model")}
    absent = [f"{key} {value}" for key, value in files.items() if value and not Path(value).is_file()]
    if absent:
        return None, [f"the checkpoint's tokenizer ({kind}) was not carried: {', '.join(absent)} not found"]
    options = TokenizerOptions(**{key: str(Path(value).resolve()) if value else None for key, value in files.items()},
                               vocab_size=_arg(args, "vocab_size"))
    return TokenizerSpec(kind, options), []


def _refuse_rope_megatron_lacks(config) -> None:
    """Megatron-LM's GPT rotates by plain RoPE or LLaMA-3.1's scaling (``--use-rope-scaling``,
    its other parameters fixed); any other RoPE would load as another model."""
    kind = getattr(config, "rope_type", "rope")
    if kind not in ("rope", "llama3"):
        raise ConversionError(f"Megatron-LM's GPT has no --rope-type {kind} (plain RoPE and --use-rope-scaling only)")
    fixed = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    changed = [name for name, value in fixed.items() if getattr(config, name) != value]
    if kind == "llama3" and changed:
        raise ConversionError(f"Megatron-LM's --use-rope-scaling keeps {', '.join(changed)} at LLaMA-3.1's "
                              f"{fixed}; this model's differ")


def args_for(config, tensor_parallel_size: int, pipeline_parallel_size: int, padded_vocab_size: int,
             iteration: int, ckpt_format: str, tokenizer: TokenizerSpec | None) -> argparse.Namespace:
    """The Megatron-LM arguments of a run of ``config`` at this layout (what ``--use-checkpoint-args``
    and ``load_checkpoint``'s checks read)."""
    if hasattr(config, "decoder_num_layers"):  # an encoder-decoder: pretrain_t5.py's arguments
        args = t5_args(config)
    else:
        if getattr(config, "mlp_activation", None) == "relu":
            raise ConversionError("Megatron-LM has no argument for a ReLU MLP (--activation relu): its "
                                  "checkpoint would load as a GELU model")
        if not getattr(config, "multi_latent_attention", False):
            _refuse_rope_megatron_lacks(config)
        args = argparse.Namespace(**{name: getattr(config, name) for name in SAME})
        args.num_query_groups = config.num_query_groups
        if getattr(config, "num_experts", None):
            for name in MOE_SAME:
                setattr(args, name, getattr(config, name))
            args.expert_model_parallel_size, args.expert_tensor_parallel_size = 1, tensor_parallel_size
        args.group_query_attention = config.num_query_groups != config.num_attention_heads
        args.position_embedding_type = config.position_embedding_type
        args.use_rotary_position_embeddings = config.position_embedding_type == "rope"
        args.norm_epsilon = config.layernorm_epsilon
        if hasattr(config, "bert_pre_layernorm"):  # pretrain_bert.py's
            bert_args(config, args)
        if getattr(config, "multi_latent_attention", False):
            deepseek_args(config, args)
    args.vocab_size = config.vocab_size
    args.padded_vocab_size = padded_vocab_size
    args.rotary_percent = 1.0
    args.tensor_model_parallel_size = tensor_parallel_size
    args.pipeline_model_parallel_size = pipeline_parallel_size
    args.virtual_pipeline_model_parallel_size = None
    args.data_parallel_size = 1
    args.world_size = tensor_parallel_size * pipeline_parallel_size
    args.iteration = iteration
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    args.ckpt_format = ckpt_format
    args.transformer_impl = "local"
    args.use_dist_ckpt = ckpt_format != "torch"
    if tokenizer is not None:
        args.tokenizer_type = tokenizer.type
        args.vocab_file, args.merge_file = tokenizer.options.vocab_file, tokenizer.options.merge_file
        args.tokenizer_model = tokenizer.options.tokenizer_model
    return args

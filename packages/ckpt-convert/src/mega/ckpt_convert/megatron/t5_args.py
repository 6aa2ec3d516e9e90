"""Megatron-LM's T5 (``pretrain_t5.py``, megatron-core's ``T5Model``): its args (its names are in
:mod:`mega.ckpt_convert.megatron.names.t5`). What the args must
say, and what they set in mega's :class:`~mega.models.t5.config.T5Config`:

* the models mega's t5 family computes: learned absolute positions (Megatron-LM's default) or
  relative-position buckets (``--position-embedding-type``), LayerNorm (the default) or RMSNorm,
  with or without linear biases (``--disable-bias-linear``), multi-head attention, an ungated
  exact GELU MLP (Megatron-LM's default activation). Anything else (rope, SwiGLU,
  ``--openai-gelu``, a QKV bias alone...) is refused by name;
* megatron-core's T5 conventions, which differ from Google's T5: attention scaled by
  1/sqrt(kv_channels), a tied output layer fed the decoder's output unscaled and given a bias
  (``softmax_scale``, ``scale_tied_output``, ``output_layer_bias``).

Exports write back only models with those conventions: a Hugging Face T5 computes something
else, and no Megatron-LM arguments describe it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from mega.ckpt_convert.errors import ConversionError

# Megatron argument -> the value every model mega's t5 family computes has (None: unset is fine).
REQUIRED = {"swiglu": False, "squared_relu": False, "openai_gelu": False, "group_query_attention": False,
            "qk_layernorm": False, "apply_residual_connection_post_layernorm": False, "apply_layernorm_1p": False}
# Megatron argument -> the values mega's t5 family computes (the T5Config field of the same name).
CHOICES = {"position_embedding_type": ("learned_absolute", "relative"), "normalization": ("LayerNorm", "RMSNorm")}
# Megatron argument -> T5Config field, where both mean the same.
SAME = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "decoder_seq_length",
        "make_vocab_size_divisible_by", "relative_attention_num_buckets", "relative_attention_max_distance",
        "untie_embeddings_and_output_weights", "init_method_std", "hidden_dropout", "attention_dropout",
        *CHOICES, "add_bias_linear")


def _arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def is_t5_args(args: argparse.Namespace) -> bool:
    """pretrain_t5.py requires a decoder sequence length, which no decoder-only run sets."""
    return _arg(args, "decoder_seq_length") is not None


def t5_settings(args: argparse.Namespace, where: str) -> dict[str, Any]:
    """T5Config fields from a Megatron-LM T5 run's args (``where`` names the file in errors)."""
    for name, needed in REQUIRED.items():
        value = _arg(args, name)
        if value is not None and value != needed:
            raise ConversionError(f"{where}: args.{name} is {value!r}; mega's t5 family computes the T5 with "
                                  f"{name}={needed!r}, so this checkpoint cannot be converted")
    for name, choices in CHOICES.items():
        value = _arg(args, name)
        if value is not None and value not in choices:
            raise ConversionError(f"{where}: args.{name} is {value!r}; mega's t5 family computes "
                                  f"{' or '.join(map(repr, choices))}, so this checkpoint cannot be converted")
    if _arg(args, "add_qkv_bias") and not _arg(args, "add_bias_linear", True):
        raise ConversionError(f"{where}: args.add_qkv_bias without add_bias_linear (a QKV bias alone); mega's t5 "
                              "family has biases on every linear layer or on none")
    missing = [name for name in ("hidden_size", "num_attention_heads", "decoder_seq_length")
               if _arg(args, name) is None]
    if _arg(args, "encoder_num_layers", _arg(args, "num_layers")) is None:
        missing.append("encoder_num_layers")
    if missing:
        raise ConversionError(f"{where}: args lack {', '.join(missing)}; the model cannot be known")
    settings = {name: getattr(args, name) for name in SAME if _arg(args, name) is not None}
    settings["num_layers"] = _arg(args, "encoder_num_layers") or args.num_layers
    settings["decoder_num_layers"] = _arg(args, "decoder_num_layers") or settings["num_layers"]
    settings["seq_length"] = _arg(args, "encoder_seq_length") or _arg(args, "seq_length")
    settings["vocab_size"] = _arg(args, "vocab_size") or _arg(args, "padded_vocab_size")
    if settings.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        settings["position_embedding_type"] = "learned_absolute"  # Megatron-LM's default, when unsaid
        settings["max_position_embeddings"] = _arg(args, "max_position_embeddings")
    settings.setdefault("normalization", "LayerNorm")
    settings.setdefault("add_bias_linear", True)
    if settings["vocab_size"] is None:
        raise ConversionError(f"{where}: args have neither vocab_size nor padded_vocab_size")
    epsilon = _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon"))
    if epsilon is not None:
        settings["layernorm_epsilon"] = epsilon
    kv_channels = settings.get("kv_channels") or args.hidden_size // args.num_attention_heads
    tied = not settings.get("untie_embeddings_and_output_weights", False)
    settings.update(feed_forward_proj="gelu", softmax_scale=_arg(args, "softmax_scale") or 1 / math.sqrt(kv_channels),
                    scale_tied_output=False, output_layer_bias=tied)
    return {name: value for name, value in settings.items() if value is not None}


def t5_args(config) -> argparse.Namespace:
    """The model arguments of a Megatron-LM T5 run of ``config`` (the layout's are added by the caller)."""
    differences = {
        "--feed-forward-proj gelu": config.feed_forward_proj != "gelu",
        "--softmax-scale 1/sqrt(kv_channels)": not math.isclose(config.softmax_scale, 1 / math.sqrt(config.kv_channels)),
        "--no-scale-tied-output": config.scale_tied_output and not config.untie_embeddings_and_output_weights,
        "--output-layer-bias exactly when tied": config.output_layer_bias == config.untie_embeddings_and_output_weights,
    }
    missing = [flag for flag, differs in differences.items() if differs]
    if missing:
        raise ConversionError(f"the t5 model is not megatron-core's T5, which needs {', '.join(missing)}: "
                              "Megatron-LM cannot compute it (a Hugging Face T5 attends unscaled and scales its tied "
                              "output layer's input)")
    args = argparse.Namespace(**{name: getattr(config, name) for name in SAME}, **REQUIRED)
    args.add_qkv_bias = config.add_bias_linear
    args.num_layers = args.encoder_num_layers = config.num_layers
    args.decoder_num_layers = config.decoder_num_layers
    args.seq_length = args.encoder_seq_length = config.seq_length
    args.max_position_embeddings = config.max_position_embeddings or max(config.seq_length, config.decoder_seq_length)
    args.num_query_groups = config.num_attention_heads
    args.norm_epsilon = config.layernorm_epsilon
    return args

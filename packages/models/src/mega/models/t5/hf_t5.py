"""The ``t5`` family as Hugging Face's ``T5ForConditionalGeneration``: config.json and weights.

* Self-attention: separate ``q/k/v`` in Hugging Face, Megatron's per-head ``[q; k; v]`` rows in
  ``linear_qkv``; cross-attention: ``q`` alone, ``[k; v]`` per head in ``linear_kv``.
* Relative-position tables: Hugging Face keeps them in block 0 of each stack
  (``...block.0.layer.0.SelfAttention.relative_attention_bias``), ``[buckets, heads]`` as mega.
* Gated-GELU (v1.1): ``linear_fc1`` is ``[wi_0 (gate); wi_1 (up)]``.
* One word embedding (``shared``) serves encoder and decoder; with tied embeddings (v1.0) the
  output layer is the same weight (``lm_head.weight`` absent or a duplicate), its input scaled
  by d_model**-0.5; v1.1 has its own ``lm_head.weight`` and no scaling. A transformers-5 model
  marked unscaled whose files hold no ``lm_head.weight`` (tied and unscaled, which no released
  T5 is) has no mega equivalent: the conversion names the missing tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from mega.core.model_family import HFMapping, TensorMap
from mega.models.hf_mapping import interleave_qkv, read_field, same
from mega.models.t5.config import T5Config

# T5Config's defaults for the keys read here (config.json may leave them out).
DEFAULTS = {
    "vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": None,
    "num_heads": 8, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6, "initializer_factor": 1.0, "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
}
# T5 v1.0 and v1.1 use these; pad_token_id doubles as the decoder's start token.
SPECIAL_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}


def _untied(hf_config: Mapping[str, Any]) -> bool:
    """T5 v1.1: a separate ``lm_head`` and no d_model**-0.5 scaling before it. Older configs say
    so with ``tie_word_embeddings: false``; transformers 5 writes ``tie_word_embeddings: true``
    always and ``scale_decoder_outputs: false`` for v1.1 (storing ``lm_head.weight`` when it differs)."""
    return hf_config.get("tie_word_embeddings", True) is False or hf_config.get("scale_decoder_outputs") is False


# feed_forward_proj -> the activation transformers applies (its dense_act_fn): "gelu" is exact,
# "gelu_new" the tanh approximation.
HF_ACTIVATIONS = {"relu": "relu", "gated-gelu": "gelu_new", "gelu": "gelu"}


def t5_config(hf_config: Mapping[str, Any], **overrides) -> T5Config:
    """The mega config computing what ``T5ForConditionalGeneration`` computes with this config.json."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    proj = get("feed_forward_proj")
    if proj not in HF_ACTIVATIONS:
        raise ValueError(f"feed_forward_proj {proj!r} has no mega equivalent ({', '.join(HF_ACTIVATIONS)} do)")
    settings = dict(
        num_layers=get("num_layers"), decoder_num_layers=get("num_decoder_layers") or get("num_layers"),
        hidden_size=get("d_model"), ffn_hidden_size=get("d_ff"), num_attention_heads=get("num_heads"),
        kv_channels=get("d_kv"), vocab_size=get("vocab_size"),
        # T5 has no position table; the sample lengths are Megatron's defaults (512 is the original T5's).
        seq_length=hf_config.get("n_positions", 512), decoder_seq_length=128,
        relative_attention_num_buckets=get("relative_attention_num_buckets"),
        relative_attention_max_distance=get("relative_attention_max_distance"),
        feed_forward_proj=proj, layernorm_epsilon=get("layer_norm_epsilon"),
        untie_embeddings_and_output_weights=_untied(hf_config),
        hidden_dropout=get("dropout_rate"), attention_dropout=get("dropout_rate"),
    )
    return T5Config(**{**settings, **overrides})


def t5_hf_config(config: T5Config) -> dict:
    """config.json of the ``T5ForConditionalGeneration`` computing what ``config`` computes."""
    if config.hidden_dropout != config.attention_dropout:
        raise ValueError(f"T5ForConditionalGeneration has one dropout_rate; --hidden-dropout {config.hidden_dropout} "
                         f"!= --attention-dropout {config.attention_dropout}")
    megatron_only = {
        f"--softmax-scale {config.softmax_scale} (T5 attends unscaled)": config.softmax_scale != 1.0,
        "--no-scale-tied-output": not config.scale_tied_output and not config.untie_embeddings_and_output_weights,
        "--output-layer-bias": config.output_layer_bias,
        "--position-embedding-type learned_absolute": not config.relative,
        "--normalization LayerNorm": config.normalization == "LayerNorm",
        "--add-bias-linear": config.add_bias_linear,
    }
    refused = [flag for flag, present in megatron_only.items() if present]
    if refused:
        raise ValueError(f"T5ForConditionalGeneration cannot compute this model: it has {', '.join(refused)} "
                         "(Megatron-Core's T5 conventions, which Hugging Face's T5 lacks)")
    gated = config.feed_forward_proj == "gated-gelu"
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
        "vocab_size": config.vocab_size, "d_model": config.hidden_size, "d_kv": config.kv_channels,
        "d_ff": config.ffn_hidden_size, "num_layers": config.num_layers,
        "num_decoder_layers": config.decoder_num_layers, "num_heads": config.num_attention_heads,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "dropout_rate": config.hidden_dropout, "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_factor": 1.0, "feed_forward_proj": config.feed_forward_proj,
        "dense_act_fn": HF_ACTIVATIONS[config.feed_forward_proj], "is_gated_act": gated,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "is_encoder_decoder": True, "use_cache": True, **SPECIAL_TOKENS,
    }


# --- Weights --------------------------------------------------------------------------------------

def _fuse_qkv(heads: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
    return (interleave_qkv(q, k, v, heads),)


def _split_qkv(heads: int, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.reshape(-1, qkv.shape[1]) for t in qkv.reshape(heads, 3, -1, qkv.shape[1]).unbind(1))


def _fuse_kv(heads: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.stack([k.reshape(heads, -1, k.shape[1]), v.reshape(heads, -1, v.shape[1])], 1).reshape(-1, k.shape[1]),)


def _split_kv(heads: int, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.reshape(-1, kv.shape[1]) for t in kv.reshape(heads, 2, -1, kv.shape[1]).unbind(1))


def _concat(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.cat([gate, up], dim=0),)


def _halves(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(fc1.chunk(2, dim=0))


def _map(mega: str, other: tuple[str, ...], to_mega, from_mega) -> TensorMap:
    return TensorMap((mega,), other, to_mega, from_mega)


def _attention(mega: str, hf: str, heads: int, self_attention: bool) -> list[TensorMap]:
    if self_attention:
        maps = [_map(mega + "linear_qkv.weight", tuple(hf + f"{p}.weight" for p in "qkv"),
                     partial(_fuse_qkv, heads), partial(_split_qkv, heads))]
    else:
        maps = [same(mega + "linear_q.weight", hf + "q.weight"),
                _map(mega + "linear_kv.weight", (hf + "k.weight", hf + "v.weight"),
                     partial(_fuse_kv, heads), partial(_split_kv, heads))]
    return maps + [same(mega + "linear_proj.weight", hf + "o.weight")]


def _mlp(config: T5Config, mega: str, hf: str) -> list[TensorMap]:
    if config.gated:
        fc1 = _map(mega + "linear_fc1.weight", (hf + "wi_0.weight", hf + "wi_1.weight"), _concat, _halves)
    else:
        fc1 = same(mega + "linear_fc1.weight", hf + "wi.weight")
    return [fc1, same(mega + "linear_fc2.weight", hf + "wo.weight")]


def t5_tensor_maps(config: T5Config) -> list[TensorMap]:
    heads = config.num_attention_heads
    maps = [same("embedding.word_embeddings.weight", "shared.weight", vocab=True)]
    for stack, count in (("encoder", config.num_layers), ("decoder", config.decoder_num_layers)):
        maps.append(same(f"{stack}_relative_pos_emb.relative_attention_bias.weight",
                         f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        for n in range(count):
            mega, hf = f"{stack}.layers.{n}.", f"{stack}.block.{n}.layer."
            maps.append(same(mega + "input_layernorm.weight", hf + "0.layer_norm.weight"))
            maps += _attention(mega + "self_attention.", hf + "0.SelfAttention.", heads, self_attention=True)
            mlp = 1
            if stack == "decoder":
                maps.append(same(mega + "pre_cross_attn_layernorm.weight", hf + "1.layer_norm.weight"))
                maps += _attention(mega + "cross_attention.", hf + "1.EncDecAttention.", heads, self_attention=False)
                mlp = 2
            maps.append(same(mega + "pre_mlp_layernorm.weight", hf + f"{mlp}.layer_norm.weight"))
            maps += _mlp(config, mega + "mlp.", hf + f"{mlp}.DenseReluDense.")
        maps.append(same(f"{stack}.final_layernorm.weight", f"{stack}.final_layer_norm.weight"))
    if config.untie_embeddings_and_output_weights:
        maps.append(same("lm_head.output_layer.weight", "lm_head.weight", vocab=True))
    return maps


def t5_copies(config: T5Config) -> dict[str, str]:
    """The stacks' views of the shared embedding, and a tied lm_head: the same tensor where saved."""
    copies = {f"{stack}.embed_tokens.weight": "shared.weight" for stack in ("encoder", "decoder")}
    if not config.untie_embeddings_and_output_weights:
        copies["lm_head.weight"] = "shared.weight"
    return copies


T5_MAPPING = HFMapping(
    architecture="T5ForConditionalGeneration",
    model_type="t5",
    base_model_prefix="",
    config_from_hf=t5_config,
    config_to_hf=t5_hf_config,
    tensor_maps=t5_tensor_maps,
    # The stacks' views of the shared embedding, and a tied lm_head, saved as duplicates.
    copies=t5_copies,
)

"""The ``bert`` family as Hugging Face's ``BertForPreTraining`` / ``BertForMaskedLM`` /
``BertModel``: config.json and weights, both ways.

* QKV: separate ``query``/``key``/``value`` in Hugging Face, interleaved per head in Megatron.
* Heads: ``BertForPreTraining`` has all of them (MLM transform and bias under
  ``cls.predictions``, pooler, ``cls.seq_relationship``); ``BertForMaskedLM`` has no pooler and
  no binary head (mega: ``--bert-no-binary-head``); a bare ``BertModel`` has the pooler and no
  ``cls.*`` at all. Heads a directory lacks are ``optional``: the converter initialises them and
  says so. Written back, a model with the binary head is a ``BertForPreTraining``, one without a
  ``BertForMaskedLM``.
* The MLM decoder is the word embedding (``tie_word_embeddings``, BERT's default); its bias is
  ``cls.predictions.bias`` (``cls.predictions.decoder.bias`` is the same tensor where saved).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from mega.core.model_family import HFMapping, TensorMap
from mega.models.bert.config import BertConfig
from mega.models.hf_mapping import interleave_qkv, read_field, same, split_qkv

# BertConfig's defaults for the keys read here (config.json may leave them out).
DEFAULTS = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
    "initializer_range": 0.02, "layer_norm_eps": 1e-12, "position_embedding_type": "absolute",
    "is_decoder": False, "add_cross_attention": False, "tie_word_embeddings": True,
}
# Hugging Face activation -> mega's openai_gelu (tanh approximation); "gelu" is the exact erf form.
ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
# Architecture -> whether the model has the pooler and binary head (mega's bert_binary_head).
ARCHITECTURES = {"BertForPreTraining": True, "BertModel": True, "BertForMaskedLM": False}


def bert_config(hf_config: Mapping[str, Any], **overrides) -> BertConfig:
    """The mega config computing what the directory's BERT architecture computes."""
    def get(key):
        return read_field(hf_config, DEFAULTS, key)

    architectures = hf_config.get("architectures") or ["BertForPreTraining"]
    if architectures[0] not in ARCHITECTURES:
        raise ValueError(f"BERT architecture {architectures[0]} has no mega equivalent "
                         f"(mega converts {', '.join(ARCHITECTURES)})")
    if get("hidden_act") not in ACTIVATIONS:
        raise ValueError(f"BERT hidden_act {get('hidden_act')!r} has no mega equivalent "
                         f"(mega has {', '.join(ACTIVATIONS)})")
    if get("position_embedding_type") != "absolute":
        raise ValueError(f"BERT position_embedding_type {get('position_embedding_type')!r} has no mega "
                         "equivalent (mega learns absolute positions)")
    if get("is_decoder") or get("add_cross_attention"):
        raise ValueError("BERT as a decoder (is_decoder, add_cross_attention) has no mega equivalent")
    settings = dict(
        num_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"), num_attention_heads=get("num_attention_heads"),
        seq_length=get("max_position_embeddings"), max_position_embeddings=get("max_position_embeddings"),
        vocab_size=get("vocab_size"), num_tokentypes=get("type_vocab_size"),
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        layernorm_epsilon=get("layer_norm_eps"), openai_gelu=ACTIVATIONS[get("hidden_act")],
        add_bias_linear=True, untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        hidden_dropout=get("hidden_dropout_prob"), attention_dropout=get("attention_probs_dropout_prob"),
        init_method_std=get("initializer_range"), bert_binary_head=ARCHITECTURES[architectures[0]],
    )
    return BertConfig(**{**settings, **overrides})


def bert_hf_config(config: BertConfig) -> dict:
    """config.json of the ``BertForPreTraining`` (binary head) or ``BertForMaskedLM`` computing
    what ``config`` computes (BertConfig's own validation already refused what BERT lacks)."""
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        raise ValueError("kv_channels (BERT heads split hidden_size)")
    if abs(config.attention_softmax_scale * config.kv_channels ** 0.5 - 1.0) > 1e-12:
        raise ValueError("softmax_scale (BERT scales by 1/sqrt(head size))")
    if config.bert_pre_layernorm:
        raise ValueError("--bert-pre-layernorm (Hugging Face's BERT is post-LN: pre-LN weights make another model)")
    architecture = "BertForPreTraining" if config.bert_binary_head else "BertForMaskedLM"
    return {
        "architectures": [architecture], "model_type": "bert",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.ffn_hidden_size, "hidden_act": "gelu_new" if config.openai_gelu else "gelu",
        "hidden_dropout_prob": config.hidden_dropout, "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_position_embeddings, "type_vocab_size": config.num_tokentypes,
        "initializer_range": config.init_method_std, "layer_norm_eps": config.layernorm_epsilon,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
    }


# --- Weights --------------------------------------------------------------------------------------

def _qkv_to_mega(heads: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor]:
    return (interleave_qkv(query, key, value, heads),)


def _qkv_from_mega(config: BertConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return split_qkv(qkv, config)


def bert_tensor_maps(config: BertConfig) -> list[TensorMap]:
    kinds = ("weight", "bias")
    maps = [same("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight", vocab=True),
            same("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight")]
    if config.num_tokentypes > 0:
        maps.append(same("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"))
    maps += [same(f"embedding.layernorm.{kind}", f"bert.embeddings.LayerNorm.{kind}") for kind in kinds]
    for n in range(config.num_layers):
        mega, hf = f"encoder.layers.{n}.", f"bert.encoder.layer.{n}."
        for kind in kinds:
            maps += [
                TensorMap((mega + f"self_attention.linear_qkv.{kind}",),
                          tuple(hf + f"attention.self.{name}.{kind}" for name in ("query", "key", "value")),
                          partial(_qkv_to_mega, config.num_attention_heads), partial(_qkv_from_mega, config)),
                same(mega + f"self_attention.linear_proj.{kind}", hf + f"attention.output.dense.{kind}"),
                same(mega + f"post_self_attn_layernorm.{kind}", hf + f"attention.output.LayerNorm.{kind}"),
                same(mega + f"mlp.linear_fc1.{kind}", hf + f"intermediate.dense.{kind}"),
                same(mega + f"mlp.linear_fc2.{kind}", hf + f"output.dense.{kind}"),
                same(mega + f"post_mlp_layernorm.{kind}", hf + f"output.LayerNorm.{kind}"),
            ]
    maps += [same(f"lm_head.dense.{kind}", f"cls.predictions.transform.dense.{kind}") for kind in kinds]
    maps += [same(f"lm_head.layer_norm.{kind}", f"cls.predictions.transform.LayerNorm.{kind}") for kind in kinds]
    maps.append(same("output_layer.bias", "cls.predictions.bias", vocab=True))
    if config.untie_embeddings_and_output_weights:
        maps.append(same("output_layer.weight", "cls.predictions.decoder.weight", vocab=True))
    if config.bert_binary_head:
        maps += [same(f"pooler.dense.{kind}", f"bert.pooler.dense.{kind}") for kind in kinds]
        maps += [same(f"binary_head.{kind}", f"cls.seq_relationship.{kind}") for kind in kinds]
    return maps


def bert_copies(config: BertConfig) -> dict[str, str]:
    """The MLM decoder's weight (tied: the word embedding) and bias (``cls.predictions.bias``),
    which some saves hold under their own names too."""
    copies = {"cls.predictions.decoder.bias": "cls.predictions.bias"}
    if not config.untie_embeddings_and_output_weights:
        copies["cls.predictions.decoder.weight"] = "bert.embeddings.word_embeddings.weight"
    return copies


def bert_buffers(config: BertConfig) -> dict[str, torch.Tensor]:
    """The position-ids buffer transformers 4.30 and older saved."""
    return {"bert.embeddings.position_ids": torch.arange(config.max_position_embeddings).expand((1, -1))}


BERT = HFMapping(
    architecture="BertForPreTraining",
    model_type="bert",
    base_model_prefix="bert.",
    config_from_hf=bert_config,
    config_to_hf=bert_hf_config,
    tensor_maps=bert_tensor_maps,
    copies=bert_copies,
    buffers=bert_buffers,
    also_reads=("BertModel", "BertForMaskedLM"),
    # A bare BertModel has no cls.* heads; one saved without its pooling layer has no pooler.
    optional=(r"cls\..*", r"bert\.pooler\..*"),
)

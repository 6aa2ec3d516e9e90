"""The pieces the Hugging Face mappings of GPT-2 (``hf_gpt2``) and LLaMA (``hf_llama``) share.

A mapping (:class:`mega.core.model_family.HFMapping`) lists a model's weights as
:class:`~mega.core.model_family.TensorMap` s, each converting a few tensors together, so a
converter holds one layer at a time. The layouts that differ between the two sides:

* QKV: Hugging Face keeps separate (LLaMA) or concatenated ``[q; k; v]`` (GPT-2) projections;
  Megatron interleaves them per query group: ``[groups, (heads/groups)*d + d + d, hidden]``.
* Vocabulary: padded with zero rows to Megatron's padded size in mega, cut back on the way out.

The whole-state-dict helpers at the end (:func:`hf_to_mega`, :func:`mega_to_hf`) apply a
mapping to tensors already in memory: tests and benchmarks that hold a ``transformers`` model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mega.core.model_family import HFMapping, TensorMap
from mega.models.config import TransformerConfig

Tensors = Mapping[str, torch.Tensor]


# --- Layout helpers ------------------------------------------------------------------------------

def refuse_headless(hf_config: Mapping[str, Any], headless: str, headed: str) -> None:
    """A decoder's base model alone (``LlamaModel``) has no ``lm_head``, which an untied mega
    decoder must have: refused, naming the class to convert instead."""
    if headless in (hf_config.get("architectures") or []):
        raise ValueError(f"architectures {headless} is the base model alone, without the lm_head of {headed}, "
                         f"which mega's model computes; mega converts {headed} directories (save the model with "
                         "its head, or load it into that class)")


def tied_lm_head(embedding: str):
    """``copies`` of a causal LM: with tied embeddings its directory may hold ``lm_head.weight`` as a
    copy of the embedding ``embedding`` (Hugging Face name)."""
    return lambda config: {} if config.untie_embeddings_and_output_weights else {"lm_head.weight": embedding}


def causal_lm_mapping(architecture: str, model_type: str, config_from_hf, config_to_hf, tensor_maps,
                      **fields) -> HFMapping:
    """The mapping of a causal LM in LLaMA's layout (``model.`` prefix, ``model.embed_tokens``, a
    tied ``lm_head`` saved as its copy): its own architecture, config and tensor maps; the bare
    base model (``...Model`` for ``...ForCausalLM``) is read too, which ``config_from_hf``
    refuses by name. ``fields``: any other :class:`HFMapping` field, or these defaults replaced."""
    fields.setdefault("also_reads", (architecture.replace("ForCausalLM", "Model"),))
    fields.setdefault("copies", tied_lm_head("model.embed_tokens.weight"))
    return HFMapping(architecture=architecture, model_type=model_type, base_model_prefix="model.",
                     config_from_hf=config_from_hf, config_to_hf=config_to_hf, tensor_maps=tensor_maps, **fields)


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Stacked per-projection rows (weights or biases) -> Megatron's per-group rows."""
    per_group = [t.reshape(num_query_groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, config: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_qkv`."""
    d, groups = config.kv_channels, config.num_query_groups
    per_group = config.num_attention_heads // groups * d
    grouped = qkv.reshape(groups, per_group + 2 * d, *qkv.shape[1:])
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def pad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    extra = padded_size - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows does not fit the padded size {padded_size}")
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])]) if extra else weight


# --- Tensor maps shared by the families ----------------------------------------------------------

def _identity(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensors


def same(mega: str, other: str, vocab: bool = False) -> TensorMap:
    """One tensor with the same layout on both sides, under two names."""
    return TensorMap((mega,), (other,), _identity, _identity, vocab)


def linear_kinds(config: TransformerConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.add_bias_linear else ("weight",)


# --- Reading config.json --------------------------------------------------------------------------

def read_field(hf_config: Mapping[str, Any], defaults: Mapping[str, Any], key: str) -> Any:
    """config.json's value, else the default ``transformers`` gives a key that is absent."""
    return hf_config[key] if key in hf_config else defaults[key]


# --- Whole state dicts (models in memory) ---------------------------------------------------------

def hf_to_mega(mapping: HFMapping, hf: Tensors, config: TransformerConfig,
               tensor_parallel_size: int = 1) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict as mega parameters, vocabulary padded for ``tensor_parallel_size``."""
    padded = config.padded_vocab_size(tensor_parallel_size)
    out = {}
    for tensor_map in mapping.tensor_maps(config):
        converted = tensor_map.to_mega(*(hf[name] for name in tensor_map.other))
        for name, tensor in zip(tensor_map.mega, converted, strict=True):
            out[name] = (pad_vocab(tensor, padded) if tensor_map.vocab else tensor).contiguous()
    return out


def mega_to_hf(mapping: HFMapping, state: Tensors, config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mega`: the tensors a Hugging Face checkpoint of the model holds."""
    out = {}
    for tensor_map in mapping.tensor_maps(config):
        inputs = (state[name][: config.vocab_size] if tensor_map.vocab else state[name] for name in tensor_map.mega)
        for name, tensor in zip(tensor_map.other, tensor_map.from_mega(*inputs), strict=True):
            out[name] = tensor.contiguous()
    return out

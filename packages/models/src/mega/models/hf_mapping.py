"""Hugging Face GPT-2 and LLaMA checkpoints <-> mega's Megatron-named parameters, both ways.

The conversions a checkpoint converter needs, kept with the model whose layout they describe:

* QKV: Hugging Face keeps separate (LLaMA) or concatenated ``[q; k; v]`` (GPT-2) projections;
  Megatron interleaves them per query group: ``[groups, (heads/groups)*d + d + d, hidden]``.
* SwiGLU: ``linear_fc1`` is ``[gate; up]``.
* GPT-2 stores its linears as ``Conv1D``, ``[in, out]``: transposed.
* Vocabulary: padded with zero rows to Megatron's padded size, cut back on the way out.
* RoPE: Hugging Face LLaMA rotates halves (``rotate_half``) as mega does: no row permutation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mega.models.config import TransformerConfig

Tensors = Mapping[str, torch.Tensor]


# --- Layout helpers ------------------------------------------------------------------------------

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


def _rope_theta_and_type(hf_config: Any) -> tuple[float, dict]:
    # transformers >= 5 keeps RoPE settings in ``rope_parameters``; 4.x in rope_theta/rope_scaling.
    parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not parameters:
        parameters = dict(getattr(hf_config, "rope_scaling", None) or {})
        parameters["rope_theta"] = hf_config.rope_theta
    return float(parameters["rope_theta"]), parameters


# --- Configs --------------------------------------------------------------------------------------

def gpt2_config(hf_config: Any, **overrides) -> TransformerConfig:
    """The mega config computing what ``transformers.GPT2LMHeadModel(hf_config)`` computes."""
    gelu = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
    if hf_config.activation_function not in gelu:
        raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} has no mega equivalent")
    if hf_config.scale_attn_by_inverse_layer_idx or not hf_config.scale_attn_weights:
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) has no mega equivalent")
    settings = dict(
        num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
        ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd, num_attention_heads=hf_config.n_head,
        seq_length=hf_config.n_positions, max_position_embeddings=hf_config.n_positions,
        vocab_size=hf_config.vocab_size, position_embedding_type="learned_absolute",
        normalization="LayerNorm", layernorm_epsilon=hf_config.layer_norm_epsilon,
        openai_gelu=gelu[hf_config.activation_function], add_bias_linear=True,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
        init_method_std=hf_config.initializer_range,
    )
    return TransformerConfig(**{**settings, **overrides})


def llama_config(hf_config: Any, **overrides) -> TransformerConfig:
    """The mega config computing what ``transformers.LlamaForCausalLM(hf_config)`` computes."""
    if hf_config.hidden_act != "silu":
        raise ValueError(f"LLaMA activation {hf_config.hidden_act!r} is not SwiGLU's silu")
    if hf_config.attention_bias != hf_config.mlp_bias:
        raise ValueError("LLaMA with attention_bias != mlp_bias has no mega equivalent")
    theta, rope = _rope_theta_and_type(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"RoPE type {rope_type!r} has no mega equivalent (default and llama3 do)")
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if any(rope[key] != value for key, value in expected.items()):
            raise ValueError(f"llama3 RoPE scaling with {rope} differs from LLaMA-3.1's {expected}")
    settings = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        seq_length=hf_config.max_position_embeddings, max_position_embeddings=hf_config.max_position_embeddings,
        vocab_size=hf_config.vocab_size, position_embedding_type="rope", rotary_base=theta,
        use_rope_scaling=rope_type == "llama3", rope_scaling_factor=float(rope.get("factor", 8.0)),
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, swiglu=True,
        add_bias_linear=hf_config.attention_bias,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        hidden_dropout=0.0, attention_dropout=hf_config.attention_dropout,
        init_method_std=hf_config.initializer_range,
    )
    return TransformerConfig(**{**settings, **overrides})


# --- Weights --------------------------------------------------------------------------------------

def _linear_kinds(config: TransformerConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.add_bias_linear else ("weight",)


def _conv1d(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """GPT-2's Conv1D weights are ``[in, out]``, nn.Linear's ``[out, in]`` (either way round)."""
    return tensor.t() if kind == "weight" else tensor


def gpt2_to_mega(hf: Tensors, config: TransformerConfig, tensor_parallel_size: int = 1) -> dict[str, torch.Tensor]:
    """A GPT-2 state dict (``transformer.*``, ``lm_head.*``) as mega parameters."""
    vocab = config.padded_vocab_size(tensor_parallel_size)
    heads = config.num_attention_heads
    out = {
        "embedding.word_embeddings.weight": pad_vocab(hf["transformer.wte.weight"], vocab),
        "embedding.position_embeddings.weight": hf["transformer.wpe.weight"],
    }
    for kind in ("weight", "bias"):
        out[f"decoder.final_layernorm.{kind}"] = hf[f"transformer.ln_f.{kind}"]
    for n in range(config.num_layers):
        src, dst = f"transformer.h.{n}.", f"decoder.layers.{n}."
        for kind in ("weight", "bias"):
            out[dst + f"input_layernorm.{kind}"] = hf[src + f"ln_1.{kind}"]
            out[dst + f"pre_mlp_layernorm.{kind}"] = hf[src + f"ln_2.{kind}"]
            q, k, v = _conv1d(hf[src + f"attn.c_attn.{kind}"], kind).chunk(3, dim=0)
            out[dst + f"self_attention.linear_qkv.{kind}"] = interleave_qkv(q, k, v, heads)
            out[dst + f"self_attention.linear_proj.{kind}"] = _conv1d(hf[src + f"attn.c_proj.{kind}"], kind)
            out[dst + f"mlp.linear_fc1.{kind}"] = _conv1d(hf[src + f"mlp.c_fc.{kind}"], kind)
            out[dst + f"mlp.linear_fc2.{kind}"] = _conv1d(hf[src + f"mlp.c_proj.{kind}"], kind)
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad_vocab(hf["lm_head.weight"], vocab)
    return {name: t.contiguous() for name, t in out.items()}


def mega_to_gpt2(state: Tensors, config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`gpt2_to_mega` (``lm_head.weight`` included, tied or not)."""
    vocab = config.vocab_size
    out = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"][:vocab],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
    }
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state[f"decoder.final_layernorm.{kind}"]
    for n in range(config.num_layers):
        src, dst = f"decoder.layers.{n}.", f"transformer.h.{n}."
        for kind in ("weight", "bias"):
            out[dst + f"ln_1.{kind}"] = state[src + f"input_layernorm.{kind}"]
            out[dst + f"ln_2.{kind}"] = state[src + f"pre_mlp_layernorm.{kind}"]
            qkv = split_qkv(state[src + f"self_attention.linear_qkv.{kind}"], config)
            out[dst + f"attn.c_attn.{kind}"] = _conv1d(torch.cat(qkv, dim=0), kind)
            out[dst + f"attn.c_proj.{kind}"] = _conv1d(state[src + f"self_attention.linear_proj.{kind}"], kind)
            out[dst + f"mlp.c_fc.{kind}"] = _conv1d(state[src + f"mlp.linear_fc1.{kind}"], kind)
            out[dst + f"mlp.c_proj.{kind}"] = _conv1d(state[src + f"mlp.linear_fc2.{kind}"], kind)
    output = "output_layer.weight" if config.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
    out["lm_head.weight"] = state[output][:vocab]
    return {name: t.contiguous() for name, t in out.items()}


def llama_to_mega(hf: Tensors, config: TransformerConfig, tensor_parallel_size: int = 1) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict (``model.*``, ``lm_head.*``) as mega parameters."""
    vocab = config.padded_vocab_size(tensor_parallel_size)
    out = {
        "embedding.word_embeddings.weight": pad_vocab(hf["model.embed_tokens.weight"], vocab),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    for n in range(config.num_layers):
        src, dst = f"model.layers.{n}.", f"decoder.layers.{n}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        for kind in _linear_kinds(config):
            q, k, v = (hf[src + f"self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[dst + f"self_attention.linear_qkv.{kind}"] = interleave_qkv(q, k, v, config.num_query_groups)
            out[dst + f"self_attention.linear_proj.{kind}"] = hf[src + f"self_attn.o_proj.{kind}"]
            gate_up = (hf[src + f"mlp.gate_proj.{kind}"], hf[src + f"mlp.up_proj.{kind}"])
            out[dst + f"mlp.linear_fc1.{kind}"] = torch.cat(gate_up, dim=0)
            out[dst + f"mlp.linear_fc2.{kind}"] = hf[src + f"mlp.down_proj.{kind}"]
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad_vocab(hf["lm_head.weight"], vocab)
    return {name: t.contiguous() for name, t in out.items()}


def mega_to_llama(state: Tensors, config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`llama_to_mega` (``lm_head.weight`` included, tied or not)."""
    vocab = config.vocab_size
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    for n in range(config.num_layers):
        src, dst = f"decoder.layers.{n}.", f"model.layers.{n}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        for kind in _linear_kinds(config):
            q, k, v = split_qkv(state[src + f"self_attention.linear_qkv.{kind}"], config)
            out.update({dst + f"self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v), strict=True)})
            out[dst + f"self_attn.o_proj.{kind}"] = state[src + f"self_attention.linear_proj.{kind}"]
            gate, up = state[src + f"mlp.linear_fc1.{kind}"].chunk(2, dim=0)
            out[dst + f"mlp.gate_proj.{kind}"], out[dst + f"mlp.up_proj.{kind}"] = gate, up
            out[dst + f"mlp.down_proj.{kind}"] = state[src + f"mlp.linear_fc2.{kind}"]
    output = "output_layer.weight" if config.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
    out["lm_head.weight"] = state[output][:vocab]
    return {name: t.contiguous() for name, t in out.items()}

"""The generic bridge: Hugging Face decoders that are LLaMA with known variations, read and written
as the ``llama`` family without a mapping of their own.

Each bridged architecture is LLaMA's layout (:mod:`mega.models.llama.hf_llama`: q/k/v interleaved per
query group, SwiGLU's ``[gate; up]``, rotate-half RoPE, its RoPE kinds) plus a few switches of
the shared blocks, read from its config.json and written back to it:

* ``qkv_bias``: q/k/v projections biased, ``o_proj`` and the MLP not (``--add-qkv-bias``).
* ``qk_norm``: RMSNorm of the queries and keys, over each head or the whole projection
  (``--qk-layernorm``, ``--qk-layernorm-scope``), weights ``self_attn.q_norm`` / ``k_norm``.
* ``post_norm``: each sublayer's output normalised before the residual add
  (``--layernorm-placement post``): ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``, no input norms.
* ``sliding_window``: how the architecture's config says its window (``--sliding-window``).
* ``rope_scaling``: every rotary scaling kind the shared blocks compute (``--rope-type``; read and
  written by :mod:`mega.models.hf_rope`, as for LLaMA).

An architecture's config field the shared blocks cannot express is refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mega.core.model_family import HFMapping, ModelFamily, TensorMap
from mega.models.config import TransformerConfig
from mega.models.hf_mapping import causal_lm_mapping, read_field, refuse_headless, same
from mega.models.hf_rope import ROPE_KINDS
from mega.models.llama.config import LlamaConfig
from mega.models.llama.hf_llama import llama_config, llama_hf_config, llama_tensor_maps

# The family every bridged model is in mega: its config class and blocks take the switches.
BRIDGE_FAMILY = "llama"


@dataclass(frozen=True)
class Variation:
    """One Llama-like architecture: its names, transformers' defaults for the keys read (the
    LLaMA keys and its own), and how it differs from LLaMA."""

    architecture: str
    model_type: str
    defaults: Mapping[str, Any]
    summary: str
    qkv_bias: bool = False  # q/k/v biased and nothing else, always (Qwen2)
    attention_bias: bool = False  # reads attention_bias: True biases q/k/v/o but not the MLP, which mega cannot
    qk_norm: str | None = None  # "head" or "projection"
    post_norm: bool = False
    window: Callable[[Mapping[str, Any]], int | None] = lambda hf: None
    window_to_hf: Callable[[int | None, int], dict] | None = None  # (window, layers) -> config.json keys


LLAMA_KEYS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_dropout": 0.0,
}


def _mistral_window(hf: Mapping[str, Any]) -> int | None:
    return read_field(hf, MISTRAL.defaults, "sliding_window")


def _qwen2_window(hf: Mapping[str, Any]) -> int | None:
    """Qwen2 slides its window on the layers ``layer_types`` (or ``use_sliding_window`` from
    ``max_window_layers`` on) says: all of them or none are expressible."""
    layers = read_field(hf, QWEN2.defaults, "num_hidden_layers")
    kinds = hf.get("layer_types")
    if kinds is None:
        sliding = read_field(hf, QWEN2.defaults, "use_sliding_window")
        first = read_field(hf, QWEN2.defaults, "max_window_layers")
        kinds = ["sliding_attention" if sliding and n >= first else "full_attention" for n in range(layers)]
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) != {"sliding_attention"}:
        raise ValueError(f"Qwen2ForCausalLM layer_types {kinds} (from use_sliding_window and max_window_layers) mix "
                         "sliding-window and full attention layers, which mega's one --sliding-window cannot express")
    return read_field(hf, QWEN2.defaults, "sliding_window")


def _qwen2_window_to_hf(window: int | None, layers: int) -> dict:
    kind = "full_attention" if window is None else "sliding_attention"
    return {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0,
            "layer_types": [kind] * layers}


MISTRAL = Variation(
    "MistralForCausalLM", "mistral",
    {**LLAMA_KEYS, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
     "sliding_window": 4096},
    "LLaMA with sliding-window attention (sliding_window)",
    window=_mistral_window, window_to_hf=lambda window, layers: {"sliding_window": window})
QWEN2 = Variation(
    "Qwen2ForCausalLM", "qwen2",
    {**LLAMA_KEYS, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
     "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
    "LLaMA with q/k/v biases; sliding window on every layer or none (use_sliding_window, layer_types)",
    qkv_bias=True, window=_qwen2_window, window_to_hf=_qwen2_window_to_hf)
OLMO2 = Variation(
    "Olmo2ForCausalLM", "olmo2",
    {**LLAMA_KEYS, "vocab_size": 50304, "rms_norm_eps": 1e-5, "attention_bias": False},
    "LLaMA with norms after each sublayer and QK-norm over the whole query and key projections",
    attention_bias=True, qk_norm="projection", post_norm=True)

VARIATIONS = {variation.architecture: variation for variation in (MISTRAL, QWEN2, OLMO2)}


# --- config.json ----------------------------------------------------------------------------------

def bridge_config(variation: Variation, hf_config: Mapping[str, Any]) -> TransformerConfig:
    """The ``llama`` family config computing what ``variation``'s class computes with this config.json."""
    name = variation.architecture
    refuse_headless(hf_config, name.replace("ForCausalLM", "Model"), name)
    if variation.attention_bias and read_field(hf_config, variation.defaults, "attention_bias"):
        raise ValueError(f"{name} attention_bias (q, k, v and o_proj biased, the MLP not) has no mega equivalent")
    keys = {key: read_field(hf_config, variation.defaults, key) for key in LLAMA_KEYS}
    # LLaMA's reading of the shared keys, its RoPE kinds and refusals; the variation's switches on top.
    llama_keys = {**hf_config, **keys, "architectures": [], "attention_bias": False, "mlp_bias": False}
    try:
        switches = dict(add_qkv_bias=variation.qkv_bias, sliding_window=variation.window(hf_config))
        if variation.qk_norm:
            switches.update(qk_layernorm=True, qk_layernorm_scope=variation.qk_norm)
        if variation.post_norm:
            switches.update(layernorm_placement="post")
        return llama_config(llama_keys, LlamaConfig, **switches)
    except ValueError as error:
        message = str(error).replace("LlamaForCausalLM", name).replace("LLaMA ", f"{name} ")
        raise ValueError(message) from None


def bridge_hf_config(variation: Variation, config: TransformerConfig) -> dict:
    """config.json of ``variation``'s class computing what ``config`` computes; what the class
    cannot express is refused, naming the mega field."""
    differences = {
        f"add_qkv_bias (on in {variation.architecture}: q/k/v biased, o_proj and the MLP not)"
        if variation.qkv_bias else "add_qkv_bias": config.add_qkv_bias != variation.qkv_bias,
        "add_bias_linear": config.add_bias_linear,
        "qk_layernorm": config.qk_layernorm != bool(variation.qk_norm),
        "qk_layernorm_scope": bool(variation.qk_norm) and config.qk_layernorm_scope != variation.qk_norm,
        "layernorm_placement": config.layernorm_placement != ("post" if variation.post_norm else "pre"),
        "sliding_window": config.sliding_window is not None and variation.window_to_hf is None,
    }
    unsupported = [field for field, differs in differences.items() if differs]
    if unsupported:
        raise ValueError(f"{variation.architecture} cannot express this model: {'; '.join(unsupported)}")
    plain = dataclasses.replace(config, add_qkv_bias=False, qk_layernorm=False, qk_layernorm_scope="head",
                                layernorm_placement="pre", sliding_window=None)
    hf = llama_hf_config(plain)
    for key in ("attention_bias", "mlp_bias"):
        hf.pop(key)
    hf.update(architectures=[variation.architecture], model_type=variation.model_type)
    if variation.attention_bias:
        hf["attention_bias"] = False
    if variation.window_to_hf is not None:
        hf.update(variation.window_to_hf(config.sliding_window, config.num_layers))
    return hf


# --- Weights --------------------------------------------------------------------------------------

def bridge_tensor_maps(variation: Variation, config: TransformerConfig) -> list[TensorMap]:
    """LLaMA's maps with the variation's tensors: q/k/v biases after their weights, QK-norms
    after the attention, post-norms in place of the input norms."""
    maps = []
    for tensor_map in llama_tensor_maps(config):
        mega = tensor_map.mega[0]
        layer = ".".join(mega.split(".")[:3]) + "." if mega.startswith("decoder.layers.") else ""
        hf = layer.replace("decoder.layers.", "model.layers.")
        if variation.post_norm and mega.endswith(".input_layernorm.weight"):
            continue
        if variation.post_norm and mega.endswith(".pre_mlp_layernorm.weight"):
            maps.append(same(layer + "post_attention_layernorm.weight", hf + "post_attention_layernorm.weight"))
            continue
        maps.append(tensor_map)
        if mega.endswith("self_attention.linear_qkv.weight") and config.add_qkv_bias and not config.add_bias_linear:
            maps.append(TensorMap((mega.replace(".weight", ".bias"),),
                                  tuple(name.replace(".weight", ".bias") for name in tensor_map.other),
                                  tensor_map.to_mega, tensor_map.from_mega))
        if mega.endswith("self_attention.linear_proj.weight") and config.qk_layernorm:
            maps += [same(layer + "self_attention.q_layernorm.weight", hf + "self_attn.q_norm.weight"),
                     same(layer + "self_attention.k_layernorm.weight", hf + "self_attn.k_norm.weight")]
        if mega.endswith("mlp.linear_fc2.weight") and variation.post_norm:
            maps.append(same(layer + "post_mlp_layernorm.weight", hf + "post_feedforward_layernorm.weight"))
    return maps


def bridge_mapping(variation: Variation) -> HFMapping:
    return causal_lm_mapping(
        variation.architecture, variation.model_type,
        lambda hf_config: bridge_config(variation, hf_config),
        lambda config: bridge_hf_config(variation, config),
        lambda config: bridge_tensor_maps(variation, config),
        ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))


MAPPINGS = {name: bridge_mapping(variation) for name, variation in VARIATIONS.items()}


# --- Choosing the mapping -------------------------------------------------------------------------

def bridged_architecture(config_json: Mapping[str, Any]) -> str | None:
    """The bridged architecture config.json names (``architectures``, else ``model_type``), or None."""
    for name in config_json.get("architectures") or []:
        for architecture in MAPPINGS:
            if name in (architecture, architecture.replace("ForCausalLM", "Model")):
                return architecture
    if not config_json.get("architectures"):
        return next((name for name, v in VARIATIONS.items() if v.model_type == config_json.get("model_type")), None)
    return None


def as_bridged(family: ModelFamily, architecture: str) -> ModelFamily:
    """``family`` (the ``llama`` family) reading and writing ``architecture``'s layout."""
    return dataclasses.replace(family, hf_mapping=MAPPINGS[architecture])


def export_mapping(family: ModelFamily, config: TransformerConfig, origin: Mapping[str, Any] | None) -> HFMapping:
    """The mapping a model of ``family`` is written to Hugging Face with: the bridged class it came
    from; else, for the bridge's family, the first of LLaMA and the bridged classes that expresses
    its config (a trained checkpoint with a sliding window goes out as Mistral); else the family's."""
    if family.name != BRIDGE_FAMILY:
        return family.hf_mapping
    came_from = (origin or {}).get("architecture") if (origin or {}).get("format") == "hf" else None
    if came_from in MAPPINGS:
        return MAPPINGS[came_from]
    for mapping in (family.hf_mapping, *MAPPINGS.values()):
        try:
            mapping.config_to_hf(config)
            return mapping
        except ValueError:
            continue
    return family.hf_mapping  # its refusal names what LLaMA cannot express


def list_architectures(families: Mapping[str, ModelFamily]) -> list[str]:
    """One line per Hugging Face architecture ``mega convert`` reads and writes."""
    lines = [f"{family.hf_mapping.architecture:28} {name} family ({family.description})"
             for name, family in families.items() if family.hf_mapping is not None]
    lines += [f"{variation.architecture:28} {BRIDGE_FAMILY} family, bridged: {variation.summary}"
              for variation in VARIATIONS.values()]
    kinds = ", ".join(ROPE_KINDS)
    lines.append(f"{'(rope_scaling.rope_type)':28} {kinds}: of LLaMA, the bridged, Qwen3, Qwen3-MoE and Mixtral ({BRIDGE_FAMILY}'s "
                 "--rope-type)")
    return lines

"""RoPE settings of a Hugging Face config.json, read into mega's ``--rope-type`` and its parameters
and written back, for every family whose attention is the shared blocks' (LLaMA's reading, which
the generic bridge, Qwen3 and Mixtral share).

transformers keeps them in ``rope_parameters`` (5.x) or ``rope_theta`` plus ``rope_scaling``
(every version; written here). Its ``rope_type`` maps to ``--rope-type``:

* ``default`` -> ``rope``; ``linear`` -> ``linear`` (``factor`` -> ``--rotary-scaling-factor``).
* ``dynamic``: ``factor``; transformers grows the base past ``max_position_embeddings``, which
  becomes ``--original-max-position-embeddings``; mega's ``--max-position-embeddings`` (the
  longest sequence it serves) is that times the factor, and is written back divided.
* ``yarn``: ``factor``, ``original_max_position_embeddings``, ``beta_fast``/``beta_slow``,
  ``truncate``, ``mscale``/``mscale_all_dim``, ``attention_factor``.
* ``llama3``: ``factor`` -> ``--rope-scaling-factor``, ``low_freq_factor``/``high_freq_factor``,
  ``original_max_position_embeddings``.

Any other kind (``longrope`` among them, not implemented) is refused naming ``rope_scaling.rope_type``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mega.models.config import TransformerConfig

# transformers' rope_type -> mega's --rope-type.
ROPE_KINDS = {"default": "rope", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
REFUSAL_REASONS = {
    "longrope": "not implemented: its per-dimension short_factor/long_factor lists have no mega config field",
}
YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}  # transformers' defaults where config.json has none


def hf_rope_parameters(hf_config: Mapping[str, Any]) -> dict:
    """RoPE settings as one dict with ``rope_theta`` and ``rope_type`` (transformers 4.x and 5.x keys)."""
    rope = dict(hf_config.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf_config.get("rope_scaling") or {})
        rope["rope_theta"] = hf_config.get("rope_theta", 10000.0)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def rope_settings(hf_config: Mapping[str, Any], max_position_embeddings: int, architecture: str) -> dict:
    """The mega config fields of this config.json's RoPE (``max_position_embeddings``: its own)."""
    rope = hf_rope_parameters(hf_config)
    kind = rope["rope_type"]
    if kind not in ROPE_KINDS:
        reason = REFUSAL_REASONS.get(kind, f"mega's --rope-type is one of {', '.join(ROPE_KINDS)}")
        raise ValueError(f"{architecture} rope_scaling.rope_type {kind!r} has no mega equivalent: {reason}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{architecture} rope_scaling.partial_rotary_factor {rope['partial_rotary_factor']} "
                         "(RoPE on part of each head) has no mega equivalent in the shared attention")
    settings: dict[str, Any] = {"rotary_base": float(rope["rope_theta"]), "rope_type": ROPE_KINDS[kind]}
    original = rope.get("original_max_position_embeddings") or max_position_embeddings
    if kind in ("linear", "dynamic"):
        settings["rotary_scaling_factor"] = float(rope["factor"])
    if kind == "dynamic":
        settings.update(original_max_position_embeddings=max_position_embeddings,
                        max_position_embeddings=int(max_position_embeddings * rope["factor"]))
    if kind == "yarn":
        factor = rope.get("factor") or max_position_embeddings / original  # transformers' default
        settings.update(
            rotary_scaling_factor=float(factor), original_max_position_embeddings=int(original),
            beta_fast=float(rope.get("beta_fast") or YARN_BETAS["beta_fast"]),
            beta_slow=float(rope.get("beta_slow") or YARN_BETAS["beta_slow"]),
            yarn_truncate=bool(rope.get("truncate", True)), mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"), rope_attention_factor=rope.get("attention_factor"))
    if kind == "llama3":
        settings.update(rope_scaling_factor=float(rope["factor"]), original_max_position_embeddings=int(original),
                        rope_low_freq_factor=float(rope["low_freq_factor"]),
                        rope_high_freq_factor=float(rope["high_freq_factor"]))
    return settings


def hf_max_position_embeddings(config: TransformerConfig) -> int:
    """config.json's ``max_position_embeddings``: dynamic scaling's original context, else mega's."""
    if config.rope_type == "dynamic" and config.original_max_position_embeddings:
        return config.original_max_position_embeddings
    return config.max_position_embeddings


def hf_rope_scaling(config: TransformerConfig) -> dict | None:
    """config.json's ``rope_scaling`` for ``config``'s ``--rope-type`` (None: plain RoPE); keys
    left at transformers' defaults are left out, so a config.json read and written comes back as
    transformers read it."""
    kind = config.rope_type
    if kind == "rope":
        return None
    if kind in ("linear", "dynamic"):
        return {"rope_type": kind, "factor": config.rotary_scaling_factor}
    original = config.original_max_position_embeddings
    if kind == "llama3":
        return {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                "low_freq_factor": config.rope_low_freq_factor, "high_freq_factor": config.rope_high_freq_factor,
                "original_max_position_embeddings": original}
    scaling = {"rope_type": "yarn", "factor": config.rotary_scaling_factor,
               "original_max_position_embeddings": original or config.max_position_embeddings}
    scaling.update({key: getattr(config, key) for key, default in YARN_BETAS.items()
                    if getattr(config, key) != default})
    if not config.yarn_truncate:
        scaling["truncate"] = False
    optional = {"mscale": config.mscale, "mscale_all_dim": config.mscale_all_dim,
                "attention_factor": config.rope_attention_factor}
    scaling.update({key: value for key, value in optional.items() if value is not None})
    return scaling

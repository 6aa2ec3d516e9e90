"""Canonical parameter names, whatever kernels a model was built with.

A fused kernel may hold a weight under its own name: Transformer Engine's LayerNormLinear keeps
the norm before QKV as ``self_attention.linear_qkv.layer_norm_weight`` where the plain layer has
``input_layernorm.weight``. The module that composes such a component declares the alias in a
``parameter_aliases`` attribute, ``{name under this module: canonical name under this module}``:

    layer.parameter_aliases = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight"}

Checkpoints, initialisation and conversion use canonical names, so a checkpoint written with one
backend loads with another.
"""

from __future__ import annotations

from torch import nn


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Full parameter name -> canonical name, for every aliased parameter of ``module``."""
    names: dict[str, str] = {}
    for prefix, owner in module.named_modules():
        aliases = getattr(owner, "parameter_aliases", None)
        if not aliases:
            continue
        base = prefix + "." if prefix else ""
        for local, canonical in aliases.items():
            names[base + local] = base + canonical
    return names


def canonical(name: str, names: dict[str, str]) -> str:
    return names.get(name, name)

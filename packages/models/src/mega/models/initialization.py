"""How each parameter starts, by its global name (the core applies it on any layout; see
:mod:`mega.core.build`).

Megatron's scheme: weights ~ N(0, init_method_std), the output-side projections of each layer
(``linear_proj``, ``linear_fc2``) with std / sqrt(2 * num_layers), biases zero, norms one. Names
decide, not module types, so a norm from any kernel backend starts the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mega.models.config import TransformerConfig

SCALED_INIT_MODULES = ("linear_proj", "linear_fc2")
NORM_MODULES = ("layernorm", "norm")


def init_parameter(config: TransformerConfig, name: str) -> Callable[[torch.Tensor, torch.Generator], None]:
    """``fill(tensor, generator)`` for (rows of) the global parameter ``name``."""
    module_name, _, kind = name.rpartition(".")
    if module_name.endswith(NORM_MODULES):
        value = 1.0 if kind == "weight" else 0.0
        return lambda tensor, generator: tensor.fill_(value)
    if kind == "bias":
        return lambda tensor, generator: tensor.zero_()
    std = config.init_method_std
    if module_name.endswith(SCALED_INIT_MODULES):
        std /= math.sqrt(2.0 * config.num_layers)
    return lambda tensor, generator: tensor.normal_(0.0, std, generator=generator)

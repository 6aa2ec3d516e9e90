"""Layout-independent initialisation: each parameter's values depend only on the seed and its
global name, so a stage holding layers 4-7 gets the same layer-4 weights as the full model, and
every tensor/pipeline/data layout starts from the same model.

Megatron's scheme: weights ~ N(0, init_method_std), the output-side projections of each layer
(``linear_proj``, ``linear_fc2``) with std / sqrt(2 * num_layers), biases zero, norms one.
Initialise the whole (single-device) model, then apply tensor parallelism, which keeps each
rank's shard of these full weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

SCALED_INIT_MODULES = ("linear_proj", "linear_fc2")
NORMS = (nn.LayerNorm, nn.RMSNorm)


def parameter_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator seeded from (seed, global parameter name); the same on every rank.

    A hash mixes both into every bit: the CPU generator (mt19937) keeps only the low 32 bits of
    a seed, so packing seed and name side by side would lose one of them.
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little"))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> None:
    """Initialise every parameter of ``model`` (a ``LanguageModel``; names are global).

    Values are drawn on the parameter's device, so a seed gives the same model on every CPU
    layout and on every GPU layout (CPU and CUDA generators differ from each other).
    """
    config = model.config
    output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    for name, param in model.named_parameters():  # a tied weight once, under its first name
        module_name, _, kind = name.rpartition(".")
        owner = model.get_submodule(module_name)
        if isinstance(owner, NORMS):
            param.fill_(1.0 if kind == "weight" else 0.0)
        elif kind == "bias":
            param.zero_()
        else:
            std = output_std if module_name.endswith(SCALED_INIT_MODULES) else config.init_method_std
            param.normal_(0.0, std, generator=parameter_generator(seed, name, param.device))

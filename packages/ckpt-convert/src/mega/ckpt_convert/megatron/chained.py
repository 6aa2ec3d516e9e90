"""megatron-core's chained optimizer: a mixture of experts' run under expert parallelism keeps two
optimizers (the dense parameters', then the experts'), saved as a list in legacy files and under
``chained_N.`` prefixes in torch_dist ones."""

from __future__ import annotations

import re

import torch

from mega.ckpt_convert.errors import ConversionError

_CHAINED = re.compile(r"chained_\d+\.")


def unchained(key: str) -> str:
    """A key without the ``chained_N.`` prefix megatron-core's chained optimizer (MoE: a second
    optimizer for the experts) gives each optimizer's state."""
    match = _CHAINED.match(key)
    return key[match.end():] if match else key


def chained_parts(saved, parameters: list[tuple[str, torch.Tensor]], is_expert, where: str) -> list[tuple]:
    """(optimizer state, its parameters) of each optimizer a rank file's ``saved`` entry holds: one,
    or megatron-core's chained pair under expert parallelism (a list: the dense parameters'
    optimizer, then the experts', ``is_expert(key)``)."""
    if not isinstance(saved, list):
        return [(saved, parameters)]
    if len(saved) != 2:
        raise ConversionError(f"{where} holds {len(saved)} optimizers' state; megatron-core's chained optimizer of "
                              "a mixture of experts holds two (the dense parameters', the experts')")
    dense = [item for item in parameters if not is_expert(item[0])]
    experts = [item for item in parameters if is_expert(item[0])]
    return [(saved[0], dense), (saved[1], experts)]

"""Applying a family's :class:`~mega.core.model_family.TensorMap` s a map at a time.

A map turns a few tensors into a few others (q, k, v -> fused QKV). Writers ask for the outputs
one by one in the order of the maps, so holding the outputs of the last map converted is all
the caching a conversion needs, and memory stays at one map's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mega.core.model_family import TensorMap


class LastConverted:
    """``output(tensor_map, i)``: the ``i``-th output of ``convert(tensor_map)``, converting each
    map once as long as its outputs are asked for together."""

    def __init__(self, convert: Callable[[TensorMap], Sequence[torch.Tensor]]):
        self.convert = convert
        self._map: TensorMap | None = None
        self._outputs: Sequence[torch.Tensor] = ()

    def output(self, tensor_map: TensorMap, index: int) -> torch.Tensor:
        if self._map is not tensor_map:
            self._map, self._outputs = None, ()  # free the previous outputs before making new ones
            self._outputs = self.convert(tensor_map)
            self._map = tensor_map
        return self._outputs[index]


def converted_shapes(convert: Callable[..., tuple], shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shapes ``convert`` (a map's ``to_mega`` or ``from_mega``) gives tensors of ``shapes``,
    found on the meta device (no data). A shape the conversion cannot take raises ``RuntimeError``."""
    outputs = convert(*(torch.empty(shape, device="meta") for shape in shapes))
    return [tuple(output.shape) for output in outputs]

"""Measure the activation memory a forward pass keeps for its backward pass, on any device.

Every tensor autograd saves goes through ``torch.autograd.graph.saved_tensors_hooks``; the bytes
kept alive are those of the storages behind them, each counted once (a view keeps its whole
storage alive), leaving out parameters and what the caller already owns (the inputs). Activation
recompute shows up as it is: a recomputed region saves only its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_activation_bytes(forward: Callable[[], object], exclude: Iterable[torch.Tensor] = (),
                           weights: Callable[[], Iterable[torch.Tensor]] | None = None) -> tuple[int, object]:
    """Run ``forward()``; return (bytes of distinct storages saved for backward, its result).
    ``weights()``: tensors to leave out too, asked at each saved tensor (FSDP's gathered weights,
    which exist only while their unit computes)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        gathered = {w.untyped_storage().data_ptr() for w in weights()} if weights is not None else set()
        if pointer not in excluded | gathered and not isinstance(tensor, torch.nn.Parameter):
            storages[pointer] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    return sum(storages.values()), result

"""What a zero-bubble W step will need, counted from the deferred products themselves.

Each entry of a ``pending`` list (:mod:`mega.core.parallel.weight_grad_split`) is a closure, or a
``functools.partial``, over the tensors its W product needs: the layers' inputs and output
gradients, and for the output layer the loss's statistics. Their storages, counted once each and
the model's parameters left out, are what a micro-batch holds from its B to its W: the figure
``mega plan`` models as ``StageFootprint.weight_grad_bytes``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch


def bytes_held_for_w(pending: list, parameters: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages the products in ``pending`` keep alive, the storages of
    ``parameters`` (which a product names, or holds detached) aside."""
    skipped = {parameter.untyped_storage().data_ptr() for parameter in parameters}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [product for product, _ in pending]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in skipped:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, functools.partial):
            stack += [item.func, *item.args, *item.keywords.values()]
        elif callable(item) and getattr(item, "__closure__", None):
            stack += [cell.cell_contents for cell in item.__closure__]
        elif isinstance(item, (tuple, list)):
            stack += list(item)
        elif isinstance(item, dict):
            stack += list(item.values())
    return sum(storages.values())

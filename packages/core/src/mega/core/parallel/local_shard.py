"""``local(tensor)``: this rank's part of a tensor that may be a DTensor (FSDP's parameters,
gradients and optimizer state), for code that runs with and without FSDP.

Duck-typed on ``to_local`` rather than an ``isinstance(DTensor)`` check, so that a run which
shards nothing never imports ``torch.distributed.tensor`` (about a second of start-up).
"""

from __future__ import annotations

import torch


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor

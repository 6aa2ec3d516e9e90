"""Tensor-parallel generation under torchrun: the first rank leads, the others follow.

Only the leader (rank 0 of the tensor group) reads prompts or takes HTTP requests. Before each
engine batch it broadcasts the batch's requests; every follower runs ``generate`` on them, so all
ranks make the same forwards (and the engine keeps their tokens in step). ``None`` tells the
followers to return.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mega.core.parallel import Group
from mega.inference.engine import GenerationEngine, GenerationRequest


def _broadcast(payload, group: Group):
    holder = [payload]
    # NCCL moves objects through the current GPU; gloo through the CPU.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group.group) == "nccl" else None
    dist.broadcast_object_list(holder, src=group.ranks[0], group=group.group, device=device)
    return holder[0]


def lead(requests: Sequence[GenerationRequest] | None, group: Group) -> None:
    """On the leader: hand the next batch (``None``: the end) to the followers."""
    if group.size > 1:
        _broadcast(list(requests) if requests is not None else None, group)


def receive(group: Group):
    """On a follower: what the leader hands over next (``lead``'s payload)."""
    return _broadcast(None, group)


def follow(engine: GenerationEngine, group: Group, generate=None) -> None:
    """On a follower: run every batch the leader hands over, until it says the end, with the
    leader's way of generating (``generate``: the engine's, or a static decoder's)."""
    generate = generate or engine.generate
    while (requests := receive(group)) is not None:
        generate(requests)

"""Tensor-parallel generation under torchrun: the first rank leads, the others follow.

Only the leader (rank 0 of the tensor group) reads prompts or takes HTTP requests. Before each
step of the engine's loop it broadcasts the requests it admitted; every follower admits them
alike and runs the same step (:meth:`EngineWorker.follow
<mega.inference.engine.worker.EngineWorker.follow>`), so all ranks make the same forwards (and
the decode step keeps their tokens in step). ``None`` tells the followers to return.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mega.core.parallel import Group
from mega.inference.engine.requests import GenerationRequest


def _broadcast(payload, group: Group):
    holder = [payload]
    # NCCL moves objects through the current GPU; gloo through the CPU.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group.group) == "nccl" else None
    dist.broadcast_object_list(holder, src=group.ranks[0], group=group.group, device=device)
    return holder[0]


def lead(requests: Sequence[GenerationRequest] | None, group: Group) -> None:
    """On the leader: hand the next step's admitted requests (``None``: the end) to the followers."""
    if group.size > 1:
        _broadcast(list(requests) if requests is not None else None, group)


def receive(group: Group):
    """On a follower: what the leader hands over next (``lead``'s payload)."""
    return _broadcast(None, group)

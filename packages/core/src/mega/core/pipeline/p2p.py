"""Point-to-point transfers of activations and gradients between pipeline stages.

Every tensor that crosses stages has one shape, known before the schedule starts ([s, b, h], or
[s/tp, b, h] under sequence parallelism), so receive buffers are allocated without asking the
sender first. One exchange is one ``batch_isend_irecv``: on NCCL the sends and receives of a step
must be issued as one group or two neighbours that both send first wait on each other forever.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mega.core.parallel import ParallelGroups
from mega.core.pipeline.messages import Exchange, Message


class PipelineLinks:
    """This rank's connections to the ranks holding its neighbouring virtual stages."""

    def __init__(self, groups: ParallelGroups, tensor_shape: Sequence[int], dtype: torch.dtype, events):
        self.groups = groups
        self.tensor_shape = torch.Size(tensor_shape)
        self.dtype = dtype
        self.events = events
        if groups.backend == "nccl" and groups.pp.size > 1:
            # NCCL leaves batched p2p undefined if it is the group's first operation and not
            # every rank of the group joins it; one collective first makes it well defined.
            dist.all_reduce(torch.zeros(1, device=groups.device), group=groups.pp.group)

    def peer(self, stage: int) -> int:
        """Global rank of the process that computes virtual stage ``stage``."""
        return self.groups.pp.ranks[stage % self.groups.pp.size]

    def exchange(self, exchange: Exchange, outbox: dict[Message, torch.Tensor]) -> dict[Message, torch.Tensor]:
        """Send ``exchange.sends`` (taken out of ``outbox``), receive ``exchange.recvs``; wait."""
        operations, received, announced = [], {}, []
        for message in exchange.sends:
            tensor = outbox.pop(message)
            if tensor.shape != self.tensor_shape or tensor.dtype != self.dtype:
                raise ValueError(
                    f"virtual stage {message.source} produced a {message.kind} of shape "
                    f"{list(tensor.shape)} and dtype {tensor.dtype} for micro-batch "
                    f"{message.microbatch}, but the pipeline sends tensor_shape "
                    f"{list(self.tensor_shape)} of dtype {self.dtype}"
                )
            peer = self.peer(message.destination)
            operations.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, self.groups.pp.group))
            announced.append((message.send_op, peer, message.microbatch))
        for message in exchange.recvs:
            buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.groups.device)
            peer = self.peer(message.source)
            operations.append(dist.P2POp(dist.irecv, buffer, peer, self.groups.pp.group))
            announced.append((message.recv_op, peer, message.microbatch))
            received[message] = buffer
        if not operations:
            return received
        for op, peer, microbatch in announced:
            self.events.hook.on_p2p_start(op=op, peer=peer, microbatch=microbatch)
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        for op, peer, microbatch in announced:
            self.events.hook.on_p2p_end(op=op, peer=peer, microbatch=microbatch)
        return received

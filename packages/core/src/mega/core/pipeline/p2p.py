"""Point-to-point transfers of activations and gradients between pipeline stages.

What crosses a boundary is a dict of named tensors whose shapes the model family declares before
the schedule starts (one ``hidden`` [s, b, h] for a decoder; an encoder's output beside the
decoder's hidden states for an encoder-decoder), so receive buffers are allocated without asking
the sender first. One exchange is one ``batch_isend_irecv``: on NCCL the sends and receives of a step
must be issued as one group or two neighbours that both send first wait on each other forever.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from mega.core.parallel import ParallelGroups
from mega.core.pipeline.messages import ACTIVATION, Exchange, Message
from mega.core.pipeline.tensor_spec import TensorSpec


class PipelineLinks:
    """This rank's connections to the ranks holding its neighbouring virtual stages.

    ``boundary(stage)`` gives the named tensors virtual stage ``stage`` sends to the next one
    (``{name: TensorSpec}``); the gradients going back are those of its floating tensors. Both
    sides post a message's tensors in name order.
    """

    def __init__(self, groups: ParallelGroups, boundary: Callable[[int], Mapping[str, TensorSpec]], events,
                 rank_and_chunk: Callable[[int], tuple[int, int]] | None = None):
        self.groups = groups
        # Which pipeline rank computes a virtual stage (default: Megatron's interleaved placement).
        self.rank_and_chunk = rank_and_chunk or (lambda stage: (stage % groups.pp.size, stage // groups.pp.size))
        self.boundary = boundary
        self.events = events
        if groups.backend == "nccl" and groups.pp.size > 1:
            # NCCL leaves batched p2p undefined if it is the group's first operation and not
            # every rank of the group joins it; one collective first makes it well defined.
            dist.all_reduce(torch.zeros(1, device=groups.device), group=groups.pp.group)

    def peer(self, stage: int) -> int:
        """Global rank of the process that computes virtual stage ``stage``."""
        return self.groups.pp.ranks[self.rank_and_chunk(stage)[0]]

    def specs(self, message: Message) -> dict[str, TensorSpec]:
        """The tensors ``message`` carries, by name, in the order they travel."""
        if message.kind == ACTIVATION:
            specs = self.boundary(message.source)
        else:
            specs = {name: spec for name, spec in self.boundary(message.destination).items() if spec.has_gradient}
        return dict(sorted(specs.items()))

    def exchange(self, exchange: Exchange, outbox: dict[Message, dict]) -> dict[Message, dict]:
        """Send ``exchange.sends`` (taken out of ``outbox``), receive ``exchange.recvs``; wait."""
        operations, received, announced = [], {}, []
        for message in exchange.sends:
            tensors = outbox.pop(message)
            peer = self.peer(message.destination)
            for name, spec in self.specs(message).items():
                tensor = tensors.get(name)
                if tensor is None or tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                    got = "nothing" if tensor is None else f"shape {list(tensor.shape)} and dtype {tensor.dtype}"
                    raise ValueError(
                        f"virtual stage {message.source} produced {got} as {message.kind} {name!r} for "
                        f"micro-batch {message.microbatch}, but the pipeline sends shape {list(spec.shape)} "
                        f"of dtype {spec.dtype} there"
                    )
                operations.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, self.groups.pp.group))
            announced.append((message.send_op, peer, message.microbatch))
        for message in exchange.recvs:
            peer = self.peer(message.source)
            buffers = {name: torch.empty(spec.shape, dtype=spec.dtype, device=self.groups.device)
                       for name, spec in self.specs(message).items()}
            operations += [dist.P2POp(dist.irecv, buffer, peer, self.groups.pp.group) for buffer in buffers.values()]
            announced.append((message.recv_op, peer, message.microbatch))
            received[message] = buffers
        if not operations:
            return received
        for op, peer, microbatch in announced:
            self.events.hook.on_p2p_start(op=op, peer=peer, microbatch=microbatch)
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        for op, peer, microbatch in announced:
            self.events.hook.on_p2p_end(op=op, peer=peer, microbatch=microbatch)
        return received

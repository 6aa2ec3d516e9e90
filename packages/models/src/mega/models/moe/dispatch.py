"""Token dispatchers: take each kept (token, expert) slot to the rank holding the expert, run the
experts, and bring the outputs back to the slot's token.

Every dispatcher returns ``[T, k, hidden]``: the output of expert ``experts[t, j]`` for token
``t`` (zeros for dropped slots), partial over the tensor group (the layer sums it). Routing
weights are applied by the layer, at the tokens' home, so the router's gradient is whole.

* one rank holds every expert (ep = 1): the slots are sorted by expert and run there;
* ``alltoall`` (Megatron's ``MoEAlltoAllTokenDispatcher``): each rank sends every expert-parallel
  peer exactly the tokens routed to that peer's experts (an all-to-all of the per-expert counts,
  then of the tokens), and the outputs travel back the same way;
* ``allgather`` (``MoEAllGatherTokenDispatcher``): every rank gathers the tokens and routing of
  its whole expert-parallel group, runs its experts on the slots routed to them, and the outputs
  are summed back to their home ranks with a reduce-scatter.

With ``--moe-pad-expert-input-to-capacity`` every expert's input is padded to its capacity (per
source rank), so the all-to-all has fixed sizes; padding rows are computed and thrown away.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mega.core.parallel.collectives import (
    all_to_all,
    all_to_all_single,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mega.core.parallel.groups import Group
from mega.models.moe.experts import GroupedExperts
from mega.models.moe.routing import Routing, count_per_expert


def dispatch(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts, ep: Group | None,
             kind: str) -> torch.Tensor:
    """``[T, k, h]`` expert outputs of ``tokens`` ``[T, h]`` routed by ``routing``."""
    if ep is None or ep.size <= 1:
        return _local(tokens, routing, experts)
    if kind == "alltoall":
        return _alltoall(tokens, routing, experts, ep)
    return _allgather(tokens, routing, experts, ep)


def _sorted_slots(routing: Routing, first_expert: int = 0, num_experts: int | None = None):
    """Kept slots (``t * k + j``) whose expert is in [first_expert, first_expert + num_experts),
    sorted by expert (stable: token order within an expert); and the slots per expert."""
    flat = routing.experts.reshape(-1)
    num_experts = num_experts if num_experts is not None else int(routing.load.numel())
    wanted = routing.kept.reshape(-1) & (flat >= first_expert) & (flat < first_expert + num_experts)
    slots = wanted.nonzero().squeeze(1)
    slots = slots[torch.sort(flat[slots], stable=True).indices]
    counts = count_per_expert(flat[slots] - first_expert, num_experts)
    return slots, counts


def _pad(rows: torch.Tensor, counts: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` grouped by ``counts`` -> each group padded with zero rows to ``size``; and where
    each original row went."""
    positions = torch.cat([torch.arange(count, device=rows.device) + group * size
                           for group, count in enumerate(counts)]) if counts else rows.new_zeros(0, dtype=torch.long)
    padded = rows.new_zeros(len(counts) * size, rows.shape[1]).index_copy(0, positions, rows)
    return padded, positions


def _run_experts(experts: GroupedExperts, rows: torch.Tensor, counts: list[int], pad_to: int | None) -> torch.Tensor:
    if pad_to is None:
        return experts(rows, counts)
    if any(count > pad_to for count in counts):
        raise RuntimeError(f"expert input of {max(counts)} rows exceeds its capacity {pad_to}")
    padded, positions = _pad(rows, counts, pad_to)
    return experts(padded, [pad_to] * len(counts))[positions]


def _scatter_to_slots(outputs: torch.Tensor, slots: torch.Tensor, total_slots: int, k: int) -> torch.Tensor:
    placed = outputs.new_zeros(total_slots, outputs.shape[1]).index_copy(0, slots, outputs)
    return placed.view(total_slots // k, k, outputs.shape[1])


def _local(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
    k = routing.experts.shape[1]
    slots, counts = _sorted_slots(routing)
    outputs = _run_experts(experts, tokens[slots // k], counts.tolist(), routing.capacity)
    return _scatter_to_slots(outputs, slots, routing.experts.numel(), k)


def _alltoall(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts, ep: Group) -> torch.Tensor:
    k, local = routing.experts.shape[1], experts.num_local_experts
    slots, counts = _sorted_slots(routing)
    rows = tokens[slots // k]
    if routing.capacity is not None:  # fixed sizes: every expert gets `capacity` rows from every rank
        rows, positions = _pad(rows, counts.tolist(), routing.capacity)
        counts = torch.full_like(counts, routing.capacity)
    received_counts = torch.empty_like(counts)
    all_to_all_single(received_counts, counts, ep)  # [source rank, local expert]
    received_counts = received_counts.view(ep.size, local)
    send = counts.view(ep.size, local).sum(1).tolist()
    receive = received_counts.sum(1).tolist()
    received = all_to_all(rows, ep, receive, send)
    # Arrived grouped by source rank, then expert; the experts want expert, then source rank.
    starts = (received_counts.reshape(-1).cumsum(0) - received_counts.reshape(-1)).view(ep.size, local)
    by_expert = [torch.arange(int(starts[src, e]), int(starts[src, e] + received_counts[src, e]), device=rows.device)
                 for e in range(local) for src in range(ep.size)]
    order = torch.cat(by_expert) if by_expert else received_counts.new_zeros(0)
    outputs = experts(received[order], received_counts.sum(0).tolist())
    outputs = outputs.new_zeros(outputs.shape).index_copy(0, order, outputs)
    returned = all_to_all(outputs, ep, send, receive)
    if routing.capacity is not None:
        returned = returned[positions]
    return _scatter_to_slots(returned, slots, routing.experts.numel(), k)


def _allgather(tokens: torch.Tensor, routing: Routing, experts: GroupedExperts, ep: Group) -> torch.Tensor:
    k, local = routing.experts.shape[1], experts.num_local_experts
    every_token = gather_from_sequence_parallel_region(tokens, ep, tensor_parallel_output_grad=True)
    gathered = Routing(_all_gather(routing.experts, ep), None, _all_gather(routing.kept, ep), routing.capacity,
                       None, None, routing.load)
    slots, counts = _sorted_slots(gathered, ep.rank * local, local)
    pad_to = routing.capacity * ep.size if routing.capacity is not None else None
    outputs = _run_experts(experts, every_token[slots // k], counts.tolist(), pad_to)
    placed = _scatter_to_slots(outputs, slots, gathered.experts.numel(), k)  # [ep * T, k, h]
    mine = reduce_scatter_to_sequence_parallel_region(placed.flatten(1), ep)
    return mine.view(tokens.shape[0], k, tokens.shape[1])


def _all_gather(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    wire = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor  # gloo has no bool
    parts = [torch.empty_like(wire) for _ in range(group.size)]
    dist.all_gather(parts, wire.contiguous(), group=group.group)
    return torch.cat(parts).to(tensor.dtype)

"""Attention across the context group, one function per ``--cp-comm-type``.

Every rank holds ``[batch, heads, seq / cp, head_dim]`` queries, keys and values of its two
load-balanced chunks (:mod:`mega.core.parallel.context_parallel`) and gets the output of its
own queries over the whole sequence's keys:

* ``p2p``: ring attention (:mod:`mega.core.parallel.ring_attention`), key/value blocks passed
  round the ring, overlapped with the attention of the block in hand. Sends per rank and layer:
  ``(cp - 1)`` key/value blocks forward, as many again and ``cp`` gradient blocks backward.
* ``all_gather``: gather every rank's keys and values, attend to them in one go per chunk
  (a chunk's queries see the keys up to its end); the gradients of the keys and values are
  reduce-scattered back to their ranks. Simple, and holds the whole sequence's keys and values.
* ``a2a``: Ulysses. An all-to-all trades the sequence split for a head split (each rank gets
  ``heads / cp`` heads of the whole sequence), the usual attention kernel runs, another
  all-to-all trades back. Needs the heads divisible by cp; key/value heads that are not (GQA)
  are repeated up to the query heads first.

``p2p`` and ``all_gather`` run the ``block_attention`` kernel (which returns the log-sum-exp);
``a2a`` runs the ``attention`` kernel. Each backward is exact.
"""

from __future__ import annotations

import torch

from mega.core.kernels import CAUSAL, FULL, Kernels
from mega.core.parallel.collectives import all_gather_into, all_to_all_single, reduce_scatter_into
from mega.core.parallel.config import CP_COMM_TYPES
from mega.core.parallel.context_parallel import (
    ContextParallelError,
    held_chunks,
    to_rank_order,
    to_sequence_order,
)
from mega.core.parallel.groups import Group
from mega.core.parallel.ring_attention import ring_attention


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group,
                               comm_type: str, kernels: Kernels, *, causal: bool,
                               softmax_scale: float) -> torch.Tensor:
    """This rank's queries' attention over the whole sequence; see the module docstring."""
    if comm_type == "p2p":
        return ring_attention(query, key, value, group, kernels.get("block_attention"), causal=causal,
                              softmax_scale=softmax_scale)
    if comm_type == "all_gather":
        return AllGatherAttention.apply(query, key, value, group, kernels.get("block_attention"), causal,
                                        softmax_scale)
    if comm_type == "a2a":
        return ulysses_attention(query, key, value, group, kernels, causal=causal, softmax_scale=softmax_scale)
    raise ContextParallelError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")


# --------------------------------------------------------------------------------------------
# all_gather
# --------------------------------------------------------------------------------------------


def _gathered_keys(key_value: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``[2, b, h, s/cp, d]`` keys and values -> the whole sequence's, in order."""
    shard = key_value.contiguous()
    gathered = shard.new_empty((group.size * shard.shape[0],) + tuple(shard.shape[1:]))
    all_gather_into(gathered, shard, group)
    gathered = gathered.view((group.size,) + tuple(shard.shape))
    return to_sequence_order(torch.cat(gathered.unbind(0), dim=3), group.size, dim=3)


def _query_chunks(num_queries: int, group: Group, causal: bool) -> list[tuple[slice, int | None]]:
    """Each run of local queries and how many of the sequence's keys it sees (None: all, unmasked)."""
    if not causal:
        return [(slice(None), None)]
    half = num_queries // 2
    return [(slice(index * half, (index + 1) * half), (chunk + 1) * half)
            for index, chunk in enumerate(held_chunks(group.rank, group.size))]


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group: Group, kernel, causal: bool, softmax_scale: float):
        key_value = _gathered_keys(torch.stack([key, value]), group)
        outs, lses = [], []
        for rows, visible in _query_chunks(query.shape[2], group, causal):
            keys = slice(None) if visible is None else slice(0, visible)
            out, lse = kernel.forward(query[:, :, rows], key_value[0][:, :, keys], key_value[1][:, :, keys],
                                      causal=visible is not None, softmax_scale=softmax_scale)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.kernel, ctx.causal, ctx.softmax_scale = group, kernel, causal, softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group = ctx.group
        key_value = _gathered_keys(torch.stack([key, value]), group)  # gathered again: not kept from forward
        wide = torch.promote_types(key.dtype, torch.float32)
        grad_key_value = torch.zeros(key_value.shape, dtype=wide, device=key.device)
        grad_query = torch.empty_like(query)
        for rows, visible in _query_chunks(query.shape[2], group, ctx.causal):
            keys = slice(None) if visible is None else slice(0, visible)
            dq, dk, dv = ctx.kernel.backward(grad_out[:, :, rows], query[:, :, rows], key_value[0][:, :, keys],
                                             key_value[1][:, :, keys], out[:, :, rows], lse[:, :, rows],
                                             causal=visible is not None, softmax_scale=ctx.softmax_scale)
            grad_query[:, :, rows] = dq
            grad_key_value[0][:, :, keys] += dk
            grad_key_value[1][:, :, keys] += dv
        # Each rank's share of every rank's keys and values, summed where they live.
        by_rank = torch.stack(to_rank_order(grad_key_value, group.size, dim=3).chunk(group.size, dim=3))
        mine = torch.empty(by_rank.shape[1:], dtype=wide, device=key.device)
        reduce_scatter_into(mine, by_rank.flatten(0, 1), group)
        return grad_query, mine[0].to(key.dtype), mine[1].to(value.dtype), None, None, None, None


# --------------------------------------------------------------------------------------------
# a2a (Ulysses)
# --------------------------------------------------------------------------------------------


def _sequence_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[b, heads, s/cp, d]`` (this rank's chunks) -> ``[b, heads/cp, s, d]`` (its heads, whole sequence)."""
    size = group.size
    batch, heads, seq, dim = x.shape
    sending = x.reshape(batch, size, heads // size, seq, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(sending)
    all_to_all_single(received, sending, group)  # [source rank, b, heads/cp, s/cp, d]
    whole = received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * seq, dim)
    return to_sequence_order(whole, size, dim=2)


def _heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`."""
    size = group.size
    batch, heads, seq, dim = x.shape
    local = seq // size
    sending = to_rank_order(x, size, dim=2).reshape(batch, heads, size, local, dim).permute(2, 0, 1, 3, 4)
    sending = sending.contiguous()
    received = torch.empty_like(sending)
    all_to_all_single(received, sending, group)  # [source rank = head group, b, heads/cp, s/cp, d]
    return received.transpose(0, 1).reshape(batch, heads * size, local, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


def check_heads(num_heads: int, group_size: int) -> None:
    if num_heads % group_size:
        raise ContextParallelError(
            f"--cp-comm-type a2a splits the attention heads over the context group: the heads per "
            f"tensor-parallel rank ({num_heads}, from --num-attention-heads / --tensor-model-parallel-size) "
            f"must be divisible by --context-parallel-size {group_size}"
        )


def ulysses_attention(query, key, value, group: Group, kernels: Kernels, *, causal: bool,
                      softmax_scale: float) -> torch.Tensor:
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, group.size)
    if kv_heads % group.size:  # too few key/value heads to split: give every query head its own
        key, value = key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1)
    query, key, value = (_SequenceToHeads.apply(t, group) for t in (query, key, value))
    out = kernels.attention(query, key, value, mask=CAUSAL if causal else FULL, softmax_scale=softmax_scale)
    return _HeadsToSequence.apply(out, group)

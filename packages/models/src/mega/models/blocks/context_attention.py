"""Attention across the context group, one function per ``--cp-comm-type``.

Every rank holds ``[batch, heads, seq / cp, head_dim]`` queries, keys and values of its two
load-balanced chunks (:mod:`mega.core.parallel.context_parallel`) and gets the output of its
own queries over the whole sequence's keys:

* ``p2p``: ring attention (:mod:`mega.models.blocks.ring_attention`), key/value blocks passed
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

Rows of several documents (``documents``: packed rows split per document, or GPT data's
``--reset-attention-mask`` rows split the ordinary way, see
:mod:`mega.core.parallel.document_chunks`) keep every query to its own document's keys, causally
by place in the row: ``p2p`` and ``all_gather`` give the ``block_attention`` kernel a mask per
block of keys (a kernel that takes masks: ``takes_mask``), ``a2a`` puts the gathered tokens back
in row order and gives the ``attention`` kernel the whole rows' ``cu_seqlens``.
"""

from __future__ import annotations

import torch

from mega.core.kernels import CAUSAL, FULL, AttentionMask, Kernels
from mega.core.parallel.collectives import all_gather_into, all_to_all_single, reduce_scatter_into
from mega.core.parallel.config import CP_COMM_TYPES
from mega.core.parallel.context_parallel import (
    ContextParallelError,
    held_chunks,
    to_rank_order,
    to_sequence_order,
)
from mega.core.parallel.groups import Group
from mega.models.blocks.chunk_layout import ChunkLayout
from mega.models.blocks.ring_attention import ring_attention


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group,
                               comm_type: str, kernels: Kernels, *, causal: bool, softmax_scale: float,
                               documents: ChunkLayout | None = None) -> torch.Tensor:
    """This rank's queries' attention over the whole sequence (``documents``: packed rows, each
    query within its own document); see the module docstring."""
    if comm_type == "p2p":
        return ring_attention(query, key, value, group, _block_kernel(kernels, comm_type, documents),
                              causal=causal, softmax_scale=softmax_scale, documents=documents)
    if comm_type == "all_gather":
        return AllGatherAttention.apply(query, key, value, group, _block_kernel(kernels, comm_type, documents),
                                        causal, softmax_scale, documents)
    if comm_type == "a2a":
        return ulysses_attention(query, key, value, group, kernels, causal=causal, softmax_scale=softmax_scale,
                                 documents=documents)
    raise ContextParallelError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")


def _block_kernel(kernels: Kernels, comm_type: str, documents: ChunkLayout | None):
    """The ``block_attention`` kernel, checked to take masks where packed rows need them."""
    kernel = kernels.get("block_attention")
    if documents is not None and not getattr(kernel, "takes_mask", False):
        raise ContextParallelError(
            f"rows of several documents (--packed-sequences, --reset-attention-mask: per-document attention) under "
            f"--cp-comm-type {comm_type} need a block_attention "
            f"kernel that takes masks; --block-attention-backend {kernels.selection.get('block_attention')} "
            f"does not: choose torch, or --cp-comm-type a2a (which runs the attention kernel's packed masks)")
    return kernel


# --------------------------------------------------------------------------------------------
# all_gather
# --------------------------------------------------------------------------------------------


def _gathered_keys(key_value: torch.Tensor, group: Group, in_sequence_order: bool) -> torch.Tensor:
    """Every rank's ``[2, b, h, s/cp, d]`` keys and values -> the whole sequence's, in order (or,
    not ``in_sequence_order``, rank by rank as gathered: packed rows' masks follow that order)."""
    shard = key_value.contiguous()
    gathered = shard.new_empty((group.size * shard.shape[0],) + tuple(shard.shape[1:]))
    all_gather_into(gathered, shard, group)
    gathered = gathered.view((group.size,) + tuple(shard.shape))
    whole = torch.cat(gathered.unbind(0), dim=3)
    return to_sequence_order(whole, group.size, dim=3) if in_sequence_order else whole


def _query_chunks(num_queries: int, group: Group, causal: bool,
                  documents: ChunkLayout | None) -> list[tuple[slice, slice, bool, dict]]:
    """Each run of local queries, the keys it sees, whether the causal mask applies, and the
    kernel's mask argument (packed rows: every key of every rank, masked per document)."""
    everything = slice(None)
    if documents is not None:
        mask = torch.cat([documents.mask(group.rank, source, causal) for source in range(group.size)], dim=-1)
        return [(everything, everything, False, {"mask": mask})]
    if not causal:
        return [(everything, everything, False, {})]
    half = num_queries // 2
    return [(slice(index * half, (index + 1) * half), slice(0, (chunk + 1) * half), True, {})
            for index, chunk in enumerate(held_chunks(group.rank, group.size))]


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group: Group, kernel, causal: bool, softmax_scale: float,
                documents: ChunkLayout | None = None):
        key_value = _gathered_keys(torch.stack([key, value]), group, documents is None)
        outs, lses = [], []
        for rows, keys, masked, mask_argument in _query_chunks(query.shape[2], group, causal, documents):
            out, lse = kernel.forward(query[:, :, rows], key_value[0][:, :, keys], key_value[1][:, :, keys],
                                      causal=masked, softmax_scale=softmax_scale, **mask_argument)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.kernel, ctx.causal, ctx.softmax_scale = group, kernel, causal, softmax_scale
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group, in_sequence_order = ctx.group, ctx.documents is None
        # Gathered again: not kept from forward.
        key_value = _gathered_keys(torch.stack([key, value]), group, in_sequence_order)
        wide = torch.promote_types(key.dtype, torch.float32)
        grad_key_value = torch.zeros(key_value.shape, dtype=wide, device=key.device)
        grad_query = torch.empty_like(query)
        for rows, keys, masked, mask_argument in _query_chunks(query.shape[2], group, ctx.causal, ctx.documents):
            dq, dk, dv = ctx.kernel.backward(grad_out[:, :, rows], query[:, :, rows], key_value[0][:, :, keys],
                                             key_value[1][:, :, keys], out[:, :, rows], lse[:, :, rows],
                                             causal=masked, softmax_scale=ctx.softmax_scale, **mask_argument)
            grad_query[:, :, rows] = dq
            grad_key_value[0][:, :, keys] += dk
            grad_key_value[1][:, :, keys] += dv
        # Each rank's share of every rank's keys and values, summed where they live.
        if in_sequence_order:
            grad_key_value = to_rank_order(grad_key_value, group.size, dim=3)
        by_rank = torch.stack(grad_key_value.chunk(group.size, dim=3))
        mine = torch.empty(by_rank.shape[1:], dtype=wide, device=key.device)
        reduce_scatter_into(mine, by_rank.flatten(0, 1), group)
        return grad_query, mine[0].to(key.dtype), mine[1].to(value.dtype), None, None, None, None, None


# --------------------------------------------------------------------------------------------
# a2a (Ulysses)
# --------------------------------------------------------------------------------------------


def _sequence_to_heads(x: torch.Tensor, group: Group, places: torch.Tensor | None) -> torch.Tensor:
    """``[b, heads, s/cp, d]`` (this rank's chunks) -> ``[b, heads/cp, s, d]`` (its heads, whole
    sequence). ``places``: packed rows, the place in the row of each gathered token
    (:meth:`ChunkLayout.gathered_places`); None: the load-balanced chunks."""
    size = group.size
    batch, heads, seq, dim = x.shape
    sending = x.reshape(batch, size, heads // size, seq, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(sending)
    all_to_all_single(received, sending, group)  # [source rank, b, heads/cp, s/cp, d]
    whole = received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * seq, dim)
    if places is None:
        return to_sequence_order(whole, size, dim=2)
    return torch.take_along_dim(whole, torch.argsort(places, dim=1)[:, None, :, None], dim=2)


def _heads_to_sequence(x: torch.Tensor, group: Group, places: torch.Tensor | None) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`."""
    size = group.size
    batch, heads, seq, dim = x.shape
    local = seq // size
    if places is None:
        x = to_rank_order(x, size, dim=2)
    else:
        x = torch.take_along_dim(x, places[:, None, :, None], dim=2)
    sending = x.reshape(batch, heads, size, local, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(sending)
    all_to_all_single(received, sending, group)  # [source rank = head group, b, heads/cp, s/cp, d]
    return received.transpose(0, 1).reshape(batch, heads * size, local, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, places: torch.Tensor | None):
        ctx.group, ctx.places = group, places
        return _sequence_to_heads(x, group, places)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group, ctx.places), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, places: torch.Tensor | None):
        ctx.group, ctx.places = group, places
        return _heads_to_sequence(x, group, places)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group, ctx.places), None, None


def check_heads(num_heads: int, group_size: int) -> None:
    if num_heads % group_size:
        raise ContextParallelError(
            f"--cp-comm-type a2a splits the attention heads over the context group: the heads per "
            f"tensor-parallel rank ({num_heads}, from --num-attention-heads / --tensor-model-parallel-size) "
            f"must be divisible by --context-parallel-size {group_size}"
        )


def ulysses_attention(query, key, value, group: Group, kernels: Kernels, *, causal: bool,
                      softmax_scale: float, documents: ChunkLayout | None = None) -> torch.Tensor:
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, group.size)
    if kv_heads % group.size:  # too few key/value heads to split: give every query head its own
        key, value = key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1)
    places = None if documents is None else documents.gathered_places()
    query, key, value = (_SequenceToHeads.apply(t, group, places) for t in (query, key, value))
    # Packed rows are whole rows again, in row order: the documents' own cu_seqlens mask them.
    if documents is None:
        mask = CAUSAL if causal else FULL
    else:
        mask = AttentionMask(causal=causal, cu_seqlens=documents.whole_cu_seqlens())
    out = kernels.attention(query, key, value, mask=mask, softmax_scale=softmax_scale)
    return _HeadsToSequence.apply(out, group, places)

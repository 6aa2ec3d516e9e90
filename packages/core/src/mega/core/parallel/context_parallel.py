"""Context parallelism: each rank of the context group holds a slice of every sequence.

Megatron's load balancing: the sequence is cut into ``2 * cp`` equal chunks and rank ``i`` holds
chunks ``i`` and ``2 * cp - 1 - i``, one from the start and one from the end. Under a causal
mask a query attends to the keys before it, so early chunks are cheap and late ones dear; a
pair of chunks from both ends gives every rank the same work.

Here live the pieces that do not depend on the attention: which chunks a rank holds, the split
of a micro-batch (done once, where the trainer forms the micro-batches; positions travel with
the tokens as ``position_ids``, so position embeddings and RoPE follow the chunks), the
reordering of gathered chunks back into sequence order, and the loss over the whole sequence.
The attention across ranks is in :mod:`mega.models.blocks.context_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mega.core.parallel.collectives import all_reduce
from mega.core.parallel.document_chunks import ContextParallelError, document_chunk_index
from mega.core.parallel.groups import Group


def held_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two of the ``2 * size`` sequence chunks that context rank ``rank`` holds, in order."""
    return rank, 2 * size - 1 - rank


def check_sequence_length(seq_length: int, cp: int) -> None:
    """The sequence must cut into ``2 * cp`` equal chunks."""
    if cp > 1 and seq_length % (2 * cp):
        raise ContextParallelError(
            f"--seq-length {seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp} "
            f"(each context rank holds two equal chunks of every sequence)"
        )


def split_sequence(tensor: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``dim`` (the whole sequence), concatenated."""
    if group.size <= 1:
        return tensor
    chunks = tensor.chunk(2 * group.size, dim=dim)
    first, second = held_chunks(group.rank, group.size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def split_batch(batch: Mapping[str, torch.Tensor], group: Group, seq_length: int, *,
                per_document: bool = False) -> dict[str, torch.Tensor]:
    """This context rank's part of a micro-batch: every ``[batch, seq, ...]`` field split into
    its two chunks. A batch without ``position_ids`` gets the whole sequence's positions first,
    so the chunks keep their place in the sequence (position embeddings, RoPE).

    Rows of several documents (``document_ids``): ``per_document`` (packed rows whose documents
    are each a multiple of ``2 * cp`` long) splits them per document, the rank's two chunks of
    every document, ``document_ids`` included; otherwise (GPT data's ``--reset-attention-mask``)
    they are split the ordinary way and ``document_ids`` stay whole rows, so that every rank knows
    the document of every key (:mod:`mega.core.parallel.document_chunks`)."""
    if group.size <= 1:
        return dict(batch)
    check_sequence_length(seq_length, group.size)
    batch = dict(batch)
    tokens = batch.get("tokens")
    if "position_ids" not in batch and tokens is not None and tokens.dim() == 2:
        batch["position_ids"] = torch.arange(seq_length, device=tokens.device).expand(tokens.shape[0], -1)
    document_ids = batch.get("document_ids")
    if document_ids is not None and per_document:
        held = document_chunk_index(document_ids, group.rank, group.size)
        return {key: _take_places(value, held) if value.dim() >= 2 and value.shape[1] == seq_length else value
                for key, value in batch.items()}
    whole = {} if document_ids is None else {"document_ids": document_ids}
    return {key: split_sequence(value, group) if value.dim() >= 2 and value.shape[1] == seq_length else value
            for key, value in batch.items()} | whole


def _take_places(tensor: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """``tensor[b, places[b, j], ...]`` for a ``[batch, seq, ...]`` tensor and ``[batch, n]`` places."""
    index = places.to(tensor.device).view(places.shape + (1,) * (tensor.dim() - 2))
    return torch.take_along_dim(tensor, index, dim=1)


def to_sequence_order(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Chunks gathered in rank order (rank 0's two, rank 1's two, ...) put back in sequence order."""
    if size <= 1:
        return tensor
    gathered = tensor.chunk(2 * size, dim=dim)
    order = [None] * (2 * size)
    for rank in range(size):
        first, second = held_chunks(rank, size)
        order[first], order[second] = gathered[2 * rank], gathered[2 * rank + 1]
    return torch.cat(order, dim=dim)


def to_rank_order(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """The inverse of :func:`to_sequence_order`: a whole sequence laid out rank by rank."""
    if size <= 1:
        return tensor
    chunks = tensor.chunk(2 * size, dim=dim)
    return torch.cat([chunks[index] for rank in range(size) for index in held_chunks(rank, size)], dim=dim)


def sequence_mean(total: torch.Tensor, count: torch.Tensor, group: Group | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of a per-token quantity over the whole sequence when each context rank holds a
    slice: ``total`` (differentiable) and ``count`` are this rank's sums.

    Returns ``(loss, mean)``: ``loss`` to differentiate, whose gradients summed over the context
    ranks are those of the whole sequence's mean (gradients are averaged over ``dp x cp``, hence
    the factor ``cp``; it also averages over the context ranks to the mean), and ``mean`` (detached)
    the whole sequence's mean, the same on every context rank.
    """
    if group is None or group.size <= 1:
        loss = total / count.clamp_min(1.0)
        return loss, loss.detach()
    sums = torch.stack([total.detach().float(), count.detach().float()])
    all_reduce(sums, group)
    whole_count = sums[1].clamp_min(1.0)
    loss = total * group.size / whole_count.to(total.dtype)
    return loss, (sums[0] / whole_count).to(total.dtype)

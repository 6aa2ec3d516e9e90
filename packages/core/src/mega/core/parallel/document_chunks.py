"""Context parallelism over rows that hold several documents: where every rank's tokens sit.

Two splits, as in Megatron:

* Packed rows (``--sft --packed-sequences``), per document, as Megatron and Transformer Engine do
  for packed (THD) batches: every document of a row (and the row's padding, its own document) is
  cut into ``2 * cp`` equal chunks, and context rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``
  *of every document*: each rank gets the same share of every document's causal work, whatever
  the documents' lengths. Every document's length must therefore be a multiple of ``2 * cp``
  (``--packed-sequences`` pads each conversation to one). On a rank, the local row is its two
  chunks of the first document, then of the second, and so on, so the per-document attention
  mask the model builds from the local ``document_ids`` (:class:`~mega.core.kernels.AttentionMask`
  ``cu_seqlens``) spans ``length / cp`` tokens per document, the same on every rank:
  :class:`DocumentChunks`.
* GPT data's ``--reset-attention-mask`` (documents end at end-of-document tokens, any length):
  the ordinary split, rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` of the whole row, and
  the row's ``document_ids`` stay whole on every rank (a key's document is needed wherever the key
  travels), so the model's mask spans the whole rows: :class:`SequenceChunks`.

From either, a :class:`ChunkLayout` knows every rank's layout: the place in the row of any rank's
tokens and their documents, hence which keys of any rank a query may see (its own document's, up
to its own place), what the cross-rank attention needs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


class ContextParallelError(ValueError):
    """A run that context parallelism cannot split (the message names the flags)."""


def document_chunk_index(document_ids: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """``[batch, seq / size]``: the places in each row of the tokens context rank ``rank`` holds
    (chunks ``rank`` and ``2 * size - 1 - rank`` of every document, in row order), given the
    rows' ``document_ids`` ``[batch, seq]``."""
    batch, seq = document_ids.shape
    starts = torch.ones(batch, seq, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    flat_starts = starts.reshape(-1)
    segment = torch.cumsum(flat_starts.long(), 0) - 1  # each token's document, numbered along the batch
    lengths = torch.bincount(segment)
    uneven = torch.nonzero(lengths % (2 * size)).flatten()
    if uneven.numel():
        first = int(uneven[0])
        begin = int(torch.nonzero(flat_starts).flatten()[first])
        raise ContextParallelError(
            f"a document of {int(lengths[first])} tokens (row {begin // seq} of the micro-batch, from position "
            f"{begin % seq}) does not cut into 2 x --context-parallel-size = {2 * size} equal chunks: context "
            f"parallelism over packed rows chunks every document, so each must be a multiple of {2 * size} long "
            f"(--packed-sequences pads every conversation to one)")
    tokens = torch.arange(batch * seq, device=document_ids.device)
    first_token = torch.nonzero(flat_starts).flatten()
    chunk_length = lengths[segment] // (2 * size)
    chunk = (tokens - first_token[segment]) // chunk_length
    keep = (chunk == rank) | (chunk == 2 * size - 1 - rank)
    # Chunk ``rank`` precedes chunk ``2 size - 1 - rank`` in its document: row order is the order held.
    return torch.nonzero(keep.view(batch, seq))[:, 1].view(batch, seq // size)


@dataclass(frozen=True)
class ChunkLayout(abc.ABC):
    """Where a context rank's local tokens sit in the whole rows, and so which keys of any rank a
    query may see: what the cross-rank attention (:mod:`mega.models.blocks.context_attention`)
    reads. Every tensor is ``[batch, local_seq]``, one entry per local token: ``offset`` its place
    among its chunk pair's local tokens, ``half`` the length of one chunk of that pair, ``start``
    the pair's first place in the whole row. A subclass says which document each token is in.
    """

    offset: torch.Tensor
    half: torch.Tensor
    start: torch.Tensor
    size: int
    cu_seqlens: torch.Tensor

    # The ranks hold the plain sequence chunks (rank i: i and 2cp-1-i of the whole row), so the
    # ring's causal block skipping (:func:`mega.models.blocks.ring_attention.visible_block`) holds.
    sequence_chunks = False

    def places(self, rank: int) -> torch.Tensor:
        """``[batch, local_seq]``: where in the whole row each token of context rank ``rank`` sits."""
        first = self.offset < self.half
        return self.start + torch.where(first, rank * self.half + self.offset,
                                        (2 * self.size - 1 - rank) * self.half + self.offset - self.half)

    @abc.abstractmethod
    def documents(self, rank: int) -> torch.Tensor:
        """``[batch, local_seq]``: the document of each token of context rank ``rank`` (numbered
        along the batch)."""

    def mask(self, query_rank: int, key_rank: int, causal: bool = True) -> torch.Tensor:
        """``[batch, 1, queries, keys]`` bool, True where a query of ``query_rank`` sees a key of
        ``key_rank``: the same document (and, ``causal``, the key not after the query)."""
        allowed = self.documents(query_rank)[:, :, None] == self.documents(key_rank)[:, None, :]
        if causal:
            allowed = allowed & (self.places(key_rank)[:, None, :] <= self.places(query_rank)[:, :, None])
        return allowed[:, None]

    @abc.abstractmethod
    def whole_cu_seqlens(self) -> torch.Tensor:
        """The ``cu_seqlens`` of the whole rows."""

    def gathered_places(self) -> torch.Tensor:
        """``[batch, seq]``: the place in the row of each token of every rank's rows laid end to end
        in rank order (what an all-gather over the context group holds)."""
        return torch.cat([self.places(rank) for rank in range(self.size)], dim=1)


@dataclass(frozen=True)
class DocumentChunks(ChunkLayout):
    """Rows split per document (:func:`document_chunk_index`), read from the local rows'
    ``cu_seqlens``: a chunk pair per document, ``document`` ``[batch, local_seq]`` the same on
    every rank."""

    document: torch.Tensor

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, local_seq: int, size: int) -> DocumentChunks:
        device = cu_seqlens.device
        offsets = cu_seqlens.to(device=device, dtype=torch.long)
        tokens = torch.arange(batch * local_seq, device=device)
        document = torch.bucketize(tokens, offsets[1:], right=True)
        local_start, local_length = offsets[document], (offsets[1:] - offsets[:-1])[document]
        if bool((local_length % 2).any()):
            raise ContextParallelError("packed rows under context parallelism must be split per document "
                                       "(mega.core.parallel.context_parallel.split_batch): a document's local "
                                       "span is not two equal chunks")
        start = (local_start % local_seq) * size  # every earlier document of the row is ``size`` times longer whole
        view = (batch, local_seq)
        return cls(offset=(tokens - local_start).view(view), half=(local_length // 2).view(view),
                   start=start.view(view), size=size, cu_seqlens=offsets, document=document.view(view))

    def documents(self, rank: int) -> torch.Tensor:
        return self.document

    def whole_cu_seqlens(self) -> torch.Tensor:
        """Every document ``size`` times its local length."""
        return (self.cu_seqlens * self.size).to(torch.int32)


@dataclass(frozen=True)
class SequenceChunks(ChunkLayout):
    """Rows split the ordinary way (rank ``i`` holds sequence chunks ``i`` and ``2cp-1-i``) whose
    documents are any length (GPT data's ``--reset-attention-mask``), read from the *whole* rows'
    ``cu_seqlens``: ``row_document`` ``[batch, seq]`` is the document of every token of the row."""

    row_document: torch.Tensor
    sequence_chunks = True

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, local_seq: int, size: int) -> SequenceChunks:
        device = cu_seqlens.device
        offsets = cu_seqlens.to(device=device, dtype=torch.long)
        row_document = torch.bucketize(torch.arange(batch * local_seq * size, device=device), offsets[1:], right=True)
        view = (batch, local_seq)
        offset = torch.arange(local_seq, device=device).expand(view)
        return cls(offset=offset, half=torch.full(view, local_seq // 2, device=device),
                   start=torch.zeros(view, dtype=torch.long, device=device), size=size, cu_seqlens=offsets,
                   row_document=row_document.view(batch, local_seq * size))

    def documents(self, rank: int) -> torch.Tensor:
        return torch.take_along_dim(self.row_document, self.places(rank), dim=1)

    def whole_cu_seqlens(self) -> torch.Tensor:
        return self.cu_seqlens.to(torch.int32)


def chunk_layout(cu_seqlens: torch.Tensor, batch: int, local_seq: int, size: int) -> ChunkLayout:
    """The layout of a context rank's ``[batch, local_seq]`` rows from the model's packed mask:
    ``cu_seqlens`` over the local rows (split per document, :class:`DocumentChunks`) or over the
    whole rows (split the ordinary way, their ``document_ids`` kept whole: :class:`SequenceChunks`).

    Every layer of a forward passes the same mask: its layout is made once (reading its length
    is a host synchronisation on a GPU; once per forward, not once per layer)."""
    key = (batch, local_seq, size)
    if _last_layout and _last_layout[0] is cu_seqlens and _last_layout[1] == key:
        return _last_layout[2]
    layout = _chunk_layout(cu_seqlens, batch, local_seq, size)
    _last_layout[:] = [cu_seqlens, key, layout]  # holds the tensor: its id cannot be reused meanwhile
    return layout


_last_layout: list = []  # [cu_seqlens, (batch, local_seq, size), layout] of the last call


def _chunk_layout(cu_seqlens: torch.Tensor, batch: int, local_seq: int, size: int) -> ChunkLayout:
    tokens = int(cu_seqlens[-1])
    if tokens == batch * local_seq:
        return DocumentChunks.from_cu_seqlens(cu_seqlens, batch, local_seq, size)
    if tokens == batch * local_seq * size:
        return SequenceChunks.from_cu_seqlens(cu_seqlens, batch, local_seq, size)
    raise ContextParallelError(
        f"the packed mask's cu_seqlens span {tokens} tokens, neither this context rank's {batch} x {local_seq} "
        f"nor the whole rows' {batch} x {local_seq * size} (split the batch with "
        f"mega.core.parallel.context_parallel.split_batch)")

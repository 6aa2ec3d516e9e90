"""Where every context rank's tokens sit in the whole rows, for the attention across the context
group (:mod:`mega.models.blocks.context_attention`): :class:`DocumentChunks` for packed rows split
per document, :class:`SequenceChunks` for whole rows (the two splits of
:mod:`mega.core.parallel.document_chunks`).

From either, a :class:`ChunkLayout` knows every rank's layout: the place in the row of any rank's
tokens and their documents, hence which keys of any rank a query may see (its own document's, up
to its own place), what the cross-rank attention needs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from mega.core.parallel.document_chunks import ContextParallelError


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

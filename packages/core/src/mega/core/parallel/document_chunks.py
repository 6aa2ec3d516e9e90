"""Context parallelism over rows that hold several documents (packed sequences), per document.

As Megatron and Transformer Engine do for packed (THD) batches, every document of a row (and the
row's padding, its own document) is cut into ``2 * cp`` equal chunks, and context rank ``i``
holds chunks ``i`` and ``2 * cp - 1 - i`` *of every document*: each rank gets the same share of
every document's causal work, whatever the documents' lengths. Every document's length must
therefore be a multiple of ``2 * cp`` (``--packed-sequences`` pads each conversation to one).

On a rank, the local row is its two chunks of the first document, then of the second, and so on,
so the per-document attention mask the model builds from the local ``document_ids``
(:class:`~mega.core.kernels.AttentionMask` ``cu_seqlens``) spans ``length / cp`` tokens per
document, the same on every rank. From it :class:`DocumentChunks` knows every rank's layout: the
place in the row of any rank's tokens, hence which keys of any rank a query may see (its own
document's, up to its own place), what the cross-rank attention needs.
"""

from __future__ import annotations

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
            f"(--packed-sequences pads every conversation to one; GPT data's --reset-attention-mask does not)")
    tokens = torch.arange(batch * seq, device=document_ids.device)
    first_token = torch.nonzero(flat_starts).flatten()
    chunk_length = lengths[segment] // (2 * size)
    chunk = (tokens - first_token[segment]) // chunk_length
    keep = (chunk == rank) | (chunk == 2 * size - 1 - rank)
    # Chunk ``rank`` precedes chunk ``2 size - 1 - rank`` in its document: row order is the order held.
    return torch.nonzero(keep.view(batch, seq))[:, 1].view(batch, seq // size)


@dataclass(frozen=True)
class DocumentChunks:
    """The per-document layout of a context rank's local rows, read from their ``cu_seqlens``.

    Every tensor is ``[batch, local_seq]``, one entry per local token: ``document`` its document
    (numbered along the batch, the same on every rank), ``offset`` its place among the document's
    local tokens, ``half`` the length of one chunk of it, ``start`` the document's first place in
    the whole row.
    """

    document: torch.Tensor
    offset: torch.Tensor
    half: torch.Tensor
    start: torch.Tensor
    size: int
    cu_seqlens: torch.Tensor

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
        return cls(document.view(view), (tokens - local_start).view(view), (local_length // 2).view(view),
                   start.view(view), size, offsets)

    def places(self, rank: int) -> torch.Tensor:
        """``[batch, local_seq]``: where in the whole row each token of context rank ``rank`` sits."""
        first = self.offset < self.half
        return self.start + torch.where(first, rank * self.half + self.offset,
                                        (2 * self.size - 1 - rank) * self.half + self.offset - self.half)

    def mask(self, query_rank: int, key_rank: int, causal: bool = True) -> torch.Tensor:
        """``[batch, 1, queries, keys]`` bool, True where a query of ``query_rank`` sees a key of
        ``key_rank``: the same document (and, ``causal``, the key not after the query)."""
        allowed = self.document[:, :, None] == self.document[:, None, :]
        if causal:
            allowed = allowed & (self.places(key_rank)[:, None, :] <= self.places(query_rank)[:, :, None])
        return allowed[:, None]

    def whole_cu_seqlens(self) -> torch.Tensor:
        """The ``cu_seqlens`` of the whole rows: every document ``size`` times its local length."""
        return (self.cu_seqlens * self.size).to(torch.int32)

    def gathered_places(self) -> torch.Tensor:
        """``[batch, seq]``: the place in the row of each token of every rank's rows laid end to end
        in rank order (what an all-gather over the context group holds)."""
        return torch.cat([self.places(rank) for rank in range(self.size)], dim=1)

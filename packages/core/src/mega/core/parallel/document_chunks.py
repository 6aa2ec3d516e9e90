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
  ``DocumentChunks``.
* GPT data's ``--reset-attention-mask`` (documents end at end-of-document tokens, any length):
  the ordinary split, rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` of the whole row, and
  the row's ``document_ids`` stay whole on every rank (a key's document is needed wherever the key
  travels), so the model's mask spans the whole rows: ``SequenceChunks``.

The layouts built from these splits (which keys of any rank a query may see, what the
cross-rank attention reads) are mega-models' (:mod:`mega.models.blocks.chunk_layout`).
"""

from __future__ import annotations

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

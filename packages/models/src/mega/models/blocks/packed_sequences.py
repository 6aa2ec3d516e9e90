"""Rows that hold several documents (packed sequences, Megatron's ``--reset-attention-mask``):
the attention mask that keeps each document to itself.

A micro-batch carries ``document_ids`` ``[batch, seq]`` (equal within a document, increasing
along a row); the mask is causal within each document, as :class:`AttentionMask` ``cu_seqlens``
over the batch's rows laid end to end, which every attention backend reads (flash-attention's
varlen kernels directly).
"""

from __future__ import annotations

import torch

from mega.core.kernels import CAUSAL, AttentionMask


def document_attention_mask(document_ids: torch.Tensor | None) -> AttentionMask:
    """Causal attention within each document of ``document_ids`` ``[batch, seq]`` (None: plain causal)."""
    if document_ids is None:
        return CAUSAL
    batch, seq = document_ids.shape
    # A new document starts where the id changes and at every row's start.
    starts = torch.ones(batch, seq, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = torch.nonzero(starts.reshape(-1)).flatten().to(torch.int32)
    end = torch.tensor([batch * seq], dtype=torch.int32, device=document_ids.device)
    return AttentionMask(causal=True, cu_seqlens=torch.cat((offsets, end)))

"""Context parallelism for the decoder-only LMs, applied from outside like tensor parallelism.

The pass :func:`mega.models.parallelize.apply_cp` swaps every layer's
:class:`~mega.models.blocks.attention.CoreAttention` for :class:`ContextParallelAttention`, which
attends this rank's chunks of the sequence to the whole sequence's keys across the context
group (``--cp-comm-type``, see :mod:`mega.models.blocks.context_attention`). Nothing else in the
model changes: the trainer hands each rank its chunks of the micro-batch with their
``position_ids`` (so learned positions and RoPE follow the chunks), norms and MLPs are per
token, and the loss sums over the whole sequence (:func:`mega.core.parallel.context_parallel.sequence_mean`).

Rows of several documents (``document_ids``) arrive split per document (packed rows, with their
local ``document_ids``) or the ordinary way (GPT data's ``--reset-attention-mask``, with the whole
rows' ``document_ids``); the mask the model builds from them (``cu_seqlens``) tells every rank the
documents' layout (:func:`~mega.core.parallel.document_chunks.chunk_layout`), and the attention
keeps each query to its own document.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import CAUSAL, AttentionMask
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.models.blocks.attention import CoreAttention, sequence_major
from mega.models.blocks.chunk_layout import chunk_layout
from mega.models.blocks.context_attention import check_heads, context_parallel_attention
from mega.models.config import ModelConfigError, TransformerConfig


def check_context_parallel(config: TransformerConfig, parallel: ParallelConfig) -> None:
    """What context parallelism cannot run, named by its flags."""
    if parallel.cp <= 1:
        return
    if config.attention_dropout:
        raise ModelConfigError(
            f"--attention-dropout {config.attention_dropout} with --context-parallel-size {parallel.cp}: "
            f"attention split across ranks has no dropout; pass --attention-dropout 0"
        )
    if config.sliding_window is not None:
        raise ModelConfigError(
            f"--sliding-window {config.sliding_window} with --context-parallel-size {parallel.cp}: the ranks' "
            "attention over the split sequence has no window; pass --context-parallel-size 1"
        )
    if getattr(config, "rope_type", "rope") == "dynamic":
        raise ModelConfigError(
            f"--rope-type dynamic with --context-parallel-size {parallel.cp}: its frequencies follow the whole "
            "sequence's length, which no rank's chunks of positions show; pass --context-parallel-size 1"
        )
    if parallel.cp_comm_type == "a2a":
        try:
            check_heads(config.num_attention_heads // parallel.tp, parallel.cp)
        except ValueError as error:
            raise ModelConfigError(str(error)) from None


class ContextParallelAttention(nn.Module):
    """``CoreAttention``'s interface (``[seq, batch, heads, head_dim]`` in, ``[seq, batch,
    heads * head_dim]`` out) over the context group; causal or full masks, and packed rows'
    ``cu_seqlens``."""

    def __init__(self, core: CoreAttention, groups: ParallelGroups, comm_type: str):
        super().__init__()
        self.kernels, self.softmax_scale = core.kernels, core.softmax_scale
        self.group, self.comm_type = groups.cp, comm_type

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: AttentionMask = CAUSAL) -> torch.Tensor:
        if mask.padding is not None or mask.bias is not None:
            raise ValueError("context parallelism takes causal or full attention masks, or packed rows' "
                             "cu_seqlens, only")
        documents = None
        if mask.cu_seqlens is not None:  # rows of several documents: the local rows' or the whole rows' mask
            seq, batch = query.shape[:2]
            documents = chunk_layout(mask.cu_seqlens, batch, seq, self.group.size)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = context_parallel_attention(query, key, value, self.group, self.comm_type, self.kernels,
                                         causal=mask.causal, softmax_scale=self.softmax_scale, documents=documents)
        return sequence_major(out)


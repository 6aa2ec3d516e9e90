"""Token (and learned position) embeddings, returned in the transformer's ``[seq, batch, hidden]``."""

from __future__ import annotations

import torch
from torch import nn

from mega.core.parallel.param_attrs import mark_padded_vocab
from mega.models.config import TransformerConfig


class Embedding(nn.Module):
    """``word_embeddings`` over the padded vocabulary, plus ``position_embeddings`` when learned.

    ``words_only`` builds the last pipeline stage's copy of a tied word embedding, which serves
    only as the output layer's weight.
    """

    def __init__(self, config: TransformerConfig, padded_vocab_size: int, words_only: bool = False):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, config.hidden_size)
        mark_padded_vocab(self.word_embeddings.weight)
        learned = config.position_embedding_type == "learned_absolute" and not words_only
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
            hidden = hidden + self.position_embeddings(position_ids)
        return self.dropout(hidden.transpose(0, 1).contiguous())

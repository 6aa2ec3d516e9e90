"""Sentence embeddings from an encoder model (the ``bert`` family): what ``POST /v1/embeddings``
and ``mega embed`` both compute.

An input is a text (tokenized, then wrapped in the tokenizer's ``[CLS]`` ... ``[SEP]`` when it
has them, as ``BertTokenizer`` does) or a list of token ids (used exactly as given). Inputs are
sorted by length and run in batches of similar lengths, each padded to its longest; the padding
mask keeps padding out of attention and out of the pooling. ``mean`` pooling averages the last
hidden states of the real tokens (sentence-transformers' default), ``cls`` takes the first
token's; ``normalize`` scales each embedding to unit L2 norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

POOLINGS = ("mean", "cls")


class EmbeddingInputError(ValueError):
    """An input that cannot be embedded; the message names which (``input[3]``) and why."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


def is_encoder(model: torch.nn.Module) -> bool:
    """Whether ``model`` gives hidden states to pool (an encoder family's stage has ``encode``)."""
    return callable(getattr(model, "encode", None))


@dataclass
class Embedder:
    """``model``: a whole encoder (one stage, eval mode); ``max_positions``: the longest input
    (its position table); ``batch_size``: inputs per forward pass."""

    model: torch.nn.Module
    tokenizer: object | None
    max_positions: int
    vocab_size: int
    pooling: str = "mean"
    normalize: bool = True
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if not is_encoder(self.model):
            raise ValueError("this model gives no hidden states to pool: embeddings need an encoder "
                             "(the bert family)")

    # -- inputs -----------------------------------------------------------------------------------
    def token_ids(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Each input as the token ids the model reads, checked against the model."""
        texts = [(index, text) for index, text in enumerate(inputs) if isinstance(text, str)]
        empty = next((index for index, item in enumerate(inputs) if len(item) == 0), None)
        if empty is not None:  # an empty text would be [CLS] [SEP] alone: not what anyone means
            raise EmbeddingInputError(f"input[{empty}] is empty", empty)
        if texts and self.tokenizer is None:
            raise EmbeddingInputError("text inputs need a tokenizer, and the model names none; send token ids",
                                      texts[0][0])
        tokenized = dict(zip((index for index, _ in texts),
                             self.tokenizer.tokenize_batch([text for _, text in texts]) if texts else [],
                             strict=True))
        cls, sep = (getattr(self.tokenizer, "cls", None), getattr(self.tokenizer, "sep", None))
        sequences = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                ids = list(tokenized[index])
                if cls is not None and sep is not None:
                    ids = [cls, *ids, sep]
            else:
                ids = list(item)
            sequences.append(self._checked(ids, index))
        return sequences

    def _checked(self, ids: list[int], index: int) -> list[int]:
        if len(ids) > self.max_positions:
            raise EmbeddingInputError(f"input[{index}] has {len(ids)} tokens, more than the model's "
                                      f"{self.max_positions} positions", index)
        bad = next((token for token in ids if not isinstance(token, int) or isinstance(token, bool)
                    or not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise EmbeddingInputError(f"input[{index}] holds token id {bad!r}, outside the vocabulary "
                                      f"[0, {self.vocab_size})", index)
        return ids

    # -- embedding --------------------------------------------------------------------------------
    @torch.no_grad()
    def embed(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[len(sequences), hidden]`` fp32 embeddings, in the order given."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out: list[torch.Tensor | None] = [None] * len(sequences)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for index, embedding in zip(chunk, self._embed_batch([sequences[i] for i in chunk]), strict=True):
                out[index] = embedding
        return torch.stack(out) if out else torch.empty(0)

    def _embed_batch(self, sequences: list[Sequence[int]]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        longest = max(len(ids) for ids in sequences)
        text = torch.zeros(len(sequences), longest, dtype=torch.long)
        padding = torch.zeros(len(sequences), longest, dtype=torch.long)
        for row, ids in enumerate(sequences):
            text[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            padding[row, :len(ids)] = 1
        text, padding = text.to(device), padding.to(device)
        hidden = self.model.encode({"text": text, "types": torch.zeros_like(text), "padding_mask": padding})
        hidden = hidden.transpose(0, 1).float()  # [b, s, h]
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = padding.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu()

"""The host-side sampler the engine used before sampling moved onto the device (mega at 3925cc7,
with every row drawing over sorted tokens): one ``.item()`` per sequence per step. Kept as the
reference the device-side :class:`mega.inference.engine.sampling.Sampler` must equal, token for token."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from mega.inference.engine.sampling import SamplingParams


class HostSampler:
    """The sampling state of a batch: settings as tensors, one random stream per sequence.

    Rows leave (:meth:`keep`) as sequences finish and join (:meth:`extend`) under continuous
    batching; each row's stream and penalty counts travel with it.
    """

    def __init__(self, params: Sequence[SamplingParams], device: torch.device):
        self.greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device)
        self.temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 0.0 for p in params], device=device)
        self.generators = [
            torch.Generator().manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
            for p in params
        ]
        self.presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        self.frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        self.bias = [p.logit_bias for p in params]
        self.adjusted = any(p.adjusts_logits for p in params)
        # [batch, vocab] counts of generated tokens and logit biases, once the vocabulary is known.
        self.counts: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None

    _ROW_TENSORS = ("greedy", "temperature", "top_k", "top_p", "presence", "frequency")

    def keep(self, rows: list[int]) -> None:
        """Keep the streams and settings of the sequences at ``rows`` (the others finished)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.greedy.device)
        for name in self._ROW_TENSORS:
            setattr(self, name, getattr(self, name)[index])
        self.generators = [self.generators[row] for row in rows]
        self.bias = [self.bias[row] for row in rows]
        if self.counts is not None:
            self.counts, self.bias_values = self.counts[index], self.bias_values[index]

    def extend(self, other: HostSampler) -> None:
        """Add ``other``'s rows after this batch's (sequences joining a running batch)."""
        for name in self._ROW_TENSORS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.generators += other.generators
        self.bias += other.bias
        self.adjusted = self.adjusted or other.adjusted
        if self.counts is not None or other.counts is not None:
            vocab = (self.counts if self.counts is not None else other.counts).shape[-1]
            mine, theirs = self._materialised(vocab), other._materialised(vocab)
            self.counts = torch.cat([mine[0], theirs[0]])
            self.bias_values = torch.cat([mine[1], theirs[1]])

    def _materialised(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None:
            rows, device = len(self.generators), self.greedy.device
            self.counts = torch.zeros(rows, vocab, device=device)
            self.bias_values = torch.zeros(rows, vocab, device=device)
            for row, bias in enumerate(self.bias):
                for token, value in bias:
                    if token < vocab:
                        self.bias_values[row, token] += value
        return self.counts, self.bias_values

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with each sequence's logit bias and penalties applied."""
        if not self.adjusted:
            return logits
        counts, bias_values = self._materialised(logits.shape[-1])
        return logits + bias_values - self.presence * (counts > 0) - self.frequency * counts

    def observe(self, tokens: torch.Tensor, generated: Sequence[bool]) -> None:
        """Count ``tokens`` for the penalties where ``generated`` (not prompt tokens)."""
        if not self.adjusted or self.counts is None:
            return
        rows = torch.tensor(generated, device=tokens.device).nonzero(as_tuple=True)[0]
        self.counts.index_put_((rows, tokens[rows]), torch.ones_like(rows, dtype=self.counts.dtype), accumulate=True)

    def sample(self, logits: torch.Tensor, drawing: Sequence[bool]) -> torch.Tensor:
        """Token ids ``[batch]`` from fp32 logits ``[batch, vocab]``.

        Only the sequences flagged in ``drawing`` advance their streams (the others are still
        being fed their prompts), so a stream's draws never depend on its batch-mates.
        """
        logits = self.adjust(logits)
        greedy_tokens = logits.argmax(dim=-1)
        if bool(self.greedy.all()):
            return greedy_tokens
        uniform = torch.tensor([torch.rand((), generator=g).item() if draw else 0.0
                                for g, draw in zip(self.generators, drawing, strict=True)], device=logits.device)
        # Every row draws over its tokens sorted most likely first, filtered or not: the token a
        # draw picks must not depend on whether a batch-mate's top-k or top-p sorted the batch.
        scaled, order = (logits / self.temperature).sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1], device=logits.device)
        removed = (self.top_k[:, None] > 0) & (ranks >= self.top_k[:, None])
        probs = scaled.masked_fill(removed, float("-inf")).softmax(dim=-1)
        # A token goes when the tokens more likely than it already reach top_p.
        removed |= (self.top_p[:, None] > 0) & (probs.cumsum(dim=-1) - probs > self.top_p[:, None])
        probs = scaled.masked_fill(removed, float("-inf")).softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cumulative, uniform[:, None], right=True)
        # Rounding can leave the total a hair below the draw: fall back to the last kept token.
        picked = torch.minimum(picked, (~removed).sum(-1, keepdim=True) - 1)
        sampled = order.gather(-1, picked).squeeze(-1)
        return torch.where(self.greedy, greedy_tokens, sampled)

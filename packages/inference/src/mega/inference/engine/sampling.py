"""Choosing the next token from logits: greedy, temperature, top-k, top-p, one setting per sequence.

Megatron's order: logits are divided by the temperature, then filtered by top-k and top-p
(the smallest set of most likely tokens whose probability reaches ``top_p``; the most likely
token always stays), then sampled. ``top_k == 1`` is greedy, as in Megatron's API.

Every sequence draws from its own CPU random stream, one uniform number per step, and picks its
token by inverse transform of the filtered distribution (its tokens sorted most likely first).
So a seeded request gives the same tokens whichever other requests share its batch, and on every
device.

No step waits for the device: each stream's numbers are drawn ahead on the CPU, a block of
``DRAWS_AHEAD`` at a time (the same numbers, in the same order, as one draw per step), and sit
on the device with each row's count of those used; the settings that decide the path (all
greedy? penalties?) are known on the host. So :meth:`Sampler.sample` is tensor operations only,
which a captured decode step can hold.

Before any of that, OpenAI's adjustments change the logits (greedy choices too): ``logit_bias``
adds a fixed value per token id, and ``presence_penalty`` / ``frequency_penalty`` subtract
``presence * [count > 0] + frequency * count``, counting each token among the tokens this
sequence has generated so far (not its prompt), as vLLM does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """Sampling settings out of range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # > 0
    top_k: int = 0  # 0: no top-k filter; 1: greedy
    top_p: float = 0.0  # 0 or 1: no top-p filter
    seed: int | None = None  # None: a fresh random stream; else in [0, 2**64)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise SamplingError(f"seed must be in [0, 2**64), got {self.seed}")
        if not self.temperature > 0:
            raise SamplingError(f"temperature must be positive, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0


SEED_LIMIT = 2**64  # torch.Generator takes an unsigned 64-bit seed
GREEDY = SamplingParams(top_k=1)


DRAWS_AHEAD = 32  # uniform numbers drawn per stream at a time


class Sampler:
    """The sampling state of a batch: settings as tensors, one random stream per sequence.

    Rows leave (:meth:`keep`) as sequences finish and join (:meth:`extend`) under continuous
    batching; each row's stream, its numbers drawn ahead and its penalty counts travel with it.
    """

    def __init__(self, params: Sequence[SamplingParams], device: torch.device):
        self.device = device
        self.greedy_rows = [p.greedy for p in params]  # on the host: no step asks the device
        self.greedy = torch.tensor(self.greedy_rows, dtype=torch.bool, device=device)
        self.temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 0.0 for p in params], device=device)
        # On the host: whether any row may filter its tokens (top-k or top-p); once true it stays so.
        self.filters = any(p.top_k > 0 or 0.0 < p.top_p < 1.0 for p in params)
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
        # Each row's numbers drawn ahead [batch, drawn], and how many it has used (on the device
        # for the step, mirrored on the host to know when to draw more).
        self.uniforms = torch.zeros(len(params), 0, device=device)
        self.used = torch.zeros(len(params), dtype=torch.long, device=device)
        self.used_rows = [0] * len(params)

    _ROW_TENSORS = ("greedy", "temperature", "top_k", "top_p", "presence", "frequency", "uniforms", "used")

    def keep(self, rows: list[int]) -> None:
        """Keep the streams and settings of the sequences at ``rows`` (the others finished)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for name in self._ROW_TENSORS:
            setattr(self, name, getattr(self, name)[index])
        self.generators = [self.generators[row] for row in rows]
        self.bias = [self.bias[row] for row in rows]
        self.greedy_rows = [self.greedy_rows[row] for row in rows]
        self.used_rows = [self.used_rows[row] for row in rows]
        if self.counts is not None:
            self.counts, self.bias_values = self.counts[index], self.bias_values[index]

    def extend(self, other: Sampler) -> None:
        """Add ``other``'s rows after this batch's (sequences joining a running batch)."""
        width = max(self.uniforms.shape[1], other.uniforms.shape[1])
        self._draw_ahead(width - self.uniforms.shape[1])
        other._draw_ahead(width - other.uniforms.shape[1])
        for name in self._ROW_TENSORS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.generators += other.generators
        self.bias += other.bias
        self.greedy_rows += other.greedy_rows
        self.used_rows += other.used_rows
        self.adjusted = self.adjusted or other.adjusted
        self.filters = self.filters or other.filters
        if self.counts is not None or other.counts is not None:
            vocab = (self.counts if self.counts is not None else other.counts).shape[-1]
            mine, theirs = self._materialised(vocab), other._materialised(vocab)
            self.counts = torch.cat([mine[0], theirs[0]])
            self.bias_values = torch.cat([mine[1], theirs[1]])

    def _draw_ahead(self, count: int) -> None:
        """``count`` more numbers of every row's stream, on the device."""
        if count <= 0:
            return
        drawn = [torch.rand(count, generator=g) for g in self.generators]
        more = torch.stack(drawn).to(self.device) if drawn else torch.zeros(0, count)
        self.uniforms = torch.cat([self.uniforms, more.to(self.device)], dim=1)

    def _materialised(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None:
            rows = len(self.generators)
            self.counts = torch.zeros(rows, vocab, device=self.device)
            self.bias_values = torch.zeros(rows, vocab, device=self.device)
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

    def _mask(self, rows: Sequence[bool]) -> torch.Tensor | None:
        """``rows`` as a device mask; None where every row is in it."""
        return None if all(rows) else torch.tensor(rows, dtype=torch.bool, device=self.device)

    def observe(self, tokens: torch.Tensor, generated: Sequence[bool]) -> None:
        """Count ``tokens`` for the penalties where ``generated`` (not prompt tokens)."""
        if not self.adjusted or self.counts is None:
            return
        mask = self._mask(generated)
        ones = torch.ones(len(generated), 1, dtype=self.counts.dtype, device=self.device)
        self.counts.scatter_add_(1, tokens[:, None], ones if mask is None else ones * mask[:, None])

    @property
    def chooses_greedily(self) -> bool:
        """Every row takes its most likely token of the unadjusted logits: :meth:`greedy_choice`
        alone decides, so it may run inside a captured decode step."""
        return all(self.greedy_rows) and not self.adjusted

    @staticmethod
    def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
        """The most likely token of each row of ``logits`` ``[batch, vocab]``."""
        return logits.argmax(dim=-1)

    def sample(self, logits: torch.Tensor, drawing: Sequence[bool]) -> torch.Tensor:
        """Token ids ``[batch]`` from fp32 logits ``[batch, vocab]``, on the device.

        Only the sequences flagged in ``drawing`` use up a number of their streams (the others
        are still being fed their prompts), so a stream's draws never depend on its batch-mates.
        """
        logits = self.adjust(logits)
        if all(self.greedy_rows):
            return self.greedy_choice(logits)
        if any(used >= self.uniforms.shape[1] for used, draw in zip(self.used_rows, drawing, strict=True) if draw):
            self._draw_ahead(DRAWS_AHEAD)
        mask = self._mask(drawing)
        uniform = self.uniforms.gather(1, self.used[:, None].clamp(max=self.uniforms.shape[1] - 1))
        self.used += 1 if mask is None else mask.long()
        self.used_rows = [used + bool(draw) for used, draw in zip(self.used_rows, drawing, strict=True)]
        drawn = self.draw(logits, uniform)
        if not any(self.greedy_rows):  # every row draws (no argmax to blend in)
            return drawn
        return torch.where(self.greedy, self.greedy_choice(logits), drawn)

    def draw(self, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """Each row's token for its number ``uniform`` ``[batch, 1]``: the temperature, top-k and
        top-p applied over the tokens sorted most likely first, then the inverse transform."""
        probs, order, removed = self._sorted_probabilities(logits)
        cumulative = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cumulative, uniform, right=True)
        # Rounding can leave the total a hair below the draw: fall back to the last kept token.
        kept = (~removed).sum(-1, keepdim=True) if self.filters else probs.shape[-1]  # unfiltered: every token
        picked = picked.clamp(max=kept - 1)
        return order.gather(-1, picked).squeeze(-1)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution ``[batch, vocab]`` (vocabulary order) each row draws its token from:
        temperature, top-k and top-p applied (a greedy row's is one-hot at its most likely
        token). Speculative decoding's verification compares drafts against it."""
        probs, order, _ = self._sorted_probabilities(logits)
        return torch.zeros_like(probs).scatter_(-1, order, probs)

    def _sorted_probabilities(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's filtered probabilities over its tokens sorted most likely first, that
        order, and the tokens filtered out."""
        # Every row draws over its tokens sorted most likely first, filtered or not: the token a
        # draw picks must not depend on whether a batch-mate's top-k or top-p sorted the batch.
        scaled, order = (logits / self.temperature).sort(dim=-1, descending=True)
        if not self.filters:  # nothing is removed: the same probabilities, without the filters' steps
            return scaled.softmax(dim=-1), order, torch.zeros_like(scaled, dtype=torch.bool)
        ranks = torch.arange(scaled.shape[-1], device=logits.device)
        removed = (self.top_k[:, None] > 0) & (ranks >= self.top_k[:, None])
        probs = scaled.masked_fill(removed, float("-inf")).softmax(dim=-1)
        # A token goes when the tokens more likely than it already reach top_p.
        removed |= (self.top_p[:, None] > 0) & (probs.cumsum(dim=-1) - probs > self.top_p[:, None])
        return scaled.masked_fill(removed, float("-inf")).softmax(dim=-1), order, removed

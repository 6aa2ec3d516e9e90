"""Choosing the next token from logits: greedy, temperature, top-k, top-p, one setting per sequence.

Megatron's order: logits are divided by the temperature, then filtered by top-k and top-p
(the smallest set of most likely tokens whose probability reaches ``top_p``; the most likely
token always stays), then sampled. ``top_k == 1`` is greedy, as in Megatron's API.

Every sequence draws from its own CPU random stream, one uniform number per step, and picks its
token by inverse transform of the filtered distribution. So a seeded request gives the same
tokens whichever other requests share its batch, and on every device.
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
    seed: int | None = None  # None: a fresh random stream

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise SamplingError(f"temperature must be positive, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


GREEDY = SamplingParams(top_k=1)


class Sampler:
    """The sampling state of a batch: settings as tensors, one random stream per sequence."""

    def __init__(self, params: Sequence[SamplingParams], device: torch.device):
        self.greedy = torch.tensor([p.greedy for p in params], device=device)
        self.temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        self.top_k = torch.tensor([p.top_k for p in params], device=device)
        self.top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 0.0 for p in params], device=device)
        self.generators = [
            torch.Generator().manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
            for p in params
        ]

    def keep(self, rows: list[int]) -> None:
        """Keep the streams and settings of the sequences at ``rows`` (the others finished)."""
        index = torch.tensor(rows, device=self.greedy.device)
        self.greedy, self.temperature = self.greedy[index], self.temperature[index]
        self.top_k, self.top_p = self.top_k[index], self.top_p[index]
        self.generators = [self.generators[row] for row in rows]

    def sample(self, logits: torch.Tensor, drawing: Sequence[bool]) -> torch.Tensor:
        """Token ids ``[batch]`` from fp32 logits ``[batch, vocab]``.

        Only the sequences flagged in ``drawing`` advance their streams (the others are still
        being fed their prompts), so a stream's draws never depend on its batch-mates.
        """
        greedy_tokens = logits.argmax(dim=-1)
        if bool(self.greedy.all()):
            return greedy_tokens
        uniform = torch.tensor([torch.rand((), generator=g).item() if draw else 0.0
                                for g, draw in zip(self.generators, drawing, strict=True)], device=logits.device)
        scaled = logits / self.temperature
        if bool((self.top_k > 0).any() or (self.top_p > 0).any()):
            scaled, order = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(scaled.shape[-1], device=logits.device)
            removed = (self.top_k[:, None] > 0) & (ranks >= self.top_k[:, None])
            probs = scaled.masked_fill(removed, float("-inf")).softmax(dim=-1)
            # A token goes when the tokens more likely than it already reach top_p.
            removed |= (self.top_p[:, None] > 0) & (probs.cumsum(dim=-1) - probs > self.top_p[:, None])
            probs = scaled.masked_fill(removed, float("-inf")).softmax(dim=-1)
        else:
            order, removed, probs = None, None, scaled.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cumulative, uniform[:, None], right=True)
        # Rounding can leave the total a hair below the draw: fall back to the last kept token.
        last_kept = (probs.shape[-1] - 1) if removed is None else (~removed).sum(-1, keepdim=True) - 1
        picked = torch.minimum(picked, torch.as_tensor(last_kept, device=logits.device))
        sampled = (order.gather(-1, picked) if order is not None else picked).squeeze(-1)
        return torch.where(self.greedy, greedy_tokens, sampled)

"""What a generation engine takes and gives: requests, results, and why a sequence ended.

Every engine path (lock-step, encoder-decoder, continuous batching, static KV cache) speaks
these, and :class:`FinishReason` is the one representation of an ending they all report.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mega.inference.sampling import GREEDY, SamplingParams
from mega.inference.stopping import StopRules


class GenerationError(ValueError):
    """A request the engine cannot run (empty prompt, longer than the model's positions)."""


class FinishReason(enum.StrEnum):
    """Why a sequence ended; a string, so results compare and serialise as ``"stop"`` etc."""

    STOP = "stop"  # a stop token, stop string or end-of-line rule
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # the client went away


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    stop: StopRules = field(default_factory=StopRules)
    logprobs: bool = False  # log-probability of every token after the first, prompt included
    top_logprobs: int = 0  # also the n most likely tokens at each of those positions
    # Set from another thread (a client went away): the sequence ends at the next step.
    cancelled: bool = False


@dataclass
class GenerationResult:
    tokens: list[int]  # the prompt, then the generated tokens (a stop token included)
    prompt_length: int
    finish_reason: FinishReason
    logprobs: list[float] | None = None  # of tokens[1:], each given the tokens before it
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position of tokens[1:]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length:]

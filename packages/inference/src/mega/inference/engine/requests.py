"""What a generation engine takes and gives: requests, results, why a sequence ended, and the
one rule that orders every ending (:func:`ending`).

One precedence decides every ending, wherever it is looked at: **stop, then length, then
cancellation**. A sequence that ended by itself (its stop rule on a generated token, or its
length reached) reports so even when its client has just gone; a cancellation ends only a
sequence that nothing else ended. The loop asks at three moments, with what is known then:

- queued, nothing computed: neither stop nor length can hold yet, so a cancelled sequence ends
  ``cancelled`` without a prefill (it never takes cache room);
- its prompt computed, before it decodes: ``length`` when there is nothing to generate
  (``max_new_tokens`` 0: prompt scoring), else ``cancelled`` if its client has gone;
- each generated token read: ``stop``, else ``length``, else ``cancelled``.

The decoder-only loop (:mod:`.continuous`) and the encoder-decoder one (:mod:`.encoder_decoder`)
ask at those moments, through :class:`~mega.inference.engine.decode_step.DecodeStep` and their
queues, so ``mega generate``, ``mega serve``'s routes and T5 all end a sequence alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mega.inference.engine.grammar import Grammar
from mega.inference.engine.sampling import GREEDY, SamplingParams
from mega.inference.engine.stopping import StopRules

if TYPE_CHECKING:
    from mega.inference.engine.lora_registry import ServedAdapter


class GenerationError(ValueError):
    """A request the engine cannot run (empty prompt, longer than the model's positions)."""


class FinishReason(enum.StrEnum):
    """Why a sequence ended; a string, so results compare and serialise as ``"stop"`` etc."""

    STOP = "stop"  # a stop token, stop string or end-of-line rule
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # the client went away


def ending(stopped: bool, at_length: bool, cancelled: bool) -> FinishReason | None:
    """The one rule: why a sequence ends now (stop, then length, then cancellation), or None."""
    if stopped:
        return FinishReason.STOP
    if at_length:
        return FinishReason.LENGTH
    if cancelled:
        return FinishReason.CANCELLED
    return None


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    stop: StopRules = field(default_factory=StopRules)
    logprobs: bool = False  # log-probability of every token after the first, prompt included
    top_logprobs: int = 0  # also the n most likely tokens at each of those positions
    # With logprobs: the prompt's tokens scored too. False (vLLM's logprobs without prompt_logprobs):
    # only the generated tokens' (the prompt's places hold None), so the prompt prefills as one
    # asking nothing (its last position's logits alone, the prefix cache usable), not every
    # position's logits over the vocabulary.
    prompt_logprobs: bool = True
    grammar: Grammar | None = None  # structured outputs: the grammar its text keeps to
    adapter: ServedAdapter | None = None  # the LoRA adapter its rows take (lora_registry); None: the base
    # Set from another thread (a client went away): the sequence ends at the next step.
    cancelled: bool = False

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's tokens get log-probabilities (every prompt position's logits)."""
        return self.logprobs and self.prompt_logprobs


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


# How a caller running requests to completion hears of them, each named by its index:
# (request index, token, its logprob, the most likely (token, logprob) pairs at its position)
TokenCallback = Callable[[int, int, "float | None", "list[tuple[int, float]] | None"], None]
FinishCallback = Callable[[int, GenerationResult], None]  # (request index, result)

"""Rollouts from mega's own decoder loop, in the training process.

:class:`RolloutEngine` wraps the policy's language model (the very module the trainer updates:
the same parameter objects, so after an optimizer step the engine generates from the new weights
with nothing copied; one process, one layout) in a
:class:`~mega.inference.engine.generation_engine.GenerationEngine`, and runs the one decoder
loop (``ContinuousBatchingWorker``, to completion) over ``group_size`` completions of each prompt.
Each completion has its own sampling seed, ``seed + its index in the step's batch``, so a run
that resumes at a step draws the same completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from mega.inference.engine.generation_engine import GenerationEngine, GenerationRequest, GenerationResult
from mega.inference.engine.sampling import SamplingParams
from mega.inference.engine.stopping import StopRules


@dataclass(frozen=True)
class RolloutSampling:
    """The sampling flags of a rollout."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 0.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    seed: int = 0


@dataclass
class Rollouts:
    """``group_size`` completions of each prompt, in prompt order."""

    prompts: list[list[int]]         # one per completion (repeated within its group)
    completions: list[list[int]]
    inference_logprobs: list[torch.Tensor]  # the engine's log-probability of each completion token
    finish_reasons: list[str]
    group_size: int
    seconds: float

    @property
    def sequences(self) -> list[torch.Tensor]:
        return [torch.tensor(p + c) for p, c in zip(self.prompts, self.completions, strict=True)]

    @property
    def generated_tokens(self) -> int:
        return sum(len(c) for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.seconds, 1e-9)


class RolloutEngine:
    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int, tokenizer=None):
        self.model = model
        self.engine = GenerationEngine(model, vocab_size=vocab_size, max_positions=max_positions, tokenizer=tokenizer)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], group_size: int, sampling: RolloutSampling,
                 step_seed: int = 0) -> Rollouts:
        """``group_size`` completions of every prompt; completion ``i`` of the batch samples with
        seed ``sampling.seed + step_seed + i`` (pass a different ``step_seed`` each step)."""
        base = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        stop = StopRules(stop_ids=sampling.stop_ids, stop_strings=sampling.stop_strings)
        requests = [GenerationRequest(prompt=list(prompt), max_new_tokens=sampling.max_new_tokens,
                                      sampling=replace(base, seed=(sampling.seed + step_seed + index) % 2**63),
                                      stop=stop, logprobs=True)
                    for index, prompt in enumerate(p for p in prompts for _ in range(group_size))]
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            results = self.engine.generate(requests)
        finally:
            self.model.train(was_training)
        seconds = time.perf_counter() - start
        return Rollouts(
            prompts=[r.tokens[:r.prompt_length] for r in results],
            completions=[r.generated for r in results],
            inference_logprobs=[_completion_logprobs(r) for r in results],
            finish_reasons=[str(r.finish_reason) for r in results],
            group_size=group_size, seconds=seconds,
        )


def _completion_logprobs(result: GenerationResult) -> torch.Tensor:
    # result.logprobs covers tokens[1:]: the completion's start at prompt_length - 1.
    return torch.tensor(result.logprobs[result.prompt_length - 1:], dtype=torch.float32)


def completion_logprobs(sequence_logprobs: list[torch.Tensor], rollouts: Rollouts) -> list[torch.Tensor]:
    """The completion part of per-sequence log-probabilities (``len - 1`` per sequence, as
    :meth:`mega.rl.policy_engine.PolicyEngine.logprobs` gives them)."""
    return [lp[len(p) - 1:] for lp, p in zip(sequence_logprobs, rollouts.prompts, strict=True)]


def logprob_gap(engine: list[torch.Tensor], trainer: list[torch.Tensor]) -> dict:
    """The engine-vs-trainer log-probability gap over all completion tokens: mean and max |delta|."""
    deltas = torch.cat([(a - b).abs() for a, b in zip(engine, trainer, strict=True)] or [torch.zeros(0)])
    if deltas.numel() == 0:
        return {"logprob_gap_mean": 0.0, "logprob_gap_max": 0.0}
    return {"logprob_gap_mean": deltas.mean().item(), "logprob_gap_max": deltas.max().item()}

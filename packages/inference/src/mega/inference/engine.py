"""``GenerationEngine``: continues a batch of token-id prompts with any decoder family's model.

The batch runs in lock-step, as Megatron's generation does: the first forward fills the KV cache
with every prompt's first ``min(prompt lengths)`` tokens, then each step feeds one token per
sequence. A sequence still inside its prompt is fed its next prompt token (whose log-probability
is recorded), the others the token just sampled. Each sequence so computes exactly what it
would alone, with no padding and no attention mask. Finished sequences leave the batch (and the
cache) at once, and their results are handed out as they finish.

Under tensor parallelism every rank of the tensor group runs ``generate`` on the same requests
(see :mod:`mega.inference.tp_serving`); the logits' vocabulary shards are gathered, the first
rank of the group samples and decides who stops, and broadcasts both each step, so the ranks
never disagree (cancellations, unseeded sampling and stop strings happen on the first rank only).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega.core.parallel import Group
from mega.core.parallel.collectives import gather_along
from mega.inference.sampling import GREEDY, Sampler, SamplingParams
from mega.inference.stopping import StopChecker, StopRules
from mega.models.kv_cache import KVCache


class GenerationError(ValueError):
    """A request the engine cannot run (empty prompt, longer than the model's positions)."""


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
    finish_reason: str  # "stop" (a stop rule), "length" (max_new_tokens) or "cancelled"
    logprobs: list[float] | None = None  # of tokens[1:], each given the tokens before it
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position of tokens[1:]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length:]


FINISHED_BY_STOP, FINISHED_BY_LENGTH, FINISHED_BY_CANCEL = 1, 2, 3
FINISH_REASONS = {FINISHED_BY_STOP: "stop", FINISHED_BY_LENGTH: "length", FINISHED_BY_CANCEL: "cancelled"}

# (request index, token, its logprob, the most likely (token, logprob) pairs at its position)
TokenCallback = Callable[[int, int, "float | None", "list[tuple[int, float]] | None"], None]
FinishCallback = Callable[[int, GenerationResult], None]  # (request index, result)


class EngineBase:
    """What every engine shares: the model and its limits, the tensor group, the stop rules, and
    the request checks that do not depend on the architecture."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int, tokenizer=None,
                 tp_group: Group | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.tokenizer = tokenizer
        self.tp_group = tp_group
        self.stop_checker = StopChecker(tokenizer)
        self.device = next(model.parameters()).device

    @property
    def is_leader(self) -> bool:
        return self.tp_group is None or self.tp_group.rank == 0

    def check_prompt(self, request: GenerationRequest) -> None:
        if not request.prompt:
            raise GenerationError("the prompt is empty: give at least one token")
        if bad := [t for t in request.prompt if not 0 <= t < self.vocab_size]:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")


def agree(group: Group | None, chosen: torch.Tensor, finish: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The first rank's tokens and finish flags, on every rank of the tensor group."""
    if group is None or group.size == 1:
        return chosen, finish
    packed = torch.stack([chosen, torch.tensor(finish, device=chosen.device)])
    dist.broadcast(packed, src=group.ranks[0], group=group.group)
    return packed[0], packed[1].tolist()


class GenerationEngine(EngineBase):
    """Generates with ``model``: a whole decoder (first and last stage) in eval mode, tensor-parallel
    over ``tp_group`` or not, whose forward takes ``inference_cache`` and ``logits_to_keep`` (as
    :class:`mega.models.language_model.LanguageModel`'s does). ``vocab_size``: the real
    vocabulary (padded rows are never chosen); ``max_positions``: the longest sequence (prompt
    and generation) the model takes; ``tokenizer``: for stop strings and end-of-line rules."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int, tokenizer=None,
                 tp_group: Group | None = None):
        missing = {"inference_cache", "logits_to_keep"} - set(inspect.signature(model.forward).parameters)
        if missing:
            raise GenerationError(f"{type(model).__name__}.forward takes no {' or '.join(sorted(missing))}: "
                                  "this model family cannot generate")
        super().__init__(model, vocab_size=vocab_size, max_positions=max_positions, tokenizer=tokenizer,
                         tp_group=tp_group)

    def check(self, request: GenerationRequest) -> None:
        """Raise :class:`GenerationError` for a request that cannot run, naming the numbers."""
        self.check_prompt(request)
        if request.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {request.max_new_tokens}")
        total = len(request.prompt) + request.max_new_tokens
        if total > self.max_positions:
            raise GenerationError(
                f"{len(request.prompt)} prompt tokens + {request.max_new_tokens} tokens to generate = "
                f"{total} exceeds the model's {self.max_positions} positions"
            )

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], on_token: TokenCallback | None = None,
                 on_finish: FinishCallback | None = None) -> list[GenerationResult]:
        for request in requests:
            self.check(request)
        run = _BatchRun(self, list(requests), on_token, on_finish)
        return run.results()


class _BatchRun:
    """One call of ``generate``: the batch's state while it runs."""

    def __init__(self, engine: GenerationEngine, requests: list[GenerationRequest],
                 on_token: TokenCallback | None, on_finish: FinishCallback | None):
        self.engine, self.requests = engine, requests
        self.on_token, self.on_finish = on_token, on_finish
        device = engine.device
        self.prompt_lengths = torch.tensor([len(r.prompt) for r in requests], device=device)
        self.limits = [len(r.prompt) + r.max_new_tokens for r in requests]
        self.tokens = torch.zeros(len(requests), max(self.limits), dtype=torch.long, device=device)
        for row, request in enumerate(requests):
            self.tokens[row, : len(request.prompt)] = torch.tensor(request.prompt)
        self.active = list(range(len(requests)))  # request index of each row of the batch
        self.cache = KVCache(max(self.limits))
        self.sampler = Sampler([r.sampling for r in requests], device)
        self.generated: list[list[int]] = [[] for _ in requests]
        self.logprobs: list[list[float] | None] = [[] if r.logprobs else None for r in requests]
        self.top_logprobs: list[list | None] = [[] if r.top_logprobs else None for r in requests]
        self.finished: dict[int, GenerationResult] = {}

    def results(self) -> list[GenerationResult]:
        length = int(self.prompt_lengths.min())
        scoring_prompts = any(r.logprobs for r in self.requests)
        logits = self._forward(self.tokens[:, :length], 0, None if scoring_prompts else 1)
        self._record_prompt_logprobs(logits, length)
        last = logits[-1]
        # Sequences with nothing to generate and no prompt left to score end here.
        kept = self._retire([FINISHED_BY_LENGTH if self.limits[i] <= length else 0 for i in self.active])
        last = last[kept]
        while self.active:
            self._step(last, length)
            length += 1
            if self.active:
                last = self._forward(self.tokens[self.active, length - 1: length], length - 1)[-1]
        return [self.finished[i] for i in range(len(self.requests))]

    def _forward(self, tokens: torch.Tensor, start: int, logits_to_keep: int | None = None) -> torch.Tensor:
        """fp32 logits ``[seq (or logits_to_keep), batch, vocab]`` over the real vocabulary, all
        tensor shards."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None, :]
        logits = self.engine.model(tokens, positions, inference_cache=self.cache, logits_to_keep=logits_to_keep)
        group = self.engine.tp_group
        if group is not None and group.size > 1:
            logits = gather_along(logits, group, dim=-1)
        return logits[..., : self.engine.vocab_size].float()

    def _record_prompt_logprobs(self, logits: torch.Tensor, length: int) -> None:
        """Log-probabilities of the prompt tokens the first forward saw (after the first)."""
        rows = [row for row, i in enumerate(self.active) if self.logprobs[i] is not None]
        if not rows or length < 2 or not self.engine.is_leader:
            return
        log_probs = F.log_softmax(logits[:-1, rows], dim=-1).transpose(0, 1)  # [rows, length-1, V]
        chosen = log_probs.gather(-1, self.tokens[rows, 1:length, None]).squeeze(-1)
        for k, row in enumerate(rows):
            i = self.active[row]
            self.logprobs[i].extend(chosen[k].tolist())
            if self.top_logprobs[i] is not None:
                self.top_logprobs[i].extend(_top(log_probs[k], self.requests[i].top_logprobs))

    def _step(self, logits: torch.Tensor, position: int) -> None:
        """Choose the token at ``position`` for every row; retire the rows that end there."""
        active, engine = self.active, self.engine
        in_prompt = self.prompt_lengths[active] > position
        finish = [0] * len(active)
        if engine.is_leader:
            in_prompt_list = in_prompt.tolist()
            drawing = [not prompt for prompt in in_prompt_list]
            sampled = self.sampler.sample(logits, drawing)
            chosen = torch.where(in_prompt, self.tokens[active, position], sampled)
            self.sampler.observe(chosen, drawing)
            self._add(chosen, in_prompt)
            self._record_step_logprobs(logits, chosen)
            for row, i in enumerate(active):
                request, generated = self.requests[i], self.generated[i]
                if not in_prompt_list[row]:
                    if self.on_token is not None:
                        logprob = self.logprobs[i][-1] if self.logprobs[i] is not None else None
                        top = self.top_logprobs[i][-1] if self.top_logprobs[i] is not None else None
                        self.on_token(i, generated[-1], logprob, top)
                    if engine.stop_checker.should_stop(request.stop, generated):
                        finish[row] = FINISHED_BY_STOP
                if request.cancelled:
                    finish[row] = FINISHED_BY_CANCEL
                elif not finish[row] and position + 1 >= self.limits[i]:
                    finish[row] = FINISHED_BY_LENGTH
            chosen, finish = agree(self.engine.tp_group, chosen, finish)
        else:
            nothing = torch.empty(len(active), dtype=torch.long, device=logits.device)
            chosen, finish = agree(self.engine.tp_group, nothing, finish)
            self._add(chosen, in_prompt)
        self.tokens[active, position] = chosen
        self._retire(finish)

    def _add(self, chosen: torch.Tensor, in_prompt: torch.Tensor) -> None:
        for i, token, prompt in zip(self.active, chosen.tolist(), in_prompt.tolist(), strict=True):
            if not prompt:
                self.generated[i].append(token)

    def _record_step_logprobs(self, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        rows = [row for row, i in enumerate(self.active) if self.logprobs[i] is not None]
        if not rows:
            return
        log_probs = F.log_softmax(logits[rows], dim=-1)
        values = log_probs.gather(-1, chosen[rows, None]).squeeze(-1).tolist()
        for k, row in enumerate(rows):
            i = self.active[row]
            self.logprobs[i].append(values[k])
            if self.top_logprobs[i] is not None:
                self.top_logprobs[i].extend(_top(log_probs[k : k + 1], self.requests[i].top_logprobs))

    def _retire(self, finish: list[int]) -> list[int]:
        """Hand out the results of the rows flagged in ``finish`` and drop them from the batch;
        return the rows kept."""
        if not any(finish):
            return list(range(len(finish)))
        keep = [row for row, flag in enumerate(finish) if not flag]
        for row, flag in enumerate(finish):
            if flag:
                i = self.active[row]
                self.finished[i] = result = self._result(i, flag)
                if self.on_finish is not None and self.engine.is_leader:
                    self.on_finish(i, result)
        self.active = [self.active[row] for row in keep]
        if self.active:
            self.cache.keep(torch.tensor(keep, device=self.tokens.device))
            self.sampler.keep(keep)
        return keep

    def _result(self, i: int, flag: int) -> GenerationResult:
        request = self.requests[i]
        return GenerationResult(
            tokens=list(request.prompt) + self.generated[i], prompt_length=len(request.prompt),
            finish_reason=FINISH_REASONS[flag], logprobs=self.logprobs[i], top_logprobs=self.top_logprobs[i],
        )


def _top(log_probs: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
    """The ``n`` most likely (token, log-probability) pairs of each row of ``log_probs``."""
    values, ids = log_probs.topk(n, dim=-1)
    rows = zip(ids.tolist(), values.tolist(), strict=True)
    return [list(zip(row_ids, row_values, strict=True)) for row_ids, row_values in rows]

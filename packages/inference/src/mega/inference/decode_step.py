"""``DecodeStep``: the one place a step's logits become tokens, log-probabilities and endings.

Every engine path (the lock-step :mod:`~mega.inference.engine`, :mod:`~mega.inference.encoder_decoder`,
:mod:`~mega.inference.continuous` and :mod:`~mega.inference.static_decode`) runs its own forwards
and its own cache, then hands the logits of its rows to one :class:`DecodeStep` (as Megatron-Core's
one text-generation controller serves its static and dynamic engines). It

- chooses each row's token: the next prompt token for a row still inside its prompt (the
  lock-step engine feeds prompts of different lengths that way), else a draw of the row's
  :class:`~mega.inference.sampling.Sampler` stream;
- records the log-probabilities the request asked for;
- decides who ends, in one order of precedence: a stop rule (on a generated token), then the
  length, then a cancellation: a sequence that ended by itself reports so even when its client
  has just gone;
- retires the finished rows: the last row takes a finished row's place, so the callers' caches
  move as few rows as possible, and ``kept`` says which old row each new row is.

Under tensor parallelism the first rank of the group decides (cancellations, unseeded draws and
stop strings happen there only) and broadcasts the tokens and endings, so ranks never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega.core.parallel import Group
from mega.inference.requests import FinishReason, GenerationRequest, GenerationResult
from mega.inference.sampling import Sampler
from mega.inference.stopping import StopChecker

# Endings as small integers, only to broadcast them with the tokens (0: goes on).
_CODES = {reason: code for code, reason in enumerate(FinishReason, start=1)}
_REASONS = {code: reason for reason, code in _CODES.items()}


@dataclass(eq=False)
class DecodingSequence:
    """One sequence's decoding state. ``known``: tokens (prompt, then generated) fixed so far;
    the logits a step gets for this row are those of token ``known``."""

    request: GenerationRequest
    known: int = -1  # -1: the whole prompt (set in __post_init__)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list | None = None
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if self.known < 0:
            self.known = len(self.request.prompt)
        if self.logprobs is None and self.request.logprobs:
            self.logprobs = []
        if self.top_logprobs is None and self.request.top_logprobs:
            self.top_logprobs = []

    @property
    def limit(self) -> int:
        return len(self.request.prompt) + self.request.max_new_tokens

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.generated

    def result(self) -> GenerationResult:
        return GenerationResult(tokens=self.tokens, prompt_length=len(self.request.prompt),
                                finish_reason=self.finish_reason, logprobs=self.logprobs,
                                top_logprobs=self.top_logprobs)


def record_logprobs(sequence: DecodingSequence, logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """Append the log-probabilities of ``tokens`` ``[n]`` under fp32 ``logits`` ``[n, vocab]``
    (a prefill's prompt tokens) to what ``sequence`` records."""
    if sequence.logprobs is None or not len(tokens):
        return
    log_probs = F.log_softmax(logits, dim=-1)
    sequence.logprobs.extend(log_probs.gather(-1, tokens[:, None]).squeeze(-1).tolist())
    if sequence.top_logprobs is not None:
        sequence.top_logprobs.extend(top_logprobs(log_probs, sequence.request.top_logprobs))


def top_logprobs(log_probs: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
    """The ``n`` most likely (token, log-probability) pairs of each row of ``log_probs``."""
    values, ids = log_probs.topk(n, dim=-1)
    rows = zip(ids.tolist(), values.tolist(), strict=True)
    return [list(zip(row_ids, row_values, strict=True)) for row_ids, row_values in rows]


@dataclass
class StepOutcome:
    chosen: torch.Tensor  # [rows before the step] the token each row took
    kept: list[int]  # the old row of each row left (all rows, in order, when none finished)
    finished: list[DecodingSequence]

    @property
    def next_tokens(self) -> torch.Tensor:
        """``[rows left]``: the tokens the rows left feed next."""
        return self.chosen if len(self.kept) == len(self.chosen) else self.chosen[self.kept]


# (sequence, token, its logprob, the most likely (token, logprob) pairs at its position)
TokenHook = Callable[[DecodingSequence, int, "float | None", "list[tuple[int, float]] | None"], None]
FinishHook = Callable[[DecodingSequence], None]


class DecodeStep:
    """The rows being decoded and their sampler. ``on_token`` runs for each generated token
    before the endings are decided (a client may cancel there); ``on_finish`` for each sequence
    that ends, on the first rank of ``tp_group`` only."""

    def __init__(self, stop_checker: StopChecker, device: torch.device, tp_group: Group | None = None,
                 on_token: TokenHook | None = None, on_finish: FinishHook | None = None):
        self.stop_checker, self.device, self.tp_group = stop_checker, device, tp_group
        self.on_token, self.on_finish = on_token, on_finish
        self.sequences: list[DecodingSequence] = []
        self.sampler = Sampler([], device)

    @property
    def is_leader(self) -> bool:
        return self.tp_group is None or self.tp_group.rank == 0

    def __len__(self) -> int:
        return len(self.sequences)

    def join(self, sequences: Sequence[DecodingSequence]) -> list[int]:
        """Add ``sequences`` as rows after the running ones, except those that end before any
        step (nothing to generate, or cancelled): they finish here. Returns the indices (into
        ``sequences``) of those that joined."""
        codes = [self._code_before_decoding(s) for s in sequences] if self.is_leader else [0] * len(sequences)
        codes = self._agree_codes(codes)
        joined = [k for k, code in enumerate(codes) if not code]
        for k, code in enumerate(codes):
            if code:
                self._finish(sequences[k], code)
        if joined:
            self.sequences += [sequences[k] for k in joined]
            self.sampler.extend(Sampler([sequences[k].request.sampling for k in joined], self.device))
        return joined

    @staticmethod
    def _code_before_decoding(sequence: DecodingSequence) -> int:
        if sequence.known >= sequence.limit:
            return _CODES[FinishReason.LENGTH]
        if sequence.request.cancelled:
            return _CODES[FinishReason.CANCELLED]
        return 0

    def reset(self) -> None:
        """Drop every row (a failed step: the caller answers their requests)."""
        self.sequences, self.sampler = [], Sampler([], self.device)

    @property
    def chooses_on_device(self) -> bool:
        """Whether the next step's tokens may be chosen where the logits are made (inside a
        captured decode step, :meth:`Sampler.greedy_choice`) and handed to :meth:`__call__`:
        every row greedy on unadjusted logits, past its prompt, asking no log-probabilities."""
        return self.sampler.chooses_greedily and self.may_choose_on_device(self.sequences)

    @staticmethod
    def may_choose_on_device(sequences: Sequence[DecodingSequence]) -> bool:
        """:attr:`chooses_on_device` for ``sequences`` about to join (their settings alone)."""
        return all(s.request.sampling.greedy and not s.request.sampling.adjusts_logits and s.logprobs is None
                   and s.known >= len(s.request.prompt) for s in sequences)

    def __call__(self, logits: torch.Tensor | None, chosen: torch.Tensor | None = None) -> StepOutcome:
        """Fp32 ``logits`` ``[rows, vocab]`` (the real vocabulary, every tensor shard) of each
        row's next token: choose it, record it, and retire the rows that end. ``chosen``: the
        tokens already chosen on the device where :attr:`chooses_on_device` allowed it (then
        ``logits`` may be None)."""
        sequences = self.sequences
        if self.is_leader:
            chosen, codes = self._decide(logits, chosen)
        else:
            chosen, codes = torch.empty(len(sequences), dtype=torch.long, device=self.device), [0] * len(sequences)
        chosen, codes = self._agree(chosen, codes)
        if not self.is_leader:
            for sequence, token in zip(sequences, chosen.tolist(), strict=True):
                if sequence.known >= len(sequence.request.prompt):
                    sequence.generated.append(token)
                sequence.known += 1
        return StepOutcome(chosen, *self._retire(codes))

    def _decide(self, logits: torch.Tensor | None, chosen: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        sequences = self.sequences
        drawing = [s.known >= len(s.request.prompt) for s in sequences]
        if chosen is None:
            chosen = self.sampler.sample(logits, drawing)
        if not all(drawing):  # rows still inside their prompts take its next token
            forced = torch.tensor([0 if draw else s.request.prompt[s.known] for s, draw in zip(sequences, drawing, strict=True)],
                                  device=chosen.device)
            chosen = torch.where(torch.tensor(drawing, device=chosen.device), chosen, forced)
        self.sampler.observe(chosen, drawing)
        wanting = [row for row, s in enumerate(sequences) if s.logprobs is not None]
        values, log_probs = [], None
        if wanting:
            log_probs = F.log_softmax(logits[wanting], dim=-1)
            values = log_probs.gather(-1, chosen[wanting, None]).squeeze(-1).tolist()
        chosen_list = chosen.tolist()
        for k, row in enumerate(wanting):
            sequence = sequences[row]
            sequence.logprobs.append(values[k])
            if sequence.top_logprobs is not None:
                sequence.top_logprobs.extend(top_logprobs(log_probs[k: k + 1], sequence.request.top_logprobs))
        codes = [0] * len(sequences)
        for row, sequence in enumerate(sequences):
            token, request = chosen_list[row], sequence.request
            sequence.known += 1
            reason = None
            if drawing[row]:
                sequence.generated.append(token)
                if self.on_token is not None:
                    logprob = sequence.logprobs[-1] if sequence.logprobs is not None else None
                    top = sequence.top_logprobs[-1] if sequence.top_logprobs is not None else None
                    self.on_token(sequence, token, logprob, top)
                if self.stop_checker.should_stop(request.stop, sequence.generated):
                    reason = FinishReason.STOP
            if reason is None and sequence.known >= sequence.limit:
                reason = FinishReason.LENGTH
            if reason is None and request.cancelled:
                reason = FinishReason.CANCELLED
            codes[row] = _CODES[reason] if reason is not None else 0
        return chosen, codes

    def _agree(self, chosen: torch.Tensor, codes: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The first rank's tokens and endings, on every rank of the tensor group."""
        group = self.tp_group
        if group is None or group.size == 1:
            return chosen, codes
        packed = torch.stack([chosen, torch.tensor(codes, dtype=chosen.dtype, device=chosen.device)])
        dist.broadcast(packed, src=group.ranks[0], group=group.group)
        return packed[0], packed[1].tolist()

    def _agree_codes(self, codes: list[int]) -> list[int]:
        if self.tp_group is None or self.tp_group.size == 1 or not codes:
            return codes
        return self._agree(torch.zeros(len(codes), dtype=torch.long, device=self.device), codes)[1]

    def _retire(self, codes: list[int]) -> tuple[list[int], list[DecodingSequence]]:
        kept = list(range(len(codes)))
        if not any(codes):
            return kept, []
        finished = []
        # The last row takes a finished row's place: the others stay where the caches hold them.
        for row in sorted((row for row, code in enumerate(codes) if code), reverse=True):
            finished.append(self.sequences[row])
            last = kept.pop()
            if last != row:
                kept[row] = last
        for row, code in enumerate(codes):
            if code:
                self._finish(self.sequences[row], code)
        self.sequences = [self.sequences[row] for row in kept]
        self.sampler.keep(kept)
        return kept, finished

    def _finish(self, sequence: DecodingSequence, code: int) -> None:
        sequence.finish_reason = _REASONS[code]
        if self.on_finish is not None and self.is_leader:
            self.on_finish(sequence)

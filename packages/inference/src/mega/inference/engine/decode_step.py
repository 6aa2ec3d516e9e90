"""``DecodeStep``: the one place a step's logits become tokens, log-probabilities and endings.

The decoder loop (:mod:`~mega.inference.engine.continuous`, over the paged or the static KV
cache) and :mod:`~mega.inference.engine.encoder_decoder` run their forwards and their caches,
then hand the logits of their rows to one :class:`DecodeStep` (as Megatron-Core's one
text-generation controller does). It

- chooses each row's token: a draw of the row's :class:`~mega.inference.engine.sampling.Sampler`
  stream;
- records the log-probabilities the request asked for;
- decides who ends, by the one rule of :func:`~mega.inference.engine.requests.ending` (stop, then
  length, then cancellation): a sequence that ended by itself reports so even when its client
  has just gone;
- retires the finished rows: the last row takes a finished row's place, so the callers' caches
  move as few rows as possible, and ``kept`` says which old row each new row is;
- keeps the chosen tokens on the device (the next step's input) and reads them on the host a
  few steps later (``lag``, :mod:`~mega.inference.engine.host_copy`), so no step waits for the device:
  endings are learnt that late and what a row decoded past its end is dropped.

Under tensor parallelism the first rank of the group decides (cancellations, unseeded draws and
stop strings happen there only) and broadcasts the tokens and endings, so ranks never disagree.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega.core.parallel import Group
from mega.inference.engine.grammar import GrammarState, advance, mask_logits
from mega.inference.engine.host_copy import HostCopy, to_device
from mega.inference.engine.requests import FinishReason, GenerationRequest, GenerationResult, ending
from mega.inference.engine.sampling import Sampler
from mega.inference.engine.stopping import StopChecker

# Endings as small integers, only to broadcast them with the tokens (0: goes on).
_CODES = {reason: code for code, reason in enumerate(FinishReason, start=1)}
_REASONS = {code: reason for reason, code in _CODES.items()}


@dataclass(eq=False)
class DecodingSequence:
    """One sequence's decoding state. ``known``: tokens (prompt, then generated) fixed so far,
    on the device (``generated`` holds those the host has read, a few steps behind); the logits
    a step gets for this row are those of token ``known``."""

    request: GenerationRequest
    known: int = field(init=False, default=0)  # the whole prompt to start with (__post_init__)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list | None = None
    finish_reason: FinishReason | None = None
    grammar_state: GrammarState | None = field(init=False, default=None)  # structured outputs

    def __post_init__(self) -> None:
        self.known = len(self.request.prompt)
        if self.request.grammar is not None:
            self.grammar_state = self.request.grammar.start()
        # The prompt's places (every token after the first) stay None where it is not scored.
        unscored = [] if self.request.scores_prompt else [None] * (len(self.request.prompt) - 1)
        if self.logprobs is None and self.request.logprobs:
            self.logprobs = list(unscored)
        if self.top_logprobs is None and self.request.top_logprobs:
            self.top_logprobs = list(unscored)

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
    kept: list[int]  # the old row of each row left (all rows, in order, when none left)
    finished: list[DecodingSequence]  # the sequences whose endings were read in this step
    next_tokens: torch.Tensor  # [rows left] the tokens the rows left feed next


@dataclass
class _Launched:
    """One step's rows as the host knew them when their tokens were chosen on the device."""

    sequences: list[DecodingSequence]
    known: list[int]  # each row's ``known`` after the step
    wanting: list[int]  # the rows whose log-probabilities were asked for
    copy: HostCopy  # chosen tokens and those log-probabilities, on their way to the host


READ_LAG = 2  # steps between choosing tokens on the device and reading them on the host


# (sequence, token, its logprob, the most likely (token, logprob) pairs at its position)
TokenHook = Callable[[DecodingSequence, int, "float | None", "list[tuple[int, float]] | None"], None]
FinishHook = Callable[[DecodingSequence], None]


class DecodeStep:
    """The rows being decoded and their sampler. ``on_token`` runs for each generated token
    before the endings are decided (a client may cancel there), on the first rank of
    ``tp_group`` only; ``on_finish`` for each sequence that ends, on every rank (a follower
    frees its caches as the leader does).

    The tokens a step chooses stay on the device, where the next step reads them; the host reads
    them ``lag`` steps later (:class:`~mega.inference.engine.host_copy.HostCopy`), so no step waits for
    the device. So a stop (or a cancellation) is learnt ``lag`` steps late: the row has decoded
    that many tokens past it, which are dropped (a sequence's tokens, log-probabilities and
    ending are those of reading every step at once). A row leaves at its length when the step
    that reaches it is launched (the host counts its tokens), so nobody decodes past its length
    and the caches sized for it hold every step. Under tensor parallelism the followers must
    leave the same rows at the same step: there ``lag`` is 0 (the leader reads each step's
    tokens, decides, and broadcasts them with the endings)."""

    def __init__(self, stop_checker: StopChecker, device: torch.device, tp_group: Group | None = None,
                 on_token: TokenHook | None = None, on_finish: FinishHook | None = None, lag: int = READ_LAG):
        self.stop_checker, self.device, self.tp_group = stop_checker, device, tp_group
        self.on_token, self.on_finish = on_token, on_finish
        self.lag = lag if tp_group is None or tp_group.size == 1 else 0
        self.sequences: list[DecodingSequence] = []
        self.sampler = Sampler([], device)
        self._launched: collections.deque[_Launched] = collections.deque()
        self._leaving: list[DecodingSequence] = []  # left the rows at their length, last tokens not read yet
        self.next_tokens = torch.zeros(0, dtype=torch.long, device=device)  # [rows] what each row feeds next

    @property
    def is_leader(self) -> bool:
        return self.tp_group is None or self.tp_group.rank == 0

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def in_flight(self) -> list[DecodingSequence]:
        """Every sequence not finished yet: the rows and those that left at their length."""
        return self.sequences + self._leaving

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
        reason = ending(stopped=False, at_length=sequence.known >= sequence.limit, cancelled=sequence.request.cancelled)
        return 0 if reason is None else _CODES[reason]

    def reset(self) -> None:
        """Drop every row and every unread step (a failed step: the caller answers the requests
        of :attr:`in_flight` first)."""
        self.sequences, self.sampler = [], Sampler([], self.device)
        self.next_tokens = self.next_tokens[:0]
        self._launched.clear()
        self._leaving = []

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
                   and s.request.grammar is None for s in sequences)

    def __call__(self, logits: torch.Tensor | None, chosen: torch.Tensor | None = None) -> StepOutcome:
        """Fp32 ``logits`` ``[rows, vocab]`` (the real vocabulary, every tensor shard) of each
        row's next token: choose it on the device, read the tokens of ``lag`` steps ago, and
        retire the rows that ended or reached their length. ``chosen``: the tokens already chosen
        on the device where :attr:`chooses_on_device` allowed it (then ``logits`` may be None)."""
        sequences = self.sequences
        for sequence in sequences:
            sequence.known += 1
        finished: list[DecodingSequence] = []
        if self.is_leader:
            chosen = self._choose(logits, chosen)
            self._launched.append(self._launch(logits, chosen))
            while len(self._launched) > self.lag:
                finished += self._read_oldest()
            codes = [_CODES[s.finish_reason] if s.finish_reason is not None else 0 for s in sequences]
        else:
            chosen, codes = torch.empty(len(sequences), dtype=torch.long, device=self.device), [0] * len(sequences)
        chosen, codes = self._agree(chosen, codes)
        if not self.is_leader:
            finished = self._follow(chosen, codes)
        leaving = [row for row, s in enumerate(sequences) if s.finish_reason is None and s.known >= s.limit]
        self._leaving += [sequences[row] for row in leaving]
        kept = self._retire([bool(code) for code in codes], leaving)
        self.next_tokens = chosen if len(kept) == len(chosen) else chosen[to_device(kept, chosen.device)]
        if not self.sequences:  # nothing decodes any more: read every step still on its way
            while self._launched:
                finished += self._read_oldest()
        return StepOutcome(chosen, kept, finished, self.next_tokens)

    def advance(self, emitted: Sequence[Sequence[int]]) -> StepOutcome:
        """A speculative step (:mod:`~mega.inference.engine.speculative`): each row takes the
        tokens ``emitted[row]`` (one or more, already verified), read at once on the host (``lag``
        0, one rank). Each token is recorded and streamed, then the one rule decides; a row that
        ends drops the tokens after its end."""
        if self.lag or not self.is_leader or (self.tp_group is not None and self.tp_group.size > 1):
            raise RuntimeError("speculative steps read their tokens at once, on a single rank")
        codes = []
        for sequence, tokens in zip(self.sequences, emitted, strict=True):
            code = 0
            for token in tokens:
                sequence.known += 1
                sequence.generated.append(token)
                if self.on_token is not None:
                    self.on_token(sequence, token, None, None)
                request = sequence.request
                stopped = self.stop_checker.should_stop(request.stop, sequence.generated)
                reason = ending(stopped, sequence.known >= sequence.limit, request.cancelled)
                if reason is not None:
                    code = _CODES[reason]
                    self._finish(sequence, code)
                    break
            codes.append(code)
        last = torch.tensor([tokens[-1] for tokens in emitted], dtype=torch.long, device=self.device)
        finished = [s for s, code in zip(self.sequences, codes, strict=True) if code]
        kept = self._retire([bool(code) for code in codes], [])
        self.next_tokens = last if len(kept) == len(last) else last[to_device(kept, last.device)]
        return StepOutcome(last, kept, finished, self.next_tokens)

    def _choose(self, logits: torch.Tensor | None, chosen: torch.Tensor | None) -> torch.Tensor:
        """Each row's token, on the device: its draw (every row is past its prompt, computed
        whole before it joined)."""
        every_row = [True] * len(self.sequences)
        states = [s.grammar_state for s in self.sequences]  # the logits processor of structured outputs
        if chosen is None:
            chosen = self.sampler.sample(mask_logits(logits, states), every_row)
        self.sampler.observe(chosen, every_row)
        advance(chosen, states)
        return chosen

    def _launch(self, logits: torch.Tensor | None, chosen: torch.Tensor) -> _Launched:
        """The step's tokens and asked-for log-probabilities, on their way to the host."""
        sequences = self.sequences
        wanting = [row for row, s in enumerate(sequences) if s.logprobs is not None]
        tensors = {"chosen": chosen}
        if wanting:
            rows = to_device(wanting, chosen.device)
            log_probs = F.log_softmax(logits[rows], dim=-1)
            tensors["logprobs"] = log_probs.gather(-1, chosen[rows, None]).squeeze(-1)
            most = max((s.request.top_logprobs or 0) for s in sequences)
            if most:
                tensors["top_values"], tensors["top_ids"] = log_probs.topk(most, dim=-1)
        return _Launched(list(sequences), [s.known for s in sequences], wanting, HostCopy(tensors))

    def _read_oldest(self) -> list[DecodingSequence]:
        """Read the oldest launched step: record its tokens, and end the sequences whose stop
        rule, length or cancellation (:func:`ending`'s precedence) says so. A sequence already
        ended by an earlier step's tokens ignores this one's (decoded past its end)."""
        launched = self._launched.popleft()
        host = launched.copy.read()
        logprob_of = {row: k for k, row in enumerate(launched.wanting)}
        ended = []
        for row, sequence in enumerate(launched.sequences):
            if sequence.finish_reason is not None:
                continue
            token, request = host["chosen"][row], sequence.request
            if row in logprob_of:
                k = logprob_of[row]
                sequence.logprobs.append(host["logprobs"][k])
                if sequence.top_logprobs is not None:
                    n = request.top_logprobs
                    sequence.top_logprobs.append(list(zip(host["top_ids"][k][:n], host["top_values"][k][:n],
                                                          strict=True)))
            sequence.generated.append(token)
            if self.on_token is not None:
                logprob = sequence.logprobs[-1] if sequence.logprobs is not None else None
                top = sequence.top_logprobs[-1] if sequence.top_logprobs is not None else None
                self.on_token(sequence, token, logprob, top)
            stopped = self.stop_checker.should_stop(request.stop, sequence.generated)
            reason = ending(stopped, launched.known[row] >= sequence.limit, request.cancelled)
            if reason is not None:
                ended.append(sequence)
                self._finish(sequence, _CODES[reason])
        self._leaving = [s for s in self._leaving if s.finish_reason is None]
        return ended

    def _follow(self, chosen: torch.Tensor, codes: list[int]) -> list[DecodingSequence]:
        """On a follower (``lag`` 0): the leader's tokens and endings for this step's rows."""
        finished = []
        for sequence, token, code in zip(self.sequences, chosen.tolist(), codes, strict=True):
            sequence.generated.append(token)
            if code:
                finished.append(sequence)
                self._finish(sequence, code)
        return finished

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

    def _retire(self, ended: list[bool], leaving: list[int]) -> list[int]:
        """Drop the rows that ``ended`` or are ``leaving``; returns ``kept``."""
        gone = sorted({row for row, end in enumerate(ended) if end} | set(leaving), reverse=True)
        kept = list(range(len(ended)))
        if not gone:
            return kept
        # The last row takes a gone row's place: the others stay where the caches hold them.
        for row in gone:
            last = kept.pop()
            if last != row:
                kept[row] = last
        self.sequences = [self.sequences[row] for row in kept]
        self.sampler.keep(kept)
        return kept

    def _finish(self, sequence: DecodingSequence, code: int) -> None:
        sequence.finish_reason = _REASONS[code]
        if self.on_finish is not None:
            self.on_finish(sequence)

"""Speculative decoding inside the one decoder loop (``--num-speculative-tokens K``).

A step of the loop (:class:`~mega.inference.engine.continuous.ContinuousBatchingWorker`) that
speculates gives every decoding sequence up to K draft tokens, then runs the target model once
over each row's last token and its drafts (K+1 new positions per sequence): one forward for
all rows whatever their lengths (:meth:`~mega.inference.engine.kv_caches.SequenceCache.verify`;
each cache's mask gives every row its own causal rule), on the static cache a fixed-shape step
over the decode step's window, captured as a CUDA graph per (bucket, K+1). Each row keeps
the drafts the target accepts and one token of the target's own (the correction at the first
rejection, or the bonus after the last draft), so a step yields 1..K+1 tokens per sequence. The
keys of rejected positions are rolled back by the sequence's ``cached`` count (the block table's
length on the paged cache, the slot's length on the static one): later tokens overwrite them.

Verification keeps the target's distribution (Leviathan et al. / Chen et al., 2023): a draft
``t`` drawn from ``q`` is accepted with probability ``min(1, p(t) / q(t))``; on rejection the
token is drawn from ``max(0, p - q)`` renormalised; after K accepted drafts the bonus is drawn
from ``p``. ``p`` is the target's distribution after temperature, top-k and top-p
(:meth:`Sampler.probabilities`); an n-gram draft is a point mass (``q(t) = 1``). A greedy row
accepts a draft exactly when it is the target's most likely token, so greedy output equals
decoding without speculation.

Drafts come from a :class:`NgramProposer` (prompt lookup: the tokens that followed the latest
earlier occurrence of the sequence's last n-gram, no extra model), a :class:`DraftModelProposer`
(a smaller model sharing the tokenizer, on its own paged KV cache, decoding K tokens per step) or
an :class:`~mega.inference.engine.mtp_proposer.MTPProposer` (the target's own multi-token
prediction layers, fed its hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mega.inference.engine.kv_caches import PagedSequenceCache
from mega.inference.engine.metrics import ServerMetrics
from mega.inference.engine.sampling import Sampler

SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram`` method): for the longest suffix of ``lookup_max`` down to
    ``lookup_min`` tokens that occurred earlier in the sequence (prompt and generated), the
    tokens that followed its latest earlier occurrence."""

    def __init__(self, lookup_max: int = 4, lookup_min: int = 1):
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= min ({lookup_min}) <= max ({lookup_max})")
        self.lookup_max, self.lookup_min = lookup_max, lookup_min

    def find(self, tokens: list[int], count: int) -> list[int]:
        for n in range(min(self.lookup_max, len(tokens) - 1), self.lookup_min - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start: start + n] == suffix:
                    # Copy on from there; where the copy reaches the sequence's end it goes on
                    # copying what it drafted (a repeating pattern repeats on).
                    drafted = list(tokens)
                    for position in range(start + n, start + n + count):
                        drafted.append(drafted[position])
                    return drafted[len(tokens):]
        return []

    def propose(self, sequences, count: int, sampler: Sampler) -> tuple[list[list[int]], None]:
        """Up to ``count`` drafts per sequence; no draft distribution (a point mass)."""
        return [self.find(s.tokens, count) for s in sequences], None

    def attach(self, kv) -> None:
        pass

    def accepted(self, sequence, accepted: int) -> None:
        pass

    def release(self, sequence) -> None:
        pass


@dataclass(eq=False)
class _DraftSequence:
    """A sequence as the draft model's cache holds it."""

    number: int
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    proposed_from: int = 0  # the sequence's length when it last proposed


class DraftModelProposer:
    """A draft model (``--speculative-model``) on its own paged KV cache: each step it catches
    up with the tokens the target fixed since its last proposal, then decodes ``count`` tokens,
    drawn as the target's row would draw them (its sampling settings) from the draft's logits."""

    def __init__(self, engine, max_batch_size: int, max_num_tokens: int, block_size: int):
        self.engine = engine
        self.kv = PagedSequenceCache(engine, max_batch_size, max_num_tokens, block_size, prefix_caching=False)
        self._states: dict[int, _DraftSequence] = {}

    def _state(self, sequence) -> _DraftSequence | None:
        """The draft's blocks for ``sequence``: as many as its length (the drafts of a step
        stop short of it); None where the draft has no room (no drafts then)."""
        state = self._states.get(sequence.number)
        if state is None:
            tokens = sequence.limit
            if tokens > self.engine.max_positions or not self.kv.allocator.can_hold(tokens):
                return None
            state = _DraftSequence(sequence.number, self.kv.allocator.allocate(tokens))
            self._states[sequence.number] = state
        return state

    def propose(self, sequences, count: int, sampler: Sampler) -> tuple[list[list[int]], torch.Tensor | None]:
        states = [self._state(s) for s in sequences]
        rows = [row for row, state in enumerate(states) if state is not None]
        drafts: list[list[int]] = [[] for _ in sequences]
        if not rows:
            return drafts, None
        vocab = self.engine.vocab_size
        logits = torch.zeros(len(sequences), vocab, device=self.engine.device)
        groups: dict[int, list[int]] = {}
        for row in rows:  # catch up: the tokens fixed since the draft last ran (as many together, at any lengths)
            groups.setdefault(len(sequences[row].tokens) - states[row].cached, []).append(row)
        for length, members in groups.items():
            fed = torch.tensor([sequences[r].tokens[-length:] for r in members], device=self.engine.device)
            logits[members] = self.kv.forward([states[r] for r in members], fed, 1)[0][:, :vocab]
        for row in rows:
            states[row].proposed_from = len(sequences[row].tokens)
        distributions = []
        for step in range(count):
            chosen, q = draw_drafts(sampler, logits, rows)
            if q is not None:
                distributions.append(q)
            for row, token in zip(rows, chosen, strict=True):
                drafts[row].append(token)
            if step + 1 < count:
                fed = torch.tensor(chosen, device=self.engine.device)[:, None]
                logits[rows] = self.kv.forward([states[r] for r in rows], fed, 1)[0][:, :vocab]
        return drafts, torch.stack(distributions) if distributions else None

    def attach(self, kv) -> None:
        pass

    def accepted(self, sequence, accepted: int) -> None:
        """The draft's cache keeps its keys of the drafts the target accepted."""
        state = self._states.get(sequence.number)
        if state is not None:
            state.cached = min(state.cached, state.proposed_from + accepted)

    def release(self, sequence) -> None:
        state = self._states.pop(sequence.number, None)
        if state is not None:
            self.kv.allocator.free(state.blocks)


class Speculator:
    """Drafts from ``proposer``, at most ``num_tokens`` per sequence and step, verified by the
    target in one forward; counts what it drafted and accepted in ``metrics``. ``disable_by_batch_size``
    (vLLM's ``speculative_disable_by_batch_size``): steps of at least that many rows decode one
    token each, for a large batch is bound by the weights' reads less and drafts that are
    rejected cost it a verify forward's extra positions for every row."""

    def __init__(self, proposer, num_tokens: int, metrics: ServerMetrics | None = None,
                 disable_by_batch_size: int | None = None):
        if num_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be positive, got {num_tokens}")
        self.proposer, self.num_tokens = proposer, num_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.metrics = metrics or ServerMetrics()

    def speculates_at(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows drafts (below ``disable_by_batch_size``)."""
        return self.disable_by_batch_size is None or rows < self.disable_by_batch_size

    def attach(self, kv) -> None:
        """The target's cache the loop runs on (``kv``): a proposer fed the target's hidden
        states (MTP) observes its forwards; a cache that compiles its fixed-shape steps compiles
        the verify step now."""
        self.proposer.attach(kv)
        kv.expect_verify(self.num_tokens + 1)

    def step(self, kv, sequences, sampler: Sampler) -> list[list[int]]:
        """The verified tokens (1 to K+1) of each decoding sequence (``sequences``, the decode
        step's rows, whose last token is not in the cache yet); their ``cached`` counts end at
        the tokens kept."""
        # Never past a sequence's length: positions beyond it have no cache room.
        count = min(self.num_tokens, min(s.limit - s.known for s in sequences))
        drafts, q = self.proposer.propose(sequences, count, sampler)
        fed = [[s.tokens[-1], *d, *[s.tokens[-1]] * (count - len(d))] for s, d in zip(sequences, drafts, strict=True)]
        cached = [s.cached for s in sequences]
        greedy = all(sampler.greedy_rows)  # the target's most likely tokens are all a greedy step needs
        # One forward for every row, whatever its length (on the static cache a captured graph).
        out = kv.verify(sequences, torch.tensor(fed, device=kv.engine.device), greedy)
        targets = (out if greedy else out.argmax(-1)).T.tolist()  # [rows][count+1]
        probs = None
        if not greedy:  # out: the logits [count+1, rows, vocab]
            probs = torch.stack([sampler.probabilities(position) for position in out], dim=1).cpu()
            q = None if q is None else q.transpose(0, 1).cpu()  # [rows, count, vocab]
        emitted = []
        for row, (sequence, draft) in enumerate(zip(sequences, drafts, strict=True)):
            if sampler.greedy_rows[row]:
                tokens = accept_greedy(draft, targets[row])
            else:
                tokens = accept_sampled(draft, probs[row], None if q is None else q[row], sampler.generators[row])
            sequence.cached = cached[row] + len(tokens)
            self.proposer.accepted(sequence, len(tokens) - 1)
            emitted.append(tokens)
        self.metrics.speculated(sum(len(d) for d in drafts), sum(len(t) - 1 for t in emitted),
                                sum(len(t) for t in emitted), len(sequences))
        return emitted

    def release(self, sequence) -> None:
        self.proposer.release(sequence)


def draw_rows(sampler: Sampler, logits: torch.Tensor, rows) -> list[int]:
    """The tokens of ``rows`` of ``logits`` ``[all rows, vocab]`` as a speculative step draws:
    greedy rows their most likely token, the others a draw of their own stream (as the drafts'
    verification draws), so a seeded sequence's tokens do not depend on its batch-mates."""
    return draw_drafts(sampler, logits, rows)[0]


def draw_drafts(sampler: Sampler, logits: torch.Tensor, rows) -> tuple[list[int], torch.Tensor | None]:
    """A token for each of ``rows`` from ``logits`` ``[all rows, vocab]``: greedy rows their most
    likely token, the others a draw of their own stream from ``q``, the distribution after each
    row's sampling settings, returned ``[all rows, vocab]`` (None where every row is greedy: greedy
    verification needs no draft distribution)."""
    q = None if all(sampler.greedy_rows) else sampler.probabilities(logits)
    host = None if q is None else q.cpu()
    return [int(logits[row].argmax()) if sampler.greedy_rows[row]
            else int(torch.multinomial(host[row], 1, generator=sampler.generators[row])) for row in rows], q


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The drafts equal to the target's most likely tokens, then the target's own next one."""
    kept = 0
    while kept < len(draft) and draft[kept] == targets[kept]:
        kept += 1
    return [*draft[:kept], targets[kept]]


def accept_sampled(draft: list[int], p: torch.Tensor, q: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """Rejection sampling: ``p`` ``[len(draft)+1.., vocab]`` the target's distributions at each
    position, ``q`` the draft's (None: each draft a point mass). The tokens kept, ending with
    one drawn from the target (the correction, or the bonus after every draft)."""
    for position, token in enumerate(draft):
        draft_probability = 1.0 if q is None else float(q[position, token])
        if float(torch.rand((), generator=generator)) * draft_probability < float(p[position, token]):
            continue
        residual = p[position].clone()
        if q is None:
            residual[token] = 0.0
        else:
            residual = (residual - q[position]).clamp_(min=0.0)
        if not residual.sum() > 0:  # p no greater than q anywhere but where they are equal
            residual = p[position]
        return [*draft[:position], int(torch.multinomial(residual, 1, generator=generator))]
    return [*draft, int(torch.multinomial(p[len(draft)], 1, generator=generator))]

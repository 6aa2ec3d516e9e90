"""Drafts from the target's own multi-token-prediction layers (``--speculative-method mtp``; vLLM
spells it ``deepseek_mtp`` or ``mtp``): a DeepSeek-V3 trained with ``--mtp-num-layers``.

MTP layer 0 at position ``j`` joins the target's final hidden state ``h[j]`` (after the final
norm) with the embedding of token ``j + 1`` and predicts token ``j + 2``
(:mod:`mega.models.deepseek_v3.mtp`). For a sequence of ``n`` tokens whose last is not in the
target's cache yet, the target has computed ``h[0..n-2]``: the layer, fed the pairs
``(h[j], t[j+1])`` it has not seen, drafts token ``n`` from position ``n - 2``. Each further draft
reuses the layer recursively, as vLLM does: at the next position, its own output standing in for
the target's hidden state, the previous draft as the token. So K drafts cost K passes of one layer
(and the output head), against K passes of a whole draft model.

The layer's attention has its own paged KV cache (:class:`PagedKVCache`, blocks per sequence as
the draft model's). Its keys at positions whose hidden state and next token are both the target's
are final (``cached``); those of the recursive drafts are rolled back before the next proposal,
which first catches up on the positions the target fixed since (the accepted drafts and its own
token), exactly as :class:`~mega.inference.engine.speculative.DraftModelProposer` catches up.

The hidden states come from the target's forwards over the loop's cache: a forward hook on the
model's decoder keeps the last output, and the cache's observer
(:attr:`~mega.inference.engine.kv_caches.SequenceCache.observer`) says which sequences and
positions it holds (prefills, whole or chunked, and verify forwards). A sequence whose hidden
states the proposer did not see (a plain decode step replayed as a CUDA graph on the static cache,
or a prompt prefix taken from the prefix cache) drafts nothing from then on. A model with several
MTP layers drafts with its first (its later layers need the earlier layers' outputs at positions
whose tokens are still drafts).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from mega.inference.engine.paged_kv_cache import BlockAllocator, PagedKVCache
from mega.inference.engine.sampling import Sampler
from mega.inference.engine.speculative import draw_drafts


@dataclass(eq=False)
class _MTPSequence:
    """A sequence as the MTP layer's cache holds it."""

    blocks: list[int]
    cached: int = 0  # positions whose MTP keys are final
    hidden: torch.Tensor | None = None  # [m, h] the target's hidden states at positions cached..cached+m-1
    lost: bool = False  # a position's hidden state was never seen: no more drafts
    view_id: int = 0  # names the cache's decode view row; new at each proposal (its keys were rolled back)

    def take(self, start: int, rows: torch.Tensor) -> None:
        """The target's hidden states ``rows`` ``[new, h]`` at positions from ``start``; those held
        from ``start`` on (a verify forward's rejected drafts) are replaced."""
        if start < self.cached:
            rows, start = rows[self.cached - start:], self.cached
        held = 0 if self.hidden is None else len(self.hidden)
        if start > self.cached + held:  # positions never seen (from 0 on: a prefix from the prefix cache)
            self.lost = True
            return
        kept = rows[:0] if self.hidden is None else self.hidden[: start - self.cached]
        self.hidden = torch.cat([kept, rows])


class MTPProposer:
    """Drafts from ``engine``'s model's first MTP layer (``model.mtp.layers[0]``, with the model's
    embedding and output layer), on its own paged cache of ``max_num_tokens`` tokens."""

    def __init__(self, engine, max_batch_size: int, max_num_tokens: int, block_size: int):
        model = engine.model
        mtp = getattr(model, "mtp", None)
        if mtp is None or not len(mtp.layers):
            raise ValueError(f"--speculative-method mtp drafts with the model's multi-token-prediction layers, and "
                             f"this {type(model).__name__} has none (a DeepSeek-V3 trained with --mtp-num-layers "
                             "has them): use --speculative-method ngram or draft_model")
        self.engine, self.model, self.layer = engine, model, mtp.layers[0]
        self.allocator = BlockAllocator(max(1, max_num_tokens // block_size), block_size)
        self.cache = PagedKVCache(self.allocator, max_batch_size, engine.kv_head_repeats)
        self._states: dict[int, _MTPSequence | None] = {}
        self._hidden: torch.Tensor | None = None  # [s, b, h] the decoder's output of the target's last forward
        self._view_ids = itertools.count()
        self._hook = None

    def attach(self, kv) -> None:
        """Observe the target's forwards over the loop's cache ``kv``."""
        if kv.engine is not self.engine:
            raise ValueError("MTP drafts read the hidden states of the model they draft for: attach its own cache")
        if self._hook is None:
            self._hook = self.model.decoder.register_forward_hook(self._capture)
        kv.observer = self.observe

    def _capture(self, module, inputs, output) -> None:
        self._hidden = output

    def observe(self, sequences, cached: list[int], real: list[int] | None) -> None:
        """After a target forward over ``sequences`` from positions ``cached``: keep each row's
        hidden states (``real``: right-padded prompts' own lengths)."""
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            return
        for row, sequence in enumerate(sequences):
            state = self._state(sequence)
            if state is not None:
                state.take(cached[row], hidden[: hidden.shape[0] if real is None else real[row], row])

    def _state(self, sequence) -> _MTPSequence | None:
        """The MTP cache's blocks for ``sequence`` (as many as its length); None where there is no
        room (no drafts then)."""
        if sequence.number not in self._states:
            tokens = sequence.limit
            fits = tokens <= self.engine.max_positions and self.allocator.can_hold(tokens)
            self._states[sequence.number] = _MTPSequence(self.allocator.allocate(tokens)) if fits else None
        return self._states[sequence.number]

    def propose(self, sequences, count: int, sampler: Sampler) -> tuple[list[list[int]], torch.Tensor | None]:
        drafts: list[list[int]] = [[] for _ in sequences]
        groups: dict[tuple[int, int], list[int]] = {}
        for row, sequence in enumerate(sequences):  # catch up: pairs (h[j], t[j+1]) for j up to n - 2
            state = self._states.get(sequence.number)
            n = len(sequence.tokens)
            if state is None or state.lost or state.hidden is None or state.cached + len(state.hidden) < n - 1:
                continue
            state.view_id = next(self._view_ids)
            groups.setdefault((n - 1 - state.cached, state.cached), []).append(row)
        rows = sorted(row for members in groups.values() for row in members)
        if not rows:
            return drafts, None
        states = {row: self._states[sequences[row].number] for row in rows}
        hidden = torch.empty(len(sequences), self.model.config.hidden_size, device=self.engine.device,
                             dtype=self.engine.dtype)
        for (length, start), members in groups.items():
            fed = torch.tensor([sequences[r].tokens[start + 1: start + 1 + length] for r in members],
                               device=self.engine.device)
            given = torch.stack([states[r].hidden[:length] for r in members], dim=1)  # [length, b, h]
            hidden[members] = self._forward([states[r] for r in members], given, fed)[-1]
            for r in members:
                states[r].hidden = states[r].hidden[length:]
        final = {row: states[row].cached for row in rows}
        logits = torch.zeros(len(sequences), self.engine.vocab_size, device=self.engine.device)
        distributions = []
        for step in range(count):
            logits[rows] = self.engine.real_logits(self.model.output_layer(hidden[rows]))
            chosen, q = draw_drafts(sampler, logits, rows)
            if q is not None:
                distributions.append(q)
            for row, token in zip(rows, chosen, strict=True):
                drafts[row].append(token)
            if step + 1 < count:  # the layer again, one position on, its output as the hidden state
                fed = torch.tensor(chosen, device=self.engine.device)[:, None]
                hidden[rows] = self._forward([states[r] for r in rows], hidden[rows][None], fed)[0]
        for row in rows:  # the recursive drafts' keys are rolled back
            states[row].cached = final[row]
        return drafts, torch.stack(distributions) if distributions else None

    @torch.inference_mode()
    def _forward(self, states: list[_MTPSequence], hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output ``[new, b, h]`` of the target's (or its own) hidden states
        ``hidden`` ``[new, b, h]`` and the tokens after them ``tokens`` ``[b, new]``, continuing
        each state's cached positions."""
        device, new = self.engine.device, tokens.shape[1]
        cached = [state.cached for state in states]
        self.cache.bind([state.blocks for state in states], cached, new, device, [state.view_id for state in states])
        positions = torch.tensor(cached, device=device)[:, None] + torch.arange(new, device=device)
        output = self.layer(hidden, self.model.embedding(tokens, positions), positions, self.cache.layer(0))
        for state in states:
            state.cached += new
        return output

    def accepted(self, sequence, accepted: int) -> None:
        """Nothing to keep: the accepted drafts' MTP keys were made from stand-in hidden states,
        so the next proposal recomputes them from the target's."""

    def release(self, sequence) -> None:
        state = self._states.pop(sequence.number, None)
        if state is not None:
            self.allocator.free(state.blocks)

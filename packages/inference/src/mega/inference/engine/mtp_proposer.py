"""Drafts from the target's own multi-token-prediction layers (``--speculative-method mtp``; vLLM
spells it ``deepseek_mtp`` or ``mtp``): a DeepSeek-V3 trained with ``--mtp-num-layers``.

MTP layer ``k`` at position ``j`` joins ``h_{k-1}[j]`` (``h_{-1}``: the target's final hidden
state, after the final norm) with the embedding of token ``j + k + 1`` and predicts token
``j + k + 2`` (:mod:`mega.models.deepseek_v3.mtp`). For a sequence of ``n`` tokens whose last is
not in the target's cache yet, the target has computed ``h[0..n-2]``: layer 0, fed the pairs it
has not seen up to position ``n - 2``, drafts token ``n``; layer ``k`` then drafts token ``n + k``
from the same position, its last input token being draft ``k`` (the chain the layers were trained
as). Drafts past the MTP layers reuse the last layer recursively, as vLLM does: one position on,
its own output standing in for its input hidden state, the previous draft as the token. So K
drafts cost K passes of one layer (and the output head), against K passes of a whole draft model.

Each layer's attention has its own paged KV cache (:class:`PagedKVCache`; one block table per
sequence for all of them). Layer ``k``'s keys at positions whose inputs are all the target's (its
hidden states and tokens, not drafts) are final (``cached[k]``: up to ``n - 2 - k``); the others
are rolled back before the next proposal, which first catches up on the positions fixed since
(the accepted drafts and the target's own token), as
:class:`~mega.inference.engine.speculative.DraftModelProposer` catches up. Each layer keeps the
final inputs it has not consumed (``pending[k]``: the target's hidden states for layer 0, the
previous layer's outputs for the others).

The hidden states come from the target's forwards over the loop's cache: a forward hook on the
model's decoder keeps the last output, and the cache's observer
(:attr:`~mega.inference.engine.kv_caches.SequenceCache.observer`) says which sequences and
positions it holds (prefills, whole or chunked, verify forwards, the paged cache's decode steps).
A sequence whose hidden states the proposer did not see (a plain decode step of the static cache,
its fixed-shape step or CUDA graph, in a step that could not speculate because a row asked
log-probabilities or penalties; a prompt prefix taken from the prefix cache) drafts nothing from
then on.
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
    """A sequence as the MTP layers' caches hold it: per layer ``k``, ``cached[k]`` positions whose
    keys are final and ``pending[k]`` ``[m, h]`` its final inputs at positions from ``cached[k]``."""

    blocks: list[int]
    cached: list[int]
    pending: list[torch.Tensor | None]
    lost: bool = False  # a position's hidden state was never seen: no more drafts
    view_id: int = 0  # names the caches' decode view rows; new at each proposal (their keys were rolled back)

    def take(self, start: int, rows: torch.Tensor) -> None:
        """The target's hidden states ``rows`` ``[new, h]`` at positions from ``start``; those held
        from ``start`` on (a verify forward's rejected drafts) are replaced."""
        cached, hidden = self.cached[0], self.pending[0]
        if start < cached:
            rows, start = rows[cached - start:], cached
        held = 0 if hidden is None else len(hidden)
        if start > cached + held:  # positions never seen (from 0 on: a prefix from the prefix cache)
            self.lost = True
            return
        self.pending[0] = torch.cat([rows[:0] if hidden is None else hidden[: start - cached], rows])


class MTPProposer:
    """Drafts from ``engine``'s model's MTP layers (``model.mtp.layers``, with the model's embedding
    and output layer), on paged caches of ``max_num_tokens`` tokens."""

    def __init__(self, engine, max_batch_size: int, max_num_tokens: int, block_size: int):
        model = engine.model
        mtp = getattr(model, "mtp", None)
        if mtp is None or not len(mtp.layers):
            raise ValueError(f"--speculative-method mtp drafts with the model's multi-token-prediction layers, and "
                             f"this {type(model).__name__} has none (a DeepSeek-V3 trained with --mtp-num-layers "
                             "has them; one converted from Hugging Face has none): use --speculative-method ngram "
                             "or draft_model")
        self.engine, self.model, self.layers = engine, model, list(mtp.layers)
        self.allocator = BlockAllocator(max(1, max_num_tokens // block_size), block_size)
        self.caches = [PagedKVCache(self.allocator, max_batch_size, engine.kv_head_repeats) for _ in self.layers]
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
        """The MTP caches' blocks for ``sequence`` (as many as its length); None where there is no
        room (no drafts then)."""
        if sequence.number not in self._states:
            tokens, layers = sequence.limit, len(self.layers)
            fits = tokens <= self.engine.max_positions and self.allocator.can_hold(tokens)
            self._states[sequence.number] = (_MTPSequence(self.allocator.allocate(tokens), [0] * layers,
                                                          [None] * layers) if fits else None)
        return self._states[sequence.number]

    def propose(self, sequences, count: int, sampler: Sampler) -> tuple[list[list[int]], torch.Tensor | None]:
        drafts: list[list[int]] = [[] for _ in sequences]
        states: dict[int, _MTPSequence] = {}
        for row, sequence in enumerate(sequences):  # those whose target hidden states reach n - 2
            state = self._states.get(sequence.number)
            n = len(sequence.tokens)
            if state is None or state.lost or state.pending[0] is None or state.cached[0] + len(state.pending[0]) < n - 1:
                continue
            state.view_id = next(self._view_ids)
            states[row] = state
        rows = sorted(states)
        if not rows:
            return drafts, None
        known = {row: len(sequences[row].tokens) for row in rows}  # n
        extended = {row: list(sequences[row].tokens) for row in rows}  # with the drafts as they come
        final = {row: list(states[row].cached) for row in rows}  # each layer's, after this proposal
        chain = min(len(self.layers), count)  # layers run at position n - 2; the rest recursion
        inputs = {row: states[row].pending[0][: known[row] - 1 - states[row].cached[0]] for row in rows}
        outputs = self._catch_up(0, rows, states, inputs, extended, known, final)
        hidden = torch.stack([outputs[row][-1] for row in rows])  # [rows, h] the last layer's output at n - 2
        logits = torch.zeros(len(sequences), self.engine.vocab_size, device=self.engine.device)
        distributions = []
        for step in range(count):
            logits[rows] = self.engine.real_logits(self.model.output_layer(hidden))
            chosen, q = draw_drafts(sampler, logits, rows)
            if q is not None:
                distributions.append(q)
            for row, token in zip(rows, chosen, strict=True):
                drafts[row].append(token)
                extended[row].append(token)
            if step + 1 == count:
                break
            if step + 1 < chain:  # the next layer of the chain, over what the previous one gave
                layer = step + 1
                inputs = {row: joined(states[row].pending[layer], outputs[row]) for row in rows}
                outputs = self._catch_up(layer, rows, states, inputs, extended, known, final)
                hidden = torch.stack([outputs[row][-1] for row in rows])
            else:  # the last layer again, one position on, its output as its input hidden state
                fed = torch.tensor(chosen, device=self.engine.device)[:, None]
                hidden = self._forward(len(self.layers) - 1, [states[r] for r in rows], hidden[None], fed)[0]
        if chain < len(self.layers):  # the first layer not run keeps the previous one's final outputs
            for row in rows:  # those at positions up to n - 1 - chain
                final_outputs = outputs[row][: len(outputs[row]) + 1 - chain]
                states[row].pending[chain] = joined(states[row].pending[chain], final_outputs)
        for row in rows:  # the drafts' keys are rolled back
            states[row].cached = final[row]
        return drafts, torch.stack(distributions) if distributions else None

    def _catch_up(self, layer: int, rows: list[int], states, inputs, extended, known, final) -> dict[int, torch.Tensor]:
        """Layer ``layer`` over each row's ``inputs`` (its input hidden states at positions
        ``cached[layer]`` to ``n - 2``) and the tokens ``layer + 1`` positions on: its outputs there
        by row. Rows of as many inputs share a forward, at any positions (the paged cache's mask
        gives each row its own causal rule)."""
        groups: dict[int, list[int]] = {}
        for row in rows:
            groups.setdefault(len(inputs[row]), []).append(row)
        outputs = {}
        for length, members in groups.items():
            starts = [states[r].cached[layer] + layer + 1 for r in members]
            fed = torch.tensor([extended[r][start: start + length] for r, start in zip(members, starts, strict=True)],
                               device=self.engine.device)
            given = torch.stack([inputs[r] for r in members], dim=1)  # [length, b, h]
            output = self._forward(layer, [states[r] for r in members], given, fed)
            for column, row in enumerate(members):
                outputs[row] = output[:, column]
        for row in rows:  # the keys at positions up to n - 2 - layer are final (no draft among their inputs)
            end, first = known[row] - 1 - layer, known[row] - 1 - len(inputs[row])  # first: inputs[row][0]'s position
            states[row].pending[layer] = inputs[row][end - first: end - first + 1]  # layer 0: none (the target's come)
            final[row][layer] = end
        return outputs

    @torch.inference_mode()
    def _forward(self, layer: int, states: list[_MTPSequence], hidden: torch.Tensor,
                 tokens: torch.Tensor) -> torch.Tensor:
        """MTP layer ``layer``'s output ``[new, b, h]`` of its input hidden states ``hidden``
        ``[new, b, h]`` and the tokens they join ``tokens`` ``[b, new]``, continuing each state's
        cached positions of that layer."""
        device, new = self.engine.device, tokens.shape[1]
        cached = [state.cached[layer] for state in states]
        cache = self.caches[layer]
        cache.bind([state.blocks for state in states], cached, new, device, [state.view_id for state in states])
        positions = torch.tensor(cached, device=device)[:, None] + torch.arange(new, device=device)
        output = self.layers[layer](hidden, self.model.embedding(tokens, positions), positions, cache.layer(0))
        for state in states:
            state.cached[layer] += new
        return output

    def accepted(self, sequence, accepted: int) -> None:
        """Nothing to keep: keys made from drafts are recomputed from the target's tokens and
        hidden states at the next proposal."""

    def release(self, sequence) -> None:
        state = self._states.pop(sequence.number, None)
        if state is not None:
            self.allocator.free(state.blocks)


def joined(first: torch.Tensor | None, second: torch.Tensor) -> torch.Tensor:
    return second if first is None else torch.cat([first, second])

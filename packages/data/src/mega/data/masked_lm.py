"""Choosing the tokens a masked-LM (BERT) or span-corruption (T5) sample hides.

The procedure is megatron-core's ``MaskedWordPieceDataset._create_masked_lm_predictions``, with
its random draws in the same order, so the same ``numpy.random.RandomState`` gives the same
masks:

1. Candidates are words: a WordPiece token starting with ``##`` continues the word before it
   (with whole-word masking) or stands alone; ``[CLS]``/``[SEP]`` are never candidates.
2. The budget is ``min(p * target_length, max(1, round(p * tokens)))`` masked tokens.
3. For each candidate position (in shuffled order) an n-gram of 1..max_ngram words is drawn
   (probabilities 1/n normalised, or geometric with p=0.2 as in SpanBERT), shortened until it
   fits the budget; n-grams touching an already masked token are skipped.
4. Each masked token is replaced by what ``replacement(rng)`` returns (None: kept as it was).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskingConfig:
    probability: float = 0.15
    max_ngram: int = 3
    whole_word: bool = True
    longer_ngrams_first: bool = False
    geometric: bool = False

    def __post_init__(self):
        if not 0.0 < self.probability < 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.probability}")
        if self.max_ngram < 1:
            raise ValueError(f"the longest masked n-gram must be at least 1, got {self.max_ngram}")


@dataclass(frozen=True)
class Masked:
    tokens: list[int]  # the sample with its masked tokens replaced
    positions: list[int]  # masked positions, ascending
    labels: list[int]  # the original tokens there
    spans: list[tuple[list[int], list[int]]]  # (positions, original tokens) per masked n-gram, in order


def mask_tokens(tokens: Sequence[int], target_length: int, rng: np.random.RandomState, *,
                config: MaskingConfig, is_special: Callable[[int], bool],
                continues_word: Callable[[int], bool],
                replacement: Callable[[np.random.RandomState], int | None]) -> Masked:
    candidates: list[list[int]] = []
    for position, token in enumerate(tokens):
        if is_special(token):
            continue
        if continues_word(token) and config.whole_word and candidates:
            candidates[-1].append(position)
        else:
            candidates.append([position])

    budget = min(config.probability * target_length, max(1, int(round(len(tokens) * config.probability))))
    sizes = np.arange(config.max_ngram, dtype=np.int64) + 1
    size_weights = 1.0 / sizes
    size_weights = size_weights / size_weights.sum(keepdims=True)
    if config.longer_ngrams_first:
        size_weights = size_weights[::-1]

    ngrams = [[candidates[start:start + n] for n in sizes] for start in range(len(candidates))]
    rng.shuffle(ngrams)

    masked = list(tokens)
    chosen: list[tuple[int, int]] = []
    spans: list[tuple[list[int], list[int]]] = []
    taken: set[int] = set()
    for options in ngrams:
        if len(chosen) >= budget:
            break
        if not options:
            continue
        if config.geometric:
            n = min(rng.geometric(0.2), config.max_ngram)
        else:
            weights = size_weights[: len(options)] / size_weights[: len(options)].sum(keepdims=True)
            n = rng.choice(sizes[: len(options)], p=weights)
        while True:  # shorten the n-gram until it fits the budget
            positions = sum(options[n - 1], [])
            n -= 1
            if budget >= len(chosen) + len(positions):
                break
            if n == 0:
                positions = None
                break
        if positions is None or any(p in taken for p in positions):
            continue
        for position in positions:
            taken.add(position)
            replaced = replacement(rng)
            masked[position] = tokens[position] if replaced is None else replaced
            chosen.append((position, tokens[position]))
        spans.append((positions, [tokens[p] for p in positions]))
    # Megatron shuffles once more after choosing (feeding its optional permutation step); the
    # draw moves the generator on, so it is kept for the samples' later draws to line up.
    rng.shuffle(ngrams)
    chosen.sort(key=lambda item: item[0])
    spans.sort(key=lambda span: span[0][0])
    return Masked(masked, [p for p, _ in chosen], [label for _, label in chosen], spans)

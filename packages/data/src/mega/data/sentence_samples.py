"""Megatron's sentence-based sample index for masked-LM (BERT) and span-corruption (T5) data.

Data preprocessed with ``--split-sentences`` holds one sequence per sentence; a document is a
run of sentences. A sample is a run of whole sentences of one document, grown until it reaches
a target length (``max_length``, or with probability ``short_seq_prob`` a shorter one drawn
uniformly from [2, max_length]). The index is megatron-core's ``helpers.build_mapping``:

* rows ``(first sentence, end sentence, target length)``, documents in order, epoch after epoch
  until ``num_samples`` rows exist (whole epochs: the last one is completed);
* a document is skipped when it has fewer than ``min_sentences`` sentences or, having more than
  one, a sentence longer than 512 tokens;
* a sample closes when it has reached its target, has ``min_sentences`` sentences and leaves more
  than one sentence in the document - or when the document ends;
* target lengths come from ``std::mt19937(seed)``, one draw per sample started (plus one per
  document), and the rows are shuffled (Fisher-Yates from the end) with ``std::mt19937_64(seed + 1)``.

Same inputs, same rows in the same order: samples line up with a Megatron-LM run's.
"""

from __future__ import annotations

import numpy as np

from mega.data.mersenne import MT19937, MT19937_64

LONG_SENTENCE = 512
EPOCHS_UNTIL_ENOUGH = np.iinfo(np.int32).max - 1


def _target_length(short_ratio: int, max_length: int, generator: MT19937) -> int:
    if short_ratio == 0:
        return max_length
    draw = generator.next()
    if draw % short_ratio == 0:
        return 2 + draw % (max_length - 1)
    return max_length


def build_sentence_sample_index(document_boundaries: np.ndarray, sentence_lengths: np.ndarray,
                                num_samples: int | None, max_length: int, short_seq_prob: float,
                                seed: int, min_sentences: int) -> np.ndarray:
    """``[samples, 3]`` rows of (first sentence, end sentence, target length); see the module.

    ``document_boundaries``: sentence index where each document starts, then where the last
    ends; ``num_samples`` None: one epoch.
    """
    if max_length < 2:
        raise ValueError(f"the target sample length must be at least 2, got {max_length}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {short_seq_prob}")
    if seed <= 0:
        raise ValueError(f"masked-LM sample indices need a positive seed, got {seed}")
    boundaries = [int(b) for b in document_boundaries]
    lengths = np.asarray(sentence_lengths)
    short_ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    epochs = 1 if num_samples is None else EPOCHS_UNTIL_ENOUGH
    usable = []
    for first, end in zip(boundaries[:-1], boundaries[1:], strict=True):
        count = end - first
        long_sentence = count > 1 and bool((lengths[first:end] > LONG_SENTENCE).any())
        usable.append(count >= min_sentences and not long_sentence)
    if num_samples is not None and not any(usable):
        raise ValueError(f"no document has {min_sentences} or more sentences of at most {LONG_SENTENCE} tokens: "
                         f"preprocess with --split-sentences, or use data with longer documents")

    generator = MT19937(seed)
    rows: list[tuple[int, int, int]] = []
    for _ in range(epochs):
        if num_samples is not None and len(rows) >= num_samples:
            break
        for document, (first, end) in enumerate(zip(boundaries[:-1], boundaries[1:], strict=True)):
            if not usable[document]:
                continue
            start, tokens, sentences, remaining = first, 0, 0, end - first
            target = _target_length(short_ratio, max_length, generator)
            for sentence in range(first, end):
                tokens += int(lengths[sentence])
                sentences += 1
                remaining -= 1
                if (tokens >= target and remaining > 1 and sentences >= min_sentences) or remaining == 0:
                    rows.append((start, sentence + 1, target))
                    start = sentence + 1
                    target = _target_length(short_ratio, max_length, generator)
                    tokens = sentences = 0
    index = np.array(rows, dtype=np.uint32 if len(lengths) <= np.iinfo(np.uint32).max else np.uint64)
    index = index.reshape(-1, 3)
    shuffle = MT19937_64(seed + 1)
    for i in range(len(index) - 1, 0, -1):
        j = shuffle.next() % (i + 1)
        index[[i, j]] = index[[j, i]]
    return index

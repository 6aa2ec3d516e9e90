"""Synthetic sentence-split documents and a matching WordPiece-like vocabulary, for BERT and T5
runs without a dataset (``--mock-data``), the way ``mock_dataset`` serves GPT.

1,000 documents of 1-8 sentences of 1-40 tokens, lengths drawn by ``numpy.random.default_rng(0)``;
the tokens run through the ordinary ids in order. The vocabulary of ``vocab_size`` ids: 0 pad,
1 cls, 2 sep, 3 mask, 4 bos, 5 eos, the top ``sentinels`` ids T5's sentinels, the rest ordinary,
every fourth of them a ``##`` continuation piece (so whole-word masking has words to keep whole).
The real BERT/T5 sample builders run over these, as over preprocessed files.
"""

from __future__ import annotations

import numpy as np

from mega.data.masked_datasets import MaskedVocabulary

SPECIAL_IDS = 6  # pad, cls, sep, mask, bos, eos


def mock_vocabulary(vocab_size: int) -> MaskedVocabulary:
    sentinels = min(100, (vocab_size - SPECIAL_IDS) // 4)
    if sentinels < 1:
        raise ValueError(f"mock masked-LM data needs --vocab-size of at least {SPECIAL_IDS + 8}, got {vocab_size}")
    continuation = np.zeros(vocab_size, dtype=bool)
    ordinary = np.arange(SPECIAL_IDS, vocab_size - sentinels)
    continuation[ordinary[ordinary % 4 == 3]] = True
    # Sentinels from the top down, as T5's <extra_id_0> is its vocabulary's last id.
    return MaskedVocabulary(cls=1, sep=2, mask=3, pad=0, continuation=continuation, lookup_size=vocab_size,
                            bos=4, eos=5, sentinels=tuple(range(vocab_size - 1, vocab_size - 1 - sentinels, -1)))


class MockSentenceSource:
    """An in-memory stand-in for a sentence-split :class:`IndexedDataset`."""

    documents = 1000

    def __init__(self, vocabulary: MaskedVocabulary):
        rng = np.random.default_rng(0)
        sentences_per_document = rng.integers(1, 9, size=self.documents)
        self.document_indices = np.concatenate([[0], np.cumsum(sentences_per_document)]).astype(np.int64)
        self.sequence_lengths = rng.integers(1, 41, size=int(self.document_indices[-1])).astype(np.int32)
        self._starts = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        self._ordinary_first = SPECIAL_IDS
        self._ordinary_count = len(vocabulary.continuation) - len(vocabulary.sentinels) - SPECIAL_IDS

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, index: int) -> np.ndarray:
        positions = np.arange(self._starts[index], self._starts[index + 1], dtype=np.int64)
        return self._ordinary_first + positions % self._ordinary_count

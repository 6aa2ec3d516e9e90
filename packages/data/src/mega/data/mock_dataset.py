"""Synthetic token data with megatron-core's ``MockGPTLowLevelDataset`` semantics.

100,000 documents with lengths drawn by ``numpy.random.default_rng(0)`` from ``[1, 4096)``;
document ``i`` of length ``n`` is ``1, 2, ..., n-1`` (modulo the vocabulary size) followed by
the end-of-document id. Same lengths and tokens as Megatron's, so mock runs line up too.
"""

from __future__ import annotations

import numpy as np


class MockTokenSource:
    seed = 0
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size = vocab_size
        self.eod = eod
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32)
        self.prefix = None

    def __len__(self) -> int:
        return self.size

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        positions = np.arange(offset, offset + length, dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == size - 1] = self.eod
        return tokens

"""Which samples each data-parallel rank reads, in Megatron's order, resumable by consumed samples.

``single``: the dataset is read in order; every global micro-batch window of
``micro_batch_size * dp`` consecutive sample indices is cut into dp slices, rank r taking the
r-th (Megatron's MegatronPretrainingSampler). ``cyclic``: each epoch is a fresh permutation
(seeded by seed + epoch) that every rank walks in its own contiguous bucket
(Megatron's MegatronPretrainingRandomSampler). Both start from ``consumed_samples`` so a resumed
run reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def single_pass_indices(
    total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> Iterator[list[int]]:
    window = micro_batch_size * dp_size
    start = consumed_samples
    while start + window <= total_samples:
        offset = start + dp_rank * micro_batch_size
        yield list(range(offset, offset + micro_batch_size))
        start += window


def cyclic_indices(
    total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int
) -> Iterator[list[int]]:
    window = micro_batch_size * dp_size
    # Whole windows only, so every rank sees the same number of micro-batches per epoch.
    usable = total_samples - total_samples % window
    if usable == 0:
        raise ValueError(
            f"the dataset has {total_samples} samples, fewer than one global micro-batch ({window})"
        )
    bucket = usable // dp_size
    epoch, position = divmod(consumed_samples, usable)
    while True:
        permutation = np.random.RandomState(seed + epoch).permutation(bucket) + dp_rank * bucket
        for start in range(position // dp_size, bucket - micro_batch_size + 1, micro_batch_size):
            yield permutation[start : start + micro_batch_size].tolist()
        epoch, position = epoch + 1, 0

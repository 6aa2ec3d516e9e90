"""Blending several datasets into one stream of samples, in Megatron's order.

Megatron fills position ``i`` of a blend with the dataset whose sample count lags its target
share the most: ``argmax_j weights[j] * max(i, 1) - count[j]`` (first index on ties). That is a
sequential recurrence, which megatron-core runs in C++. Here it runs in numpy, exactly:

* the positions are cut into blocks, and every block is simulated at once (one numpy step
  advances all blocks by one position), each block starting from a *guess* of the counts at its
  start: the largest-remainder apportionment of ``weights * (start - 128)``, advanced by the
  recurrence itself over those 128 positions;
* a block whose guessed start differs from the counts at which the block before it really
  ended is simulated again from those, until every start agrees with its predecessor's end.

Block 0 starts from the true counts (zero), so by induction the accepted result is the exact
sequential one; the guesses only decide how many passes that takes (in practice one, because
the recurrence forgets a wrong starting point within a few dozen positions).
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np

from mega.data.index_cache import description_hash

logger = logging.getLogger(__name__)

_MIN_BLOCK = 256
_BURN_IN = 128


def normalize(weights) -> list[float]:
    """Weights divided by their sum, in float64 as Megatron does (so that the bits agree)."""
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def _guess_counts(weights: np.ndarray, starts: np.ndarray, caps: np.ndarray | None) -> np.ndarray:
    share = weights[None, :] * np.maximum(starts, 1)[:, None].astype(np.float64)
    counts = np.floor(share).astype(np.int64)
    if caps is not None:
        counts = np.minimum(counts, caps)
    deficit = starts - counts.sum(axis=1)
    order = np.argsort(-(share - np.floor(share)), axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(weights.size)[None, :].repeat(len(starts), 0), axis=1)
    counts += ranks < deficit[:, None]
    if caps is not None:
        counts = np.minimum(counts, caps)
    counts[starts == 0] = 0
    return counts


def _simulate(weights: np.ndarray, starts: np.ndarray, counts: np.ndarray, steps: int, caps: np.ndarray | None):
    """Advance every block ``steps`` positions; returns (chosen datasets [blocks, steps], end counts)."""
    counts = counts.astype(np.float64)  # exact for any realistic count, and saves a cast per step
    blocks, datasets = counts.shape
    chosen = np.empty((blocks, steps), dtype=np.int16)
    flat = counts.reshape(-1)
    row_offsets = np.arange(blocks) * datasets
    error = np.empty_like(counts)
    position = starts.astype(np.float64)
    first_block = np.nonzero(starts == 0)[0]
    for step in range(steps):
        if step < 2 and first_block.size:
            # Positions 0 and 1 both count as 1 in Megatron's max(i, 1).
            position[first_block] = 1.0
        np.multiply.outer(position, weights, out=error)
        error -= counts
        if caps is not None:
            error[counts >= caps] = -np.inf  # exhausted datasets take no more samples
        pick = error.argmax(axis=1)
        chosen[:, step] = pick
        flat[row_offsets + pick] += 1
        position += 1.0
    return chosen, counts.astype(np.int64)


def build_blending_indices(weights, size: int, dataset_sizes=None) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index int16, sample index within that dataset int64) for ``size`` positions.

    ``weights`` are used as given (normalise them first, as Megatron does). With
    ``dataset_sizes``, a dataset drops out once it has given that many samples (Megatron's
    "exhaustive" blending, used when no weights were given).
    """
    weights = np.asarray(weights, dtype=np.float64)
    caps = None if dataset_sizes is None else np.asarray(dataset_sizes, dtype=np.int64)[None, :]
    if size <= 0:
        return np.zeros(0, np.int16), np.zeros(0, np.int64)
    # About sqrt(size) blocks of sqrt(size) positions balances numpy's per-call cost against the
    # work per call.
    block = max(_MIN_BLOCK, int(math.sqrt(size * weights.size)))
    blocks = -(-size // block)
    starts = np.arange(blocks, dtype=np.int64) * block
    # Guess the counts a little before each block and run the recurrence up to the block's start:
    # it forgets a wrong starting point within a few dozen positions, so this "burn-in" makes the
    # guess right almost always, and the loop below rarely has anything to redo.
    burn_in = np.minimum(starts, _BURN_IN)
    start_counts = _guess_counts(weights, starts - burn_in, caps)
    warm = burn_in == _BURN_IN
    if warm.any():
        _, start_counts[warm] = _simulate(weights, starts[warm] - _BURN_IN, start_counts[warm], _BURN_IN, caps)
    chosen, end_counts = _simulate(weights, starts, start_counts, block, caps)
    while True:
        wrong = np.nonzero((start_counts[1:] != end_counts[:-1]).any(axis=1))[0] + 1
        if wrong.size == 0:
            break
        start_counts[wrong] = end_counts[wrong - 1]
        chosen[wrong], end_counts[wrong] = _simulate(weights, starts[wrong], start_counts[wrong], block, caps)
    dataset_index = chosen.reshape(-1)[:size]
    # Sample k of dataset j is the number of earlier positions that chose j: group the positions
    # by dataset (a stable radix sort of int16) and number them within each group.
    order = np.argsort(dataset_index, kind="stable")
    group_starts = np.concatenate(([0], np.cumsum(np.bincount(dataset_index, minlength=weights.size))[:-1]))
    sample_index = np.empty(size, dtype=np.int64)
    sample_index[order] = np.arange(size, dtype=np.int64) - group_starts[dataset_index[order]]
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets in Megatron's blending order.

    With ``size``, ``weights`` are normalised and ``size`` positions are filled; without, the
    weights are sample counts and every dataset gives exactly that many (Megatron's exhaustive
    blend, for datasets given without weights).
    """

    def __init__(self, datasets: list, weights: list, size: int | None, split: str, cache=None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("a blend needs one weight per dataset, and at least one dataset")
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {weights}")
        if len(datasets) >= 32767:
            raise ValueError("a blend holds at most 32766 datasets (its index is int16)")
        self.datasets = datasets
        self.split = split
        self.size = size
        self.weights = normalize(weights) if size is not None else list(weights)
        self.description = json.dumps(
            {
                "class": "BlendedDataset",
                "datasets": [json.loads(d.description) for d in datasets],
                "split": split,
                "weights": self.weights,
                "size": size,
            },
            indent=2,
        )
        self.stem = f"{description_hash(self.description)}-BlendedDataset-{split}"
        cached = cache.load(self.stem, ["dataset_index", "dataset_sample_index"]) if cache is not None else None
        if cached is not None:
            self.dataset_index, self.dataset_sample_index = cached["dataset_index"], cached["dataset_sample_index"]
            return
        if size is not None:
            self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        else:
            total = int(sum(self.weights))
            fractions = [int(w) / float(total) for w in self.weights]
            self.dataset_index, self.dataset_sample_index = build_blending_indices(fractions, total, self.weights)
        drawn = np.bincount(self.dataset_index, minlength=len(datasets))
        for number, (dataset, count) in enumerate(zip(datasets, drawn, strict=True)):
            if count > len(dataset):
                raise IndexError(
                    f"the {split} blend draws {count} samples from dataset {number} ({dataset.path}), "
                    f"which has {len(dataset)}; raise mid_level_dataset_surplus"
                )
        if cache is not None:
            try:
                cache.save(
                    self.stem,
                    self.description,
                    {"dataset_index": self.dataset_index, "dataset_sample_index": self.dataset_sample_index},
                )
            except OSError as error:
                logger.warning("cannot cache the %s blend indices in %s: %s", split, cache.directory, error)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def sample_tokens(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        dataset = int(self.dataset_index[index])
        return self.datasets[dataset].sample_tokens(int(self.dataset_sample_index[index]))

    def __getitem__(self, index: int) -> dict:
        dataset = int(self.dataset_index[index])
        return {"dataset_id": dataset, **self.datasets[dataset][int(self.dataset_sample_index[index])]}

    def __repr__(self) -> str:
        return f"BlendedDataset({len(self.datasets)} datasets, split={self.split}, {len(self)} samples)"

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

import numpy as np

from mega.data.index_cache import description_hash

logger = logging.getLogger(__name__)

# Megatron's mid_level_dataset_surplus: each blended dataset is asked for 0.5% more than its share.
MID_LEVEL_SURPLUS = 0.005
_MIN_BLOCK = 512
_MAX_BLOCKS = 16384
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
    """Advance every block ``steps`` positions from ``counts`` ([blocks, datasets]).

    Returns the dataset chosen at each position ([blocks, steps]) and the counts at the end.
    Each position is one whole-array step over all blocks, computing Megatron's error
    ``weights[j] * max(i, 1) - counts[j]`` in float64 exactly as its C++ does and keeping the
    first dataset with the largest error. Few datasets: one comparison per dataset over
    contiguous rows; many: one argmax over the dataset axis.
    """
    blocks, datasets = counts.shape
    state = np.ascontiguousarray(counts.T, dtype=np.float64)  # [datasets, blocks]; exact counts
    limit = None if caps is None else caps.reshape(-1).astype(np.float64)
    chosen = np.empty((steps, blocks), dtype=np.int16)
    position = starts.astype(np.float64)
    first_block = np.nonzero(starts == 0)[0]
    best, error = np.empty(blocks), np.empty(blocks)
    better = np.empty(blocks, dtype=bool)
    pick = np.empty(blocks, dtype=np.int16)
    columns = np.arange(blocks)
    flat_state, flat_index = state.reshape(-1), np.empty(blocks, dtype=np.intp)
    errors = np.empty((datasets, blocks)) if datasets > 8 else None
    for step in range(steps):
        if step < 2 and first_block.size:
            position[first_block] = 1.0  # positions 0 and 1 both count as 1: max(i, 1)
        if datasets <= 8:
            pick.fill(0)
            for j in range(datasets):
                target = best if j == 0 else error
                np.multiply(weights[j], position, out=target)
                target -= state[j]
                if limit is not None:
                    target[state[j] >= limit[j]] = -np.inf  # exhausted datasets take no more
                if j:
                    np.greater(error, best, out=better)
                    np.maximum(best, error, out=best)
                    np.copyto(pick, j, where=better)
        else:
            np.multiply.outer(weights, position, out=errors)
            errors -= state
            if limit is not None:
                errors[state >= limit[:, None]] = -np.inf
            pick[:] = errors.argmax(axis=0)
        chosen[step] = pick
        if datasets <= 8:
            for j in range(datasets):  # cheaper than a scatter for a few datasets
                np.equal(pick, j, out=better)
                np.add(state[j], better, out=state[j])
        else:
            np.multiply(pick, blocks, out=flat_index, dtype=np.intp)  # (int16 would overflow)
            flat_index += columns
            flat_state[flat_index] += 1.0
        position += 1.0
    return np.ascontiguousarray(chosen.T), state.T.astype(np.int64)


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
    # Enough blocks that each numpy call has thousands of elements to work on, few enough that
    # the blocks stay long compared with the burn-in before them.
    blocks = max(1, min(size // _MIN_BLOCK, _MAX_BLOCKS))
    block = -(-size // blocks)
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

"""The three index arrays behind a GPT dataset, built exactly as megatron-core builds them.

* document index: the split's documents repeated once per epoch and shuffled;
* sample index: ``[num_samples + 1, 2]`` of (position in the document index, token offset) at
  which each sample starts; a sample spans ``sequence_length + 1`` tokens (with the extra token
  for the shifted labels), so consecutive samples overlap by one token;
* shuffle index: a permutation of the samples.

Megatron builds the sample index with a C++ loop over documents; here it is a few whole-array
numpy operations (see :func:`build_sample_index`), as fast and with the same result.
"""

from __future__ import annotations

import math

import numpy as np

# If the last epoch would supply fewer than this fraction of an epoch's samples, Megatron
# shuffles it separately so that its samples do not mix with (and dilute) the earlier epochs.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, sequence_length: int, extra_token: int) -> int:
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens: it cannot supply any sample")
    needed = num_samples * sequence_length + extra_token
    return max(1, -(-needed // tokens_per_epoch))  # ceil


def separate_final_epoch(
    num_epochs: int, tokens_per_epoch: int, num_samples: int, sequence_length: int, extra_token: int
) -> tuple[bool, int]:
    """Whether the last epoch is shuffled apart, and the number of samples before it."""
    if num_epochs == 1:
        return False, 0
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - extra_token) // sequence_length
    samples_from_final = num_samples - samples_before_final
    samples_per_epoch = (tokens_per_epoch - extra_token) // sequence_length
    if not 0 <= samples_from_final <= samples_per_epoch + 1:
        raise AssertionError("inconsistent epoch arithmetic")  # cannot happen with num_epochs_needed
    return samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch), samples_before_final


def build_document_index(
    documents: np.ndarray, num_epochs: int, random_state: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    if not separate_final or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        random_state.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, random_state, False)
    last = build_document_index(documents, 1, random_state, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: bool = True,
) -> np.ndarray:
    extra = int(add_extra_token)
    total = num_epochs * tokens_per_epoch
    if drop_last_partial_sequence:
        num_samples = (total - extra) // sequence_length
    else:
        # Megatron computes this in single precision (C++ float); so must we, to agree on it.
        num_samples = int(math.ceil(np.float32(total - extra) / np.float32(sequence_length)))
    dtype = np.int32 if max(len(document_index), int(sequence_lengths.max(initial=0))) <= np.iinfo(np.int32).max else np.int64

    lengths = np.asarray(sequence_lengths)[document_index]
    ends = lengths.astype(np.int64)
    np.cumsum(ends, out=ends)
    # Sample k (k >= 1) starts at token k * L of the concatenated documents, inside the document
    # that holds the last token sample k - 1 consumes, k * L + extra - 1. With
    # q(x) = floor((x - extra) / L), document d holds q(end_d) - q(start_d) such values of k
    # (counting k = 0 too when extra is 1, which the slice below drops), so the document of every
    # sample start is one np.repeat: O(documents + samples), like Megatron's C++ loop.
    q = ends - extra
    q //= sequence_length
    counts = np.diff(q, prepend=(0 - extra) // sequence_length)
    position = np.repeat(np.arange(len(document_index), dtype=dtype), counts)[extra : num_samples + extra]
    found = len(position)
    index = np.empty((num_samples + 1, 2), dtype=dtype)
    index[0] = 0
    index[1 : found + 1, 0] = position
    # offset = k * L - start of the document = k * L - end + length
    offsets = np.arange(sequence_length, (found + 1) * sequence_length, sequence_length, dtype=np.int64)
    offsets -= ends[position]
    offsets += lengths[position]
    index[1 : found + 1, 1] = offsets
    if found < num_samples:
        # Only the last, partial sample (kept when not dropping it) runs out of documents; it
        # ends where the data ends.
        index[found + 1 :, 0] = len(document_index) - 1
        index[found + 1 :, 1] = lengths[-1] - extra
    return index


def build_shuffle_index(num_samples: int, total_size: int, random_state: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return np.concatenate((first, last))


def epoch_plan(tokens_per_epoch: int, num_samples: int | None, sequence_length: int,
               extra_token: int) -> tuple[int, bool, int]:
    """(epochs, whether the last is shuffled apart, samples before it): all that the sample count
    changes in the indices."""
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, sequence_length, extra_token)
    if num_samples is None:
        return num_epochs, False, 0
    return (num_epochs, *separate_final_epoch(num_epochs, tokens_per_epoch, num_samples, sequence_length, extra_token))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    sequence_length: int,
    seed: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) for one split, as megatron-core's GPTDataset."""
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.sum(np.asarray(sequence_lengths)[documents], dtype=np.int64))
    num_epochs, separate, samples_before_final = epoch_plan(tokens_per_epoch, num_samples, sequence_length, extra)
    random_state = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, random_state, separate)
    sample_index = build_sample_index(
        sequence_lengths, document_index, sequence_length, num_epochs, tokens_per_epoch,
        drop_last_partial_sequence, add_extra_token,
    )
    size = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(samples_before_final if separate else size, size, random_state)
    return document_index, sample_index, shuffle_index

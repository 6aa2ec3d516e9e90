"""The data's token ids must lie inside the model's vocabulary.

An id at or above the vocabulary size would index past the embedding (an ``IndexError`` in one
process, a device-side assert on a GPU) or, vocab-parallel, silently train against a row of
another rank's shard or of the padding. The largest id of a ``.bin`` is read once (a max over the
memory-mapped file, a chunk at a time) and cached next to the dataset's indices, keyed by the
file's path, size and modification time.
"""

from __future__ import annotations

import os

import numpy as np

from mega.data.index_cache import IndexCache, description_hash
from mega.data.indexed_dataset import IndexedDataset, bin_path

_CHUNK_TOKENS = 1 << 24


def largest_token_id(dataset: IndexedDataset, cache: IndexCache | None = None) -> int:
    """The largest token id in ``dataset``'s ``.bin`` (-1 when it holds no token)."""
    path = bin_path(dataset.prefix)
    stat = os.stat(path)
    description = f"largest token id of {os.path.abspath(path)} ({stat.st_size} bytes, mtime {stat.st_mtime_ns} ns)"
    stem = description_hash(description)
    if cache is not None:
        cached = cache.load(stem, ["largest_token_id"])
        if cached is not None:
            return int(cached["largest_token_id"])
    largest = scan_largest_token_id(path, dataset.dtype)
    if cache is not None:
        try:
            cache.save(stem, description, {"largest_token_id": np.array(largest, dtype=np.int64)})
        except OSError:
            pass  # a read-only dataset directory: the max is computed again next time
    return largest


def scan_largest_token_id(path: str, dtype: np.dtype) -> int:
    """The largest value of the ``.bin`` at ``path`` (-1 when empty), a chunk at a time."""
    if not os.path.getsize(path):
        return -1
    tokens = np.memmap(path, mode="r", dtype=dtype)
    return max(int(tokens[start:start + _CHUNK_TOKENS].max()) for start in range(0, len(tokens), _CHUNK_TOKENS))


def check_token_ids(dataset: IndexedDataset, vocab_size: int, vocabulary: str, cache: IndexCache | None = None) -> None:
    """Raise ``ValueError`` naming the file, the id and the vocabulary when an id is >= ``vocab_size``."""
    largest = largest_token_id(dataset, cache)
    if largest >= vocab_size:
        raise ValueError(f"{bin_path(dataset.prefix)} holds token id {largest}, outside {vocabulary} "
                         f"({vocab_size} ids); was it tokenised with another tokenizer?")

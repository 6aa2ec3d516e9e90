"""Token ids at or above the vocabulary size fail when the dataset is built, naming the file, the
id and the vocabulary; the largest id is computed once and cached."""

from __future__ import annotations

import numpy as np
import pytest

from mega.core.datasets import DatasetRequest
from mega.data import token_range
from mega.data.index_cache import IndexCache
from mega.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from mega.data.token_range import largest_token_id
from mega.data.training_data import gpt_datasets


def write_corpus(prefix, largest: int) -> str:
    documents = [np.arange(0, 40) * 7 % 300, np.array([5, largest, 9] * 10), np.arange(30)]
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for document in documents:
            writer.add_document(document)
    return str(prefix)


def request(prefix: str, vocab_size: int, cache) -> DatasetRequest:
    return DatasetRequest(data_path=[prefix], split="100,0,0", seq_length=8, seed=1, num_samples=(20, 0, 0),
                          cache_path=str(cache), tokenizer=None, vocab_size=vocab_size)


def test_an_id_outside_the_vocabulary_names_file_id_and_vocabulary(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", largest=1200)
    with pytest.raises(ValueError, match=rf"{prefix}\.bin holds token id 1200, outside --vocab-size 1000 \(1000 ids\)"):
        gpt_datasets(request(prefix, 1000, tmp_path / "cache"))
    with pytest.raises(ValueError, match="token id 1200"):
        gpt_datasets(request(prefix, 1200, tmp_path / "cache"))
    assert gpt_datasets(request(prefix, 1201, tmp_path / "cache")).train is not None


def test_the_largest_id_is_cached_per_file_version(tmp_path, monkeypatch):
    cache = IndexCache(tmp_path / "cache")
    dataset = IndexedDataset(write_corpus(tmp_path / "corpus", largest=777))
    assert largest_token_id(dataset, cache) == 777

    def no_reading(*args, **kwargs):
        raise AssertionError("the cached value should have been used")

    monkeypatch.setattr(token_range, "scan_largest_token_id", no_reading)
    assert largest_token_id(dataset, cache) == 777
    monkeypatch.undo()
    # Another file (or this one rewritten: another size or time) is another entry, never a stale hit.
    assert largest_token_id(IndexedDataset(write_corpus(tmp_path / "other", largest=65000)), cache) == 65000

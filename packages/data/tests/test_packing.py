"""First-fit-decreasing packing and the SFT rows built on it (labels within a conversation, the
assistant mask shifted onto the labels, positions and documents restarting, the packing cached)."""

from __future__ import annotations

import numpy as np
import pytest

from mega.data.chat_encoder import LOSS_MASK_SUFFIX
from mega.data.index_cache import IndexCache
from mega.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from mega.data.packing import document_ids_after_eod, first_fit_decreasing, positions_within_documents
from mega.data.sft_dataset import SFTDataset, SFTDatasetConfig


def textbook_ffd(lengths, capacity):
    """First fit decreasing as the textbook states it: longest first, each into the first open bin with room."""
    bins, free = [], []
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, room in enumerate(free) if room >= lengths[item]), None)
        if target is None:
            bins.append([])
            free.append(capacity)
            target = len(bins) - 1
        bins[target].append(item)
        free[target] -= lengths[item]
    return bins


def test_first_fit_decreasing_is_the_textbook_packing():
    rng = np.random.default_rng(0)
    for capacity in (8, 64, 100):
        lengths = rng.integers(1, capacity + 1, size=300)
        items, offsets = first_fit_decreasing(lengths, capacity)
        bins = [items[offsets[b]:offsets[b + 1]].tolist() for b in range(len(offsets) - 1)]
        assert bins == textbook_ffd(lengths.tolist(), capacity)
    with pytest.raises(ValueError, match="an item of 9 does not fit a bin of 8"):
        first_fit_decreasing(np.array([3, 9]), 8)


def test_positions_and_documents():
    assert positions_within_documents(np.array([0, 0, 0, 1, 1, 2])).tolist() == [0, 1, 2, 0, 1, 0]
    assert document_ids_after_eod(np.array([5, 9, 6, 7, 9, 9, 4]), 9).tolist() == [0, 0, 1, 1, 1, 2, 3]


@pytest.fixture
def chat_dataset(tmp_path):
    prefix = str(tmp_path / "chat_messages_document")
    conversations = [([10, 11, 12, 13, 14], [0, 0, 1, 1, 1]), ([20, 21, 22], [0, 1, 1]),
                     ([30, 31, 32, 33, 34, 35], [0, 0, 0, 1, 1, 0]), ([40, 41], [0, 1])]
    with IndexedDatasetWriter(prefix, np.uint16) as tokens, \
            IndexedDatasetWriter(prefix + LOSS_MASK_SUFFIX, np.uint8) as masks:
        for ids, mask in conversations:
            tokens.add_document(ids, [len(ids)])
            masks.add_document(mask, [len(mask)])
    return prefix, conversations


def test_packed_rows(chat_dataset, tmp_path):
    prefix, conversations = chat_dataset
    config = SFTDatasetConfig(sequence_length=8, packed=True, pad=7)
    cache = IndexCache(tmp_path / "cache")
    dataset = SFTDataset(IndexedDataset(prefix), prefix, np.arange(4), 2, "train", config, cache)
    seen = []
    for row in (dataset[i] for i in range(len(dataset))):
        documents = row["document_ids"]
        for d in np.unique(documents):
            where = np.flatnonzero(documents == d)
            assert row["position_ids"][where].tolist() == list(range(len(where)))
            tokens = row["tokens"][where].tolist()
            if tokens[0] == 7:  # the padding: nothing in the loss
                assert not row["loss_mask"][where].any()
                continue
            ids, mask = next(c for c in conversations if c[0] == tokens)
            seen.append(ids[0])
            assert row["labels"][where][:-1].tolist() == ids[1:]
            assert row["loss_mask"][where].tolist() == mask[1:] + [0]
    assert sorted(seen) == [10, 20, 30, 40] and len(dataset) == 2  # 6+2 | 5+3: one epoch
    again = SFTDataset(IndexedDataset(prefix), prefix, np.arange(4), 2, "train", config, cache)
    assert isinstance(again.sample_bins, np.memmap)  # from the cache
    assert np.array_equal(again.sample_bins, dataset.sample_bins)
    with pytest.raises(ValueError, match=r"conversation 2 has 6 tokens, more than --seq-length 5"):
        SFTDataset(IndexedDataset(prefix), prefix, np.arange(4), 3, "train",
                   SFTDatasetConfig(sequence_length=5, packed=True), None)


def test_packed_rows_padded_for_context_parallelism(chat_dataset, tmp_path):
    """``pad_to`` (2 x cp): every conversation takes a multiple of it, its padding after it in its
    document (positions go on, nothing in the loss), so each cuts into 2 x cp equal chunks."""
    prefix, conversations = chat_dataset
    config = SFTDatasetConfig(sequence_length=8, packed=True, pad=7, pad_to=4)
    dataset = SFTDataset(IndexedDataset(prefix), prefix, np.arange(4), None, "train", config, IndexCache(tmp_path))
    assert len(dataset) == 3  # 8 | 8 | 4+4: 6 and 5 rounded up to 8, 3 and 2 to 4
    for row in (dataset[i] for i in range(len(dataset))):
        lengths = np.unique(row["document_ids"], return_counts=True)[1]
        assert not (lengths % 4).any()
        for d in np.unique(row["document_ids"]):
            where = np.flatnonzero(row["document_ids"] == d)
            assert row["position_ids"][where].tolist() == list(range(len(where)))
            ids = [c[0] for c in conversations if c[0][0] == row["tokens"][where][0]]
            if ids:  # a conversation: its tokens, then the padding, out of the loss
                length = len(ids[0])
                assert row["tokens"][where][:length].tolist() == ids[0] and (row["tokens"][where][length:] == 7).all()
                assert not row["loss_mask"][where][length - 1:].any()
    unpadded = SFTDataset(IndexedDataset(prefix), prefix, np.arange(4), None, "train",
                          SFTDatasetConfig(sequence_length=8, packed=True, pad=7), IndexCache(tmp_path))
    assert len(unpadded) == 2 and dataset.description != unpadded.description  # cached apart

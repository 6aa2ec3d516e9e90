"""The .bin/.idx format against megatron-core's own reader and writer, both ways."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from mega.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    dtype_for_vocab_size,
    find_dataset_prefixes,
    merge_datasets,
)

megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.fixture(autouse=True)
def _helpers(megatron_dataset_writer, make_documents):
    global write_indexed_dataset, random_documents
    write_indexed_dataset, random_documents = megatron_dataset_writer, make_documents

# Documents of several sequences, including an empty sequence and an empty document.
DOCUMENTS = [
    [[1, 2, 3], [4, 5]],
    [[6]],
    [],
    [[7, 8, 9, 10], [], [11]],
    [[65499, 0, 12345]],
]


def write_with_mega(prefix, documents, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            flat = [t for sequence in document for t in sequence]
            writer.add_document(flat, [len(s) for s in document])
    return str(prefix)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_files_are_byte_identical_to_megatron(tmp_path, dtype):
    documents = DOCUMENTS if dtype != np.uint8 else [[[t % 256 for t in s] for s in d] for d in DOCUMENTS]
    ours = write_with_mega(tmp_path / "ours", documents, dtype)
    theirs = write_indexed_dataset(tmp_path / "theirs", documents, dtype)
    for suffix in (".bin", ".idx"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read()


def test_megatron_reads_what_mega_writes(tmp_path):
    documents = random_documents(0, 50) + DOCUMENTS
    prefix = write_with_mega(tmp_path / "ours", documents)
    theirs = megatron_indexed.IndexedDataset(prefix)
    flat_sequences = [s for d in documents for s in d]
    assert len(theirs) == len(flat_sequences)
    for i, sequence in enumerate(flat_sequences):
        assert theirs[i].tolist() == sequence
    assert theirs.document_indices.tolist() == np.cumsum([0] + [len(d) for d in documents]).tolist()
    assert theirs.get(0, offset=1, length=2).tolist() == flat_sequences[0][1:3]


def test_mega_reads_what_megatron_writes(tmp_path):
    documents = random_documents(1, 60, vocab=70000) + DOCUMENTS
    prefix = write_indexed_dataset(tmp_path / "theirs", documents, np.int32)
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.int32 and ours.num_documents == len(documents)
    flat_sequences = [s for d in documents for s in d]
    assert [ours[i].tolist() for i in range(len(ours))] == flat_sequences
    for d, document in enumerate(documents):
        assert ours.document(d).tolist() == [t for s in document for t in s]
        assert [ours[i].tolist() for i in ours.document_sequences(d)] == document
    assert ours.get(0, 3, 5).tolist() == flat_sequences[0][3:8]
    assert ours.num_tokens == sum(len(s) for s in flat_sequences)
    with pytest.raises(IndexError):
        ours.get(0, 0, len(flat_sequences[0]) + 1)


def test_bulk_add_documents_matches_one_by_one(tmp_path):
    documents = random_documents(2, 30) + DOCUMENTS
    one_by_one = write_with_mega(tmp_path / "a", documents)
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as writer:
        tokens = [t for d in documents for s in d for t in s]
        writer.add_documents(np.array(tokens), [len(s) for d in documents for s in d], [len(d) for d in documents])
    for suffix in (".bin", ".idx"):
        assert open(one_by_one + suffix, "rb").read() == open(f"{tmp_path / 'b'}{suffix}", "rb").read()


def test_merge_equals_writing_everything_at_once(tmp_path):
    parts = [random_documents(seed, 20) for seed in (3, 4, 5)]
    prefixes = [write_with_mega(tmp_path / f"part{i}", part) for i, part in enumerate(parts)]
    merged = merge_datasets(prefixes, tmp_path / "merged")
    whole = write_with_mega(tmp_path / "whole", [d for part in parts for d in part])
    for suffix in (".bin", ".idx"):
        assert open(f"{merged.prefix}{suffix}", "rb").read() == open(whole + suffix, "rb").read()
    assert find_dataset_prefixes(tmp_path)[:3] == sorted(prefixes + [merged.prefix, whole])[:3]

    # And megatron-core's own merge (add_index) produces the same bytes.
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "megatron_merged.bin"), dtype=np.uint16)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(str(tmp_path / "megatron_merged.idx"))
    for suffix in (".bin", ".idx"):
        assert open(f"{merged.prefix}{suffix}", "rb").read() == open(f"{tmp_path / 'megatron_merged'}{suffix}", "rb").read()


def test_merge_refuses_mixed_dtypes(tmp_path):
    a = write_with_mega(tmp_path / "a", DOCUMENTS, np.uint16)
    b = write_with_mega(tmp_path / "b", DOCUMENTS, np.int32)
    with pytest.raises(IndexedDatasetError, match="int32"):
        merge_datasets([a, b], tmp_path / "c")
    assert not os.path.exists(tmp_path / "c.bin") and not os.path.exists(tmp_path / "c.idx")


def test_nothing_appears_until_finalized_and_abort_leaves_nothing(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "out", np.uint16)
    writer.add_document([1, 2, 3])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == []
    writer.abort()
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "out", np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("failure mid-way")
    assert list(tmp_path.iterdir()) == []


def test_dtype_choice_follows_megatron():
    assert dtype_for_vocab_size(50257) == np.uint16
    assert dtype_for_vocab_size(65499) == np.uint16
    assert dtype_for_vocab_size(65500) == np.int32
    assert dtype_for_vocab_size(None) == np.int32
    assert megatron_indexed.DType.optimal_dtype(65500) == np.int32


class TestBadFiles:
    def test_missing(self, tmp_path):
        with pytest.raises(IndexedDatasetError, match="no such file"):
            IndexedDataset(tmp_path / "nothing")
        (tmp_path / "half.idx").write_bytes(b"")
        with pytest.raises(IndexedDatasetError, match=r"half\.bin: no such file"):
            IndexedDataset(tmp_path / "half")

    def test_foreign_file(self, tmp_path):
        (tmp_path / "x.idx").write_bytes(b"PK\x03\x04 this is a zip file, not an index" * 3)
        (tmp_path / "x.bin").write_bytes(b"")
        with pytest.raises(IndexedDatasetError, match="not a Megatron indexed dataset"):
            IndexedDataset(tmp_path / "x")

    @pytest.mark.parametrize("keep", [0, 5, 20, 40, -1])
    def test_truncated_index(self, tmp_path, keep):
        prefix = write_with_mega(tmp_path / "t", DOCUMENTS)
        data = open(prefix + ".idx", "rb").read()
        open(prefix + ".idx", "wb").write(data[:keep])
        with pytest.raises(IndexedDatasetError, match="truncated"):
            IndexedDataset(prefix)

    def test_truncated_or_mismatched_bin(self, tmp_path):
        prefix = write_with_mega(tmp_path / "t", DOCUMENTS)
        data = open(prefix + ".bin", "rb").read()
        open(prefix + ".bin", "wb").write(data[:-2])
        with pytest.raises(IndexedDatasetError, match="truncated"):
            IndexedDataset(prefix)
        open(prefix + ".bin", "wb").write(data + b"\x00\x00")
        with pytest.raises(IndexedDatasetError, match="does not belong"):
            IndexedDataset(prefix)

    def test_bad_header_fields(self, tmp_path):
        prefix = write_with_mega(tmp_path / "t", DOCUMENTS)
        data = bytearray(open(prefix + ".idx", "rb").read())
        bad_version = data[:9] + struct.pack("<Q", 2) + data[17:]
        open(prefix + ".idx", "wb").write(bad_version)
        with pytest.raises(IndexedDatasetError, match="version 2"):
            IndexedDataset(prefix)
        bad_dtype = data[:17] + bytes([42]) + data[18:]
        open(prefix + ".idx", "wb").write(bad_dtype)
        with pytest.raises(IndexedDatasetError, match="dtype code 42"):
            IndexedDataset(prefix)
        open(prefix + ".idx", "wb").write(bytes(data) + b"junk")
        with pytest.raises(IndexedDatasetError, match="unexpected bytes"):
            IndexedDataset(prefix)


def test_multimodal_modes_round_trip(tmp_path):
    with IndexedDatasetWriter(tmp_path / "mm", np.int32, multimodal=True) as writer:
        writer.add_document([1, 2, 3], [2, 1], modes=[0, 1])
        writer.add_document([4], [1], modes=[1])
    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "mm"), multimodal=True)
    assert theirs.index.sequence_modes.tolist() == [0, 1, 1]
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32, multimodal=True)
    builder.add_document(np.array([1, 2, 3]), [2, 1], modes=[0, 1])
    builder.add_document(np.array([4]), [1], modes=[1])
    builder.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"mm{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()
    ours = IndexedDataset(tmp_path / "mm", multimodal=True)
    assert ours.sequence_modes.tolist() == [0, 1, 1] and ours[1].tolist() == [3]
    # Read without the multimodal flag, the modes are tolerated trailing bytes, as in Megatron.
    assert IndexedDataset(tmp_path / "mm").num_documents == 2


def test_the_scratch_of_a_killed_writer_is_removed_by_the_next(tmp_path):
    # A SIGKILLed `mega preprocess` cannot clean up; its hidden .partial directory was left for ever.
    import signal
    import subprocess
    import sys

    prefix = tmp_path / "corpus"
    script = ("import sys, time; from mega.data.indexed_dataset import IndexedDatasetWriter; "
              "w = IndexedDatasetWriter(sys.argv[1]); w.add_document([1, 2, 3]); print('writing', flush=True); "
              "time.sleep(60)")
    killed, live = (subprocess.Popen([sys.executable, "-c", script, str(prefix)], stdout=subprocess.PIPE, text=True)
                    for _ in range(2))
    assert killed.stdout.readline() == live.stdout.readline() == "writing\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    try:
        assert len(list(tmp_path.glob(".corpus.*.partial"))) == 2
        writer = IndexedDatasetWriter(prefix)
        # The killed writer's scratch is gone; the live one's and this one's remain.
        assert len(list(tmp_path.glob(".corpus.*.partial"))) == 2
        writer.abort()
        assert len(list(tmp_path.glob(".corpus.*.partial"))) == 1
    finally:
        live.kill()
        live.wait()

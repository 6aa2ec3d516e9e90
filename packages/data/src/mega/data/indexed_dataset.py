"""Megatron's indexed dataset: a ``.bin`` of token ids and an ``.idx`` that says where each sequence is.

The layout (byte-compatible with ``megatron.core.datasets.indexed_dataset``), little-endian:

    .idx  magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code | uint64 S | uint64 D
          | int32[S] sequence lengths | int64[S] byte offsets into .bin | int64[D] document
          boundaries (sequence indices, 0 ... S) | int8[S] sequence modes (multimodal only)
    .bin  the sequences' tokens back to back, in the dtype of the header, no header of its own

A *sequence* is what Megatron's ``IndexedDataset[i]`` returns (a sentence with ``--split-sentences``,
else a whole document); a *document* is a run of sequences.

:class:`IndexedDataset` reads a pair through memory maps; :class:`IndexedDatasetWriter` streams one
to disk with memory that does not grow with the dataset (the per-sequence index goes to scratch
files, not lists) and makes it appear atomically; :func:`merge_datasets` concatenates pairs.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_SIZE = _HEADER.size  # 34

DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_BY_DTYPE = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}

# Copying scratch files and .bin data in pieces of this many bytes keeps memory flat (and small:
# an 8 MiB dataset is read the same way as an 8 TiB one).
_COPY_CHUNK = 1 << 20


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that is missing, truncated, inconsistent or not a Megatron dataset."""


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def dtype_for_vocab_size(vocab_size: int | None) -> np.dtype:
    """The token dtype Megatron picks: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _as_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in CODE_BY_DTYPE:
        names = ", ".join(str(d) for d in CODE_BY_DTYPE)
        raise ValueError(f"dtype {dtype} cannot be stored in an indexed dataset; use one of {names}")
    return dtype


class IndexedDataset:
    """Read-only, memory-mapped access to ``{prefix}.bin`` / ``{prefix}.idx``.

    ``dataset[i]`` is sequence ``i`` (a numpy view, no copy); ``get(i, offset, length)`` a slice of
    it; ``document(d)`` all tokens of document ``d``. Every structural promise of the header is
    checked against the file sizes on open, so a truncated or foreign file fails here with a
    message rather than later with garbage tokens.
    """

    def __init__(self, prefix: str | os.PathLike, multimodal: bool = False):
        self.prefix = os.fspath(prefix)
        self.multimodal = multimodal
        index_file, data_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (index_file, data_file):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: no such file (indexed dataset prefix {self.prefix!r})")

        header = _read_header(index_file)
        _, _, code, self.sequence_count, self.document_count = header
        self.dtype = DTYPE_BY_CODE[code]

        idx_size = os.path.getsize(index_file)
        s, d = self.sequence_count, self.document_count
        expected = HEADER_SIZE + s * 4 + s * 8 + d * 8 + (s if multimodal else 0)
        if idx_size < expected:
            raise IndexedDatasetError(
                f"{index_file}: truncated: the header announces {s} sequences and {d - 1} documents, "
                f"which need {expected} bytes, but the file has {idx_size}"
            )
        # Megatron writes the modes of multimodal datasets after the document index without a flag,
        # so exactly S spare bytes are legitimate; anything else means the file is not what it says.
        if idx_size not in (expected, expected + s) or (idx_size != expected and multimodal):
            raise IndexedDatasetError(
                f"{index_file}: {idx_size - expected} unexpected bytes after the index "
                f"({s} sequences, {d - 1} documents); the file is corrupt or not a Megatron index"
            )

        self._idx_map = np.memmap(index_file, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_map, np.int32, s, offset)
        offset += s * 4
        self.sequence_pointers = np.frombuffer(self._idx_map, np.int64, s, offset)
        offset += s * 8
        self.document_indices = np.frombuffer(self._idx_map, np.int64, d, offset)
        offset += d * 8
        self.sequence_modes = np.frombuffer(self._idx_map, np.int8, s, offset) if multimodal else None

        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != s:
            raise IndexedDatasetError(
                f"{index_file}: corrupt document index (must run from 0 to the sequence count {s})"
            )

        bin_size = os.path.getsize(data_file)
        itemsize = self.dtype.itemsize
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if s else 0
        if bin_size < needed:
            raise IndexedDatasetError(
                f"{data_file}: truncated: the index needs {needed} bytes of {self.dtype} tokens, "
                f"the file has {bin_size}"
            )
        if bin_size != needed:
            raise IndexedDatasetError(
                f"{data_file}: {bin_size} bytes where the index describes {needed}; "
                f"the .bin does not belong to {index_file}"
            )
        # numpy cannot memory-map an empty file.
        self._bin_map = np.memmap(data_file, mode="r", dtype=np.uint8) if bin_size else np.empty(0, np.uint8)

    # -- sequences -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self.get(i) for i in range(*index.indices(len(self)))]
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``index`` (to its end without ``length``)."""
        index = int(index)
        if not -self.sequence_count <= index < self.sequence_count:
            raise IndexError(f"sequence {index} out of range for {self.sequence_count} sequences")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}:{offset + length} out of range for a sequence of {size}")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, self.dtype, length, start)

    # -- documents -------------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return self.document_count - 1

    def document_sequences(self, document: int) -> range:
        """The sequence indices of ``document``."""
        return range(int(self.document_indices[document]), int(self.document_indices[document + 1]))

    def document(self, document: int) -> np.ndarray:
        """All tokens of ``document`` (its sequences are stored back to back, so this is one view)."""
        if not 0 <= document < self.num_documents:
            raise IndexError(f"document {document} out of range for {self.num_documents} documents")
        sequences = self.document_sequences(document)
        if not sequences:
            return np.empty(0, self.dtype)
        count = int(self.sequence_lengths[sequences.start : sequences.stop].sum())
        return np.frombuffer(self._bin_map, self.dtype, count, int(self.sequence_pointers[sequences.start]))

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, {self.num_documents} documents, "
            f"{self.sequence_count} sequences, {self.dtype})"
        )


def _read_header(index_file: str) -> tuple:
    with open(index_file, "rb") as stream:
        raw = stream.read(HEADER_SIZE)
    if not (raw.startswith(MAGIC) or MAGIC.startswith(raw)):
        raise IndexedDatasetError(
            f"{index_file}: not a Megatron indexed dataset (expected the magic bytes {MAGIC!r}, "
            f"found {raw[:9]!r})"
        )
    if len(raw) < HEADER_SIZE:
        raise IndexedDatasetError(f"{index_file}: truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
    header = _HEADER.unpack(raw)
    if header[1] != VERSION:
        raise IndexedDatasetError(f"{index_file}: unsupported index version {header[1]} (expected {VERSION})")
    if header[2] not in DTYPE_BY_CODE:
        raise IndexedDatasetError(f"{index_file}: unknown dtype code {header[2]}")
    return header


_OWNER_FILE = "owner"  # "host pid" of the writer, so a later one can tell an abandoned scratch


def _remove_abandoned_scratch(directory: str, stem: str) -> None:
    """Delete the scratch directories of writers of ``stem`` that were killed (SIGKILL, power loss)
    before they could clean up; those of live writers (this host's pids that exist) stay."""
    for scratch in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(stem)}.*.partial")):
        try:
            with open(os.path.join(scratch, _OWNER_FILE)) as owner:
                host, pid = owner.read().split()
        except (OSError, ValueError):
            continue  # not ours to judge (another version, or a writer that is just starting)
        if host == socket.gethostname() and not _pid_alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class IndexedDatasetWriter:
    """Writes ``{prefix}.bin`` / ``{prefix}.idx`` so that they appear only when complete.

    Tokens go straight to a hidden temporary file next to the target; sequence lengths, document
    boundaries and modes go to scratch files, so memory stays flat however many sequences are
    added. :meth:`finalize` writes the index and renames both files into place (the ``.idx`` last);
    :meth:`abort`, or leaving a ``with`` block by an exception, removes every temporary file.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32, multimodal: bool = False):
        self.prefix = os.fspath(prefix)
        self.dtype = _as_dtype(dtype)
        self.multimodal = multimodal
        directory = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(directory, exist_ok=True)
        stem = os.path.basename(self.prefix)
        _remove_abandoned_scratch(directory, stem)
        self._scratch = tempfile.mkdtemp(prefix=f".{stem}.", suffix=".partial", dir=directory)
        with open(os.path.join(self._scratch, _OWNER_FILE), "w") as owner:
            owner.write(f"{socket.gethostname()} {os.getpid()}")
        self._bin = open(os.path.join(self._scratch, "data.bin"), "wb")
        self._lengths = open(os.path.join(self._scratch, "lengths.i32"), "wb")
        self._documents = open(os.path.join(self._scratch, "documents.i64"), "wb")
        self._modes = open(os.path.join(self._scratch, "modes.i8"), "wb") if multimodal else None
        self.sequence_count = 0
        self.document_count = 1  # Megatron's document index starts with a 0 boundary
        self._documents.write(np.zeros(1, np.int64).tobytes())
        self._closed = False

    # -- adding data -----------------------------------------------------------------------------
    def add_document(self, tokens, lengths: Sequence[int] | None = None, modes: Sequence[int] | None = None) -> None:
        """Append a document: ``tokens`` split into sequences of ``lengths`` (one sequence by default).

        Like Megatron's builder, ``lengths=[]`` records a document with no sequences.
        """
        array = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        lengths = np.asarray([array.size] if lengths is None else lengths, dtype=np.int64)
        if int(lengths.sum()) != array.size:
            raise ValueError(f"sequence lengths sum to {int(lengths.sum())}, the document has {array.size} tokens")
        self.add_documents(array, lengths, np.asarray([lengths.size]), modes)

    def add_documents(self, tokens, sequence_lengths, sequences_per_document, modes=None) -> None:
        """Append many documents at once (the fast path of ``mega preprocess``).

        ``tokens`` holds all sequences back to back (an array, or raw bytes in this writer's
        dtype), ``sequence_lengths`` their lengths and ``sequences_per_document`` how many
        consecutive sequences make each document.
        """
        if isinstance(tokens, (bytes, bytearray, memoryview)):
            data = tokens
            token_count = len(tokens) // self.dtype.itemsize
        else:
            array = np.ascontiguousarray(tokens, dtype=self.dtype)
            data, token_count = array.tobytes(), array.size
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if int(lengths.sum()) != token_count:
            raise ValueError(f"sequence lengths sum to {int(lengths.sum())}, got {token_count} tokens")
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("sequence lengths must be between 0 and 2**31-1")
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        if int(counts.sum()) != lengths.size:
            raise ValueError(f"documents hold {int(counts.sum())} sequences, got {lengths.size} lengths")
        self._bin.write(data)
        self._lengths.write(lengths.astype(np.int32).tobytes())
        if self._modes is not None:
            modes = np.zeros(lengths.size, np.int8) if modes is None else np.asarray(modes, np.int8)
            self._modes.write(modes.tobytes())
        boundaries = self.sequence_count + np.cumsum(counts)
        self._documents.write(boundaries.astype(np.int64).tobytes())
        self.sequence_count += int(lengths.size)
        self.document_count += int(counts.size)

    def add_dataset(self, prefix: str | os.PathLike) -> None:
        """Append every document of another dataset (its dtype must match this writer's)."""
        source = IndexedDataset(prefix, multimodal=self.multimodal)
        if source.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {source.prefix!r} ({source.dtype}) into a {self.dtype} dataset"
            )
        for start in range(0, len(source.sequence_lengths), _COPY_CHUNK // 4):
            self._lengths.write(source.sequence_lengths[start : start + _COPY_CHUNK // 4].tobytes())
        if self._modes is not None:
            self._modes.write(source.sequence_modes.tobytes())
        boundaries = source.document_indices[1:]
        for start in range(0, len(boundaries), _COPY_CHUNK // 8):
            self._documents.write((boundaries[start : start + _COPY_CHUNK // 8] + self.sequence_count).tobytes())
        with open(bin_path(source.prefix), "rb") as data:
            shutil.copyfileobj(data, self._bin, _COPY_CHUNK)
        self.sequence_count += source.sequence_count
        self.document_count += source.num_documents

    # -- finishing -------------------------------------------------------------------------------
    def write_index(self) -> None:
        """Write the .idx next to the data, still under temporary names (see :meth:`publish`)."""
        for stream in (self._bin, self._lengths, self._documents, self._modes):
            if stream is not None:
                stream.close()
        itemsize = self.dtype.itemsize
        with open(os.path.join(self._scratch, "index.idx"), "wb") as index:
            index.write(
                _HEADER.pack(MAGIC, VERSION, CODE_BY_DTYPE[self.dtype], self.sequence_count, self.document_count)
            )
            _copy_file(os.path.join(self._scratch, "lengths.i32"), index)
            # Pointers are the running byte offsets of the lengths: computed piecewise with a carry.
            carry = 0
            with open(os.path.join(self._scratch, "lengths.i32"), "rb") as lengths:
                while block := lengths.read(_COPY_CHUNK // 8):
                    sizes = np.frombuffer(block, np.int32).astype(np.int64) * itemsize
                    ends = np.cumsum(sizes) + carry
                    index.write((ends - sizes).tobytes())
                    carry = int(ends[-1])
            _copy_file(os.path.join(self._scratch, "documents.i64"), index)
            if self._modes is not None:
                _copy_file(os.path.join(self._scratch, "modes.i8"), index)

    def publish(self) -> None:
        """Move the finished files to their final names: the .bin first, the .idx that declares it last."""
        os.replace(os.path.join(self._scratch, "data.bin"), bin_path(self.prefix))
        os.replace(os.path.join(self._scratch, "index.idx"), idx_path(self.prefix))
        self._remove_scratch()

    def finalize(self) -> None:
        self.write_index()
        self.publish()

    def abort(self) -> None:
        for stream in (self._bin, self._lengths, self._documents, self._modes):
            if stream is not None and not stream.closed:
                stream.close()
        self._remove_scratch()

    def remove_files(self) -> None:
        """Delete what has been written without closing anything: safe from a signal handler
        that may have interrupted a write (closing the file there would be a reentrant call)."""
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _remove_scratch(self) -> None:
        if not self._closed:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._closed = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None and not self._closed:
            self.finalize()
        else:
            self.abort()


def _copy_file(path: str, destination) -> None:
    with open(path, "rb") as source:
        shutil.copyfileobj(source, destination, _COPY_CHUNK)


def merge_datasets(prefixes: Iterable[str | os.PathLike], output_prefix: str | os.PathLike) -> IndexedDataset:
    """Concatenate datasets (in the given order) into ``output_prefix``, as Megatron's merge tool does."""
    prefixes = [os.fspath(p) for p in prefixes]
    if not prefixes:
        raise ValueError("nothing to merge: no input datasets")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetWriter(output_prefix, first.dtype) as writer:
        for prefix in prefixes:
            writer.add_dataset(prefix)
    return IndexedDataset(output_prefix)


def find_dataset_prefixes(directory: str | os.PathLike) -> list[str]:
    """The prefixes of every complete .bin/.idx pair in ``directory``, sorted by name."""
    directory = Path(directory)
    prefixes = sorted(str(p.with_suffix("")) for p in directory.glob("*.idx"))
    return [p for p in prefixes if os.path.isfile(bin_path(p))]

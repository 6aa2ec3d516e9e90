"""Reading ``mega preprocess`` input as a stream of bounded batches.

JSON Lines (optionally gzip/zstd/bz2/xz-compressed) is read here directly, in blocks of whole
lines that the encoding workers parse themselves, so the main process only moves bytes. Every
other format (JSON arrays, Parquet, CSV, Arrow, plain text, compressed or not) goes through
Hugging Face ``datasets`` in streaming mode, which reads it piece by piece as well. Either way at
most a few batches exist at a time, so memory does not grow with the input.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
FORMATS_BY_SUFFIX = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet",
    ".csv": "csv", ".tsv": "csv", ".arrow": "arrow", ".txt": "text", ".text": "text",
}
FORMATS = ("jsonl", "json", "parquet", "csv", "arrow", "text")


class InputError(ValueError):
    """Input that cannot be read; the message names the file (and line or row)."""


@dataclass
class LineBlock:
    """Whole lines of JSON Lines, undecoded; ``first_line`` is the 1-based number of the first."""

    path: str
    first_line: int
    data: bytes
    progress_bytes: int  # input bytes (compressed, if so) consumed up to the end of this block


@dataclass
class RecordBlock:
    """Rows read by ``datasets``: for each JSON key, one value per row."""

    path: str
    first_line: int  # 1-based row number
    columns: dict[str, list] = field(default_factory=dict)
    progress_bytes: int | None = None
    rows: int = 0


def compression_of(path: str) -> str | None:
    return COMPRESSIONS.get(os.path.splitext(path)[1].lower())


def detect_format(path: str) -> str:
    stem = path[: -len(os.path.splitext(path)[1])] if compression_of(path) else path
    suffix = os.path.splitext(stem)[1].lower()
    fmt = FORMATS_BY_SUFFIX.get(suffix)
    if fmt is None:
        raise InputError(
            f"{path}: cannot tell the format from the name; pass --input-format ({', '.join(FORMATS)})"
        )
    if fmt == "json":
        # A .json file holding one object per line is JSON Lines; an array or object is for datasets.
        raw, stream = open_binary(path)
        with raw, stream:
            head = stream.read(4096).lstrip()
        fmt = "json" if head[:1] == b"[" else "jsonl"
    return fmt


def open_binary(path: str) -> tuple[io.BufferedReader, io.IOBase]:
    """``(raw, stream)``: the file on disk and the decompressed bytes read through it."""
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory") from None
    compression = compression_of(path)
    if compression == "gzip":
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "bz2":
        return raw, bz2.BZ2File(raw, "rb")
    if compression == "xz":
        return raw, lzma.LZMAFile(raw, "rb")
    if compression == "zstd":
        try:
            # optional dependency: the [zstd] / [hf] extra
            import zstandard
        except ImportError:
            raw.close()
            raise InputError(f"{path}: reading .zst files needs the zstandard package") from None
        return raw, io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw, raw


def read_jsonl_blocks(path: str, block_bytes: int = 1 << 20) -> Iterator[LineBlock]:
    """Blocks of about ``block_bytes`` that end at a line end (a longer line is one block)."""
    raw, stream = open_binary(path)
    try:
        line = 1
        carry = b""
        while True:
            try:
                chunk = stream.read(block_bytes)
            except Exception as error:  # gzip, lzma, bz2 and zstandard each raise their own
                raise InputError(f"{path}: cannot be decompressed after line {line} ({error})") from None
            if not chunk:
                break
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            block, carry = data[:cut], data[cut:]
            yield LineBlock(path, line, block, raw.tell())
            line += block.count(b"\n")
        if carry:
            yield LineBlock(path, line, carry, raw.tell())
    finally:
        stream.close()
        raw.close()


_DATASETS_BUILDER = {"json": "json", "parquet": "parquet", "csv": "csv", "arrow": "arrow", "text": "text"}


def read_records(path: str, fmt: str, keys: list[str], rows_per_block: int = 2048) -> Iterator[RecordBlock]:
    """Rows of ``path`` through ``datasets.load_dataset(..., streaming=True)``."""
    try:
        # optional dependency, as above
        import datasets
    except ImportError:
        raise InputError(
            f"{path}: reading {fmt} input needs Hugging Face datasets (pip install -c constraints.txt -e 'packages/data[hf]', from the mega repository); "
            f"JSON Lines needs nothing extra"
        ) from None
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    datasets.disable_progress_bars()
    extra = {"delimiter": "\t"} if fmt == "csv" and ".tsv" in path.lower() else {}
    try:
        stream = datasets.load_dataset(
            _DATASETS_BUILDER[fmt], data_files=[path], split="train", streaming=True, **extra
        )
        rows = iter(stream)
        block = RecordBlock(path, 1, {key: [] for key in keys})
        number = 0
        for number, row in enumerate(rows, 1):
            if number == 1:
                missing = [key for key in keys if key not in row]
                if missing:
                    raise InputError(
                        f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(row)}); "
                        f"choose them with --json-keys"
                    )
            for key in keys:
                block.columns[key].append(row[key])
            block.rows += 1
            if block.rows == rows_per_block:
                yield block
                block = RecordBlock(path, number + 1, {key: [] for key in keys})
        if block.rows:
            yield block
    except InputError:
        raise
    except Exception as error:
        raise InputError(f"{path}: cannot be read as {fmt} ({type(error).__name__}: {error})") from None

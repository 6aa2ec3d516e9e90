"""Reading and writing safetensors files one tensor at a time, with plain file reads and writes.

The format: an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` and the tensors' bytes back to back.
The ``safetensors`` library maps the whole file and its writer wants every tensor in memory;
reading with seek + readinto and writing each tensor as it is produced keeps a converter's
memory at one tensor however large the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A header larger than this is not a safetensors header (the library's own limit).
MAX_HEADER_BYTES = 100_000_000


class SafetensorsError(ValueError):
    """A file that is not a complete safetensors file; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # of the first byte, from the start of the file
    nbytes: int


def tensor_nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


class SafetensorsReader:
    """The header of one file, and its tensors read one at a time (the file stays open)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        try:
            self.tensors, self.metadata = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict]:
        file_size = self.path.stat().st_size
        prefix = self._file.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{self.path}: {file_size} bytes is too short for a safetensors file")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(MAX_HEADER_BYTES, file_size - 8):
            raise SafetensorsError(f"{self.path}: header length {header_size} does not fit a file of {file_size} bytes")
        try:
            header = json.loads(self._file.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise SafetensorsError(f"{self.path}: the header is not JSON ({error})") from None
        metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + header_size, file_size - 8 - header_size
        tensors = {}
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(size) for size in entry["shape"])
                begin, end = (int(offset) for offset in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: tensor {name!r} has a malformed header entry {entry}") from None
            if end - begin != tensor_nbytes(shape, dtype) or not 0 <= begin <= end <= data_size:
                raise SafetensorsError(f"{self.path}: tensor {name!r} ({entry['dtype']} {list(shape)}) spans "
                                       f"bytes [{begin}, {end}) of {data_size}; the file is truncated or corrupt")
            tensors[name] = TensorInfo(shape, dtype, data_start + begin, end - begin)
        self._check_coverage(tensors, data_start, data_size)
        return tensors, metadata

    def _check_coverage(self, tensors: dict[str, TensorInfo], data_start: int, data_size: int) -> None:
        """The tensors tile the data exactly, as the library requires: no gap, no overlap, no
        trailing bytes (which would mean a header that does not describe the file)."""
        covered = 0
        for name, info in sorted(tensors.items(), key=lambda item: (item[1].offset, item[1].nbytes)):
            begin = info.offset - data_start
            if begin != covered:
                what = "overlaps the tensor before it" if begin < covered else f"leaves bytes [{covered}, {begin}) unused"
                raise SafetensorsError(f"{self.path}: tensor {name!r} at bytes [{begin}, {begin + info.nbytes}) {what}")
            covered += info.nbytes
        if covered != data_size:
            raise SafetensorsError(f"{self.path}: {data_size - covered} bytes follow the last tensor; "
                                   "the header does not describe the whole file")

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        buffer = torch.empty(info.nbytes, dtype=torch.uint8)
        self._file.seek(info.offset)
        if self._file.readinto(buffer.numpy()) != info.nbytes:
            raise SafetensorsError(f"{self.path}: tensor {name!r} is cut short")
        return buffer.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class TensorToWrite:
    """A tensor a writer asks for only when its turn comes: ``produce() -> Tensor``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


def write_safetensors(path: Path, tensors: list[TensorToWrite], metadata: dict[str, str] | None = None,
                      on_written: Callable[[TensorToWrite], None] | None = None) -> None:
    """Write ``tensors`` in order, producing each just before its bytes are written."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensor data starts 8-byte aligned, as the library writes
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for tensor in tensors:
            value = tensor.produce()
            if tuple(value.shape) != tensor.shape or value.dtype != tensor.dtype:
                raise ValueError(f"{tensor.name}: produced {value.dtype} {list(value.shape)}, "
                                 f"expected {tensor.dtype} {list(tensor.shape)}")
            file.write(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if on_written is not None:
                on_written(tensor)

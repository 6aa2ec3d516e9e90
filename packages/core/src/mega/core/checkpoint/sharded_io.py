"""Writing and reading global tensors as pieces through ``torch.distributed.checkpoint`` (DCP).

Each key of a checkpoint is one global tensor. A rank offers the pieces of it that it holds as a
:class:`ShardedEntry`; DCP writes each distinct piece once (replicas on other ranks are
deduplicated) into ``__{rank}_{n}.distcp`` files with a ``.metadata`` index, and on load reads,
for every piece a rank wants, the overlapping parts of whatever pieces were saved, which is
what lets a checkpoint load at any other layout.

Nothing here unpickles arbitrary objects: tensors are read by DCP with ``weights_only=True``,
we never store non-tensor objects through DCP, and DCP's ``.metadata`` index (a pickle) is read
by an unpickler that accepts only DCP's own metadata classes.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from mega.core.checkpoint.metadata import DCP_METADATA_FILE, CheckpointError
from mega.core.parallel.pieces import Piece


class LazyTensor:
    """A tensor to write that is made only when DCP writes it (conversion reads its source then),
    so writing a checkpoint holds one tensor at a time rather than the model."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, produce: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self.produce = tuple(shape), dtype, produce

    def __call__(self) -> torch.Tensor:
        tensor = self.produce()
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"lazy tensor produced shape {tuple(tensor.shape)}, declared {self.shape}")
        return tensor.to(self.dtype)


@dataclass
class ShardedEntry:
    """The pieces of one global tensor that this rank writes or fills."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece | tuple[LazyTensor, tuple[int, ...]]]

    def _piece_at(self, offsets: torch.Size):
        for piece in self.pieces:
            at = piece.offsets if isinstance(piece, Piece) else piece[1]
            if tuple(at) == tuple(offsets):
                return piece
        raise KeyError(f"no piece at offsets {tuple(offsets)}")

    def _sizes(self, piece) -> tuple[int, ...]:
        return tuple(piece.data.shape) if isinstance(piece, Piece) else piece[0].shape

    # -- the hooks DCP's planners call on objects that are neither tensors nor DTensors --------
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        items = []
        for piece in self.pieces:
            offsets = torch.Size(piece.offsets if isinstance(piece, Piece) else piece[1])
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(self._sizes(piece))),
                    properties=TensorProperties(dtype=self.dtype),
                    size=torch.Size(self.global_shape),
                ),
            ))
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.data.shape))
                for p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        piece = self._piece_at(index.offset)
        return piece.data if isinstance(piece, Piece) else piece[0]()


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's own set-up walks the state dict to materialise meta tensors and drops values of
        # types it does not know (ours); there is nothing to materialise here.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts DCP's metadata classes, torch sizes and dtypes, and plain containers only."""

    _ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
    _ALLOWED = {
        ("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
        ("torch.serialization", "_get_layout"),
        # DCP records the checkpoint's path in the index.
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str):
        if module.startswith(self._ALLOWED_MODULES) or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which is not DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with its ``.metadata`` index read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / DCP_METADATA_FILE
        data = path.read_bytes()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as error:  # a damaged pickle fails in any of a dozen ways; all mean the same
            raise CheckpointError(f"{path} (the checkpoint's tensor index) is damaged: "
                                  f"{type(error).__name__}: {error}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold torch.distributed.checkpoint metadata; it is damaged")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_index(path: Path) -> dict[str, TensorStorageMetadata]:
    """The global tensors of a checkpoint directory: key -> DCP's metadata (size, dtype, chunks)."""
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    return {key: md for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def save_entries(path: Path, entries: dict[str, ShardedEntry], process_group=None, *,
                 file_per_tensor: bool = False) -> None:
    """Write ``entries`` (the same keys on every rank of ``process_group``) into ``path``.

    ``file_per_tensor``: one ``.distcp`` file per piece instead of one per rank. DCP's writer
    keeps every tensor of a file alive until the file is closed, so lazy tensors written into
    one file would all be held at once; a file each frees every tensor once it is written.
    """
    writer = FileSystemWriter(str(path), sync_files=True, single_file_per_rank=not file_per_tensor)
    with _single_process_quietly():
        try:
            dcp.save(entries, storage_writer=writer, planner=_SavePlanner(),
                     process_group=process_group, no_dist=not torch.distributed.is_initialized())
        except CheckpointException as error:
            refused = _refused_plan(error)
            if refused is None:
                raise
            raise IncompleteSave(path, refused) from None


# DCP refuses a save whose ranks' pieces leave part of a tensor out ("key:K invalid fill
# tensor-volume: T chunks-volume: C") or overlap, before it writes anything, on every rank.
_INVALID_FILL = re.compile(r"key:(\S+) invalid fill tensor-volume: (\d+) chunks-volume: (\d+)")


def _refused_plan(error: CheckpointException) -> list[str] | None:
    """What DCP's check of the ranks' pieces found, said as completeness.py says it (None when
    ``error`` is another failure)."""
    for failure in error.failures.values():
        text = str(failure[0])
        if "Failed to validate global plan" in text:
            fills = _INVALID_FILL.findall(text)
            if not fills:
                return [text]
            return [f"{key}: its pieces cover {chunks} of its {total} elements" for key, total, chunks in fills]
    return None


class IncompleteSave(CheckpointError):
    """A save whose ranks did not write every tensor it records, whole; raised on every rank
    before the checkpoint is published."""

    def __init__(self, staging: Path, problems: list[str]):
        super().__init__(f"the save into {staging} missed state, so it was not published (the previous checkpoint "
                         "and the tracker are unchanged): it " + "; ".join(problems))


def load_entries(path: Path, entries: dict[str, ShardedEntry], process_group=None, *, alone: bool = False) -> None:
    """Fill the pieces of ``entries`` from ``path``: every rank of ``process_group`` together, or
    this process on its own (``alone``)."""
    with _single_process_quietly():
        dcp.load(entries, storage_reader=SafeFileSystemReader(str(path)), planner=_LoadPlanner(),
                 process_group=process_group, no_dist=alone or not torch.distributed.is_initialized())


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns whenever it runs without torch.distributed, which is our normal one-process case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

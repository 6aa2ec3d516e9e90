"""Model weights in and out of checkpoints without a training run: for conversion and serving.

* :func:`tensor_shapes` / :func:`read_tensors`: a checkpoint's model tensors at their global
  shapes, by Megatron-Core name, read a few at a time (a converter reads layer by layer).
* :func:`write_checkpoint`: a complete weights-only (``release``) checkpoint from global tensors,
  each made only when written when it is a :class:`LazyTensor`.
* :func:`load_model_weights`: fill stage modules built at any tp/pp layout, from a checkpoint or
  from any source of global tensors (a Hugging Face directory opened by a converter).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from mega.core.checkpoint import space
from mega.core.checkpoint.completeness import check_complete, confirm_written
from mega.core.checkpoint.directory import (
    RELEASE,
    checkpoint_and_metadata,
    iteration_name,
    publish,
    remove_leftovers,
    resolve_checkpoint,
    staging_path,
)
from mega.core.checkpoint.metadata import CheckpointMetadata
from mega.core.checkpoint.sharded_io import LazyTensor, ShardedEntry, load_entries, read_index, save_entries
from mega.core.checkpoint.state import MODEL, OPTIMIZER, model_entries, prepare_optional
from mega.core.checkpoint.tokenizer_files import copy_tokenizer_files, tokenizer_entry
from mega.core.checkpoint.validate import check_entries, zero_rows_beyond
from mega.core.parallel.pieces import Piece
from mega.core.tokenizer import TokenizerSpec


class TensorSource(Protocol):
    """Global tensors by Megatron-Core name (vocabulary tensors may have any number of rows)."""

    def get(self, name: str) -> torch.Tensor: ...


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    index = read_index(resolve_checkpoint(path))
    return {key[len(MODEL):]: (tuple(md.size), md.properties.dtype) for key, md in index.items()
            if key.startswith(MODEL)}


def read_tensors(path: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """The global model tensors ``names`` of a checkpoint."""
    directory, metadata = checkpoint_and_metadata(path, checksums=False)
    index = read_index(directory)
    missing = [name for name in names if MODEL + name not in index]
    if missing:
        raise KeyError(f"{directory} has no model tensor(s) {', '.join(missing)}")
    check_complete(directory, metadata, index, optimizer=False, only={MODEL + name for name in names})
    tensors = {name: torch.empty(tuple(index[MODEL + name].size), dtype=index[MODEL + name].properties.dtype)
               for name in names}
    entries = {MODEL + name: ShardedEntry(tuple(t.shape), t.dtype, [Piece(t, (0,) * t.dim())])
               for name, t in tensors.items()}
    load_entries(directory, entries, alone=True)
    return tensors


def write_checkpoint(save_dir: str | os.PathLike, metadata: CheckpointMetadata,
                     tensors: dict[str, torch.Tensor | LazyTensor], tokenizer: TokenizerSpec | None = None,
                     tokenizer_files: Sequence[Path] = (),
                     optimizer: dict[str, torch.Tensor | LazyTensor] | None = None) -> Path:
    """Write ``tensors`` (global, by model parameter name) as the ``release`` checkpoint of
    ``save_dir`` and point its tracker at it; on any error nothing new is left behind.

    ``optimizer``: optimizer state by ``<parameter name>.<state key>`` (``metadata.optimizer``
    describes it); a checkpoint with it is the checkpoint of ``metadata.iteration``, which
    ``mega train --load`` resumes (optimizer and all), where a release gives weights only.

    ``tokenizer_files``: more files for ``tokenizer/`` beside those ``tokenizer`` names (a Hugging
    Face tokenizer's ``tokenizer_config.json``, ``special_tokens_map.json``...), kept by name.
    """
    save_dir = Path(save_dir)
    created = not save_dir.exists()
    saved_as = RELEASE if optimizer is None else iteration_name(metadata.iteration)
    staging = staging_path(save_dir, saved_as)
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(save_dir)
        staging.mkdir()
        copy_tokenizer_files(tokenizer, staging, tokenizer_files)
        metadata.tokenizer = tokenizer_entry(tokenizer)
        entries = {}
        for name, tensor in tensors.items():
            zeros = (0,) * len(tensor.shape)
            piece = Piece(tensor, zeros) if isinstance(tensor, torch.Tensor) else (tensor, zeros)
            entries[MODEL + name] = ShardedEntry(tuple(tensor.shape), tensor.dtype, [piece])
        for key, tensor in (optimizer or {}).items():
            zeros = (0,) * len(tensor.shape)
            piece = Piece(tensor, zeros) if isinstance(tensor, torch.Tensor) else (tensor, zeros)
            entries[OPTIMIZER + key] = ShardedEntry(tuple(tensor.shape), tensor.dtype, [piece])
        # A file per tensor: memory stays at one (lazy) tensor, not the whole model.
        metadata.tensors = {key: list(entry.global_shape) for key, entry in entries.items()}
        with space.removed_if_failed(staging, space.entries_bytes(entries)):
            save_entries(staging, entries, file_per_tensor=True)
            confirm_written(staging, metadata.tensors)
        return publish(save_dir, saved_as, metadata, RELEASE if optimizer is None else str(metadata.iteration))
    except BaseException:
        shutil.rmtree(save_dir if created else staging, ignore_errors=True)
        raise


def load_model_weights(source: str | os.PathLike | TensorSource, modules: list[nn.Module], groups=None) -> None:
    """Fill ``modules`` (this rank's stages, tensor-parallel already applied over ``groups``)
    from a checkpoint path or a :class:`TensorSource`. Each rank reads only its own pieces."""
    entries = model_entries(modules, groups.tp if groups is not None else None)
    if isinstance(source, (str, os.PathLike)):
        directory, metadata = checkpoint_and_metadata(source, checksums=False)
        index = read_index(directory)
        check_complete(directory, metadata, index, optimizer=False)
        extra_state = prepare_optional(entries, index)
        check_entries(directory, entries, index)
        zero_rows_beyond(entries, index)
        load_entries(directory, entries.entries, alone=True)
        for module, extra in extra_state:
            module.set_extra_state(extra)
    else:
        # A foreign source (a Hugging Face directory) has no buffers or extra state: modules keep theirs.
        for key in entries.optional:
            del entries.entries[key], entries.sources[key]
        with torch.no_grad():
            for key, entry in entries.entries.items():
                _fill_from_global(entry, source.get(key[len(MODEL):]), key, padded_vocab=entries.sources[key][1])
    with torch.no_grad():
        for first, copy in entries.duplicates:
            copy.copy_(first)


def _fill_from_global(entry: ShardedEntry, tensor: torch.Tensor, key: str, padded_vocab: bool) -> None:
    fits = tuple(tensor.shape[1:]) == entry.global_shape[1:] if padded_vocab else tuple(tensor.shape) == entry.global_shape
    if not fits:
        raise ValueError(f"{key}: source shape {list(tensor.shape)} does not fit {list(entry.global_shape)}")
    for piece in entry.pieces:
        first_row, rows = piece.offsets[0], piece.data.shape[0]
        present = max(0, min(rows, tensor.shape[0] - first_row))  # vocabulary rows the source has
        if present < rows:
            piece.data[present:].zero_()
        if present:
            region = tensor.narrow(0, first_row, present)
            for dim in range(1, tensor.dim()):
                region = region.narrow(dim, piece.offsets[dim], piece.data.shape[dim])
            piece.data[:present].copy_(region)

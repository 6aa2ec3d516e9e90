"""Reading Megatron-LM's torch_dist checkpoints (megatron-core ``dist_checkpointing``): a
``torch.distributed.checkpoint`` directory (``.metadata``, ``__R_S.distcp``) of global tensors, plus
``common.pt`` (args, iteration) and ``metadata.json`` (the backend).

Keys are Megatron-Core's, with its Transformer Engine names for the norms
(``decoder.layers.self_attention.linear_qkv.layer_norm_weight``) and the layer dimension stacked
in front (``[num_layers, ...]`` under ``decoder.layers.<rest>``), or one key per layer
(``decoder.layers.N.<rest>``). A tied output layer is saved under its own key too (a copy). Modules' ``_extra_state``
are byte objects (``<module>._extra_state/shard_<layer>_<layers>``).

Reading takes one layer's slice of a stacked tensor at a time, so memory stays at one layer's
tensors (:mod:`.write_torch_dist` writes them).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.buffer_optimizer import BufferOptimizer
from mega.ckpt_convert.megatron.chained import unchained
from mega.ckpt_convert.megatron.directory import COMMON_FILE, MegatronCheckpoint, read_dist_config
from mega.ckpt_convert.megatron.names import mega_name, names_for, split_stack_layer
from mega.ckpt_convert.megatron.pickles import load_megatron_pickle
from mega.ckpt_convert.megatron.source import MegatronSource
from mega.ckpt_convert.megatron.torch_dist_optimizer import BUFFER_LAYOUT, read_optimizer_state
from mega.core.checkpoint import CheckpointError
from mega.core.checkpoint.sharded_io import SafeFileSystemReader, ShardedEntry, load_entries
from mega.core.parallel.pieces import Piece

NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine_state")


def check_file_sizes(directory: Path, metadata) -> None:
    """Every ``.distcp`` file holds the bytes the index places in it (a truncated or missing file
    is named here, not as an error deep inside a read)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise ConversionError(f"{path} is missing; {directory / '.metadata'} places tensors in it")
        actual = path.stat().st_size
        if actual < size:
            raise ConversionError(f"{path} has {actual} bytes, but {directory / '.metadata'} places data up to byte "
                                  f"{size}: the file is truncated")


def read_index(directory: Path):
    try:
        metadata = SafeFileSystemReader(str(directory)).read_metadata()
    except FileNotFoundError:
        raise ConversionError(f"{directory / '.metadata'} is missing; the torch_dist checkpoint is incomplete") \
            from None
    except CheckpointError as error:
        raise ConversionError(str(error)) from None
    check_file_sizes(directory, metadata)
    return metadata


class TorchDistSource(MegatronSource):
    kind = "torch_dist (dist_checkpointing)"

    def __init__(self, checkpoint: MegatronCheckpoint, model_family: str | None, allow_unused: bool = False):
        directory, self.allow_unused = checkpoint.directory, allow_unused
        read_dist_config(directory)
        common_path = directory / COMMON_FILE
        common = load_megatron_pickle(common_path)
        if not isinstance(common, dict):
            raise ConversionError(f"{common_path} holds a {type(common).__name__}, not Megatron's common state dict")
        metadata = read_index(directory)
        self._setup(directory, common.get("args"), common.get("iteration"), str(common_path), model_family,
                    metadata.state_dict_metadata)
        names = names_for(self.family)
        self._index = {key: md for key, md in metadata.state_dict_metadata.items()
                       if isinstance(md, TensorStorageMetadata) and not unchained(key).startswith(NOT_MODEL)}
        copies: dict[str, str] = {}
        self._keys, shapes = self.map_keys(self._index, names, "", copies)
        self._found = {name: (shape, dtype, directory / ".metadata") for name, (shape, dtype) in shapes.items()}
        self._check(str(directory))
        self._check_copies(copies)
        self._common, self._metadata = common, metadata

    def map_keys(self, index: dict, names, prefix: str, copies: dict[str, str] | None = None):
        """mega name -> (key, layer in a stacked key) and mega name -> (shape, dtype) of the
        tensors of ``index`` under ``prefix``; ``copies`` gets key -> mega name of each second copy
        of a tensor (a tied output layer's, a second name), which is left out."""
        keys: dict[str, tuple[str, int | None]] = {}
        shapes = {}
        tied = not self.config.untie_embeddings_and_output_weights
        for key, md in index.items():
            if not key.startswith(prefix):
                continue
            file_key = key[len(prefix):]
            if tied and file_key in names.tied_copies:  # the tied output layer under its own key
                (copies if copies is not None else {})[key] = "embedding.word_embeddings.weight"
                continue
            if file_key in names.duplicate_keys:  # a second name of a tensor held under its first
                (copies if copies is not None else {})[key] = names.duplicate_keys[file_key]
                continue
            size, dtype = tuple(md.size), md.properties.dtype
            stack = next((prefix for prefix in names.stacks if file_key.startswith(prefix)), None)
            stacked = stack is not None and split_stack_layer(file_key) is None
            for layer in range(size[0]) if stacked else (None,):
                file_name = file_key if layer is None else f"{stack}{layer}.{file_key[len(stack):]}"
                name = mega_name(names, file_name)
                if name in keys:
                    raise ConversionError(f"{self.directory}: {key} and {keys[name][0]} both hold {name}")
                keys[name] = (key, layer)
                shapes[name] = (size[1:] if stacked else size, dtype)
        return keys, shapes

    def _check_copies(self, copies: dict[str, str]) -> None:
        """Each second copy equals the tensor it repeats, or it is a tensor the conversion does not use."""
        for key, original in copies.items():
            if original not in self._keys:
                self._unused([key], f"a second copy of {original}, which the model of its args does not have")
                continue
            copy, first = self._read(key, None, self._index), self.get(original)
            if copy.shape != first.shape or not torch.equal(copy, first):
                self._unused([key], f"which differs from {original}, the tensor it is a copy of in the model of its "
                                    "args (untie_embeddings_and_output_weights="
                                    f"{self.config.untie_embeddings_and_output_weights})")

    def _read(self, key: str, layer: int | None, index: dict) -> torch.Tensor:
        md = index[key]
        size = tuple(md.size)
        if layer is None:
            buffer, offsets = torch.empty(size, dtype=md.properties.dtype), (0,) * len(size)
        else:
            buffer, offsets = torch.empty((1, *size[1:]), dtype=md.properties.dtype), (layer,) + (0,) * (len(size) - 1)
        entries = {key: ShardedEntry(size, md.properties.dtype, [Piece(buffer, offsets)])}
        load_entries(self.directory, entries, alone=True)
        return buffer if layer is None else buffer[0]

    def optimizer_state(self):
        if getattr(self, "_optimizer", None) is None:
            if any(unchained(key).startswith(BUFFER_LAYOUT) for key in self._metadata.state_dict_metadata):
                self._optimizer = BufferOptimizer(self, self._metadata)
            else:
                self._optimizer = read_optimizer_state(self, self._common, self._metadata, names_for(self.family))
        return self._optimizer.state

    def get_optimizer(self, name: str, key: str) -> torch.Tensor:
        self.optimizer_state()
        if hasattr(self._optimizer, "get"):  # the distributed optimizer's buffers
            return self._optimizer.get(name, key)
        index_key, layer = self._optimizer.keys[key][name]
        stored = self._optimizer.stored_keys.get(index_key, index_key)
        return self._read(stored, layer, {stored: self._optimizer.index[index_key]})

    def get(self, name: str) -> torch.Tensor:
        key, layer = self._keys[name]
        return self._read(key, layer, self._index)

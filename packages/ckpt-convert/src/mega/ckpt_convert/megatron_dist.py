"""Megatron-LM's torch_dist checkpoints (megatron-core ``dist_checkpointing``): a
``torch.distributed.checkpoint`` directory (``.metadata``, ``__R_S.distcp``) of global tensors, plus
``common.pt`` (args, iteration) and ``metadata.json`` (the backend).

Keys are Megatron-Core's, with its Transformer Engine names for the norms
(``decoder.layers.self_attention.linear_qkv.layer_norm_weight``) and the layer dimension stacked
in front (``[num_layers, ...]`` under ``decoder.layers.<rest>``), or one key per layer
(``decoder.layers.N.<rest>``). A tied output layer is saved under its own key too (a copy). Modules' ``_extra_state``
are byte objects (``<module>._extra_state/shard_<layer>_<layers>``).

Reading takes one layer's slice of a stacked tensor at a time; writing produces each layer's
slice when DCP writes it, so memory stays at one layer's tensors either way.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron_args import args_for
from mega.ckpt_convert.megatron_directory import (
    COMMON_FILE,
    DIST_CONFIG,
    TORCH_DIST,
    TRACKER_FILE,
    MegatronCheckpoint,
    iteration_dir_name,
    read_dist_config,
)
from mega.ckpt_convert.megatron_layout import TensorLayout, model_layouts
from mega.ckpt_convert.megatron_names import (
    LAYER_PREFIX,
    mega_name,
    names_for,
    split_stack_layer,
    stack_sizes,
)
from mega.ckpt_convert.megatron_pickle import load_megatron_pickle
from mega.ckpt_convert.megatron_source import MegatronSource
from mega.ckpt_convert.optimizer_state import MAIN_PARAM
from mega.core.checkpoint import CheckpointError
from mega.core.checkpoint.sharded_io import LazyTensor, SafeFileSystemReader, ShardedEntry, load_entries
from mega.core.parallel.pieces import Piece

CHECKPOINT_VERSION = 3.0
DIST_CONFIG_CONTENT = {"sharded_backend": TORCH_DIST, "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine_state")
_CHAINED = re.compile(r"chained_\d+\.")


def unchained(key: str) -> str:
    """A key without the ``chained_N.`` prefix megatron-core's chained optimizer (MoE: a second
    optimizer for the experts) gives each optimizer's state."""
    match = _CHAINED.match(key)
    return key[match.end():] if match else key


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

    def __init__(self, checkpoint: MegatronCheckpoint, model_family: str | None):
        directory = checkpoint.directory
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
        self._keys, shapes = self.map_keys(self._index, names, "")
        self._found = {name: (shape, dtype, directory / ".metadata") for name, (shape, dtype) in shapes.items()}
        self._check(str(directory))
        self._common, self._metadata = common, metadata

    def map_keys(self, index: dict, names, prefix: str):
        """mega name -> (key, layer in a stacked key) and mega name -> (shape, dtype) of the
        tensors of ``index`` under ``prefix``."""
        keys: dict[str, tuple[str, int | None]] = {}
        shapes = {}
        tied = not self.config.untie_embeddings_and_output_weights
        for key, md in index.items():
            if not key.startswith(prefix):
                continue
            file_key = key[len(prefix):]
            if tied and file_key in names.tied_copies:  # megatron-core saves the tied output layer under its own key
                continue
            if file_key in names.duplicate_keys:  # a second name of a tensor held under its first
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
        from mega.ckpt_convert.megatron_optimizer import BUFFER_LAYOUT, read_optimizer_state

        if getattr(self, "_optimizer", None) is None:
            if any(unchained(key).startswith(BUFFER_LAYOUT) for key in self._metadata.state_dict_metadata):
                from mega.ckpt_convert.megatron_distopt import BufferOptimizer

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


# What a Megatron-Core module without FP8 state saves as its ``_extra_state`` object: the list of
# the objects' data under one key (one object, None), which DCP's writer torch.saves as bytes.
EMPTY_EXTRA_STATE = [None]


def _file_key(names, rest: str) -> str:
    """The Megatron-Core (Transformer Engine) name of a layer-local mega name."""
    reverse = {mega: te for te, mega in names.layer_aliases.items()}
    return reverse.get(rest, rest)


def write_torch_dist(source, family, directory: Path, tp: int, pp: int, iteration: int | None,
                     optimizer=None, distributed: bool = False) -> None:
    """``source`` as a torch_dist checkpoint Megatron-LM loads at tp x pp (the vocabulary is padded
    for ``tp``; the rest of the checkpoint is layout-free) in ``directory`` (a new save directory);
    with ``optimizer`` (an :class:`~mega.ckpt_convert.optimizer_state.OptimizerState` of the
    source), the state megatron-core's regular optimizer saves too, or with ``distributed`` its
    distributed optimizer's (:func:`~mega.ckpt_convert.megatron_optimizer.distributed_common_optimizer`)."""
    from mega.ckpt_convert.megatron_optimizer import (
        DISTRIBUTED_MAIN_PARAM_KEY,
        STATE_PREFIX,
        TO_MEGATRON,
        common_optimizer,
        distributed_common_optimizer,
    )

    config = source.config
    layouts: dict[str, TensorLayout] = model_layouts(family, config, tp)
    names = names_for(family.name)
    num_layers = config.num_layers
    stacks = stack_sizes(names, layouts)
    entries = _tensor_entries(source.get, source.dtype, layouts, names, stacks, "")
    if not config.untie_embeddings_and_output_weights:  # megatron-core loads a tied output layer by its own key
        layout = layouts["embedding.word_embeddings.weight"]
        entries["output_layer.weight"] = ShardedEntry(layout.shape, source.dtype("embedding.word_embeddings.weight"), [
            (_lazy(source.get, source.dtype, "embedding.word_embeddings.weight", layout), (0,) * len(layout.shape))])
    for key, name in names.duplicate_keys.items():
        if name in entries:
            entries[key] = entries[name]
    # Megatron's state key -> the tensor of a mega name it holds
    state = {TO_MEGATRON[key]: functools.partial(source.get_optimizer, key=key)
             for key in (optimizer.keys if optimizer is not None else ())}
    if distributed:  # its main parameters under their own key, of an fp32 model too (the weights themselves)
        state[DISTRIBUTED_MAIN_PARAM_KEY] = state.pop(TO_MEGATRON[MAIN_PARAM], source.get)
    for state_key, get in state.items():
        entries.update(_tensor_entries(lambda name, g=get: g(name).float(), lambda name: torch.float32,
                                       layouts, names, stacks, f"{STATE_PREFIX}{state_key}."))
    for stack, size in stacks.items():
        for module in names.extra_state_layer_modules:
            if f"{stack}0.{module}.weight" in layouts:
                for n in range(size):
                    entries[f"{stack}{module}._extra_state/shard_{n}_{size}"] = EMPTY_EXTRA_STATE
    for module in names.extra_state_modules:
        entries[f"{module}._extra_state/shard_0_1"] = EMPTY_EXTRA_STATE
    experts = getattr(config, "num_experts", 0) if names.expert_patterns else 0
    for part in names.expert_extra_state_parts:  # an object per layer and expert
        for n in range(num_layers):
            for e in range(experts):
                entries[f"{LAYER_PREFIX}mlp.experts.experts.{part}._extra_state/shard_{n}.{e}_{num_layers}.{experts}"] \
                    = EMPTY_EXTRA_STATE
    checkpoint_dir = directory / iteration_dir_name(iteration)
    checkpoint_dir.mkdir(parents=True)
    args = args_for(config, tp, pp, config.padded_vocab_size(tp), iteration or 0, TORCH_DIST, source.tokenizer)
    if optimizer is not None:
        args.consumed_train_samples = optimizer.consumed_samples
    with open(checkpoint_dir / COMMON_FILE, "wb") as stream:
        common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0}
        if optimizer is not None and distributed:
            common["optimizer"], common["content_metadata"] = distributed_common_optimizer(optimizer)
        elif optimizer is not None:
            common["optimizer"] = common_optimizer(optimizer)
        if optimizer is not None and "schedule" in optimizer.hyperparameters:  # Megatron-LM's load_checkpoint requires it
            common["opt_param_scheduler"] = optimizer.hyperparameters["schedule"]
        torch.save(common, stream)
    save_dcp(checkpoint_dir, entries)
    (checkpoint_dir / DIST_CONFIG).write_text(json.dumps(DIST_CONFIG_CONTENT))
    (directory / TRACKER_FILE).write_text(f"{iteration if iteration is not None else 'release'}\n")


def _tensor_entries(get, dtype, layouts: dict[str, TensorLayout], names, stacks: dict[str, int], prefix: str) -> dict:
    """Entries for every tensor ``get(name)`` gives, each stack's layers stacked under one key
    (``stacks``: prefix -> layers), keys under ``prefix``."""
    entries: dict[str, object] = {}
    stacked: dict[str, list[str]] = {}  # key -> the mega names of its layers, in order
    for name, layout in layouts.items():
        layer = split_stack_layer(name)
        if layer is None or layer[0] not in stacks:
            entries[prefix + name] = ShardedEntry(layout.shape, dtype(name), [
                (_lazy(get, dtype, name, layout), (0,) * len(layout.shape))])
        else:
            stacked.setdefault(layer[0] + _file_key(names, layer[2]), []).append(name)
    for key, layer_names in stacked.items():
        num_layers = stacks[split_stack_layer(layer_names[0])[0]]
        if len(layer_names) != num_layers:
            raise ConversionError(f"{key}: {len(layer_names)} of {num_layers} layers have it; mega writes only "
                                  "models whose layers are alike")
        layout = layouts[layer_names[0]]
        pieces = [(_lazy(get, dtype, name, layout, unsqueeze=True), (n,) + (0,) * len(layout.shape))
                  for n, name in enumerate(layer_names)]
        entries[prefix + key] = ShardedEntry((num_layers, *layout.shape), dtype(layer_names[0]), pieces)
    return entries


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner for global tensors offered as :class:`ShardedEntry` pieces, and objects."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.__get_tensor_shard__(index) if isinstance(value, ShardedEntry) else value


def save_dcp(directory: Path, entries: dict) -> None:
    """Write ``entries`` from this one process, a file per piece: DCP keeps every tensor of a file
    alive until the file is closed, so a file each holds one layer's tensor at a time."""
    writer = FileSystemWriter(str(directory), sync_files=True, single_file_per_rank=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(entries, storage_writer=writer, planner=_SavePlanner(), no_dist=True)


def _lazy(get, dtype, name: str, layout: TensorLayout, unsqueeze: bool = False) -> LazyTensor:
    from mega.ckpt_convert.megatron_legacy import fit_rows

    def produce() -> torch.Tensor:
        tensor = get(name)
        if layout.padded_vocab:
            tensor = fit_rows(tensor, layout.shape[0])
        return tensor[None] if unsqueeze else tensor

    shape = (1, *layout.shape) if unsqueeze else layout.shape
    return LazyTensor(shape, dtype(name), produce)

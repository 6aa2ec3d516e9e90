"""Writing Megatron-LM's torch_dist checkpoints (megatron-core ``dist_checkpointing``) that Megatron-LM
loads at any layout: global tensors, each stack of layers stacked under one key where megatron-core
stacks them (layers alike), else one key per layer (``--moe-layer-freq`` mixing dense and MoE
layers), MTP modules (``mtp.layers.N.*``) one key each, the names megatron-core's local spec
saves (Transformer Engine's for the norms it fuses), ``common.pt`` (args, iteration, the
optimizer's common part) and ``metadata.json``. Each layer's slice is produced when DCP writes it, so memory stays at one
layer's tensors.
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
from torch.distributed.checkpoint.metadata import MetadataIndex

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.args import args_for
from mega.ckpt_convert.megatron.directory import (
    CHECKPOINT_VERSION,
    COMMON_FILE,
    DIST_CONFIG,
    TORCH_DIST,
    TRACKER_FILE,
    iteration_dir_name,
)
from mega.ckpt_convert.megatron.layout import (
    TensorLayout,
    fit_rows,
    is_stacked_experts,
    layers_alike,
    model_layouts,
)
from mega.ckpt_convert.megatron.names import names_for, split_stack_layer, stack_sizes, torch_dist_name
from mega.ckpt_convert.megatron.torch_dist_optimizer import (
    DISTRIBUTED_MAIN_PARAM_KEY,
    STATE_PREFIX,
    TO_MEGATRON,
    common_optimizer,
    distributed_common_optimizer,
)
from mega.ckpt_convert.optimizer_state import MAIN_PARAM
from mega.core.checkpoint.sharded_io import LazyTensor, ShardedEntry

DIST_CONFIG_CONTENT = {"sharded_backend": TORCH_DIST, "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}

# What a Megatron-Core module without FP8 state saves as its ``_extra_state`` object: the list of
# the objects' data under one key (one object, None), which DCP's writer torch.saves as bytes.
EMPTY_EXTRA_STATE = [None]
# An MTP module's layer-local names: its own modules (eh_proj...) and its transformer layer's.
_MTP_MODULE = re.compile(r"(mtp\.layers\.\d+\.(?:transformer_layer\.)?)(.+)")


def write_torch_dist(source, family, directory: Path, tp: int, pp: int, iteration: int | None,
                     optimizer=None, distributed: bool = False) -> None:
    """``source`` as a torch_dist checkpoint Megatron-LM loads at tp x pp (the vocabulary is padded
    for ``tp``; the rest of the checkpoint is layout-free) in ``directory`` (a new save directory);
    with ``optimizer`` (an :class:`~mega.ckpt_convert.optimizer_state.OptimizerState` of the
    source), the state megatron-core's regular optimizer saves too, or with ``distributed`` its
    distributed optimizer's (:func:`~mega.ckpt_convert.megatron.torch_dist_optimizer.distributed_common_optimizer`)."""
    config = source.config
    layouts: dict[str, TensorLayout] = model_layouts(family, config, tp)
    names = names_for(family.name)
    # megatron-core stacks a block's layers under one key only when they are alike; otherwise (and
    # always for MTP modules) each layer has its keys
    stacks = stack_sizes(names, layouts) if layers_alike(config) else {}
    entries = _model_entries(source, layouts, names, stacks)
    entries.update(_optimizer_entries(source, layouts, names, stacks, optimizer, distributed))
    entries.update(_extra_state_entries(layouts, names, stacks))
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


def _model_entries(source, layouts: dict[str, TensorLayout], names, stacks: dict[str, int]) -> dict:
    """The weights' entries, with the keys megatron-core loads besides: a tied output layer's
    own, and the second names of a tensor."""
    entries = _tensor_entries(source.get, source.dtype, layouts, names, stacks, "")
    if not source.config.untie_embeddings_and_output_weights:  # megatron-core loads a tied output layer by its own key
        layout = layouts["embedding.word_embeddings.weight"]
        entries["output_layer.weight"] = ShardedEntry(layout.shape, source.dtype("embedding.word_embeddings.weight"), [
            (_lazy(source.get, source.dtype, "embedding.word_embeddings.weight", layout), (0,) * len(layout.shape))])
    for key, name in names.duplicate_keys.items():
        if name in entries:
            entries[key] = entries[name]
    return entries


def _optimizer_entries(source, layouts: dict[str, TensorLayout], names, stacks: dict[str, int], optimizer,
                       distributed: bool) -> dict:
    """The per-parameter optimizer state's entries (fp32), under Megatron's state keys (frozen
    parameters have none)."""
    # Megatron's state key -> the tensor of a mega name it holds
    state = {TO_MEGATRON[key]: functools.partial(source.get_optimizer, key=key)
             for key in (optimizer.keys if optimizer is not None else ())}
    if distributed:  # its main parameters under their own key, of an fp32 model too (the weights themselves)
        state[DISTRIBUTED_MAIN_PARAM_KEY] = state.pop(TO_MEGATRON[MAIN_PARAM], source.get)
    entries, trained = {}, {name: layout for name, layout in layouts.items() if layout.trained}
    for state_key, get in state.items():
        entries.update(_tensor_entries(lambda name, g=get: g(name).float(), lambda name: torch.float32,
                                       trained, names, stacks, f"{STATE_PREFIX}{state_key}."))
    return entries


def _place(name: str, stacks: dict[str, int]) -> tuple[str | None, str, tuple[int, ...], tuple[int, ...]]:
    """Where megatron-core keeps the mega tensor ``name``: (the prefix of its key, its layer-local
    name, its layer's index and the layers' count in the shards of a stacked key); the prefix is
    None outside layers. A stacked layer's prefix is its stack's; another's (one key per layer, an
    MTP module's) its own."""
    layer = split_stack_layer(name)
    if layer is not None:
        stack, number, rest = layer
        return (stack, rest, (number,), (stacks[stack],)) if stack in stacks else (f"{stack}{number}.", rest, (), ())
    mtp = _MTP_MODULE.fullmatch(name)
    return (mtp.group(1), mtp.group(2), (), ()) if mtp else (None, name, (), ())


def _shard_key(module: str, index: tuple[int, ...], count: tuple[int, ...]) -> str:
    """The key of one ``_extra_state`` object of ``module`` (``index`` of ``count`` along stacked dims)."""
    index, count = index or (0,), count or (1,)
    return f"{module}._extra_state/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, count))}"


def _extra_state_entries(layouts: dict[str, TensorLayout], names, stacks: dict[str, int]) -> dict:
    """The empty ``_extra_state`` objects Megatron-Core's local spec loads strictly: one per linear
    layer's module (per layer of a stack, per expert of a mixture of experts)."""
    entries = {_shard_key(module, (), ()): EMPTY_EXTRA_STATE for module in names.extra_state_modules}
    for name, layout in layouts.items():
        prefix, local, index, count = _place(name, stacks)
        module, _, kind = local.rpartition(".")
        if kind != "weight" or prefix is None:
            continue
        if module in names.extra_state_layer_modules:
            entries[_shard_key(prefix + module, index, count)] = EMPTY_EXTRA_STATE
        elif is_stacked_experts(name) and names.expert_extra_state_parts:
            part, experts = module.rpartition(".")[2], layout.shape[0]
            for expert in range(experts):
                entries[_shard_key(f"{prefix}mlp.experts.experts.{part}", (*index, expert), (*count, experts))] = \
                    EMPTY_EXTRA_STATE
    return entries


def _tensor_entries(get, dtype, layouts: dict[str, TensorLayout], names, stacks: dict[str, int], prefix: str) -> dict:
    """Entries for every tensor ``get(name)`` gives, each stack's layers stacked under one key
    (``stacks``: prefix -> layers), keys under ``prefix``."""
    entries: dict[str, object] = {}
    stacked: dict[str, list[str]] = {}  # key -> the mega names of its layers, in order
    for name, layout in layouts.items():
        layer = split_stack_layer(name)
        if layer is None or layer[0] not in stacks:
            entries[prefix + torch_dist_name(names, name)] = ShardedEntry(layout.shape, dtype(name), [
                (_lazy(get, dtype, name, layout), (0,) * len(layout.shape))])
        else:  # the file's name without the layer number
            stacked.setdefault(layer[0] + torch_dist_name(names, name).split(".", 3)[3], []).append(name)
    for key, layer_names in stacked.items():
        num_layers = stacks[split_stack_layer(layer_names[0])[0]]
        if len(layer_names) != num_layers:
            raise ConversionError(f"{key}: {len(layer_names)} of {num_layers} layers have it, but the model's config "
                                  "makes its layers alike (megatron-core stacks them under one key)")
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
    def produce() -> torch.Tensor:
        tensor = get(name)
        if layout.padded_vocab:
            tensor = fit_rows(tensor, layout.shape[0])
        return tensor[None] if unsqueeze else tensor

    shape = (1, *layout.shape) if unsqueeze else layout.shape
    return LazyTensor(shape, dtype(name), produce)

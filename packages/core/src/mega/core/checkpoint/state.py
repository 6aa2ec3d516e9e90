"""The tensors of a training run as checkpoint entries: ``model.<name>`` and ``optimizer.<name>.<key>``.

Names are the model's global parameter names (layer ``N`` is ``decoder.layers.N`` on any stage),
shapes are global, and every rank offers the pieces it holds, so the same code saves at one
layout and loads at another. Optimizer state follows its parameter: the Adam moments (and the
fp32 main parameters of a bf16/fp16 model) of ``decoder.layers.3.mlp.linear_fc1.weight`` are
``optimizer.decoder.layers.3.mlp.linear_fc1.weight.exp_avg`` etc., whole or, under the
distributed optimizer, the flat slices each data-parallel rank owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mega.core.checkpoint.metadata import CheckpointError
from mega.core.checkpoint.sharded_io import ShardedEntry
from mega.core.optim.optimizer import MainParam, MixedPrecisionOptimizer
from mega.core.parallel.fsdp import shard_pieces
from mega.core.parallel.groups import Group
from mega.core.parallel.param_attrs import is_checkpoint_optional, is_padded_vocab
from mega.core.parallel.pieces import Piece, TensorParallelSplit, tensor_pieces
from mega.core.parameter_names import canonical, canonical_names

MODEL = "model."
BUFFER = "buffer."
OPTIMIZER = "optimizer."
MAIN_PARAM = "main_param"
EXTRA_STATE = "_extra_state"


@dataclass
class Entries:
    """Checkpoint entries of this rank, and the parameters each name stands for."""

    entries: dict[str, ShardedEntry] = field(default_factory=dict)
    # entry key -> the local tensor it was built from and whether dim 0 is the padded vocabulary
    sources: dict[str, tuple[torch.Tensor, bool]] = field(default_factory=dict)
    # copies of an already-listed parameter (tied embeddings on two chunks of one rank)
    duplicates: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)
    # entry key -> module whose ``get_extra_state()`` tensor it holds (a kernel's FP8 scales...)
    extra_state: dict[str, nn.Module] = field(default_factory=dict)
    # keys loaded only when the checkpoint has them (buffers, extra state: kernel-specific)
    optional: set[str] = field(default_factory=set)
    # model keys of parameters that are their own fp32 main parameters (FSDP's shards) and load
    # from the checkpoint's main parameter instead, which a bf16 model entry would round
    main_param_instead: set[str] = field(default_factory=set)
    # whether the model has parameters added after it was built (LoRA adapters, ``optional`` too)
    adapters: bool = False

    def add(self, key: str, tensor: torch.Tensor, param: nn.Parameter, tp: Group | None,
            flat_range: tuple[int, int] | None = None) -> None:
        split = _split(param, tp)
        shape = tuple(param.shape)
        if isinstance(tensor, DTensor):  # an FSDP shard (of the parameter or of its optimizer state)
            pieces = shard_pieces(tensor, split)
        else:
            pieces = tensor_pieces(tensor.detach(), split, shape, flat_range)
        self.entries[key] = ShardedEntry(split.global_shape(shape), tensor.dtype, pieces)
        self.sources[key] = (tensor, is_padded_vocab(param))


def _split(param: torch.Tensor, tp: Group | None) -> TensorParallelSplit:
    return TensorParallelSplit.of(param, tp.rank, tp.size) if tp is not None else TensorParallelSplit.of(param, 0, 1)


def named_parameters(chunks: list[nn.Module], buffers: bool = False) -> tuple[dict[str, torch.Tensor], list]:
    """Global canonical name (:mod:`mega.core.parameter_names`) -> parameter over a rank's
    model chunks (or its persistent buffers, with ``buffers``); plus (first, copy) pairs of names
    held twice on this rank (a tied embedding's copy on a later chunk)."""
    named, duplicates = {}, []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)  # DDP-wrapped or not
        aliases = canonical_names(module)
        if buffers:
            tensors = [(name, buffer) for name, buffer in module.named_buffers() if _persistent(module, name)]
        else:
            tensors = list(module.named_parameters())
        for name, param in tensors:
            name = canonical(name, aliases)
            if name in named:
                if param is not named[name]:
                    duplicates.append((named[name], param))
            else:
                named[name] = param
    return named, duplicates


def model_entries(chunks: list[nn.Module], tp: Group | None) -> Entries:
    """Parameters (``model.<name>``) by canonical name; and, loaded only where a checkpoint has
    them (they belong to a kernel backend, or are derived), persistent buffers (``buffer.<name>``)
    and the extra state modules declare (``get_extra_state()`` returning a tensor), saved per
    tensor-parallel rank as ``buffer.<module>._extra_state.tp<rank>of<size>`` and restored only at
    the same tp size. ``tp``: the tensor group the chunks are split over (None: whole parameters)."""
    named, duplicates = named_parameters(chunks)
    result = Entries(duplicates=duplicates)
    for name, param in named.items():
        result.add(MODEL + name, param.data, param, tp)
        if is_checkpoint_optional(param):  # LoRA adapters: absent from a base model's checkpoint
            result.optional.add(MODEL + name)
            result.adapters = True
    for name, buffer in named_parameters(chunks, buffers=True)[0].items():
        result.add(BUFFER + name, buffer, buffer, tp)
        result.optional.add(BUFFER + name)
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    for chunk in chunks:
        for prefix, module in getattr(chunk, "module", chunk).named_modules():
            if type(module).get_extra_state is nn.Module.get_extra_state:
                continue
            extra = module.get_extra_state()
            if not torch.is_tensor(extra):
                raise TypeError(f"{prefix or 'the model'}: get_extra_state() returned {type(extra).__name__}; "
                                "checkpoints take extra state only as a tensor")
            key = f"{BUFFER}{prefix + '.' if prefix else ''}{EXTRA_STATE}.tp{rank}of{size}"
            result.entries[key] = ShardedEntry(tuple(extra.shape), extra.dtype, [Piece(extra, (0,) * extra.dim())])
            result.sources[key] = (extra, False)
            result.extra_state[key] = module
            result.optional.add(key)
    return result


def _persistent(module: nn.Module, name: str) -> bool:
    owner_name, _, buffer = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return buffer not in owner._non_persistent_buffers_set


def optimizer_state_description(optimizer: MixedPrecisionOptimizer) -> dict | None:
    """Which per-parameter tensors and which scalars the inner optimizer keeps (None before its
    first step: there is no state yet)."""
    # The union over parameters: an optimizer may keep different state for different ones (Muon's
    # momentum for matrices, AdamW's moments for the rest).
    keys, scalars = set(), {}
    for entry in optimizer.main_params:
        state = optimizer.optimizer.state.get(entry.main) or {}
        keys.update(k for k, v in state.items() if torch.is_tensor(v) and v.shape == entry.main.shape)
        scalars.update((k, float(v)) for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0))
    if not keys and not scalars:
        return None
    return {
        "state_keys": sorted(keys),
        "scalars": scalars,
        "main_params": (any(e.model_view is not None for e in optimizer.main_params)
                        or getattr(optimizer, "saves_main_params", False)),
    }


def keeps_main_param(optimizer: MixedPrecisionOptimizer, param: nn.Parameter) -> bool:
    """Whether ``param`` has an fp32 main parameter a checkpoint stores (when the optimizer's
    description says main parameters are saved): a copy beside a bf16/fp16 parameter, or the
    parameter itself where it is its own (FSDP's shards)."""
    return param.dtype != torch.float32 or getattr(optimizer, "params_are_main_params", False)


def optimizer_entries(optimizer: MixedPrecisionOptimizer, chunks: list[nn.Module], tp: Group | None,
                      state_keys: list[str], main_params: bool) -> Entries:
    """Entries of the inner optimizer's ``state_keys`` (and of the fp32 main parameters when
    ``main_params``) for every main parameter of this rank."""
    named, duplicates = named_parameters(chunks)
    names = {id(param): name for name, param in named.items()}
    copies = {id(copy) for _, copy in duplicates}  # a second copy of a tied weight: its state equals the first's
    result = Entries()
    for entry in optimizer.main_params:
        name = names.get(id(entry.model))
        if name is None:
            if id(entry.model) in copies:
                continue
            raise CheckpointError(f"the optimizer steps a parameter of shape {list(entry.model.shape)} that no model "
                                  "chunk holds (are FSDP units left gathered? settle() reshards them)")
        state = optimizer.optimizer.state[entry.main]
        for key in (k for k in state_keys if k in state):  # (the keys this parameter keeps)
            result.add(f"{OPTIMIZER}{name}.{key}", state[key], entry.model, tp, entry.flat_range)
        if main_params and keeps_main_param(optimizer, entry.model):
            result.add(f"{OPTIMIZER}{name}.{MAIN_PARAM}", entry.main.data, entry.model, tp, entry.flat_range)
            if getattr(optimizer, "params_are_main_params", False):
                result.main_param_instead.add(MODEL + name)
    return result


def expected_optimizer_shapes(optimizer: MixedPrecisionOptimizer, chunks: list[nn.Module], tp: Group | None,
                              state_keys: list[str], main_params: bool) -> dict[str, list[int]]:
    """The global shape of every optimizer entry a checkpoint must hold for this rank's trainable
    parameters, whichever data-parallel rank holds (a slice of) their state: what a save is
    checked against, named from the model, not from the optimizer's own bookkeeping."""
    named, _ = named_parameters(chunks)
    shapes = {}
    for name, param in named.items():
        if not param.requires_grad:
            continue
        shape = list(_split(param, tp).global_shape(tuple(param.shape)))
        keys_of = getattr(optimizer.optimizer, "state_keys", None)  # per parameter (Muon + AdamW)
        for key in (state_keys if keys_of is None else [k for k in state_keys if k in keys_of(param)]):
            shapes[f"{OPTIMIZER}{name}.{key}"] = shape
        if main_params and keeps_main_param(optimizer, param):
            shapes[f"{OPTIMIZER}{name}.{MAIN_PARAM}"] = shape
    return shapes


def settle(chunks: list[nn.Module], optimizer) -> None:
    """Bring the model to the state checkpoints read and fill: the distributed optimizer's
    parameter all-gathers finished, FSDP's units resharded (an evaluation leaves the units that do
    not reshard after forward gathered, their sharded parameters, which the optimizer steps and
    whose state a checkpoint names by module, replaced by plain unsharded tensors)."""
    finish = getattr(optimizer, "finish_param_sync", None)
    if finish is not None:
        finish()
    for chunk in chunks:
        if getattr(chunk, "fully_sharded", False):
            chunk.reshard()


def create_optimizer_state(optimizer: MixedPrecisionOptimizer, description: dict) -> None:
    """Give every main parameter zeroed state of the saved kinds, ready to be loaded into."""
    for entry in optimizer.main_params:
        state = optimizer.optimizer.state[entry.main]
        keys_of = getattr(optimizer.optimizer, "state_keys", None)  # per parameter (Muon + AdamW)
        kept = set(keys_of(entry.main)) if keys_of is not None else set(description["state_keys"])
        for key in (k for k in description["state_keys"] if k in kept):
            state[key] = torch.zeros_like(entry.main, memory_format=torch.preserve_format)
        for key, value in description["scalars"].items():
            state[key] = torch.tensor(value, dtype=torch.float32)


def refresh_main_params(main_params: list[MainParam]) -> None:
    """Copy loaded model weights into separate fp32 main parameters."""
    with torch.no_grad():
        for entry in main_params:
            if entry.model_view is not None:
                entry.main.copy_(entry.model_view.reshape(entry.main.shape))


def prepare_optional(wanted: Entries, index: dict) -> list[tuple[nn.Module, torch.Tensor]]:
    """Keep of ``wanted``'s optional entries those the checkpoint has (the others keep their own
    values: saved by another backend or at another tp size); extra state is read at its saved
    shape. Returns (module, tensor) pairs to hand to ``set_extra_state`` once loaded."""
    restore = []
    for key in wanted.optional:
        if key not in index:
            del wanted.entries[key], wanted.sources[key]
        elif key in wanted.extra_state:
            saved = torch.empty(tuple(index[key].size), dtype=index[key].properties.dtype)
            wanted.entries[key] = ShardedEntry(tuple(saved.shape), saved.dtype, [Piece(saved, (0,) * saved.dim())])
            wanted.sources[key] = (saved, False)
            restore.append((wanted.extra_state[key], saved))
    return restore

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

from mega.core.checkpoint.pieces import TensorParallelSplit, tensor_pieces
from mega.core.checkpoint.sharded_io import ShardedEntry
from mega.core.optim.optimizer import MainParam, MixedPrecisionOptimizer
from mega.core.parallel.groups import Group
from mega.core.parallel.param_attrs import is_padded_vocab

MODEL = "model."
OPTIMIZER = "optimizer."
MAIN_PARAM = "main_param"


@dataclass
class Entries:
    """Checkpoint entries of this rank, and the parameters each name stands for."""

    entries: dict[str, ShardedEntry] = field(default_factory=dict)
    # entry key -> the local tensor it was built from and whether dim 0 is the padded vocabulary
    sources: dict[str, tuple[torch.Tensor, bool]] = field(default_factory=dict)
    # copies of an already-listed parameter (tied embeddings on two chunks of one rank)
    duplicates: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)

    def add(self, key: str, tensor: torch.Tensor, param: nn.Parameter, tp: Group | None,
            flat_range: tuple[int, int] | None = None) -> None:
        split = TensorParallelSplit.of(param, tp.rank, tp.size) if tp is not None else TensorParallelSplit()
        shape = tuple(param.shape)
        pieces = tensor_pieces(tensor.detach(), split, shape, flat_range)
        self.entries[key] = ShardedEntry(split.global_shape(shape), tensor.dtype, pieces)
        self.sources[key] = (tensor, is_padded_vocab(param))


def named_parameters(chunks: list[nn.Module]) -> tuple[dict[str, nn.Parameter], list[tuple[nn.Parameter, nn.Parameter]]]:
    """Global name -> parameter over a rank's model chunks; plus (first, copy) pairs of names
    held twice on this rank (a tied embedding's copy on a later chunk)."""
    named, duplicates = {}, []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)  # DDP-wrapped or not
        for name, param in module.named_parameters():
            if name in named:
                if param is not named[name]:
                    duplicates.append((named[name], param))
            else:
                named[name] = param
    return named, duplicates


def model_entries(chunks: list[nn.Module], tp: Group | None) -> Entries:
    """``tp``: the tensor group the chunks are split over (None: whole parameters)."""
    named, duplicates = named_parameters(chunks)
    result = Entries(duplicates=duplicates)
    for name, param in named.items():
        result.add(MODEL + name, param.data, param, tp)
    return result


def optimizer_state_description(optimizer: MixedPrecisionOptimizer) -> dict | None:
    """Which per-parameter tensors and which scalars the inner optimizer keeps (None before its
    first step: there is no state yet)."""
    for entry in optimizer.main_params:
        state = optimizer.optimizer.state.get(entry.main)
        if state:
            return {
                "state_keys": sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == entry.main.shape),
                "scalars": {k: float(v) for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)},
                "main_params": any(e.model_view is not None for e in optimizer.main_params),
            }
    return None


def optimizer_entries(optimizer: MixedPrecisionOptimizer, chunks: list[nn.Module], tp: Group | None,
                      state_keys: list[str], main_params: bool) -> Entries:
    """Entries of the inner optimizer's ``state_keys`` (and of the fp32 main parameters when
    ``main_params``) for every main parameter of this rank."""
    named, _ = named_parameters(chunks)
    names = {id(param): name for name, param in named.items()}
    result = Entries()
    for entry in optimizer.main_params:
        name = names.get(id(entry.model))
        if name is None:  # a second copy of a tied weight: its state equals the first's
            continue
        state = optimizer.optimizer.state[entry.main]
        for key in state_keys:
            result.add(f"{OPTIMIZER}{name}.{key}", state[key], entry.model, tp, entry.flat_range)
        if main_params and entry.model_view is not None:
            result.add(f"{OPTIMIZER}{name}.{MAIN_PARAM}", entry.main.data, entry.model, tp, entry.flat_range)
    return result


def create_optimizer_state(optimizer: MixedPrecisionOptimizer, description: dict) -> None:
    """Give every main parameter zeroed state of the saved kinds, ready to be loaded into."""
    for entry in optimizer.main_params:
        state = optimizer.optimizer.state[entry.main]
        for key in description["state_keys"]:
            state[key] = torch.zeros_like(entry.main, memory_format=torch.preserve_format)
        for key, value in description["scalars"].items():
            state[key] = torch.tensor(value, dtype=torch.float32)


def refresh_main_params(main_params: list[MainParam]) -> None:
    """Copy loaded model weights into separate fp32 main parameters."""
    with torch.no_grad():
        for entry in main_params:
            if entry.model_view is not None:
                entry.main.copy_(entry.model_view.reshape(entry.main.shape))

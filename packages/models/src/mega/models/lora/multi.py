"""Many LoRA adapters served from one base at once, each row of a batch with its own (S-LoRA and
punica's scheme, written with torch's batched matrix products).

:func:`apply_multi_lora` wraps each adaptable linear layer (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``) of a built model in a :class:`MultiLoRALinear` holding every
served adapter's A and B stacked: ``a [slots, rank, in]``, ``b [slots, out, rank]``, slot 0 the
base (zeros), one slot per adapter after it. Adapters of different ranks are padded to the
largest (``max_rank``) with zero rows of A and zero columns of B, which add exactly nothing; an
adapter that leaves a layer alone has zeros there. Each row of a forward's batch takes the slot
:meth:`MultiLoRA.bind` gave it, so one forward computes, row by row,
``base(x) + B_slot (A_slot x)`` (alpha / rank folded into B when the adapter is written): each row's
A and B gathered by its slot, then two batched matrix products. A batch of base rows alone skips
them on the CPU; on a GPU every step computes them (captured decode graphs must).

The stacks are allocated once (``max_loras`` slots) and written in place, so a captured CUDA
graph of a decode step keeps reading them, and so does the row-to-slot tensor
(:meth:`MultiLoRA.bind` copies into one buffer).

Under tensor parallelism each rank holds its part, as :mod:`~mega.models.lora.adapters` splits a
trained adapter: beside a column-parallel layer A whole and B split like the layer's output rows
(no communication: the input is whole on every rank); beside a row-parallel layer A split like the
layer's input columns and B whole, the low-rank partial products summed over the tensor group
before B. Adapters are written as global tensors and each rank keeps its part. Sequence
parallelism (training's) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mega.core.parallel.collectives import reduce_from_tensor_parallel_region
from mega.core.parallel.grad_accumulation_fusion import Linear as FusionAwareLinear
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_of
from mega.core.parameter_names import canonical_names
from mega.models.lora.adapters import TARGETS, LoRAError

ADAPTABLE = (ColumnParallelLinear, RowParallelLinear, nn.Linear, FusionAwareLinear)  # as LoRA training adapts

MAX_ROWS = 4096  # rows the row-to-slot buffer holds (a forward's batch; grown when exceeded)


@dataclass
class AdapterWeights:
    """One adapter in mega's layout: ``{layer's global name: (A [r, in], B [out, r] with the
    scaling folded in)}`` and its rank (the largest of its layers)."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.layers.values())


class MultiLoRA:
    """The served adapters' slots across every wrapped layer, and which slot each row of the
    next forward takes."""

    def __init__(self, layers: Mapping[str, MultiLoRALinear], max_loras: int, max_rank: int, device: torch.device):
        self.layers, self.max_loras, self.max_rank = dict(layers), max_loras, max_rank
        self._rows = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
        self.rows = self._rows[:0]
        self.active = False  # whether the bound rows' forward adds the adapters' products
        for layer in self.layers.values():
            layer.router = self

    def bind(self, slots: Sequence[int]) -> None:
        """Row ``r`` of the next forward takes slot ``slots[r]`` (0: the base alone)."""
        if len(slots) > len(self._rows):
            self._rows = torch.zeros(len(slots), dtype=torch.long, device=self._rows.device)
        self.rows = self._rows[: len(slots)]
        self.rows.copy_(torch.tensor(list(slots), dtype=torch.long), non_blocking=True)
        # A batch of base rows skips the products, except on a GPU, whose decode steps are captured
        # once per batch size as CUDA graphs (or compiled) and must hold them whatever rows come later.
        self.active = self._rows.device.type == "cuda" or any(slots)

    @torch.no_grad()
    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Put ``adapter`` in ``slot`` (1..max_loras), zeros where it adapts nothing. Errors name
        a layer the model lacks, a shape that does not fit, or a rank over ``max_rank``."""
        if not 1 <= slot <= self.max_loras:
            raise LoRAError(f"slot {slot} is outside 1..{self.max_loras} (--max-loras)")
        if adapter.rank > self.max_rank:
            raise LoRAError(f"its rank {adapter.rank} exceeds --max-lora-rank {self.max_rank}")
        unknown = sorted(set(adapter.layers) - set(self.layers))
        if unknown:
            raise LoRAError(f"it adapts {unknown[0]}, which this base model does not have (or LoRA cannot adapt)")
        for name, (a, b) in adapter.layers.items():
            out, into = self.layers[name].global_shape
            if a.shape[1] != into or b.shape[0] != out or a.shape[0] != b.shape[1]:
                raise LoRAError(f"{name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base layer "
                                f"({out} x {into})")
        for name, layer in self.layers.items():
            layer.a[slot].zero_()
            layer.b[slot].zero_()
            if name in adapter.layers:
                a, b = layer.local(*adapter.layers[name])
                layer.a[slot, : a.shape[0]].copy_(a)
                layer.b[slot, :, : b.shape[1]].copy_(b)

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.a[slot].zero_()
            layer.b[slot].zero_()


class MultiLoRALinear(nn.Module):
    """``base(x) + B_s (A_s x)`` for each row's slot ``s``; ``x`` is ``[seq, batch, in]``."""

    def __init__(self, base: nn.Module, max_loras: int, max_rank: int):
        super().__init__()
        weight, group = base.weight, getattr(base, "group", None)
        self.style = "whole" if group is None or group.size == 1 else \
            "column" if isinstance(base, ColumnParallelLinear) else "row"
        if self.style != "whole" and base.sequence_parallel:
            raise LoRAError("served adapters do not run under sequence parallelism")
        self.global_shape = (base.out_features, base.in_features)
        self.base = base
        self.parameter_aliases = {f"base.{name}": name for name, _ in base.named_parameters()}
        self.router: MultiLoRA | None = None
        options = dict(device=weight.device, dtype=weight.dtype)
        self.register_buffer("a", torch.zeros(max_loras + 1, max_rank, weight.shape[1], **options), persistent=False)
        self.register_buffer("b", torch.zeros(max_loras + 1, weight.shape[0], max_rank, **options), persistent=False)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.base(x, *args, **kwargs)
        if not self.router.active:
            return out
        rows = self.router.rows
        if x.dim() != 3 or x.shape[1] != len(rows):
            raise LoRAError(f"a batch of {tuple(x.shape)} where the adapters were bound for {len(rows)} rows")
        # gather each row's A and B, then two batched products: [b, s, in] -> [b, s, r] -> [b, s, out]
        low = torch.bmm(x.transpose(0, 1), self.a[rows].transpose(1, 2))
        if self.style == "row":  # A split like the input: sum the partial low-rank products
            low = reduce_from_tensor_parallel_region(low, self.base.group)
        return out + torch.bmm(low, self.b[rows].transpose(1, 2)).transpose(0, 1)


    def local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a global A and B (the layer's split)."""
        if self.style == "column":
            return a, shard_of(b, self.base.group, 0, self.base.chunks)
        if self.style == "row":
            return shard_of(a, self.base.group, 1), b
        return a, b


def adaptable_layers(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """``{global layer name: (module name, module)}`` of every layer served adapters may adapt
    (not grouped experts: an adapter of theirs is refused when written)."""
    names = canonical_names(model)
    return {names.get(f"{name}.weight", f"{name}.weight").rpartition(".")[0]: (name, module)
            for name, module in model.named_modules()
            if name.rpartition(".")[2] in TARGETS and type(module) in ADAPTABLE}


def adaptable_weight_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """``{global weight name: global shape}`` of :func:`adaptable_layers`."""
    return {f"{layer}.weight": torch.Size((module.out_features, module.in_features))
            for layer, (_, module) in adaptable_layers(model).items()}


def apply_multi_lora(model: nn.Module, max_loras: int, max_rank: int) -> MultiLoRA:
    """Wrap every adaptable linear layer of ``model`` (a whole model, tensor-parallel or not) for
    ``max_loras`` adapters of rank at most ``max_rank``."""
    if max_loras < 1 or max_rank < 1:
        raise LoRAError(f"--max-loras ({max_loras}) and --max-lora-rank ({max_rank}) must be positive")
    layers = {}
    for global_name, (name, module) in adaptable_layers(model).items():
        wrapped = MultiLoRALinear(module, max_loras, max_rank)
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, wrapped)
        layers[global_name] = wrapped
    if not layers:
        raise LoRAError(f"this model has no {', '.join(TARGETS)} layers to adapt")
    return MultiLoRA(layers, max_loras, max_rank, next(model.parameters()).device)

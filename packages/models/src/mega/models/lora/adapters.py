"""LoRA (Hu et al. 2021): low-rank adapters beside the frozen linear layers of a built stage.

:func:`apply_lora` is a pass over a built (and already tensor-parallel) stage: each targeted
layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, Megatron-Bridge's names;
``all-linear`` for all four) becomes a :class:`LoRALinear`, ``base(x) + B(A(dropout(x))) * alpha / rank``,
and every other parameter is frozen. The base keeps its parameter names (``parameter_aliases``),
so a base checkpoint loads as it is; the adapter is ``<layer>.adapter.linear_in.weight`` (A,
``[rank, in]``) and ``<layer>.adapter.linear_out.weight`` (B, ``[out, rank]``), Megatron-Bridge's
names, with ``<layer>.adapter.scaling`` (alpha / rank) beside them. A starts as PEFT starts it (Kaiming-uniform, from the seed and its global name, so every
layout starts alike) and B at zero, so a fresh adapter leaves the model's function unchanged.

Under tensor parallelism the adapter follows its layer (as Megatron-Bridge splits it): beside a
column-parallel layer A is whole and B split like the layer's output rows (SwiGLU's two blocks
each on their own), the low-rank activation crossing into the tensor region as the layer's input
does; beside a row-parallel layer A is split like the layer's input columns and B whole, the
low-rank partial products summed (reduce-scattered under sequence parallelism) as the layer's
are. A replicated adapter weight that sees only a rank's sequence shard is marked
``sequence_parallel``, so its gradient is summed over the tensor group.

:func:`merge_lora` folds the adapters into the base weights (``W + B A * alpha / rank``) and
puts the base layers back: the merged stage is a plain model with the base's names.
:func:`adapters_disabled` switches the adapters off for a while instead (the base model, with
no copy of it: the reference policy of RL post-training).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from mega.core.build import parameter_generator
from mega.core.parallel.collectives import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mega.core.parallel.grad_accumulation_fusion import Linear as FusionAwareLinear
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_of
from mega.core.parallel.param_attrs import (
    mark_checkpoint_optional,
    mark_sequence_parallel,
    mark_tensor_parallel,
)
from mega.core.parameter_names import canonical_names

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ALL_LINEAR = "all-linear"


class LoRAError(ValueError):
    """LoRA cannot be applied as asked (a target the model lacks, a layer it cannot adapt)."""


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_targets(names: Iterable[str] | None) -> tuple[str, ...]:
    """``--lora-target-modules`` (None or ``all-linear``: all four) checked against the known names."""
    names = list(names or [ALL_LINEAR])
    if ALL_LINEAR in names:
        return TARGETS
    unknown = [name for name in names if name not in TARGETS]
    if unknown:
        raise LoRAError(f"--lora-target-modules {' '.join(unknown)}: not a LoRA target; choose among "
                        f"{', '.join(TARGETS)} or {ALL_LINEAR}")
    return tuple(dict.fromkeys(names))


class LoRAAdapter(nn.Module):
    """``linear_out(linear_in(dropout(x))) * scale`` laid out like the layer it adapts: ``style``
    ``whole`` (no tensor parallelism), ``column`` or ``row`` over ``group``."""
    def __init__(self, in_features: int, out_features: int, settings: LoRASettings, style: str = "whole",
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.style, self.group, self.sequence_parallel = style, group, sequence_parallel
        self.scale = settings.scale
        # What a checkpoint of this run records of its adapters (mega.core.checkpoint.adapters).
        self.adapter_settings = {"method": "lora", "rank": settings.rank, "alpha": settings.alpha,
                                 "dropout": settings.dropout, "targets": list(settings.targets)}
        # alpha / rank travels with the adapter in checkpoints (export and merge read it).
        self.register_buffer("scaling", torch.tensor([settings.scale], dtype=torch.float32, device=device))
        self.dropout = nn.Dropout(settings.dropout)
        self.linear_in = nn.Linear(in_features, settings.rank, bias=False, device=device, dtype=dtype)
        self.linear_out = nn.Linear(settings.rank, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = self.linear_in(self.dropout(x))
        if self.style == "column":  # A whole: the low-rank activation enters the tensor region
            low = (gather_from_sequence_parallel_region(low, self.group) if self.sequence_parallel
                   else copy_to_tensor_parallel_region(low, self.group))
        elif self.style == "row":  # A split: sum the partial low-rank products
            low = (reduce_scatter_to_sequence_parallel_region(low, self.group) if self.sequence_parallel
                   else reduce_from_tensor_parallel_region(low, self.group))
        return self.linear_out(low) * self.scale


class LoRALinear(nn.Module):
    """``base(x) + adapter(x)``; the base's parameters keep their names (``parameter_aliases``).
    ``adapter_enabled`` False (see :func:`adapters_disabled`) leaves ``base(x)`` alone."""
    def __init__(self, base: nn.Module, adapter: LoRAAdapter):
        super().__init__()
        self.base, self.adapter = base, adapter
        self.parameter_aliases = {f"base.{name}": name for name, _ in base.named_parameters()}
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return self.base(x)
        return self.base(x) + self.adapter(x)


@contextlib.contextmanager
def adapters_disabled(*modules: nn.Module) -> Iterator[int]:
    """Every LoRA layer inside ``modules`` computes its base layer alone for the duration: the
    base model, with no second copy of it (RL's reference policy under LoRA). Yields how many
    layers it switched off; each gets its previous setting back on exit."""
    layers = [layer for module in modules for layer in module.modules() if isinstance(layer, LoRALinear)]
    previous = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield len(layers)
    finally:
        for layer, enabled in zip(layers, previous, strict=True):
            layer.adapter_enabled = enabled


def _adapter_for(base: nn.Module, settings: LoRASettings) -> LoRAAdapter:
    """An adapter shaped and split like ``base`` (its A and B uninitialised)."""
    weight = base.weight
    options = dict(device=weight.device, dtype=weight.dtype)
    if isinstance(base, ColumnParallelLinear):
        adapter = LoRAAdapter(base.in_features, weight.shape[0], settings, "column", base.group,
                              base.sequence_parallel, **options)
        mark_tensor_parallel(adapter.linear_out.weight, 0, base.chunks)
        if base.sequence_parallel:
            mark_sequence_parallel(adapter.linear_in.weight)
    elif isinstance(base, RowParallelLinear):
        adapter = LoRAAdapter(weight.shape[1], base.out_features, settings, "row", base.group,
                              base.sequence_parallel, **options)
        mark_tensor_parallel(adapter.linear_in.weight, 1)
        if base.sequence_parallel:
            mark_sequence_parallel(adapter.linear_out.weight)
    elif type(base) in (nn.Linear, FusionAwareLinear):
        adapter = LoRAAdapter(base.in_features, base.out_features, settings, **options)
    else:
        raise LoRAError(f"is a {type(base).__name__}, which LoRA does not adapt (it adapts mega's linear "
                        f"layers: not grouped experts, nor a kernel backend's fused layer)")
    for param in adapter.parameters():
        mark_checkpoint_optional(param)  # a base model's checkpoint has none
    return adapter


@torch.no_grad()
def _initialise(adapter: LoRAAdapter, base: nn.Module, name: str, seed: int) -> None:
    """A: PEFT's Kaiming-uniform of the whole ``[rank, in]`` from (seed, name), this rank's part;
    B: zero. Every layout starts from the same adapter."""
    whole_in = base.in_features
    full = torch.empty(adapter.linear_in.weight.shape[0], whole_in, dtype=torch.float32)
    bound = 1 / math.sqrt(whole_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    full.uniform_(-bound, bound, generator=parameter_generator(seed, name, torch.device("cpu")))
    if adapter.style == "row":
        full = shard_of(full, adapter.group, 1)
    adapter.linear_in.weight.copy_(full)
    adapter.linear_out.weight.zero_()


def apply_lora(stage: nn.Module, settings: LoRASettings, seed: int) -> list[str]:
    """Wrap every targeted linear layer of ``stage`` in a :class:`LoRALinear` and freeze all but
    the adapters; returns the adapted layers' global names. A target this stage's model does not
    have (no layer of that name anywhere in it) is an error naming the flag."""
    names = canonical_names(stage)
    layers = [(name, module) for name, module in stage.named_modules() if name.rpartition(".")[2] in settings.targets]
    found = {name.rpartition(".")[2] for name, _ in layers}
    missing = [target for target in settings.targets if target not in found]
    if missing and _holds_layers(stage):
        raise LoRAError(f"--lora-target-modules: this model has no {', '.join(missing)} layers "
                        f"(it has {', '.join(sorted(found)) or 'none of ' + ', '.join(TARGETS)})")
    for param in stage.parameters():
        param.requires_grad_(False)
    adapted = []
    for name, base in layers:
        global_name = names.get(f"{name}.weight", f"{name}.weight").rpartition(".")[0]
        try:
            adapter = _adapter_for(base, settings)
        except LoRAError as error:
            raise LoRAError(f"--lora-target-modules {name.rpartition('.')[2]}: {global_name} {error}") from None
        _initialise(adapter, base, f"{global_name}.adapter.linear_in.weight", seed)
        parent_name, _, child = name.rpartition(".")
        stage.get_submodule(parent_name).register_module(child, LoRALinear(base, adapter))
        adapted.append(global_name)
    return adapted


def _holds_layers(stage: nn.Module) -> bool:
    """Whether the stage holds transformer layers at all (an embedding-only stage has no targets)."""
    return any(name.endswith(".layers") for name, _ in stage.named_modules())


@torch.no_grad()
def merge_lora(stage: nn.Module) -> int:
    """Fold every adapter into its base weight and put the base layer back; returns how many."""
    merged = 0
    for name, module in list(stage.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        adapter, base = module.adapter, module.base
        # The saved alpha / rank (a loaded adapter's), as mega lora merge multiplies by.
        base.weight.copy_(merged_weight(base.weight, adapter.linear_in.weight, adapter.linear_out.weight,
                                        float(adapter.scaling)))
        parent_name, _, child = name.rpartition(".")
        stage.get_submodule(parent_name).register_module(child, base)
        merged += 1
    return merged


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + B A * scaling`` in fp32, in ``W``'s dtype: the one merge formula (``merge_lora`` on a
    stage's shards, ``mega lora merge`` on a checkpoint's global tensors)."""
    return (weight.float() + b.float() @ a.float() * scaling).to(weight.dtype)


def adapter_parameters(stage: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by global name."""
    names = canonical_names(stage)
    return {names.get(name, name): param for name, param in stage.named_parameters() if ".adapter." in name}

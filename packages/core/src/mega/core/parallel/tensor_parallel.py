"""``apply_tensor_parallel``: split a model written for one device with a plan of styles.

:func:`mega.core.build.build_stage` calls it on a stage built on the ``meta`` device (nothing
allocated yet); only afterwards does each rank materialise and initialise its own shards, from
per-name seeds, so every layout holds slices of the same model. The plan maps module-name
patterns to the styles of :mod:`mega.core.parallel.plan`; each matching ``nn.Linear`` /
``nn.Embedding`` is replaced by its parallel layer holding this rank's shard. Names are unchanged (a parallel layer keeps
``weight`` and ``bias``), so state dicts and hooks keep working.

Under sequence parallelism the activations between the marked ``SequenceParallelOutput`` module
and the next column-parallel layer are split along the sequence. Every parameter that is neither
sharded by the plan nor inside a ``SequenceParallelOutput`` module (which runs before the split,
on the whole sequence) is therefore computed on sequence shards - norms, row-parallel biases -
and is marked ``sequence_parallel`` so the data-parallel wrapper sums its gradient over the
tensor group.

The model derives what depends on the split from its weights (e.g. local attention heads =
``linear_qkv.weight.shape[0] // ((heads/groups + 2) * head_dim)``); fused QKV weights stored per
query group (Megatron's layout) split into whole groups with a plain ``Colwise``.

A layer from a kernel backend that does its own tensor/sequence-parallel communication (see
:mod:`mega.core.kernels`) implements ``to_tensor_parallel(style, group, sequence_parallel)``; the
plan hands it its style and uses the layer it returns.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from mega.core.parallel.collectives import scatter_to_sequence_parallel_region
from mega.core.parallel.grad_accumulation_fusion import Linear as FusionAwareLinear
from mega.core.parallel.groups import ParallelGroups
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mega.core.parallel.param_attrs import is_expert_parallel, is_tensor_parallel, mark_sequence_parallel
from mega.core.parallel.plan import (
    ColumnThenRow,
    Colwise,
    PlanStyle,
    Rowwise,
    SequenceParallelOutput,
    VocabEmbedding,
)


def apply_tensor_parallel(module: nn.Module, plan: Mapping[str, PlanStyle], groups: ParallelGroups,
                          *, sequence_parallel: bool | None = None, strict: bool = True) -> nn.Module:
    """Replace the modules ``plan`` names by their tensor-parallel versions, in place.

    ``sequence_parallel`` defaults to ``groups.config.sequence_parallel``. With ``strict`` a
    pattern that matches no module is an error (it is usually a typo). Returns ``module``.
    A tensor group of size 1 leaves the model as it is.
    """
    if sequence_parallel is None:
        sequence_parallel = groups.config.sequence_parallel
    matches = _match_plan(module, plan, strict)
    group = groups.tp
    if group.size == 1:
        return module

    # A weight tied between two planned modules (word embeddings and the LM head) stays tied.
    # Keyed by id of the old parameter, which the value keeps alive so the id is not reused.
    replaced_params: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    sequence_inputs: list[str] = []
    for name, style in matches.items():
        old = module.get_submodule(name)
        if isinstance(style, SequenceParallelOutput):
            if sequence_parallel:
                old.register_forward_hook(_scatter_output_hook(group))
                sequence_inputs.append(name)
            continue
        new = _parallel_layer(name, old, style, group, sequence_parallel)
        for attr in ("weight", "bias"):
            old_param = getattr(old, attr, None)
            if old_param is None:
                continue
            if id(old_param) in replaced_params:
                setattr(new, attr, replaced_params[id(old_param)][1])
            else:
                _carry_marks(old_param, getattr(new, attr))
                replaced_params[id(old_param)] = (old_param, getattr(new, attr))
        _set_submodule(module, name, new)

    _check_no_broken_ties(module, replaced_params)
    if sequence_parallel:
        _mark_sequence_parallel_params(module, sequence_inputs)
    return module


# Marks a model or the pipeline set before the split (e.g. a word embedding tied across stages)
# must survive on the shard that replaces the parameter.
_CARRIED_MARKS = ("shared_embedding", "shared", "expert_parallel", "expert_shard", "expert_tensor_shard",
                  "padded_vocab")


def _carry_marks(old: nn.Parameter, new: nn.Parameter) -> None:
    for mark in _CARRIED_MARKS:
        if hasattr(old, mark):
            setattr(new, mark, getattr(old, mark))


def _check_no_broken_ties(module: nn.Module, replaced: dict) -> None:
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in replaced:
            raise ValueError(f"parameter {name!r} is tied to a weight the plan split, but its module "
                             "is not in the plan; add it so both stay tied")


def _match_plan(module: nn.Module, plan: Mapping[str, PlanStyle], strict: bool) -> dict[str, PlanStyle]:
    names = [name for name, _ in module.named_modules() if name]
    matches: dict[str, PlanStyle] = {}
    for pattern, style in plan.items():
        if not isinstance(style, (Colwise, Rowwise, VocabEmbedding, SequenceParallelOutput, ColumnThenRow)):
            raise TypeError(f"plan entry {pattern!r}: {style!r} is not a tensor-parallel style")
        hits = fnmatch.filter(names, pattern)
        if not hits and strict:
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of {type(module).__name__}")
        for name in hits:
            if name in matches and matches[name] != style:
                raise ValueError(f"module {name!r} matches two plan styles: {matches[name]} and {style}")
            matches[name] = style
    return matches


def _parallel_layer(name: str, old: nn.Module, style: PlanStyle, group, sequence_parallel: bool) -> nn.Module:
    if hasattr(old, "to_tensor_parallel"):  # a kernel's layer that does its own TP/SP communication
        return old.to_tensor_parallel(style, group, sequence_parallel)
    if isinstance(style, ColumnThenRow):
        raise TypeError(f"plan style ColumnThenRow for {name!r} needs a module that does its own tensor-parallel "
                        f"communication (to_tensor_parallel), found {type(old).__name__}")
    expected = nn.Embedding if isinstance(style, VocabEmbedding) else nn.Linear
    # The exact class (a subclass's own forward would be lost), or the fusion-aware Linear.
    if type(old) not in (expected, FusionAwareLinear if expected is nn.Linear else expected):
        raise TypeError(f"plan style {type(style).__name__} for {name!r} needs an {expected.__name__}, "
                        f"found {type(old).__name__}")
    if isinstance(style, Colwise):
        return ColumnParallelLinear.from_linear(old, group, chunks=style.chunks,
                                                gather_output=style.gather_output,
                                                sequence_parallel=sequence_parallel)
    if isinstance(style, Rowwise):
        return RowParallelLinear.from_linear(old, group, sequence_parallel=sequence_parallel)
    return VocabParallelEmbedding.from_embedding(old, group)


def _scatter_output_hook(group):
    def hook(module, args, output):
        return scatter_to_sequence_parallel_region(output, group)
    return hook


def _mark_sequence_parallel_params(module: nn.Module, before_split: list[str]) -> None:
    for name, param in module.named_parameters():
        # (experts are split over their own groups: under --expert-tensor-parallel-size 1 the
        # ranks of a tensor group hold different experts, whose gradients must not be summed)
        if is_tensor_parallel(param) or is_expert_parallel(param):
            continue
        if any(name.startswith(prefix + ".") for prefix in before_split):
            continue
        mark_sequence_parallel(param)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)

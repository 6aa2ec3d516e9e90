"""Split a model, given as a sequence of layers, into pipeline stages and model chunks.

There are ``pp * vpp`` virtual stages; virtual stage ``c * pp + r`` is model chunk ``c`` of
pipeline rank ``r`` and holds the ``c * pp + r``-th block of consecutive layers (Megatron's
interleaved assignment; with ``vpp == 1`` rank ``r`` simply holds block ``r``); in a V (the
``zbv`` and ``dualpipev`` schedules) rank ``r``'s second chunk is stage ``2 pp - 1 - r``. Blocks are equal
unless ``layers_per_stage`` gives each virtual stage's layer count, in pipeline order, e.g. fewer
layers on the stages that also hold the embedding or the output layer (:mod:`mega.core.pipeline.layout`
derives them from Megatron's flags); only the first and the last stage may then hold none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from mega.core.parallel import ParallelGroups
from mega.core.pipeline.actions import INTERLEAVED, stage_of


class PartitionError(ValueError):
    """Layers that cannot be divided into stages as asked."""


def split_layers(
    num_layers: int, pp: int, vpp: int = 1, layers_per_stage: Sequence[int] | None = None,
    placement: str = INTERLEAVED,
) -> list[list[range]]:
    """Layer indices of every pipeline rank and model chunk: ``result[rank][chunk]`` (virtual
    stage ``stage_of(rank, chunk)``: Megatron's interleaved placement, or a V)."""
    stages = pp * vpp
    if num_layers < stages and layers_per_stage is None:
        raise PartitionError(
            f"cannot split {num_layers} layers into pp*vpp = {pp}*{vpp} = {stages} stages: "
            f"every stage needs at least one layer"
        )
    if layers_per_stage is None:
        if num_layers % stages:
            raise PartitionError(
                f"cannot split {num_layers} layers evenly into pp*vpp = {pp}*{vpp} = {stages} "
                f"stages ({num_layers} is not divisible by {stages}); pass layers_per_stage with "
                f"{stages} counts in pipeline order, e.g. {even_layer_counts(num_layers, stages)}"
            )
        layers_per_stage = [num_layers // stages] * stages
    counts = list(layers_per_stage)
    if len(counts) != stages:
        raise PartitionError(
            f"layers_per_stage has {len(counts)} counts, but pp*vpp = {pp}*{vpp} = {stages} "
            f"stages need one each"
        )
    ends = {0, stages - 1}
    if any(not isinstance(count, int) or count < (0 if stage in ends else 1) for stage, count in enumerate(counts)):
        raise PartitionError(f"every stage but the first and the last needs at least one layer; "
                             f"layers_per_stage = {counts}")
    if sum(counts) != num_layers:
        raise PartitionError(
            f"layers_per_stage = {counts} adds up to {sum(counts)} layers, but the model has {num_layers}"
        )
    starts = [sum(counts[:stage]) for stage in range(stages)]
    blocks = [range(start, start + count) for start, count in zip(starts, counts, strict=True)]
    return [[blocks[stage_of(rank, chunk, pp, placement)] for chunk in range(vpp)] for rank in range(pp)]


def pipeline_chunks(
    layers: Sequence[nn.Module],
    groups: ParallelGroups,
    layers_per_stage: Sequence[int] | None = None,
    placement: str = INTERLEAVED,
) -> list[nn.Sequential]:
    """This rank's model chunks (``groups.config.vpp`` of them, else one), each an ``nn.Sequential``
    of its layers named by their index in ``layers``, so parameter names match the full model's."""
    vpp = groups.config.vpp or 1
    ranges = split_layers(len(layers), groups.pp.size, vpp, layers_per_stage, placement)[groups.pp.rank]
    return [nn.Sequential(OrderedDict((str(i), layers[i]) for i in indices)) for indices in ranges]


def even_layer_counts(num_layers: int, stages: int) -> list[int]:
    """An even-as-possible split, the larger stages first."""
    base, extra = divmod(num_layers, stages)
    return [base + 1] * extra + [base] * (stages - extra)

"""Uneven pipeline layouts: how many transformer layers each virtual stage holds, from Megatron's flags.

The first stage also holds the embedding and the last the output layer and loss, so an even
split of the transformer layers leaves those two stages the slowest. Megatron-LM's flags, with
its meaning (megatron-core ``get_num_layers_to_build`` / ``PipelineParallelLayerLayout``):

* ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``: the first
  (last) pipeline rank holds F (L) layers, the other ranks split the rest evenly; with ``vpp``
  chunks per rank every rank's layers split evenly over its chunks.
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the
  embedding (the loss) counts as one layer in an even split of ``num_layers + 1 (+ 1)`` over
  ``pp * vpp`` chunks; the first (last) virtual stage then holds one transformer layer fewer.
* ``--pipeline-model-parallel-layout``: every virtual stage spelled out, ``|`` between stages in
  pipeline order, ``E`` the embedding (first character), ``t`` a transformer layer, ``L`` the
  loss (last character), ``(...)*n`` and ``x*n`` repeats, commas ignored:
  ``"Et*3|(tt|)*29,m|L"``. It has ``pp * vpp`` stages, so it sets ``vpp``. ``m`` (a
  multi-token-prediction layer) is refused: no mega family places one by layout yet.

The result is the layer count of every virtual stage in pipeline order (virtual stage
``c * pp + r`` is chunk ``c`` of rank ``r``), what
:func:`~mega.core.pipeline.partition.split_layers` takes; None where the split is even.
Only the first and the last virtual stage may hold no transformer layer (they still hold the
embedding or the output layer).
"""

from __future__ import annotations

import re

from mega.core.pipeline.actions import rank_and_chunk_of
from mega.core.pipeline.config import PipelineConfig
from mega.core.pipeline.partition import PartitionError
from mega.core.pipeline.zero_bubble import placement_of

_REPEAT_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_REPEAT_ONE = re.compile(r"(.)\*(\d+)")


def parse_layout(layout: str) -> list[str]:
    """The stages of a ``--pipeline-model-parallel-layout`` string, each as its characters
    (``"E(t|)*2L"`` -> ``["Et", "tL"]``)."""
    text = layout.replace(",", "").replace(" ", "")
    while _REPEAT_GROUP.search(text):  # innermost groups first, so nested repeats unroll
        text = _REPEAT_GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = _REPEAT_ONE.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for number, stage in enumerate(stages):
        unknown = sorted(set(stage) - set("EtLm"))
        if unknown:
            raise PartitionError(f"--pipeline-model-parallel-layout {layout!r}: stage {number} ({stage!r}) has "
                                 f"{', '.join(map(repr, unknown))}; a stage holds E (embedding), t (transformer "
                                 f"layer) and L (loss)")
    return stages


def layout_string(counts) -> str:
    """The ``--pipeline-model-parallel-layout`` of these layer counts per virtual stage."""
    stages = [f"t*{count}" if count > 1 else "t" * count for count in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + ("," if stages[-1] else "") + "L"
    return "|".join(stages)


def uneven_candidates(num_layers: int, pp: int, vpp: int = 1) -> list[tuple[int, ...]]:
    """Uneven layouts worth trying beside the even split (``mega plan --search``): Megatron's
    embedding and loss each counted as a layer, the loss alone, and one layer fewer on the last
    stage (and on the first) spread over the others, where they split evenly."""
    if pp == 1:
        return []
    fewer = num_layers // pp - 1
    tries = [dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
             dict(account_for_loss_in_pipeline_split=True),
             dict(decoder_last_pipeline_num_layers=fewer),
             dict(decoder_first_pipeline_num_layers=fewer, decoder_last_pipeline_num_layers=fewer)]
    found = []
    for flags in tries:
        try:
            found.append(tuple(layers_per_stage(PipelineConfig(**flags), num_layers, pp, vpp)))
        except ValueError:  # does not split evenly (or a count below zero)
            continue
    even = num_layers % (pp * vpp) == 0
    unique = []
    for counts in found:
        if counts not in unique and not (even and len(set(counts)) == 1):
            unique.append(counts)
    return unique


def layout_stage_count(pipeline: PipelineConfig) -> int | None:
    """How many virtual stages the layout string has (None without one)."""
    layout = pipeline.pipeline_model_parallel_layout
    return None if layout is None else len(parse_layout(layout))


def layers_per_stage(pipeline: PipelineConfig, num_layers: int, pp: int, vpp: int = 1) -> list[int] | None:
    """Transformer layers of each of the ``pp * vpp`` virtual stages (pipeline order), or None
    for an even split. The first/last flags count a pipeline rank's layers, over the chunks the
    schedule places on it (in a V the first rank holds the first and the last stage)."""
    if pipeline.pipeline_model_parallel_layout is not None:
        counts = _from_layout(pipeline.pipeline_model_parallel_layout, num_layers, pp, vpp)
    elif pipeline.decoder_first_pipeline_num_layers is not None or pipeline.decoder_last_pipeline_num_layers is not None:
        counts = _first_and_last(pipeline, num_layers, pp, vpp)
    elif pipeline.account_for_embedding_in_pipeline_split or pipeline.account_for_loss_in_pipeline_split:
        counts = _accounting(pipeline, num_layers, pp, vpp)
    else:
        return None
    middle = [stage for stage in range(1, len(counts) - 1) if counts[stage] == 0]
    if middle:
        raise PartitionError(f"the layout leaves virtual stage(s) {middle} without a transformer layer (layers per "
                             f"stage {counts}); only the first and the last stage may hold none")
    return counts


def _from_layout(layout: str, num_layers: int, pp: int, vpp: int) -> list[int]:
    stages = parse_layout(layout)
    if len(stages) != pp * vpp:
        raise PartitionError(f"--pipeline-model-parallel-layout {layout!r} has {len(stages)} stages, but "
                             f"pp*vpp = {pp}*{vpp} = {pp * vpp}")
    flat = "".join(stages)
    if not flat.startswith("E") or flat.count("E") != 1:
        raise PartitionError(f"--pipeline-model-parallel-layout {layout!r}: the embedding E must come first, once")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise PartitionError(f"--pipeline-model-parallel-layout {layout!r}: the loss L must come last, once")
    if "m" in flat:
        raise PartitionError(f"--pipeline-model-parallel-layout {layout!r}: multi-token-prediction layers (m) "
                             f"are not placed by layout in mega")
    counts = [stage.count("t") for stage in stages]
    if sum(counts) != num_layers:
        raise PartitionError(f"--pipeline-model-parallel-layout {layout!r} places {sum(counts)} transformer "
                             f"layers, but the model has {num_layers} (--num-layers)")
    return counts


def _first_and_last(pipeline: PipelineConfig, num_layers: int, pp: int, vpp: int) -> list[int]:
    first, last = pipeline.decoder_first_pipeline_num_layers, pipeline.decoder_last_pipeline_num_layers
    given = [("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)]
    named = " + ".join(f"{flag} {value}" for flag, value in given if value is not None)
    rest = num_layers - (first or 0) - (last or 0)
    middle_ranks = pp - (first is not None) - (last is not None)
    if pp == 1 or middle_ranks < 0:
        raise PartitionError(f"{named} needs a pipeline of more ranks (--pipeline-model-parallel-size {pp})")
    if rest < 0 or (middle_ranks == 0 and rest != 0):
        raise PartitionError(f"{named} = {num_layers - rest} layers on the first and last stages, but the model has "
                             f"{num_layers} (--num-layers)")
    if middle_ranks and rest % middle_ranks:
        raise PartitionError(f"the {rest} layers left after {named} do not split evenly over the "
                             f"{middle_ranks} middle pipeline ranks (--num-layers {num_layers})")
    per_rank = [rest // middle_ranks if middle_ranks else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    for rank, count in enumerate(per_rank):
        if count % vpp:
            raise PartitionError(f"pipeline rank {rank} holds {count} layers, which do not split evenly over its "
                                 f"{vpp} virtual stages ({named}, --num-layers {num_layers})")
    placement = placement_of(pipeline.pipeline_schedule)
    return [per_rank[rank_and_chunk_of(stage, pp, placement)[0]] // vpp for stage in range(pp * vpp)]


def _accounting(pipeline: PipelineConfig, num_layers: int, pp: int, vpp: int) -> list[int]:
    embedding, loss = pipeline.account_for_embedding_in_pipeline_split, pipeline.account_for_loss_in_pipeline_split
    counted = num_layers + embedding + loss
    what = " and ".join(name for name, on in (("the embedding", embedding), ("the loss", loss)) if on)
    if counted % (pp * vpp):
        raise PartitionError(f"--num-layers {num_layers} plus {what} = {counted} layers do not split evenly over "
                             f"pp*vpp = {pp}*{vpp} = {pp * vpp} virtual stages")
    counts = [counted // (pp * vpp)] * (pp * vpp)
    counts[0] -= embedding
    counts[-1] -= loss
    return counts

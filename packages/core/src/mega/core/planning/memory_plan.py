"""Per-rank memory of a training run, stage by stage, from the model family's footprint.

What each rank holds, as `mega train` allocates it:

    weights      every parameter of its stage's chunks, in the run's dtype
    gradients    DDP's gradient buffers, in fp32 with bf16 (--accumulate-allreduce-grads-in-fp32,
                 the default) else in the parameters' dtype (padded per bucket to 128 x dp
                 elements with the distributed optimizer)
    optimizer    fp32 main copies of 16-bit parameters plus the inner optimizer's state (Adam:
                 two fp32 moments; SGD: one momentum), over dp*cp ranks with the distributed
                 optimizer
    activations  what the micro-batches in flight keep for backward at the worst point of the
                 pipeline schedule, plus the largest recomputed region rebuilt during backward
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mega.core.distributed.ddp import DDPConfig
from mega.core.distributed.grad_buffer import SHARD_ALIGNMENT
from mega.core.model_family import ModelFamily
from mega.core.parallel import ParallelConfig
from mega.core.pipeline.actions import INTERLEAVED
from mega.core.pipeline.layout import layout_string
from mega.core.pipeline.partition import even_layer_counts, split_layers
from mega.core.pipeline.schedule_table import BACKWARD, FORWARD, schedule_table
from mega.core.planning.footprint import StageFootprint

FP32 = 4
OPTIMIZER_STATE_BYTES = {"adam": 2 * FP32, "sgd": FP32}  # per parameter, fp32


class PlanError(ValueError):
    """A run that cannot be planned (the family has no memory model, a layout that cannot split)."""


@dataclass(frozen=True)
class Layout:
    """What the plan varies: parallel sizes, recompute and the micro-batch."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: str | None = None  # None, "selective" or "full"
    micro_batch_size: int = 1
    # Transformer layers of every virtual stage in pipeline order (None: split evenly); see
    # mega.core.pipeline.layout.
    layers_per_stage: tuple[int, ...] | None = None
    schedule: str = "1f1b"  # --pipeline-schedule

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp, cp=self.cp, vpp=self.vpp if self.vpp > 1 else None,
                              sequence_parallel=self.sequence_parallel)

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"vpp{self.vpp}"] if self.vpp > 1 else [])
        parts += ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"dp{self.dp}"]
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["distopt"] if self.distributed_optimizer else []
        parts += [f"recompute-{self.recompute}"] if self.recompute else []
        parts += [f"mb{self.micro_batch_size}"] + ([self.schedule] if self.schedule != "1f1b" else [])
        if self.layers_per_stage is not None:
            parts += [f"--pipeline-model-parallel-layout '{layout_string(self.layers_per_stage)}'"]
        return " ".join(parts)


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank of pipeline stage ``stage``."""

    stage: int
    layers: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    in_flight: int  # micro-batch chunks whose activations are held at the peak

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def layer_split(num_layers: int, pp: int, vpp: int, layers_per_stage=None, placement=INTERLEAVED) -> list[list[range]]:
    """Layers of every rank and chunk: ``layers_per_stage`` where given, else an uneven model is
    split as evenly as possible (larger stages first), as Megatron's uneven pipeline flags would."""
    if layers_per_stage is not None:
        try:
            return split_layers(num_layers, pp, vpp, list(layers_per_stage), placement)
        except ValueError as error:
            raise PlanError(str(error)) from None
    stages = pp * vpp
    if num_layers < stages:
        raise PlanError(f"cannot split {num_layers} layers into pp*vpp = {stages} stages")
    counts = None if num_layers % stages == 0 else even_layer_counts(num_layers, stages)
    return split_layers(num_layers, pp, vpp, counts, placement)


@functools.lru_cache(maxsize=256)
def schedule_of(pp: int, num_microbatches: int, vpp: int, schedule: str = "1f1b"):
    """The schedule's table (the search asks for few distinct ones)."""
    return schedule_table(pp, num_microbatches, vpp, schedule=schedule)


def _padded(numel: int, alignment: int) -> int:
    return math.ceil(numel / alignment) * alignment


def _gradient_elements(footprints: list[StageFootprint], tied_embedding: list[int], layout: Layout) -> int:
    """Elements of the gradient buffers of a rank's chunks (DDP pads with the distributed optimizer)."""
    if not layout.distributed_optimizer:
        return sum(f.parameters for f in footprints)
    alignment = SHARD_ALIGNMENT * layout.dp * layout.cp
    bucket = DDPConfig().bucket_size
    total = 0
    for footprint, tied in zip(footprints, tied_embedding, strict=True):
        rest = footprint.parameters - tied
        buckets = max(1, rest // bucket) if rest else 0
        total += buckets * _padded(math.ceil(rest / buckets), alignment) if buckets else 0
        total += _padded(tied, alignment) if tied else 0  # a tied embedding has a bucket of its own
    return total


def plan_memory(family: ModelFamily, config, layout: Layout, *, dtype_bytes: int, optimizer: str = "adam",
                num_microbatches: int = 1, device_type: str = "cuda",
                grad_dtype_bytes: int | None = None) -> list[RankMemory]:
    """One :class:`RankMemory` per pipeline stage (every rank of a stage holds the same);
    ``grad_dtype_bytes``: of the gradient buffers (default: the parameters')."""
    grad_dtype_bytes = grad_dtype_bytes or dtype_bytes
    if family.memory_model is None:
        raise PlanError(f"model family {family.name!r} does not describe its memory (no memory_model)")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise PlanError(f"--optimizer {optimizer!r}: the planner knows {', '.join(OPTIMIZER_STATE_BYTES)}")
    if layout.recompute != config.recompute_granularity:
        raise PlanError("the layout's recompute must be the config's recompute_granularity")
    parallel = layout.parallel
    tied = not getattr(config, "untie_embeddings_and_output_weights", True)
    table = schedule_of(layout.pp, num_microbatches, layout.vpp, layout.schedule)
    schedule = table.actions
    ranks = []
    split = layer_split(config.num_layers, layout.pp, layout.vpp, layout.layers_per_stage, table.placement)
    for stage, chunks in enumerate(split):
        footprints, tied_elements = [], []
        for index, layers in enumerate(chunks):
            pre = table.stage(stage, index) == 0
            post = table.stage(stage, index) == table.num_stages - 1
            footprint = family.memory_model(
                config, layers=len(layers), pre_process=pre, post_process=post, parallel=parallel,
                micro_batch_size=layout.micro_batch_size, dtype_bytes=dtype_bytes, device_type=device_type)
            footprints.append(footprint)
            tied_elements.append(config.padded_vocab_size(layout.tp) * config.hidden_size // layout.tp
                                 if tied and (pre or post) else 0)
        parameters = sum(f.parameters for f in footprints)
        gradient_elements = _gradient_elements(footprints, tied_elements, layout)
        main_copy = 0 if dtype_bytes == FP32 else FP32
        per_element = main_copy + OPTIMIZER_STATE_BYTES[optimizer]
        # Sharded, each rank owns 1/(dp*cp) of every bucket; padding has no optimizer state.
        optimizer_bytes = (parameters // (layout.dp * layout.cp) if layout.distributed_optimizer
                           else parameters) * per_element
        held = peak = peak_chunks = chunks_held = 0
        for action in schedule[stage]:
            # A backward frees its chunk's activations (a split one mostly: W keeps a few inputs).
            sign = 1 if action.kind == FORWARD else -1 if action.kind == BACKWARD else 0
            held += sign * footprints[action.chunk].activation_bytes
            chunks_held += sign
            if held > peak:
                peak, peak_chunks = held, chunks_held
        activations = peak + max(f.recompute_bytes for f in footprints)
        weights = (gradient_elements if layout.distributed_optimizer else parameters) * dtype_bytes
        ranks.append(RankMemory(stage, sum(len(c) for c in chunks), parameters, weights,
                                gradient_elements * grad_dtype_bytes, optimizer_bytes, activations, peak_chunks))
    return ranks

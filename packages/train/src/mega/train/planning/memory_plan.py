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
                 pipeline schedule, plus the largest recomputed region rebuilt during backward;
                 under a zero-bubble schedule a micro-batch is in flight from F to W, holding
                 from its B on only what its W needs (``StageFootprint.weight_grad_bytes``)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mega.core.distributed.ddp import DDPConfig
from mega.core.distributed.grad_buffer import SHARD_ALIGNMENT
from mega.core.footprint import StageFootprint
from mega.core.model_family import ModelFamily
from mega.core.parallel import ParallelConfig
from mega.core.parallel.fsdp_config import FSDP_STRATEGIES
from mega.core.pipeline.actions import INTERLEAVED
from mega.core.pipeline.layout import layout_string
from mega.core.pipeline.partition import even_layer_counts, split_layers
from mega.core.pipeline.schedule_table import BACKWARD, FORWARD, schedule_table, whole_backwards
from mega.train.planning.fsdp_memory import ShardedStage, fully_sharded_bytes

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
    ep: int = 1  # --expert-model-parallel-size
    etp: int | None = None  # --expert-tensor-parallel-size (None: tp)
    # --data-parallel-sharding-strategy; with an FSDP one: HSDP's replica groups
    # (--num-distributed-optimizer-instances), --fsdp-reshard-after-forward, --cpu-offload
    sharding: str = "no_shard"
    replicas: int = 1
    reshard_after_forward: str = "default"
    cpu_offload: bool = False
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
    def distributed_optimizer(self) -> bool:
        return self.sharding == "optim"

    @property
    def fully_sharded(self) -> bool:
        return self.sharding in FSDP_STRATEGIES

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp,
                              vpp=self.vpp if self.vpp > 1 else None, sequence_parallel=self.sequence_parallel)

    @property
    def expert_data_parallel(self) -> int:
        """Ranks that share one expert shard: the distributed optimizer splits its state over them."""
        return self.tp * self.dp * self.cp // (self.ep * (self.tp if self.etp is None else self.etp))

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"vpp{self.vpp}"] if self.vpp > 1 else [])
        parts += ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"dp{self.dp}"]
        parts += ([f"ep{self.ep}"] if self.ep > 1 else []) + ([f"etp{self.etp}"] if self.etp is not None else [])
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["distopt"] if self.distributed_optimizer else []
        if self.fully_sharded:
            parts += [self.sharding] + ([f"hsdp{self.replicas}"] if self.replicas > 1 else [])
            parts += [f"reshard-{self.reshard_after_forward}"] if self.reshard_after_forward != "default" else []
            parts += ["cpu-offload"] if self.cpu_offload else []
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
    gathered: int = 0  # FSDP's gathered weights and unreduced gradients at the peak
    host: int = 0  # what --cpu-offload keeps in host memory (not in the total)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.gathered


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


@dataclass(frozen=True)
class _StageUsage:
    """What a pipeline rank's chunks hold whatever the data-parallel sharding."""

    chunks: list[range]
    footprints: list[StageFootprint]
    tied_elements: list[int]  # of a tied embedding (or output layer) per chunk
    has_output: bool
    activations: int
    in_flight: int
    layer_parameters: int  # elements of one transformer layer (an FSDP unit)


def plan_memory(family: ModelFamily, config, layout: Layout, *, dtype_bytes: int, optimizer: str = "adam",
                num_microbatches: int = 1, device_type: str = "cuda", grad_dtype_bytes: int | None = None,
                cache: dict | None = None) -> list[RankMemory]:
    """One :class:`RankMemory` per pipeline stage (every rank of a stage holds the same);
    ``grad_dtype_bytes``: of the gradient buffers (default: the parameters'), under FSDP of its
    reduction; ``cache``: a dict kept across calls that differ only in the sharding (the search)."""
    grad_dtype_bytes = grad_dtype_bytes or dtype_bytes
    if family.memory_model is None:
        raise PlanError(f"model family {family.name!r} does not describe its memory (no memory_model)")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise PlanError(f"--optimizer {optimizer!r}: the planner knows {', '.join(OPTIMIZER_STATE_BYTES)}")
    if layout.recompute != config.recompute_granularity:
        raise PlanError("the layout's recompute must be the config's recompute_granularity")
    key = (id(family), id(config), layout.tp, layout.pp, layout.cp, layout.vpp, layout.sequence_parallel,
           layout.recompute, layout.micro_batch_size, layout.layers_per_stage, layout.schedule, dtype_bytes,
           num_microbatches, device_type)  # what activations depend on: not dp, not the sharding
    usage = cache.get(key) if cache is not None else None
    if usage is None:
        usage = _stage_usage(family, config, layout, dtype_bytes, num_microbatches, device_type)
        if cache is not None:
            cache[key] = usage
    ranks = []
    for stage, use in enumerate(usage):
        parameters = sum(f.parameters for f in use.footprints)
        layers = sum(len(c) for c in use.chunks)
        if layout.fully_sharded:
            held = fully_sharded_bytes(
                _sharded_stage(config, layout, use, family.compile_units is not None), layout,
                dtype_bytes=dtype_bytes, reduce_dtype_bytes=grad_dtype_bytes,
                state_bytes_per_param=OPTIMIZER_STATE_BYTES[optimizer], accumulating=num_microbatches > 1)
            ranks.append(RankMemory(stage, layers, parameters, held.weights, held.gradients, held.optimizer,
                                    use.activations, use.in_flight, held.gathered, held.host))
            continue
        gradient_elements = _gradient_elements(use.footprints, use.tied_elements, layout)
        main_copy = 0 if dtype_bytes == FP32 else FP32
        per_element = main_copy + OPTIMIZER_STATE_BYTES[optimizer]
        # Sharded, each rank owns 1/(dp*cp) of every dense bucket and 1/(expert dp) of every expert
        # bucket; padding has no optimizer state.
        experts = sum(f.expert_parameters for f in use.footprints)
        owned = ((parameters - experts) // (layout.dp * layout.cp) + experts // layout.expert_data_parallel
                 if layout.distributed_optimizer else parameters)
        optimizer_bytes = owned * per_element
        weights = (gradient_elements if layout.distributed_optimizer else parameters) * dtype_bytes
        ranks.append(RankMemory(stage, layers, parameters, weights, gradient_elements * grad_dtype_bytes,
                                optimizer_bytes, use.activations, use.in_flight))
    return ranks


def _stage_usage(family: ModelFamily, config, layout: Layout, dtype_bytes: int, num_microbatches: int,
                 device_type: str) -> list[_StageUsage]:
    """Every pipeline rank's chunks, footprints and activations at the schedule's peak."""
    parallel = layout.parallel
    tied = not getattr(config, "untie_embeddings_and_output_weights", True)
    table = schedule_of(layout.pp, num_microbatches, layout.vpp, layout.schedule)
    schedule, splits_backward = table.actions, table.splits_backward  # (each built anew at each read)
    layer = family.memory_model(config, layers=1, first_layer=config.num_layers - 1, pre_process=False,
                                post_process=False, parallel=parallel, micro_batch_size=layout.micro_batch_size,
                                dtype_bytes=dtype_bytes, device_type=device_type).parameters
    usage = []
    split = layer_split(config.num_layers, layout.pp, layout.vpp, layout.layers_per_stage, table.placement)
    for stage, chunks in enumerate(split):
        footprints, tied_elements, has_output = [], [], False
        for index, layers in enumerate(chunks):
            pre = table.stage(stage, index) == 0
            post = table.stage(stage, index) == table.num_stages - 1
            has_output |= post
            footprints.append(family.memory_model(
                config, layers=len(layers), first_layer=layers.start, pre_process=pre, post_process=post,
                parallel=parallel,
                micro_batch_size=layout.micro_batch_size, dtype_bytes=dtype_bytes, device_type=device_type))
            tied_elements.append(config.padded_vocab_size(layout.tp) * config.hidden_size // layout.tp
                                 if tied and (pre or post) else 0)
        held = peak = peak_chunks = chunks_held = 0
        whole = whole_backwards(table, stage) if splits_backward else set()
        for action in schedule[stage]:
            footprint, item = footprints[action.chunk], (action.microbatch, action.chunk)
            split = splits_backward and item not in whole
            if action.kind == FORWARD:
                held += footprint.activation_bytes
                chunks_held += 1
            elif action.kind == BACKWARD:  # frees the forward's tensors; a split one keeps W's operands
                held += (_held_for_w(footprint) if split else 0) - footprint.activation_bytes
                chunks_held -= 0 if split else 1
            elif split:  # W
                held -= _held_for_w(footprint)
                chunks_held -= 1
            if held > peak:
                peak, peak_chunks = held, chunks_held
        activations = peak + max(f.recompute_bytes for f in footprints)
        usage.append(_StageUsage(chunks, footprints, tied_elements, has_output, activations, peak_chunks, layer))
    return usage


def _held_for_w(footprint: StageFootprint) -> int:
    """What a micro-batch holds from its B to its W: the operands of its deferred weight
    gradients, or, where the family does not say, everything its forward kept."""
    if footprint.weight_grad_bytes is None:
        return footprint.activation_bytes
    return footprint.weight_grad_bytes


def _sharded_stage(config, layout: Layout, use: _StageUsage, units: bool) -> ShardedStage:
    """A rank's chunks as FSDP units (``units``: its layers are, else each chunk is one): the root
    unit of a chunk as what its layers leave, the output layer where the rank has it."""
    layer = use.layer_parameters
    roots = [f.parameters - len(layers) * layer for f, layers in zip(use.footprints, use.chunks, strict=True)]
    vocabulary = getattr(config, "padded_vocab_size", None)
    output = vocabulary(layout.tp) * config.hidden_size // layout.tp if vocabulary and use.has_output else 0
    return ShardedStage(parameters=sum(f.parameters for f in use.footprints), root=max(0, *roots),
                        output_layer=output, layer=layer, layers=sum(len(c) for c in use.chunks), units=units)

"""FLOPs of a step, its estimated time, and the search for layouts that fit.

    step time = FLOPs x recompute x imbalance / (GPUs x peak x MFU x (1 - bubble))

FLOPs are the family's (Megatron's formula, the model's own work); full recompute repeats the
layers' forward (x 4/3), selective recompute only the attention core's (not counted). ``MFU`` is
what the kernels achieve while busy (mega measured ~47% for GPT 1.3B on one H100), and the 1F1B
bubble is ``(pp - 1) / (vpp * m + pp - 1)`` of the step (m micro-batches per step). The
pipeline runs at the pace of its busiest rank: ``imbalance`` is that rank's FLOPs over the mean
(the output layer and loss make the last stage the busiest of an even split), which uneven
layouts (``--pipeline-model-parallel-layout``...) even out; ``--search`` tries Megatron's.
Communication is not modelled: among equal estimates the search prefers less model parallelism.
For each layout the search keeps the least data-parallel sharding that fits (no_shard on one
replica; else optim, the distributed optimizer, then FSDP's optim_grads, then
optim_grads_params): each step further shards more state but communicates more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mega.core.model_family import ModelFamily
from mega.core.parallel import ParallelConfig
from mega.core.parallel.fsdp_config import FSDP_STRATEGIES, layout_conflict
from mega.core.pipeline.layout import uneven_candidates
from mega.core.pipeline.schedule_table import V_SCHEDULES
from mega.train.planning.memory_plan import (
    Layout,
    PlanError,
    RankMemory,
    layer_split,
    plan_memory,
    schedule_of,
)

RECOMPUTE_COST = {None: 1.0, "selective": 1.0, "full": 4.0 / 3.0}
# What the search tries where there is more than one data-parallel replica, least sharded first.
SHARDED_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
# Kept free on every GPU for the CUDA context, NCCL buffers and allocator fragmentation.
MEMORY_HEADROOM = 0.1


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    ranks: list[RankMemory]
    flops_per_step: float
    bubble: float
    step_time_s: float | None  # None without a peak TFLOP/s
    tokens_per_step: int

    @property
    def peak_bytes(self) -> int:
        return max(rank.total for rank in self.ranks)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step_time_s if self.step_time_s else None


def with_recompute(config, recompute: str | None):
    """The model config with Megatron's recompute settings (full: uniform, one layer per region)."""
    full = recompute == "full"
    return dataclasses.replace(config, recompute_granularity=recompute,
                               recompute_method="uniform" if full else None,
                               recompute_num_layers=1 if full else None)


def estimate(family: ModelFamily, config, layout: Layout, *, global_batch_size: int, dtype_bytes: int,
             optimizer: str = "adam", peak_tflops: float | None = None, mfu: float = 0.45,
             device_type: str = "cuda", grad_dtype_bytes: int | None = None, cache: dict | None = None,
             like: Estimate | None = None) -> Estimate:
    """``like``: the estimate of the same layout under another sharding (its FLOPs and time
    hold: communication is not modelled); ``cache``: see :func:`plan_memory`."""
    per_step = layout.micro_batch_size * layout.dp
    if global_batch_size % per_step:
        raise PlanError(f"--global-batch-size {global_batch_size} is not divisible by micro-batch "
                        f"{layout.micro_batch_size} x dp {layout.dp}")
    microbatches = global_batch_size // per_step
    if layout.vpp > 1 and microbatches % layout.pp and layout.schedule not in V_SCHEDULES:
        raise PlanError(f"the interleaved schedule needs the micro-batches ({microbatches}) to be a multiple of pp")
    # The peak of held activations is reached by the end of the warm-up; two rounds of pp
    # micro-batches show it without walking thousands of them.
    walked = min(microbatches, 2 * layout.pp)
    ranks = plan_memory(family, config, layout, dtype_bytes=dtype_bytes, optimizer=optimizer,
                        num_microbatches=walked, device_type=device_type, grad_dtype_bytes=grad_dtype_bytes,
                        cache=cache)
    if like is not None:
        return dataclasses.replace(like, layout=layout, ranks=ranks)
    flops = family.num_floating_point_operations(config, global_batch_size)
    bubble = pipeline_bubble(layout, microbatches)
    step_time = None
    if peak_tflops:
        busy = flops * RECOMPUTE_COST[layout.recompute] * stage_imbalance(family, config, layout) / (
            layout.world_size * peak_tflops * 1e12 * mfu)
        step_time = busy / (1.0 - bubble)
    return Estimate(layout, ranks, flops, bubble, step_time, global_batch_size * config.seq_length)


def pipeline_bubble(layout: Layout, microbatches: int) -> float:
    """1F1B's ``(pp - 1) / (vpp m + pp - 1)``; a zero-bubble schedule's idle share of its slotted
    table (unit costs F = B = W: its slots are its makespan)."""
    if layout.schedule == "1f1b":
        return (layout.pp - 1) / (layout.vpp * microbatches + layout.pp - 1)
    table = schedule_of(layout.pp, microbatches, layout.vpp, layout.schedule)
    return 1.0 - 3 * microbatches * layout.vpp / len(table.steps[0])


def stage_imbalance(family: ModelFamily, config, layout: Layout) -> float:
    """The busiest pipeline rank's FLOPs over the mean rank's: the transformer layers it holds,
    plus the output layer and loss on the last rank (what the model's FLOPs have beside its layers').
    """
    if layout.pp == 1:
        return 1.0
    total = family.num_floating_point_operations(config, 1)
    try:
        per_layer = total - family.num_floating_point_operations(_without_last_layer(config), 1)
    except ValueError:  # a config that cannot lose a layer alone (a per-layer pattern): layers only
        per_layer = total / config.num_layers
    head = total - per_layer * config.num_layers
    placement = schedule_of(layout.pp, 1 if layout.vpp == 1 or layout.schedule in V_SCHEDULES else layout.pp,
                            layout.vpp, layout.schedule).placement
    ranks = layer_split(config.num_layers, layout.pp, layout.vpp, layout.layers_per_stage, placement)
    work = [sum(len(chunk) for chunk in chunks) * per_layer for chunks in ranks]
    work[-1] += head
    return max(work) / (total / layout.pp)


def _without_last_layer(config):
    """``config`` one layer shorter; a field listing a value per layer loses its last entry with it."""
    layers = config.num_layers
    per_layer = {field.name: getattr(config, field.name)[:-1] for field in dataclasses.fields(config)
                 if isinstance(getattr(config, field.name), list | tuple) and len(getattr(config, field.name)) == layers}
    return dataclasses.replace(config, num_layers=layers - 1, **per_layer)


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def search(family: ModelFamily, config, *, world_size: int, global_batch_size: int, gpu_memory_bytes: int,
           dtype_bytes: int, optimizer: str = "adam", peak_tflops: float | None = None, mfu: float = 0.45,
           gpus_per_node: int = 8, micro_batch_sizes=(1, 2, 4, 8), device_type: str = "cuda",
           grad_dtype_bytes: int | None = None, fsdp_grad_dtype_bytes: int | None = None,
           strategies=SHARDED_STRATEGIES, fsdp_options: dict | None = None, ep: int = 1,
           etp: int | None = None) -> list[Estimate]:
    """Every layout that fits in ``gpu_memory_bytes`` (less the headroom), fastest first, each with
    the first of ``strategies`` that fits; ``fsdp_options``: the FSDP strategies' ``replicas``,
    ``reshard_after_forward`` and ``cpu_offload`` (Layout fields); ``fsdp_grad_dtype_bytes``: their
    reduction's dtype (default: ``grad_dtype_bytes``); ``ep``/``etp``: the experts' layout, kept in
    every candidate (those it does not divide are skipped)."""
    budget = gpu_memory_bytes * (1.0 - MEMORY_HEADROOM)
    options = fsdp_options or {}
    # The strategies of a layout share its activations: planned once (the search's cost).
    common = dict(global_batch_size=global_batch_size, dtype_bytes=dtype_bytes, optimizer=optimizer,
                  peak_tflops=peak_tflops, mfu=mfu, device_type=device_type, grad_dtype_bytes=grad_dtype_bytes,
                  cache={})
    fitting = []
    for recompute in (None, "selective", "full"):
        model = with_recompute(config, recompute)
        for tp in _powers_of_two(min(gpus_per_node, world_size)):
            try:
                model.validate(tp)
            except ValueError:
                continue
            for cp in _powers_of_two(world_size // tp):
                if config.seq_length % (2 * cp) and cp > 1:
                    continue
                for pp in range(1, min(config.num_layers, world_size // (tp * cp)) + 1):
                    if world_size % (tp * cp * pp):
                        continue
                    dp = world_size // (tp * cp * pp)
                    if not _experts_fit(tp, dp, cp, pp, ep, etp, world_size):
                        continue
                    shardings = _shardings(strategies, options, dp=dp, cp=cp, pp=pp)
                    vpps = [1] + [v for v in (2, 4) if pp > 1 and config.num_layers % (pp * v) == 0]
                    splits = [(vpp, counts) for vpp in vpps
                              for counts in [None, *uneven_candidates(config.num_layers, pp, vpp)]]
                    for vpp, counts in splits:
                        for micro in micro_batch_sizes:
                            layout = Layout(tp=tp, pp=pp, cp=cp, vpp=vpp, dp=dp, sequence_parallel=tp > 1,
                                            ep=ep, etp=etp, recompute=recompute, micro_batch_size=micro,
                                            layers_per_stage=counts)
                            result = _least_sharded_fit(family, model, layout, shardings, options, budget,
                                                        fsdp_grad_dtype_bytes=fsdp_grad_dtype_bytes, **common)
                            if result is not None:
                                fitting.append(result)

    def speed(result: Estimate):
        layout = result.layout
        time = result.step_time_s if result.step_time_s is not None else (
            RECOMPUTE_COST[layout.recompute] / (1.0 - result.bubble))
        return (time, layout.tp * layout.cp * layout.pp, SHARDING_ORDER.index(layout.sharding),
                -layout.micro_batch_size, result.peak_bytes)

    return sorted(fitting, key=speed)


def _experts_fit(tp: int, dp: int, cp: int, pp: int, ep: int, etp: int | None, world_size: int) -> bool:
    """Whether ``mega train`` takes ep x etp with this dense layout."""
    if ep == 1 and etp is None:
        return True
    try:
        ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp).validate(world_size)
    except ValueError:
        return False
    return True


SHARDING_ORDER = ("no_shard", *SHARDED_STRATEGIES)


def _least_sharded_fit(family: ModelFamily, config, layout: Layout, shardings: list[str], options: dict,
                       budget: float, *, fsdp_grad_dtype_bytes: int | None, **common) -> Estimate | None:
    """``layout`` with the first of ``shardings`` whose peak fits in ``budget`` bytes, or None."""
    result = None
    for sharding in shardings:
        fsdp = _fsdp_fields(sharding, options)
        if fsdp and fsdp_grad_dtype_bytes:
            common = {**common, "grad_dtype_bytes": fsdp_grad_dtype_bytes}
        try:
            result = estimate(family, config, dataclasses.replace(layout, sharding=sharding, **fsdp), like=result,
                              **common)
        except PlanError:
            return None  # the layout cannot split, whatever it shards
        if result.peak_bytes <= budget:
            return result
        if max(rank.activations for rank in result.ranks) > budget:
            return None  # no sharding shrinks the activations
    return None


def _fsdp_fields(sharding: str, options: dict) -> dict:
    """The FSDP options of the Layout (none for DDP and the distributed optimizer)."""
    return dict(options) if sharding in FSDP_STRATEGIES else {}


def _shardings(strategies, options: dict, *, dp: int, cp: int, pp: int) -> list[str]:
    """The strategies to try for a layout, least sharded first: on one replica no_shard (and FSDP
    only to offload to the CPU), and none that ``mega train`` would refuse."""
    if dp * cp == 1:
        strategies = ("no_shard", *(s for s in strategies if s in FSDP_STRATEGIES and options.get("cpu_offload")))
    return [s for s in strategies if not layout_conflict(
        s, s, replicas=_fsdp_fields(s, options).get("replicas", 1), dp=dp, cp=cp, pp=pp,
        cpu_offload=_fsdp_fields(s, options).get("cpu_offload", False))]

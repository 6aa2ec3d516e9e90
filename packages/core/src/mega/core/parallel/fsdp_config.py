"""How data parallelism shards a run's state: the ``data_parallel`` section of a run.

Megatron's four ``--data-parallel-sharding-strategy`` values, each sharding one more kind of state
over the data-parallel ranks:

* ``no_shard``: weights, gradients and optimizer state replicated (plain DDP);
* ``optim``: optimizer state sharded (ZeRO-1, mega's distributed optimizer;
  ``--use-distributed-optimizer`` says the same);
* ``optim_grads``: gradients too (ZeRO-2): torch's FSDP2 keeping the gathered weights from forward
  to the end of backward (``reshard_after_forward=False``), so each unit gathers once per
  micro-batch; between steps only this rank's shard of weights, gradients and state is held;
* ``optim_grads_params``: weights too (ZeRO-3): FSDP2 with each transformer layer its own unit,
  resharded after forward as ``--fsdp-reshard-after-forward`` says (``--use-torch-fsdp2`` is
  Megatron's spelling of it).

``--num-distributed-optimizer-instances N`` (Megatron; torchtitan's ``dp_replicate``, accepted as
``--data-parallel-replicate-degree``) shards within groups of dp/N ranks and replicates over N
of them (HSDP).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from mega.core.config import ConfigError
from mega.core.config.options import option

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
FSDP_STRATEGIES = ("optim_grads", "optim_grads_params")
RESHARD_POLICIES = ("default", "always", "never")


@dataclass(frozen=True)
class DataParallelConfig:
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None = option(
        None, "what data parallelism shards: no_shard (DDP), optim (ZeRO-1, the distributed optimizer), optim_grads "
        "(ZeRO-2: FSDP2 without resharding after forward), optim_grads_params (ZeRO-3: FSDP2, each transformer "
        "layer a unit); default: optim with --use-distributed-optimizer, else no_shard", choices=STRATEGIES)
    use_torch_fsdp2: bool = option(False, "torch's FSDP2 (fully_shard): --data-parallel-sharding-strategy "
                                   "optim_grads_params")
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = option(
        "default", "free a unit's gathered weights after its forward (gather again for backward): always, never, or "
        "default (torchtitan's: always, but never under pipeline parallelism, and never for the last layer, "
        "whose backward comes first)", choices=RESHARD_POLICIES)
    num_distributed_optimizer_instances: int = option(
        1, "hybrid sharding (HSDP): shard within dp/N ranks, replicate over N groups of them")
    data_parallel_replicate_degree: int | None = option(
        None, "torchtitan's name for --num-distributed-optimizer-instances (dp_replicate x dp_shard = dp)")
    cpu_offload: bool = option(False, "keep FSDP2's sharded weights, gradients and optimizer step on the CPU "
                               "(CPUOffloadPolicy); needs a sharding strategy optim_grads[_params]")

    def __post_init__(self) -> None:
        replicate = self.data_parallel_replicate_degree
        if replicate is not None and self.num_distributed_optimizer_instances not in (1, replicate):
            raise ValueError(f"--data-parallel-replicate-degree {replicate} contradicts "
                             f"--num-distributed-optimizer-instances {self.num_distributed_optimizer_instances}")
        if self.replicas < 1:
            raise ValueError(f"--num-distributed-optimizer-instances must be >= 1, got {self.replicas}")
        if self.use_torch_fsdp2 and self.data_parallel_sharding_strategy not in (None, "optim_grads_params"):
            raise ValueError(f"--use-torch-fsdp2 means --data-parallel-sharding-strategy optim_grads_params; it "
                             f"contradicts --data-parallel-sharding-strategy {self.data_parallel_sharding_strategy}")

    @property
    def replicas(self) -> int:
        """Replica groups of HSDP (1: shard over every data-parallel rank)."""
        return self.data_parallel_replicate_degree or self.num_distributed_optimizer_instances

    def strategy(self, use_distributed_optimizer: bool) -> str:
        """The sharding strategy the flags ask for."""
        if self.use_torch_fsdp2:
            return "optim_grads_params"
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if use_distributed_optimizer else "no_shard"

    def uses_fsdp(self, use_distributed_optimizer: bool) -> bool:
        return self.strategy(use_distributed_optimizer) in FSDP_STRATEGIES


def layout_conflict(strategy: str, named: str, *, replicas: int, cpu_offload: bool, dp: int, cp: int, pp: int,
                    schedule: str = "1f1b") -> str | None:
    """What a layout's sizes and schedule conflict with in its sharding flags (both flags named),
    or None: what ``mega train`` refuses and ``mega plan`` (and its ``--search``) therefore too."""
    fsdp = strategy in FSDP_STRATEGIES
    if replicas > 1:
        if not fsdp:
            return (f"--num-distributed-optimizer-instances {replicas} (hybrid sharding) needs "
                    f"--data-parallel-sharding-strategy optim_grads or optim_grads_params, not {strategy} "
                    "(the distributed optimizer shards over every data-parallel rank)")
        if (dp * cp) % replicas:
            return (f"--num-distributed-optimizer-instances {replicas} must divide the "
                    f"data-parallel x context-parallel size {dp} x {cp}")
    if cpu_offload and not fsdp:
        return (f"--cpu-offload needs --data-parallel-sharding-strategy optim_grads or optim_grads_params "
                f"(or --use-torch-fsdp2), not {strategy}")
    if cpu_offload and pp > 1:
        return (f"--cpu-offload with --pipeline-model-parallel-size {pp} is not supported "
                "(the tied embedding's gradients would cross stages from host memory)")
    if fsdp and schedule != "1f1b":
        return (f"--pipeline-schedule {schedule} leaves weight gradients to a step after the backward, "
                f"but {named} (FSDP) reduces them at its end: use --pipeline-schedule 1f1b with FSDP")
    return None


def check_sharding(run, dp: int, *, launching: bool = True):
    """Fail, naming both flags, for a sharding strategy with a flag it cannot honour; return
    ``run`` with ``--use-distributed-optimizer`` set when the strategy is ``optim``.
    ``launching=False`` (``mega plan``) leaves out what only the process about to train can tell."""
    config, optimizer, precision, parallel = run.data_parallel, run.optimizer, run.precision, run.parallel
    strategy = config.strategy(optimizer.use_distributed_optimizer)
    named = ("--use-torch-fsdp2" if config.use_torch_fsdp2 else f"--data-parallel-sharding-strategy {strategy}")
    if strategy == "no_shard" and optimizer.use_distributed_optimizer:
        raise ConfigError("--data-parallel-sharding-strategy no_shard contradicts --use-distributed-optimizer "
                          "(which shards the optimizer state: strategy optim)")
    if strategy == "optim" and not optimizer.use_distributed_optimizer:
        run = dataclasses.replace(run, optimizer=dataclasses.replace(optimizer, use_distributed_optimizer=True))
    fsdp = strategy in FSDP_STRATEGIES
    problem = layout_conflict(strategy, named, replicas=config.replicas, cpu_offload=config.cpu_offload, dp=dp,
                              cp=parallel.cp, pp=parallel.pp, schedule=run.pipeline.pipeline_schedule)
    if problem:
        raise ConfigError(problem)
    if not fsdp:
        return run
    if launching and dp * parallel.tp * parallel.pp * parallel.cp == 1 and not dist.is_initialized():
        raise ConfigError(f"{named} (FSDP2) needs torch.distributed even on one GPU: launch with "
                          "--nproc-per-node 1 (or torchrun)")
    if precision.gradient_accumulation_fusion:  # the weight-gradient GEMM would write into DDP's buffers
        raise ConfigError(f"{named} (FSDP2) with --gradient-accumulation-fusion is not supported (FSDP owns the "
                          "gradients)")
    if (precision.fp8_format is not None or precision.fp8_hybrid) and precision.fp8_recipe == "delayed":
        raise ConfigError(f"{named} (FSDP2) with --fp8-recipe delayed (Transformer Engine's FP8) is not supported; "
                          "torchao's recipes are (--fp8-recipe tensorwise or rowwise)")
    return run

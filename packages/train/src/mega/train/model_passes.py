"""The core's passes of a training run's model setup, registered through ``register_setup_passes``
as a third party's are (:mod:`mega.core.setup_passes`): ``--compile``, the weights tied across
pipeline stages, and data parallelism (DDP with the distributed optimizer's buffers, or FSDP2).
"""

from __future__ import annotations

import torch

from mega.core.distributed.ddp import DDPConfig, DistributedDataParallel
from mega.core.pipeline.tied import setup_tied_weights
from mega.core.setup_passes import ModelSetup, Phase, SetupPass
from mega.train.compile import compile_stage, compiles
from mega.train.precision import gradient_accumulation_fusion, grads_in_fp32, model_dtype


def compile_pass(run_config) -> SetupPass:
    """Each chunk's units compiled when the run compiles (:func:`compiles`: ``--compile``, or FP8 on a GPU)."""

    def apply(setup: ModelSetup) -> None:
        if not compiles(setup.run, setup.groups.device):
            return
        for chunk in setup.chunks:
            compile_stage(setup.family, chunk, setup.run.kernels.compile_backend)

    return SetupPass("compile", Phase.COMPILE, apply)


def weight_tying_pass(run_config) -> SetupPass:
    """The last stage's copies of tied weights start as the first stage's (a pipeline's LM head)."""
    return SetupPass("weight-tying", Phase.WEIGHT_TYING, lambda setup: setup_tied_weights(setup.chunks, setup.groups))


def data_parallel_pass(run_config) -> SetupPass:
    """Every chunk wrapped for data parallelism: FSDP2 by the sharding strategy, else mega's DDP."""
    return SetupPass("data-parallel", Phase.DATA_PARALLEL, wrap_data_parallel)


def wrap_data_parallel(setup: ModelSetup) -> None:
    run, groups = setup.run, setup.groups
    if run.data_parallel.uses_fsdp(run.optimizer.use_distributed_optimizer):
        # Start-up cost: torch's FSDP and DTensor take a second to import; only runs that shard pay it.
        from mega.core.parallel.fsdp import fully_shard_chunks

        layers_of = setup.family.compile_units or (lambda chunk: [])
        setup.chunks[:] = fully_shard_chunks(
            setup.chunks, layers_of, groups, strategy=run.data_parallel.strategy(run.optimizer.use_distributed_optimizer),
            replicas=run.data_parallel.replicas, compute_dtype=model_dtype(run.precision),
            reshard_after_forward=run.data_parallel.fsdp_reshard_after_forward,
            cpu_offload=run.data_parallel.cpu_offload,
            reduce_in_fp32=run.precision.accumulate_allreduce_grads_in_fp32 is not False)
        return
    config = DDPConfig(
        overlap_grad_reduce=run.optimizer.overlap_grad_reduce,
        use_distributed_optimizer=run.optimizer.use_distributed_optimizer,
        grad_reduce_in_fp32=grads_in_fp32(run.precision),
        gradient_accumulation_fusion=gradient_accumulation_fusion(run.precision, groups.device),
    )
    setup.chunks[:] = [DistributedDataParallel(chunk, groups, config) for chunk in setup.chunks]


def build_dtype(run) -> torch.dtype:
    """The dtype chunks are built in: fp32 under FSDP2, whose shards are the optimizer's main
    weights (its mixed-precision policy computes in the run's dtype), else the run's dtype."""
    if run.data_parallel.uses_fsdp(run.optimizer.use_distributed_optimizer):
        return torch.float32
    return model_dtype(run.precision)

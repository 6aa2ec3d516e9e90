"""``RunConfig``: every section of a training run, and the values derived from them.

Sections are the dataclasses whose fields declare the flags (see mega.core.config); the model
section is the chosen family's config class. :func:`derive` turns sizes into the numbers the loop
uses (data-parallel size, micro-batches per step, virtual stages) and fails early, naming the
flags, when they do not fit together or ask for something this installation cannot do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mega.core.config import ConfigError
from mega.core.kernels import KernelBackendError, get_attention_backend
from mega.core.parallel import ParallelConfig
from mega.core.plugins import PluginError
from mega.core.training.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    MoEConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainingConfig,
)

SECTIONS: dict[str, type] = {
    "training": TrainingConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "moe": MoEConfig,
}


@dataclass
class RunConfig:
    model: Any  # the model family's config (e.g. mega.models.TransformerConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


@dataclass(frozen=True)
class Derived:
    world_size: int
    data_parallel_size: int
    global_batch_size: int
    num_microbatches: int


def derive(run: RunConfig, world_size: int) -> tuple[RunConfig, Derived]:
    """Check the run against the world size; return it with derived fields filled in."""
    run = dataclasses.replace(run, model=_model_with_megatron_shorthands(run))
    check_supported(run)
    parallel = run.parallel
    nlpvs = run.training.num_layers_per_virtual_pipeline_stage
    if nlpvs is not None:
        layers_per_rank, rest = divmod(run.model.num_layers, parallel.pp)
        if rest or layers_per_rank % nlpvs:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {nlpvs} must divide the layers per pipeline "
                f"stage (--num-layers {run.model.num_layers} / --pipeline-model-parallel-size {parallel.pp})"
            )
        parallel = dataclasses.replace(parallel, vpp=layers_per_rank // nlpvs)
    try:
        dp = parallel.data_parallel_size(world_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    run.model.validate(parallel.tp)

    training = run.training
    per_step = training.micro_batch_size * dp
    global_batch = training.global_batch_size or per_step
    if global_batch % per_step:
        raise ConfigError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
            f"{training.micro_batch_size} x data-parallel size {dp} = {per_step}"
        )
    microbatches = global_batch // per_step
    if training.gradient_accumulation_steps not in (None, microbatches):
        raise ConfigError(
            f"--gradient-accumulation-steps {training.gradient_accumulation_steps} disagrees with "
            f"--global-batch-size {global_batch} / (--micro-batch-size {training.micro_batch_size} x dp {dp}) "
            f"= {microbatches}"
        )
    if (parallel.vpp or 1) > 1 and microbatches % parallel.pp:
        raise ConfigError(
            f"the interleaved schedule needs the micro-batches per step ({microbatches}) to be a multiple "
            f"of --pipeline-model-parallel-size {parallel.pp}"
        )
    run = dataclasses.replace(run, parallel=parallel)
    return run, Derived(world_size, dp, global_batch, microbatches)


def _model_with_megatron_shorthands(run: RunConfig):
    """Apply flags Megatron spells outside the model config: --recompute-activations, --use-flash-attn."""
    model = run.model
    if run.training.recompute_activations and model.recompute_granularity is None:
        model = dataclasses.replace(model, recompute_granularity="selective")
    if run.precision.use_flash_attn:
        model = dataclasses.replace(model, attention_backend="flash-attn")
    return model


def check_supported(run: RunConfig) -> None:
    """Fail, naming the flag and what is missing, for what this installation cannot run."""
    precision = run.precision
    if precision.fp8_hybrid or precision.transformer_impl == "transformer_engine" or precision.tp_comm_overlap:
        flag = ("--fp8-hybrid" if precision.fp8_hybrid else "--tp-comm-overlap" if precision.tp_comm_overlap
                else "--transformer-impl transformer_engine")
        raise ConfigError(
            f"{flag} needs NVIDIA Transformer Engine on a GPU (a kernel-backend plugin such as "
            f"mega-transformer-engine); none is installed here"
        )
    if run.moe.num_experts:
        raise ConfigError(
            "--num-experts (mixture of experts) needs an MoE model family (e.g. mixtral), which is not installed"
        )
    if run.parallel.ep > 1:
        raise ConfigError("--expert-model-parallel-size > 1 needs an MoE model (--num-experts)")
    if run.parallel.cp > 1:
        raise ConfigError("--context-parallel-size > 1: context parallelism is not available in this version")
    if run.optimizer.cpu_optimizer:
        raise ConfigError("--cpu-optimizer: optimizer offloading is not available in this version")
    try:
        get_attention_backend(run.model.attention_backend)
    except (KernelBackendError, PluginError) as error:
        hint = " (--use-flash-attn needs the flash-attn kernel plugin and a GPU)" if run.precision.use_flash_attn else ""
        raise ConfigError(f"{error}{hint}") from None
    checkpoint = run.checkpoint
    if checkpoint.save_interval is not None and checkpoint.save_interval < 1:
        raise ConfigError(f"--save-interval must be a positive number of iterations, got {checkpoint.save_interval}")
    if checkpoint.keep_last is not None and checkpoint.keep_last < 1:
        raise ConfigError(f"--keep-last must be at least 1, got {checkpoint.keep_last}")
    if (checkpoint.save_interval or checkpoint.async_save or checkpoint.keep_last) and not checkpoint.save:
        raise ConfigError("--save-interval, --async-save and --keep-last need --save DIR")

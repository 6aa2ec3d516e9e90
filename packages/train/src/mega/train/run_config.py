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
from mega.core.model_family import check_features
from mega.core.parallel import ParallelConfig
from mega.core.parallel.context_parallel import check_sequence_length
from mega.core.parallel.fsdp_config import DataParallelConfig, check_sharding
from mega.core.pipeline.config import PipelineConfig
from mega.core.pipeline.layout import layers_per_stage, layout_stage_count
from mega.core.pipeline.schedule_table import V_SCHEDULES
from mega.core.plugins import get_plugins
from mega.train.config import (
    CheckpointConfig,
    DataConfig,
    KernelConfig,
    LoggingConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainingConfig,
)

SECTIONS: dict[str, type] = {
    "training": TrainingConfig,
    "parallel": ParallelConfig,
    "pipeline": PipelineConfig,
    "data_parallel": DataParallelConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "kernels": KernelConfig,
}


def run_sections(model_config_class: type) -> dict[str, type]:
    """The model section then the others; a section whose every field the model's config declares
    itself is left to the model, so each flag is declared once. (The MoE flags, --num-experts and
    --moe-*, are the MoE families' own: see mega.core.model_family.check_flag_of_other_families.)"""
    model_fields = {field.name for field in dataclasses.fields(model_config_class)}
    return {"model": model_config_class,
            **{name: cls for name, cls in SECTIONS.items()
               if not {field.name for field in dataclasses.fields(cls)} <= model_fields}}


@dataclass
class RunConfig:
    model: Any  # the model family's config (e.g. mega.models.TransformerConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    data_parallel: DataParallelConfig = dataclasses.field(default_factory=DataParallelConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    # The options plugins declare, by plugin name: run_config.plugins["loss_csv"] (see
    # mega.core.plugins.options); empty where the run was not parsed from flags or TOML.
    plugins: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Derived:
    world_size: int
    data_parallel_size: int
    global_batch_size: int
    num_microbatches: int


def derive(run: RunConfig, world_size: int) -> tuple[RunConfig, Derived]:
    """Check the run against the world size; return it with derived fields filled in."""
    run = dataclasses.replace(run, model=model_with_megatron_shorthands(run),
                              kernels=_kernels_with_megatron_shorthands(run))
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
    parallel = _vpp_of_schedule(run, _vpp_of_layout(run.pipeline, parallel))
    try:
        dp = parallel.data_parallel_size(world_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    run = check_sharding(run, dp)
    run.model.validate(parallel.tp)
    try:
        check_sequence_length(run.model.seq_length, parallel.cp)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_layout = getattr(run.model, "validate_parallel", None)  # a family's own layout needs (experts / ep)
    if check_layout is not None:
        check_layout(parallel)

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
    if (parallel.vpp or 1) > 1 and microbatches % parallel.pp and run.pipeline.pipeline_schedule not in V_SCHEDULES:
        raise ConfigError(
            f"the interleaved schedule needs the micro-batches per step ({microbatches}) to be a multiple "
            f"of --pipeline-model-parallel-size {parallel.pp}"
        )
    try:
        layers_per_stage(run.pipeline, getattr(run.model, "num_layers", 0), parallel.pp, parallel.vpp or 1)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    run = dataclasses.replace(run, parallel=parallel)
    return run, Derived(world_size, dp, global_batch, microbatches)


def _vpp_of_schedule(run: RunConfig, parallel: ParallelConfig) -> ParallelConfig:
    """zbv and dualpipev run two model chunks per rank in a V (vpp 2 unless set otherwise). (No
    zero-bubble schedule runs under FSDP: check_sharding says so.)"""
    schedule = run.pipeline.pipeline_schedule
    if schedule not in V_SCHEDULES:
        return parallel
    if parallel.pp < 2:
        raise ConfigError(f"--pipeline-schedule {schedule} needs --pipeline-model-parallel-size of 2 or more")
    if (parallel.vpp or 2) != 2:
        raise ConfigError(f"--pipeline-schedule {schedule} runs two model chunks per pipeline rank in a V; got "
                          f"{parallel.vpp} virtual stages per rank")
    if not getattr(run.model, "untie_embeddings_and_output_weights", True):
        raise ConfigError(f"--pipeline-schedule {schedule} puts the embedding and the output layer on the first "
                          f"rank, as two model chunks: untie them (--untie-embeddings-and-output-weights)")
    return dataclasses.replace(parallel, vpp=2)


def _vpp_of_layout(pipeline: PipelineConfig, parallel: ParallelConfig) -> ParallelConfig:
    """--pipeline-model-parallel-layout spells out pp*vpp stages: it sets vpp, as in Megatron."""
    try:
        stages = layout_stage_count(pipeline)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if stages is None:
        return parallel
    if stages % parallel.pp:
        raise ConfigError(f"--pipeline-model-parallel-layout has {stages} stages, not a multiple of "
                          f"--pipeline-model-parallel-size {parallel.pp}")
    vpp = stages // parallel.pp
    if (parallel.vpp or 1) not in (1, vpp):
        raise ConfigError(f"--pipeline-model-parallel-layout has {stages} stages = {vpp} per pipeline rank, but "
                          f"the virtual stages per rank are {parallel.vpp}")
    return dataclasses.replace(parallel, vpp=vpp if vpp > 1 else None)


def model_with_megatron_shorthands(run: RunConfig):
    """Apply the flag Megatron spells outside the model config: --recompute-activations."""
    model = run.model
    if run.training.recompute_activations and getattr(model, "recompute_granularity", "") is None:
        model = dataclasses.replace(model, recompute_granularity="selective")
    return model


def _kernels_with_megatron_shorthands(run: RunConfig) -> KernelConfig:
    """--use-flash-attn and --transformer-impl transformer_engine pick kernel backends."""
    kernels = run.kernels
    if run.precision.use_flash_attn and kernels.attention_backend is None:
        kernels = dataclasses.replace(kernels, attention_backend="flash-attn")
    if run.precision.transformer_impl == "transformer_engine" and kernels.kernels is None:
        kernels = dataclasses.replace(kernels, kernels="transformer-engine")
    return kernels


def check_supported(run: RunConfig, family=None, plugins=None) -> None:
    """Fail, naming the flag and what is missing, for what this installation cannot run. Each section
    checks its own flags, asking the registries (model family features, kernel backends, optimizers)
    and assuming nothing; the model's config checks its own in :func:`derive`."""
    if plugins is None:
        plugins = get_plugins()
    family = family or plugins.models.get(run.training.model_family)
    check_features(family, run.parallel.features_asked(), plugins.models)
    run.kernels.check(run.parallel.tp, plugins, requested_by=run.precision.kernel_request())
    run.precision.check_kernel_features(run.kernels.kernels, plugins)
    run.optimizer.check_available(plugins)
    run.kernels.check_compile(run.model)
    run.checkpoint.check()

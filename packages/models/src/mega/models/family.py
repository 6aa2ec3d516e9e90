"""The ``ModelFamily`` of a decoder-only LM, shared by GPT and LLaMA (they differ only in their
presets): build a stage, make it parallel, start its parameters, compute its loss."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import HFMapping, LossContext, ModelFamily, ParallelContext, Stage
from mega.core.parallel import ParallelConfig
from mega.core.parallel.context_parallel import sequence_mean
from mega.core.setup_passes import ModelSetup
from mega.models.blocks.language_model import (
    LanguageModel,
    fused_linear_cross_entropy,
    per_token_cross_entropy,
)
from mega.models.config import TransformerConfig
from mega.models.flops import num_floating_point_operations
from mega.models.initialization import init_parameter
from mega.models.memory import stage_footprint
from mega.models.parallel_plan import tensor_parallel_plan, with_fused_mlps
from mega.models.parallelize import transformer_passes
from mega.models.parameter_count import num_parameters


def build_language_model(config: TransformerConfig, stage: Stage, *, kernels: Kernels,
                         parallel: ParallelConfig, context: ParallelContext | None = None) -> LanguageModel:
    return LanguageModel(config, stage, kernels, parallel, context)


def language_model_plan(model: LanguageModel, setup: ModelSetup) -> dict:
    """The dense transformer's tensor plan (the MLP split whole where a ``norm_mlp`` kernel made
    it one module)."""
    plan = tensor_parallel_plan(setup.config, model.stage)
    if any(layer.fused_mlp for layer in model.decoder.layers.values()):
        plan = with_fused_mlps(plan)
    return plan


LANGUAGE_MODEL_PASSES = transformer_passes(language_model_plan)


def language_model_loss(outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor],
                        context: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean cross-entropy over the tokens ``loss_mask`` keeps (of the whole sequence when the
    context group splits it); logged as Megatron's ``lm loss``."""
    labels, loss_mask = batch["labels"], batch["loss_mask"]
    vocab_size = context.config.vocab_size
    if "output_hidden" in outputs:  # a fused linear_loss kernel: no logits were made
        total = fused_linear_cross_entropy(context.kernels, outputs["output_hidden"], outputs["output_weight"],
                                           labels, loss_mask, context.tp_group, vocab_size)
    else:
        logits = outputs["logits"]  # [s, b, vocab (shard)]
        per_token = per_token_cross_entropy(context.kernels, logits, labels, context.tp_group, vocab_size,
                                            fused=getattr(context.config, "cross_entropy_loss_fusion", False))
        total = (per_token * loss_mask).sum()
    loss, mean = sequence_mean(total, loss_mask.sum(), context.cp_group)
    return loss, {"lm loss": mean}


def transformer_layers(model: LanguageModel) -> list[nn.Module]:
    """What ``--compile`` compiles one by one: each transformer layer of the stage."""
    return list(model.decoder.layers.values())


def transformer_family(name: str, presets: Mapping[str, TransformerConfig], description: str,
                       hf_mapping: HFMapping | None = None, config_class: type = TransformerConfig) -> ModelFamily:
    return ModelFamily(
        name=name,
        config_class=config_class,
        presets=presets,
        build=build_language_model,
        init_parameter=init_parameter,
        loss=language_model_loss,
        num_parameters=num_parameters,
        num_floating_point_operations=num_floating_point_operations,
        tensor_parallel_plan=tensor_parallel_plan,
        setup_passes=LANGUAGE_MODEL_PASSES,
        description=description,
        hf_mapping=hf_mapping,
        memory_model=stage_footprint,
        compile_units=transformer_layers,
        features=frozenset({"context_parallel"}),
    )

"""Making a built stage parallel from outside: explicit passes over the stage, in a fixed order.

A family builds its stage as single-device code (:func:`mega.core.build.build_stage` builds it
on the meta device); its ``parallelize`` (the :class:`~mega.core.model_family.ModelFamily` hook,
``parallelize(stage, groups, run)``) then applies passes to it. Each pass is a function of the
stage and of exactly what it needs (groups, config, flags), changes modules in place and keeps
every parameter name (checkpoints depend on them). The order:

1. Family passes that need the whole weights: the experts this rank keeps
   (:func:`mega.models.moe_model.apply_expert_parallel`), T5's relative-position tables split by
   heads (:func:`mega.models.t5.family.shard_relative_position_tables`).
2. Tensor and sequence parallelism by the family's plan:
   :func:`mega.core.parallel.tensor_parallel.apply_tensor_parallel` ``(stage, plan, groups,
   sequence_parallel=)``; then family passes that amend it (BERT's heads see the whole sequence:
   :func:`mega.models.bert.keep_heads_whole`); :func:`apply_head_norm_grad_sum` (QK-norm weights
   see only a rank's own heads).
3. :func:`apply_attention_dropout_rng` ``(stage, rng_tracker, sequence_parallel)``: dropout over
   a rank's own attention heads draws from the RNG tracker's model-parallel stream.
4. :func:`apply_sequence_parallel_rng` ``(stage, rng_tracker, sequence_parallel)``: under
   sequence parallelism every layer stack runs in that stream (Megatron's convention).
5. :func:`apply_recompute` ``(stage, config, rng_tracker, training)``: full recompute of runs of
   layers, or selective recompute of the attention core.
6. :func:`apply_cp` ``(stage, groups, config, parallel)``: attention over the context group.
   Last, since it replaces the attention cores the passes before it set up.

:func:`parallelize` applies 2-6 (GPT, LLaMA, Mixtral after its expert pass, BERT before its
heads pass); T5 applies 1-3 (:func:`mega.models.t5.family.parallelize_t5`).

Adding a pass (FSDP, FP8, LoRA, ...): write ``apply_<what>(stage, <what it needs>) -> None``,
finding the modules it changes in ``stage.modules()`` by class (:func:`modules_of`); call it
from :func:`parallelize` (and from a family's own ``parallelize`` where it applies) at its place
in the order; and add it to the list above.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from mega.core.model_family import StageRun
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel.param_attrs import mark_sequence_parallel
from mega.core.parallel.plan import PlanStyle
from mega.core.parallel.tensor_parallel import apply_tensor_parallel
from mega.models.attention import CoreAttention, SelfAttention
from mega.models.config import TransformerConfig
from mega.models.context_parallel import ContextParallelAttention, check_context_parallel
from mega.models.layer_stack import LayerStack
from mega.models.mla import MultiLatentAttention
from mega.models.recompute import layer_runs

# The self-attention modules whose core the recompute and context-parallel passes set up.
ATTENTIONS = (SelfAttention, MultiLatentAttention)


def parallelize(stage: nn.Module, groups: ParallelGroups, run: StageRun, plan: Mapping[str, PlanStyle]) -> nn.Module:
    """Passes 2-6 of the module docstring, in order; returns ``stage``."""
    sequence_parallel = run.parallel.sequence_parallel
    apply_tensor_parallel(stage, plan, groups, sequence_parallel=sequence_parallel)
    apply_head_norm_grad_sum(stage, groups)
    apply_attention_dropout_rng(stage, run.rng_tracker, sequence_parallel)
    apply_sequence_parallel_rng(stage, run.rng_tracker, sequence_parallel)
    apply_recompute(stage, run.config, run.rng_tracker, run.training)
    apply_cp(stage, groups, run.config, run.parallel)
    return stage


def modules_of(stage: nn.Module, kind: type) -> list:
    """The modules of ``stage`` that are ``kind``s, listed first so a pass may replace them."""
    return [module for module in stage.modules() if isinstance(module, kind)]


def apply_head_norm_grad_sum(stage: nn.Module, groups: ParallelGroups) -> None:
    """QK-norm weights are whole on every tensor rank but each rank normalises only its own heads,
    so their gradients are summed over the tensor group (marked as the sequence-parallel norms are,
    which DDP sums; Megatron-Core's ``average_gradients_across_tp_domain``)."""
    if groups.tp.size <= 1:
        return
    for attention in modules_of(stage, SelfAttention):
        for norm in (attention.q_layernorm, attention.k_layernorm):
            for param in norm.parameters() if norm is not None else ():
                mark_sequence_parallel(param)


def apply_attention_dropout_rng(stage: nn.Module, rng_tracker, sequence_parallel: bool) -> None:
    """Each attention core's dropout forks into ``rng_tracker``'s model-parallel stream: the heads
    are this rank's own, so their masks must differ between tensor-parallel ranks. Not under
    sequence parallelism, where the whole stack already runs in that stream (pass 4)."""
    for core in modules_of(stage, CoreAttention):
        core.dropout_rng_tracker = None if sequence_parallel else rng_tracker


def apply_sequence_parallel_rng(stage: nn.Module, rng_tracker, sequence_parallel: bool) -> None:
    """Under sequence parallelism every activation of a layer stack is this rank's slice of the
    sequence, so each stack draws all its dropout from ``rng_tracker``'s model-parallel stream."""
    for stack in modules_of(stage, LayerStack):
        stack.rng_stream = rng_tracker if sequence_parallel else None


def apply_recompute(stage: nn.Module, config: TransformerConfig, rng_tracker, training: bool) -> None:
    """``--recompute-granularity full``: each layer stack recomputes the runs of layers
    :func:`~mega.models.recompute.layer_runs` chooses; ``selective``: each self-attention
    recomputes its core. Recomputed regions replay ``rng_tracker``'s streams, so dropout draws
    the same masks again. Nothing is recomputed in a stage that is not trained."""
    for stack in modules_of(stage, LayerStack):
        stack.recompute_rng_tracker = rng_tracker
        if training:
            stack.recompute_runs = layer_runs(config, len(stack.layers))
    selective = training and config.recompute_granularity == "selective"
    for attention in modules_of(stage, ATTENTIONS):
        attention.recompute_core = selective
        attention.recompute_rng_tracker = rng_tracker


def apply_cp(stage: nn.Module, groups: ParallelGroups, config: TransformerConfig, parallel: ParallelConfig) -> None:
    """Swap every self-attention's core for :class:`ContextParallelAttention` over ``groups.cp``
    (nothing when the context group is one rank); refuses what context parallelism cannot run."""
    if groups.cp.size <= 1:
        return
    check_context_parallel(config, parallel)
    for attention in modules_of(stage, ATTENTIONS):
        attention.core_attention = ContextParallelAttention(attention.core_attention, groups, parallel.cp_comm_type)

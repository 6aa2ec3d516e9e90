"""Making a built stage parallel from outside: the model families' setup passes.

A family builds its stage as single-device code (:func:`mega.core.build.build_model` builds it on
the meta device) and names its passes of the model setup (``ModelFamily.setup_passes``), each a
:class:`~mega.core.setup_passes.SetupPass` at its :class:`~mega.core.setup_passes.Phase`; the
core's one runner (:func:`mega.core.setup_passes.run_setup`) runs them with its own and a run's
passes (LoRA, FP8, compile, tying, data parallelism) in phase order. Each pass is a function of a
chunk and of exactly what it needs (groups, config, flags), changes modules in place and keeps
every parameter name (checkpoints depend on them). The dense transformer's (:func:`transformer_passes`):

* ``EXPERT_PARALLEL`` (mixtures of experts only): the experts this rank keeps
  (:func:`mega.models.mixtral.model.apply_expert_parallel`; the layers route over the groups they
  were built with).
* ``TENSOR_PARALLEL``, one pass in this order: the family's plan
  (:func:`mega.core.parallel.tensor_parallel.apply_tensor_parallel` ``(stage, plan, groups,
  sequence_parallel=)``); the family's amendments (BERT's heads see the whole sequence); :func:`apply_head_norm_grad_sum` (QK-norm weights see only a rank's own heads).
* ``CONTEXT_PARALLEL``: :func:`apply_cp`, attention over the context group.
* ``RECOMPUTE``: :func:`apply_recompute`, full recompute of runs of layers or selective recompute
  of the attention core (after the adapters and FP8 layers, before compile).

T5 names its own tensor-parallel pass (:func:`mega.models.t5.family.parallelize_t5`).

Process groups, sequence parallelism and dropout streams are not set here: the modules take
them at construction from the :class:`~mega.core.model_family.ParallelContext` the core hands the
family's ``build`` (experts and multi-latent attention their groups; attention cores, and under
sequence parallelism whole layer stacks, the RNG tracker's model-parallel stream). What the passes
still set on modules: the recompute flags (a phase of its own, which a run may leave out).

Adding a pass: write ``apply_<what>(stage, <what it needs>) -> None``, finding the modules it
changes in ``stage.modules()`` by class (:func:`modules_of`); give it a phase with
:func:`mega.core.setup_passes.per_chunk` in a family's ``setup_passes`` (or, for every family of a
run, through the ``register_setup_passes`` hook); and add it to the list above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from torch import nn

from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel.param_attrs import mark_sequence_parallel
from mega.core.parallel.plan import PlanStyle
from mega.core.parallel.tensor_parallel import apply_tensor_parallel
from mega.core.setup_passes import ModelSetup, Phase, SetupPass, per_chunk
from mega.models.blocks.attention import SelfAttention
from mega.models.blocks.context_parallel import ContextParallelAttention, check_context_parallel
from mega.models.blocks.layer_stack import LayerStack
from mega.models.blocks.mla import MultiLatentAttention
from mega.models.blocks.recompute import layer_runs
from mega.models.config import TransformerConfig

# The self-attention modules whose core the recompute and context-parallel passes set up.
ATTENTIONS = (SelfAttention, MultiLatentAttention)


PlanOf = Callable[[nn.Module, ModelSetup], Mapping[str, PlanStyle]]
Amendment = Callable[[nn.Module, ModelSetup], None]


def transformer_passes(plan_of: PlanOf, amendments: Iterable[Amendment] = ()) -> tuple[SetupPass, ...]:
    """The tensor-parallel, context-parallel and recompute passes of the module docstring, with
    ``plan_of(chunk, setup)`` the tensor plan and ``amendments`` run right after it."""
    return (tensor_parallel_pass(plan_of, amendments),
            per_chunk("context-parallel", Phase.CONTEXT_PARALLEL, _context_parallel,
                      "self-attention over the context group (--context-parallel-size)"),
            per_chunk("recompute", Phase.RECOMPUTE, _recompute,
                      "activation recompute of layer runs or attention cores (--recompute-*)"))


def tensor_parallel_pass(plan_of: PlanOf, amendments: Iterable[Amendment] = ()) -> SetupPass:
    amendments = tuple(amendments)

    def apply(stage: nn.Module, setup: ModelSetup) -> None:
        sequence_parallel = setup.parallel.sequence_parallel
        apply_tensor_parallel(stage, plan_of(stage, setup), setup.groups, sequence_parallel=sequence_parallel)
        for amend in amendments:
            amend(stage, setup)
        apply_head_norm_grad_sum(stage, setup.groups)

    return per_chunk("tensor-parallel", Phase.TENSOR_PARALLEL, apply,
                     "the family's tensor plan and sequence parallelism")


def _context_parallel(stage: nn.Module, setup: ModelSetup) -> None:
    apply_cp(stage, setup.groups, setup.config, setup.parallel)


def _recompute(stage: nn.Module, setup: ModelSetup) -> None:
    apply_recompute(stage, setup.config, setup.rng_tracker, setup.training)


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


def apply_recompute(stage: nn.Module, config: TransformerConfig, rng_tracker, training: bool) -> None:
    """``--recompute-granularity full``: each layer stack recomputes the runs of layers
    :func:`~mega.models.blocks.recompute.layer_runs` chooses; ``selective``: each self-attention
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

"""``ModelFamily``: what a model plugin hands the core - the behaviour of one kind of model.

A family (``gpt``, ``llama``, a third party's) is registered with ``register_models``. The core
never imports a model package: training, inference, checkpoint loading and conversion all build
a rank's part of a model with :func:`mega.core.build.build_stage`, which asks the family

* ``pipeline_stages(config, pp, vpp, layers_per_stage=None)``: the virtual stages of the model, in
  pipeline order, each a :class:`Stage` (which layers of which stack it holds, which micro-batch
  fields it reads); ``layers_per_stage`` an uneven split (:mod:`mega.core.pipeline.layout`);
* ``build(config, stage, kernels, parallel, context)``: the stage as single-device code (built
  on the ``meta`` device by the core; nothing allocated), asking ``kernels`` for its components;
  its modules take the layout they run in (groups, sequence parallelism, RNG tracker) at
  construction from ``context`` (:class:`ParallelContext`), not as attributes written later;
* ``setup_passes``: its passes of the model setup (:mod:`mega.core.setup_passes`), each at
  its phase - experts, tensor and sequence parallelism, context parallelism, recompute; a family
  without them has its ``parallelize(module, groups, run)`` run as its one tensor-parallel pass,
  or else its ``tensor_parallel_plan`` applied;
* ``init_parameter(config, name)``: how the parameter ``name`` (its global name) starts, which
  the core applies per name and seed on whatever shard a rank holds.

Between stages the pipeline carries a dict of named tensors whose shapes the family declares
(``boundary``). A stage module is called with a dict: the micro-batch (dict of the batch fields,
``batch_keys``) on the first stage, the tensors that crossed in on later ones (plus the batch
fields the stage reads); it returns the dict it sends on, or, on the last stage, what ``loss``
takes. ``loss(outputs, batch, context)`` returns ``(loss, metrics)``: the scalar to
differentiate (this micro-batch's mean) and named scalars the loop averages over micro-batches
and data-parallel ranks and logs (``lm loss``; auxiliary losses of MoE, BERT's sentence loss).

Parameter names are global and layout-independent (layer ``N`` is ``decoder.layers.N`` on
whichever stage holds it), so checkpoints of every layout line up. A family that has a Hugging
Face counterpart describes it with an :class:`HFMapping`; converters read and write Hugging Face
directories through it one :class:`TensorMap` at a time.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mega.core.config import ConfigError
from mega.core.config.parser import known_flags
from mega.core.parallel.config import ParallelConfig
from mega.core.parallel.tensor_parallel import apply_tensor_parallel
from mega.core.pipeline.partition import split_layers
from mega.core.pipeline.tensor_spec import TensorSpec  # noqa: F401  (part of the family contract: ``boundary``)
from mega.core.plugins import PluginError
from mega.core.setup_passes import ModelSetup, Phase, SetupPass, per_chunk

if TYPE_CHECKING:
    from torch import nn

    from mega.core.parallel.groups import ParallelGroups
    from mega.core.parallel.plan import PlanStyle


@dataclass(frozen=True)
class TensorMap:
    """A few tensors under mega's global names <-> the same weights under another layout's names,
    converted together (one layer's fused QKV <-> its separate q/k/v projections, say).

    ``to_mega(*other_tensors) -> tuple`` takes the ``other`` tensors in order and returns the
    ``mega`` ones in order; ``from_mega`` is its exact inverse. Both are pure reshapes, splits
    and concatenations, so they also run on ``meta`` tensors to tell shapes without data.
    ``vocab``: the first dimension of the mega tensors is vocabulary rows, padded in mega
    (``padded_vocab_size``) and exactly ``vocab_size`` rows on the other side.
    """

    mega: tuple[str, ...]
    other: tuple[str, ...]
    to_mega: Callable[..., tuple]
    from_mega: Callable[..., tuple]
    vocab: bool = False


@dataclass(frozen=True)
class HFMapping:
    """How a family's models are laid out as a Hugging Face ``transformers`` model.

    * ``architecture`` / ``model_type``: config.json's ``architectures[0]`` and ``model_type``.
    * ``base_model_prefix``: the prefix of the base model's tensors (``"model."``); checkpoints
      saved from the base model alone lack it.
    * ``config_from_hf(config_json: Mapping) -> config`` and ``config_to_hf(config) -> dict``:
      config.json contents (transformers' defaults for absent keys) <-> the family's config; both
      raise ``ValueError`` naming the field when the other side cannot express the model.
    * ``tensor_maps(config) -> list[TensorMap]``: every weight of the model, in checkpoint
      order (embeddings, layer 0, layer 1, ..., final norm, output layer).
    * ``ignored``: regular expressions of Hugging Face tensors that no map takes and that are
      skipped when present (buffers some versions saved, a tied output layer's duplicate).
    * ``also_reads``: further ``architectures`` read as this family (BERT's ``BertModel`` and
      ``BertForMaskedLM`` beside ``BertForPreTraining``); ``config_from_hf`` tells them apart.
    * ``optional``: regular expressions of Hugging Face tensors a directory may lack (the heads
      a bare base model has not); a map all of whose tensors are absent is initialised by the
      family's ``init_parameter`` instead, and the converter says so.
    * ``copies(config) -> {name: name it repeats}``: tensors a directory may hold twice (a tied
      output layer beside the embedding), by Hugging Face name; read, each must equal the other.
    * ``buffers(config) -> {name: tensor}``: the non-parameter buffers some transformers versions
      saved (position ids, causal masks), as transformers computes them; read, each must equal
      its value. Copies and buffers a directory held are written back when it round-trips.
    """

    architecture: str
    model_type: str
    base_model_prefix: str
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    config_to_hf: Callable[[Any], dict]
    tensor_maps: Callable[[Any], list[TensorMap]]
    ignored: tuple[str, ...] = ()
    also_reads: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    copies: Callable[[Any], dict[str, str]] | None = None
    buffers: Callable[[Any], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Stage:
    """One virtual pipeline stage: the part of the model one model chunk holds.

    ``layers`` maps a stack's name to its layer numbers held here (``{"decoder": range(4, 8)}``;
    an encoder-decoder stage may hold parts of both stacks). ``batch_keys``: the micro-batch
    fields this stage's forward reads besides what crosses in from the previous stage (the
    first stage's tokens, a decoder's first stage's decoder inputs).
    """

    index: int
    num_stages: int
    layers: Mapping[str, range]
    batch_keys: tuple[str, ...] = ()

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass(frozen=True)
class StageRun:
    """What ``parallelize`` may need of the run besides the groups: the model config, the
    layout, the RNG tracker whose streams dropout forks into (None: one stream) and whether the
    stage will be trained (recompute and dropout forks only matter then)."""

    config: Any
    parallel: ParallelConfig
    rng_tracker: Any = None
    training: bool = True


@dataclass(frozen=True)
class ParallelContext:
    """What the modules of a stage take at construction about the layout they run in (the one
    context a family's ``build`` hands down, when it declares a ``context`` argument):

    * ``groups``: the process groups, for modules that communicate themselves (experts over the
      expert group, multi-latent attention's shared rope key over the tensor group); None: one device;
    * ``sequence_parallel``: activations between the tensor-parallel regions are sequence shards;
    * ``rng_tracker``: the tracker whose model-parallel stream a rank's own shards draw dropout
      from (attention over its heads; every layer of a stack under sequence parallelism); None:
      the default stream.
    """

    groups: ParallelGroups | None = None
    sequence_parallel: bool = False
    rng_tracker: Any = None

    @property
    def attention_dropout_tracker(self) -> Any:
        """The tracker an attention core forks its dropout into: not under sequence parallelism,
        where the whole stack already runs in its stream (:attr:`stack_dropout_tracker`)."""
        return None if self.sequence_parallel else self.rng_tracker

    @property
    def stack_dropout_tracker(self) -> Any:
        """The tracker a layer stack runs in (sequence parallelism, Megatron's convention)."""
        return self.rng_tracker if self.sequence_parallel else None


@dataclass(frozen=True)
class LossContext:
    """What a family's loss needs besides outputs and batch: the config, the tensor group over
    which the last stage's vocabulary (or other output) is split, the kernels (the loss
    head is a kernel kind) and the context group over which the sequence is split (a loss over
    the sequence sums over it: :func:`mega.core.parallel.context_parallel.sequence_mean`)."""

    config: Any
    tp_group: Any = None
    kernels: Any = None
    cp_group: Any = None


def stack_stages(config: Any, pp: int, vpp: int = 1, layers_per_stage: Sequence[int] | None = None, *,
                 stack: str = "decoder", batch_keys: tuple[str, ...] = ("tokens", "position_ids", "document_ids")
                 ) -> list[Stage]:
    """The default ``pipeline_stages``: one stack of ``config.num_layers`` layers split evenly, or
    ``layers_per_stage[i]`` layers on virtual stage ``i`` (Megatron's interleaved assignment with
    ``vpp`` chunks); the first stage reads the tokens (and the positions and ``document_ids`` of
    packed rows where the samples have them)."""
    per_rank = split_layers(config.num_layers, pp, vpp, layers_per_stage)
    ranges = [per_rank[index % pp][index // pp] for index in range(pp * vpp)]
    return [Stage(index, pp * vpp, {stack: layers}, batch_keys if index == 0 else ())
            for index, layers in enumerate(ranges)]


def hidden_boundary(config: Any, stage: Stage, micro_batch_size: int, parallel: ParallelConfig,
                    dtype: torch.dtype) -> dict[str, TensorSpec]:
    """The default ``boundary``: one ``hidden`` tensor ``[seq, micro-batch, hidden]`` (the
    sequence split over the tensor group under sequence parallelism, and over the context group)."""
    seq = config.seq_length // parallel.cp
    if parallel.sequence_parallel:
        seq //= parallel.tp
    return {"hidden": TensorSpec((seq, micro_batch_size, config.hidden_size), dtype)}


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config class and presets, and how to build and describe a model.

    Building (see the module docstring and :func:`mega.core.build.build_stage`):

    * ``build(config, stage, *, kernels, parallel, context=None) -> nn.Module``: the stage
      module, written for one device; it keeps ``stage`` as its ``stage`` attribute. ``kernels``
      (:class:`mega.core.kernels.Kernels`) gives the components the user selected (attention,
      norms, linear layers...); ``parallel`` the layout shapes are padded for; ``context`` (a
      :class:`ParallelContext`, only to a builder that declares the argument) the process groups,
      sequence parallelism and RNG tracker its modules take at construction.
    * ``init_parameter(config, name) -> fill(tensor, generator)``: fills a block of whole rows
      (dimension 0) of the global parameter ``name``; the core seeds ``generator`` from the seed,
      the name and the block, so every layout starts from the same model.
    * ``setup_passes``: the family's passes (:class:`~mega.core.setup_passes.SetupPass`: experts,
      tensor plan and dropout streams, context parallelism, recompute), each at its phase, which
      every build runs with the core's and the run's (:meth:`layout_passes`). A family without
      them may give ``tensor_parallel_plan(config, stage) -> {module-name pattern: style}`` for
      :func:`mega.core.parallel.tensor_parallel.apply_tensor_parallel`, or ``parallelize(module,
      groups, run: StageRun) -> nn.Module``, run as its one tensor-parallel pass.
    * ``pipeline_stages(config, pp, vpp, layers_per_stage=None) -> list[Stage]`` (default
      :func:`stack_stages`); a family that lays its stages out itself may leave out
      ``layers_per_stage`` and then refuses uneven layouts (:meth:`stages`).
    * ``boundary(config, stage, micro_batch_size, parallel, dtype) -> {name: TensorSpec}``: what
      ``stage`` sends to the next stage (default :func:`hidden_boundary`).
    * ``batch_keys``: the micro-batch fields the family's stages and loss read.
    * ``datasets``: the registered dataset builders (:mod:`mega.core.datasets`) that make those
      fields: ``(from --data-path, for --mock-data)``; GPT's samples by default.
    * ``loss(outputs, batch, context: LossContext) -> (loss, metrics)``.

    Describing: ``num_parameters(config, tensor_parallel_size=1) -> int`` (whole model, vocabulary
    padded for that tp, without allocating), ``num_floating_point_operations(config,
    batch_size) -> float`` (one iteration, forward and backward, for throughput and MFU) and
    ``hf_mapping`` (:class:`HFMapping`), if the family has a Hugging Face counterpart.
    ``features``: capabilities beyond a dense model that flags may ask for (``"moe"``,
    ``"context_parallel"``); the core refuses such flags for a family without them.
    * ``memory_model(config, *, layers, first_layer, pre_process, post_process, parallel,
      micro_batch_size, dtype_bytes, device_type="cuda") -> StageFootprint``: parameters and saved
      activations of one rank of a stage of ``layers`` layers from layer ``first_layer`` on (:mod:`mega.core.footprint`), for
      `mega plan`; None if the family cannot tell.
    * ``compile_units(module) -> modules``: what ``--compile`` compiles one by one in a built
      stage (torchtitan compiles each transformer layer: small graphs, compiled once and reused
      by every layer of the same shape); None: the whole stage module.
    """

    name: str
    config_class: type
    presets: Mapping[str, Any]
    build: Callable[..., nn.Module]
    init_parameter: Callable[[Any, str], Callable]
    loss: Callable[..., tuple]
    num_parameters: Callable[..., int]
    num_floating_point_operations: Callable[[Any, int], float]
    tensor_parallel_plan: Callable[..., dict[str, PlanStyle]] | None = None
    parallelize: Callable[..., nn.Module] | None = None
    pipeline_stages: Callable[..., list[Stage]] = stack_stages
    boundary: Callable[..., dict[str, TensorSpec]] = hidden_boundary
    batch_keys: tuple[str, ...] = ("tokens", "labels", "loss_mask")
    datasets: tuple[str, str] = ("gpt", "mock")
    features: frozenset[str] = frozenset()
    description: str = ""
    hf_mapping: HFMapping | None = None
    memory_model: Callable[..., Any] | None = None
    compile_units: Callable[[nn.Module], Iterable[nn.Module]] | None = None
    setup_passes: tuple[SetupPass, ...] = ()

    def preset(self, name: str, **overrides: Any) -> Any:
        """The config of preset ``name``, with ``overrides`` replacing fields (e.g. seq_length).

        Sizes the preset derived from others (``ffn_hidden_size`` from ``hidden_size``...) stay as
        they are unless overridden too.
        """
        try:
            config = self.presets[name]
        except KeyError:
            raise KeyError(
                f"model family {self.name!r} has no preset {name!r}; presets: {', '.join(self.presets)}"
            ) from None
        return dataclasses.replace(config, **overrides) if overrides else config

    def layout_passes(self) -> list[SetupPass]:
        """The family's passes of every build: ``setup_passes``, or else one tensor-parallel pass
        (:meth:`parallelize_stage`)."""
        if self.setup_passes:
            return list(self.setup_passes)
        return [per_chunk("tensor-parallel", Phase.TENSOR_PARALLEL, self._parallelize_chunk)]

    def _parallelize_chunk(self, chunk: nn.Module, setup: ModelSetup) -> nn.Module:
        run = StageRun(setup.config, setup.parallel, setup.rng_tracker, setup.training)
        return self.parallelize_stage(chunk, setup.groups, run)

    def parallelize_stage(self, module: nn.Module, groups: ParallelGroups, run: StageRun) -> nn.Module:
        """The family's ``parallelize``, or else its tensor-parallel plan applied to ``module``."""
        if self.parallelize is not None:
            return self.parallelize(module, groups, run)
        plan = self.tensor_parallel_plan(run.config, module.stage) if self.tensor_parallel_plan else {}
        return apply_tensor_parallel(module, plan, groups, sequence_parallel=run.parallel.sequence_parallel)

    def stages(self, config: Any, pp: int, vpp: int = 1, layers_per_stage: Sequence[int] | None = None) -> list[Stage]:
        """``pipeline_stages``, with an uneven split where one is given and the family takes it."""
        if layers_per_stage is None:
            return self.pipeline_stages(config, pp, vpp)
        if "layers_per_stage" not in inspect.signature(self.pipeline_stages).parameters:
            raise ValueError(f"the {self.name} family lays out its pipeline stages itself: it takes no uneven "
                             f"layout (--decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split, "
                             f"--pipeline-model-parallel-layout)")
        return self.pipeline_stages(config, pp, vpp, layers_per_stage=layers_per_stage)

    def whole_model(self, config: Any) -> Stage:
        """The one stage that holds the whole model (one process, inference, conversion)."""
        return self.pipeline_stages(config, 1, 1)[0]


def check_features(family: ModelFamily, asked: Mapping[str, tuple[str, str]], families) -> None:
    """Fail, naming the flag, when a flag asks for a feature ``family`` lacks; ``asked`` maps each
    set flag to (feature, what it needs in words), as its own section says (e.g.
    ``ParallelConfig.features_asked``); ``families`` (the models registry) names the ones that have it."""
    for flag, (feature, needs) in asked.items():
        if feature not in family.features:
            offering = [name for name in families.names() if feature in families.get(name).features]
            where = f"families that have it: {', '.join(offering)}" if offering else "none is installed"
            raise ConfigError(f"{flag} {needs}; {family.name!r} is not one ({where})")


# The features a flag may ask of a family (ModelFamily.features), in words: (what it is, who has it).
FEATURES = {"moe": ("mixture of experts", "an MoE model family"),
            "context_parallel": ("context parallelism", "a model family with context parallelism")}


def check_flag_of_other_families(flag: str, family: ModelFamily, families) -> None:
    """A flag ``family``'s config does not declare but the configs of families with a feature it
    lacks do (``--num-experts`` on gpt: the MoE flags are the MoE families' own) fails naming that
    feature, not as an unknown flag. ``families``: the models registry (each family is loaded)."""
    owners = [other for other in map(_loaded_or_none(families), families.names())
              if other is not None and flag in known_flags({"model": other.config_class})]
    missing = sorted(frozenset.intersection(*(other.features for other in owners)) - family.features) if owners else []
    if missing:
        what, who = FEATURES.get(missing[0], (missing[0], f"a model family with {missing[0]}"))
        raise ConfigError(f"{flag} ({what}) needs {who}; {family.name!r} is not one "
                          f"(families that have it: {', '.join(other.name for other in owners)})")


def _loaded_or_none(families):
    """``families.get`` where a family that fails to load (a broken or duplicate plugin) is None:
    the unknown-flag error that follows names that failure, not this check."""
    def get(name):
        try:
            return families.get(name)
        except PluginError:
            return None
    return get

"""``ModelFamily``: what a model plugin hands the training loop, the pipeline and the converters.

A family (``gpt``, ``llama``...) is registered with ``register_models``. The core never imports a
model package; it reads everything it needs from this object.

The stage module ``build`` returns holds one pipeline stage (or one virtual chunk) and follows
Megatron's conventions, so schedules and checkpoints treat every family alike:

* ``forward(inputs, position_ids=None)``: the first stage (``pre_process``) takes token ids
  ``[batch, seq]``, later stages take hidden states ``[seq, batch, hidden]`` (``seq`` split over
  the tensor group under sequence parallelism). A stage that is not last returns hidden states
  ``[seq, batch, hidden]``; the last (``post_process``) returns logits ``[seq, batch, vocab]``,
  the vocabulary split over the tensor group when tp > 1.
  For generation a stage also takes ``inference_cache`` (the family's key/value cache: the
  inputs continue the cached positions) and ``logits_to_keep`` (the last stage computes the
  logits of the last N positions only).
* ``loss(logits, labels, tp_group=None) -> [batch, seq]`` per-token cross-entropy of the last
  stage's logits (vocab-parallel over ``tp_group``, a :class:`mega.core.parallel.Group`);
  masking and averaging are the loop's.
* Parameter names are global and layout-independent: layer ``N`` is ``decoder.layers.N.*``
  on whichever stage holds it. With tied embeddings the last stage (when it is not also the
  first) holds its own copy named ``embedding.word_embeddings.weight``; the pipeline sums the
  gradients of the copies over ``groups.embedding``.
* ``init_parameters(module, seed)`` gives every parameter the value the full model would have
  for that seed (seeded from the seed and the parameter's global name), so layouts agree.

A family that has a Hugging Face ``transformers`` counterpart describes it with an
:class:`HFMapping` (``ModelFamily.hf_mapping``); checkpoint converters read and write Hugging Face
directories through it, one :class:`TensorMap` at a time, so memory stays at one layer's tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

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
    """

    architecture: str
    model_type: str
    base_model_prefix: str
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    config_to_hf: Callable[[Any], dict]
    tensor_maps: Callable[[Any], list[TensorMap]]
    ignored: tuple[str, ...] = ()


class ModelConfig(Protocol):
    """The fields of a family's config that code outside the family reads."""

    num_layers: int
    hidden_size: int
    seq_length: int
    vocab_size: int

    def validate(self, tensor_parallel_size: int = 1) -> None:
        """Raise ``ValueError`` naming the flags and numbers when the config cannot be built."""


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config class and presets, and how to build and describe a model.

    * ``build(config, *, pre_process=True, post_process=True, layers=None, parallel=None,
      rng_tracker=None, device=None, seed=...) -> nn.Module``: the stage holding the embeddings if
      ``pre_process``, the final norm and output layer if ``post_process``, and the decoder
      layers numbered in ``layers`` (a ``range``; all when ``None``), initialised from ``seed``
      (nothing is allocated on the ``meta`` device). ``parallel`` (a ``ParallelConfig``) sets
      the vocabulary padding (tp) and how dropout uses ``rng_tracker`` (the core's
      ``RNGStatesTracker``); the module is still single-device code until
      ``apply_tensor_parallel`` swaps its layers.
    * ``tensor_parallel_plan(config, *, pre_process=True, post_process=True)`` -> ``{module-name
      pattern: style}`` for :func:`mega.core.parallel.tensor_parallel.apply_tensor_parallel`,
      naming only what a stage built with the same flags holds (so ``strict`` holds).
    * ``init_parameters(module, seed)``: re-initialise a built (not yet tensor-parallel) stage.
    * ``num_parameters(config, tensor_parallel_size=1) -> int``: of the whole model (vocabulary
      padded for that tp), computed without allocating.
    * ``num_floating_point_operations(config, batch_size) -> float``: of one training iteration
      (forward and backward) over ``batch_size`` sequences of ``config.seq_length`` tokens, by
      Megatron's formula (for throughput and MFU).
    * ``hf_mapping``: the Hugging Face counterpart (:class:`HFMapping`), if the family has one.
    * ``memory_model(config, *, layers, pre_process, post_process, parallel, micro_batch_size,
      dtype_bytes, device_type="cuda") -> StageFootprint``: parameters and saved activations of
      one rank of a stage of ``layers`` layers (:mod:`mega.core.planning.footprint`), for
      `mega plan`; None if the family cannot tell.
    """

    name: str
    config_class: type
    presets: Mapping[str, Any]
    build: Callable[..., nn.Module]
    tensor_parallel_plan: Callable[..., dict[str, PlanStyle]]
    init_parameters: Callable[[nn.Module, int], None]
    num_parameters: Callable[..., int]
    num_floating_point_operations: Callable[[Any, int], float]
    description: str = ""
    hf_mapping: HFMapping | None = None
    memory_model: Callable[..., Any] | None = None

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

"""One ordered model setup: the passes that turn a family's single-device stages into this rank's
model, each declaring its :class:`Phase`, all run by :func:`run_setup` in phase order.

    EXPERT_PARALLEL -> TENSOR_PARALLEL -> CONTEXT_PARALLEL     on the meta device: layout, shapes
    -> MATERIALIZE                                             the core's: cast, storage, initial values
    -> ADAPTERS -> PRECISION -> RECOMPUTE -> COMPILE -> WEIGHT_TYING -> DATA_PARALLEL

Where a pass comes from does not change when it runs: a model family names its own passes
(``ModelFamily.setup_passes``: experts, tensor plan, context parallelism, recompute), the core
adds materialisation (:func:`mega.core.build.build_model`), and a run adds those its plugins
register through the ``register_setup_passes`` hook (LoRA, FP8, ``--compile``, weight tying, DDP
or FSDP2, a third party's). Passes of one phase must commute; they run in name order, so the
order in which they were registered never changes the model.

This module imports no torch until a setup runs: plugins import it where they register.

A pass reads what it needs from the one :class:`ModelSetup` of the build (groups, RNG tracker,
config, run) and changes ``setup.chunks`` in place; it may replace a chunk (a data-parallel
wrapper). Passes before ``MATERIALIZE`` run under ``torch.device("meta")``: whatever module they
make holds no storage until the core materialises this rank's shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


class Phase(IntEnum):
    """When a pass runs; the runner sorts passes by phase (then by name)."""

    EXPERT_PARALLEL = 10  # which experts this rank keeps (needs the whole expert weights)
    TENSOR_PARALLEL = 20  # the tensor plan, sequence parallelism, the dropout streams of shards
    CONTEXT_PARALLEL = 30  # attention over the context group
    MATERIALIZE = 40  # the core's: cast, this rank's shards on the device, initial values
    ADAPTERS = 50  # LoRA: adapters beside the (frozen) layers
    PRECISION = 60  # FP8 layers (of the base and the adapters alike)
    RECOMPUTE = 70  # activation recompute of layer runs or attention cores
    COMPILE = 80  # torch.compile of the family's units
    WEIGHT_TYING = 90  # weights shared by the first and the last pipeline stage
    DATA_PARALLEL = 100  # DDP, the distributed optimizer's buffers (ZeRO-1), FSDP2 (ZeRO-2/3)


@dataclass
class ModelSetup:
    """The one context of a model's setup: what every pass may read, and the chunks it changes.

    ``chunks``: this rank's model chunks (virtual pipeline stages), in order. ``run``: the
    training run's configuration (None when inference, loading or conversion builds a model).
    ``training``: the model will be trained (recompute and dropout streams only matter then).
    """

    chunks: list[nn.Module]
    family: Any
    config: Any
    groups: Any
    parallel: Any
    rng_tracker: Any = None
    training: bool = True
    device: torch.device | None = None  # None: the groups' device
    dtype: torch.dtype | None = None  # None: as built (fp32)
    seed: int = 1234
    init: bool = True
    run: Any = None


@dataclass(frozen=True)
class SetupPass:
    """``apply(setup)`` changes ``setup.chunks`` in place, at ``phase``."""

    name: str
    phase: Phase
    apply: Callable[[ModelSetup], None]
    description: str = ""


class SetupError(ValueError):
    """Passes that cannot run together (two of one name)."""


def per_chunk(name: str, phase: Phase, fn: Callable[[nn.Module, ModelSetup], nn.Module | None],
              description: str = "") -> SetupPass:
    """A pass that runs ``fn(chunk, setup)`` on each chunk; a module it returns replaces the chunk."""

    def apply(setup: ModelSetup) -> None:
        for index, chunk in enumerate(setup.chunks):
            replaced = fn(chunk, setup)
            if replaced is not None:
                setup.chunks[index] = replaced

    return SetupPass(name, phase, apply, description)


def ordered(passes: Iterable[SetupPass]) -> list[SetupPass]:
    """``passes`` by phase, then by name; two passes of one name are an error naming it."""
    passes = list(passes)
    names = [setup_pass.name for setup_pass in passes]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SetupError(f"setup pass {', '.join(map(repr, twice))} given twice: a pass runs once per setup")
    return sorted(passes, key=lambda setup_pass: (setup_pass.phase, setup_pass.name))


def run_setup(setup: ModelSetup, passes: Iterable[SetupPass]) -> list[nn.Module]:
    """Run ``passes`` over ``setup.chunks`` in phase order (see the module docstring); returns the chunks."""
    import torch  # start-up cost: this module is imported where plugins register, which imports no torch

    for setup_pass in ordered(passes):
        on_meta = setup_pass.phase < Phase.MATERIALIZE
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            setup_pass.apply(setup)
    return setup.chunks


def registered_passes(plugins, run_config: Any) -> list[SetupPass]:
    """The passes plugins registered (``register_setup_passes``) that want this run, each under
    its registered name. A pass that cannot be loaded raises naming its plugin, unless the run
    skips failed plugins (``--skip-failed-plugins``; mega train has warned)."""
    skip_failed = bool(getattr(getattr(run_config, "training", None), "skip_failed_plugins", False))
    return [dataclasses.replace(setup_pass, name=name)
            for name, setup_pass in plugins.setup_passes.made_for(run_config, skip_failed)]

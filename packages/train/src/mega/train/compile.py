"""``--compile``: ``torch.compile`` applied to each unit a model family names, as torchtitan does
per transformer layer.

Each unit is compiled in place (``nn.Module.compile``), so parameter names, hooks and checkpoints
stay those of the eager module. Layers of one shape share their compiled code: the first layer
compiles, the others reuse it (dynamo guards on the module's parameters' shapes, not identities
when ``inline_inbuilt_nn_modules`` is on, torch's default since 2.5).
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.model_family import ModelFamily


def compiles(run, device: torch.device) -> bool:
    """Whether the layers run compiled: as ``--compile`` / ``--no-compile`` say, else by default
    with FP8 (``--fp8-format``) on a GPU. Eager, torchao's FP8 casts and amax reductions are
    kernels of their own: one H200 measured GPT 1.3B in FP8 at 0.38x of bf16's tokens/s eager and
    1.04x compiled (docs/benchmarks.md). Not by default under selective recompute, which
    ``--compile`` refuses."""
    if run.kernels.compile is not None:
        return run.kernels.compile
    return (device.type == "cuda" and run.precision.fp8 is not None
            and getattr(run.model, "recompute_granularity", None) != "selective")


def compile_stage(family: ModelFamily, module: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile ``module``'s units (``family.compile_units``, or the whole module) with ``backend``."""
    units = list(family.compile_units(module)) if family.compile_units is not None else [module]
    for unit in units:
        unit.compile(backend=backend)
    return module

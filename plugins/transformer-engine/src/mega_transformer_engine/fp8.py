"""FP8 training: every forward of every micro-batch inside ``te.fp8_autocast`` with Megatron's
delayed-scaling recipe, through mega's ``forward_context`` event.

The recipe follows Megatron-Core's flags: ``--fp8-format e4m3`` (E4M3 forward and backward) or
``hybrid`` (E4M3 forward, E5M2 gradients; ``--fp8-hybrid`` is the same), ``--fp8-margin``,
``--fp8-amax-history-len`` and ``--fp8-amax-compute-algo``.

TE reduces the amaxes over ``fp8_group`` when the outermost autocast exits. As Megatron-Core
does (its amax reduction group), that group is the ranks of this pipeline stage: tensor-,
context- and data-parallel ranks run the same micro-batch forwards in the same order, while
other stages run theirs at other times, so a pipeline works with FP8 too.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

from mega.core.config import ConfigError
from mega.core.parallel.layout import rank_groups
from mega.core.plugins import hookimpl


def fp8_recipe(recipe_module, precision):
    """TE's ``DelayedScaling`` for the run's precision flags (``recipe_module`` is
    ``transformer_engine.common.recipe``)."""
    formats = {"e4m3": recipe_module.Format.E4M3, "hybrid": recipe_module.Format.HYBRID}
    return recipe_module.DelayedScaling(
        margin=precision.fp8_margin, fp8_format=formats[precision.fp8],
        amax_history_len=precision.fp8_amax_history_len, amax_compute_algo=precision.fp8_amax_compute_algo)


def amax_reduction_group(parallel):
    """The process group of this rank's pipeline stage (its tensor-, context- and data-parallel
    ranks); None in a single process. Every rank must call this, in the same order, since it
    creates one group per stage."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    sizes = {"tp": parallel.tp, "cp": parallel.cp, "dp": parallel.data_parallel_size(world), "pp": parallel.pp}
    mine = None
    for ranks in rank_groups(sizes, "tp-cp-dp"):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


class FP8Autocast:
    """The listener: ``forward_context`` returns TE's autocast for one forward."""

    def __init__(self, te, recipe, amax_group=None):
        self.te, self.recipe, self.amax_group = te, recipe, amax_group

    @hookimpl
    def forward_context(self, microbatch, chunk):
        return self.te.fp8_autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=self.amax_group)


def fp8_autocast_callback(run_config):
    """The per-run listener when the run asks for FP8 (None otherwise)."""
    precision = run_config.precision
    if precision.fp8 is None or precision.fp8_recipe != "delayed":  # current scaling: another backend's
        return None
    # optional dependency: the kernel library may be absent; the backend reports it
    from mega.core.plugins import get_plugins

    backend = get_plugins().kernel_backends.get(run_config.kernels.kernels or "transformer-engine")
    check = getattr(backend, "fp8_available", None)
    if check is None:
        raise ConfigError(f"--fp8-format needs the transformer-engine kernels (--kernels transformer-engine), "
                          f"not {backend.name!r}")
    available, missing = check()
    if not available:
        raise ConfigError(f"--fp8-format {precision.fp8}: {missing}")
    te = importlib.import_module("transformer_engine.pytorch")
    recipe = fp8_recipe(importlib.import_module("transformer_engine.common.recipe"), precision)
    return FP8Autocast(te, recipe, amax_reduction_group(run_config.parallel))

"""FP8 training: every forward of every micro-batch inside ``te.fp8_autocast`` with Megatron's
delayed-scaling recipe, through mega's ``forward_context`` event.

The recipe follows Megatron-Core's flags: ``--fp8-format e4m3`` (E4M3 forward and backward) or
``hybrid`` (E4M3 forward, E5M2 gradients; ``--fp8-hybrid`` is the same), ``--fp8-margin``,
``--fp8-amax-history-len`` and ``--fp8-amax-compute-algo``. TE reduces the amaxes over
``fp8_group`` when the outermost autocast exits; mega leaves it None (every rank), so FP8 with
pipeline parallelism, whose stages run their forwards at different times, is refused.
"""

from __future__ import annotations

import importlib

from mega.core.config import ConfigError
from mega.core.plugins import hookimpl


def fp8_recipe(recipe_module, precision):
    """TE's ``DelayedScaling`` for the run's precision flags (``recipe_module`` is
    ``transformer_engine.common.recipe``)."""
    formats = {"e4m3": recipe_module.Format.E4M3, "hybrid": recipe_module.Format.HYBRID}
    return recipe_module.DelayedScaling(
        margin=precision.fp8_margin, fp8_format=formats[precision.fp8],
        amax_history_len=precision.fp8_amax_history_len, amax_compute_algo=precision.fp8_amax_compute_algo)


class FP8Autocast:
    """The listener: ``forward_context`` returns TE's autocast for one forward."""

    def __init__(self, te, recipe):
        self.te, self.recipe = te, recipe

    @hookimpl
    def forward_context(self, microbatch, chunk):
        return self.te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)


def fp8_autocast_callback(run_config):
    """The per-run listener when the run asks for FP8 (None otherwise)."""
    precision = run_config.precision
    if precision.fp8 is None:
        return None
    from mega.core.plugins import get_plugins

    backend = get_plugins().kernel_backends.get(run_config.kernels.kernels or "transformer-engine")
    check = getattr(backend, "fp8_available", None)
    if check is None:
        raise ConfigError(f"--fp8-format needs the transformer-engine kernels (--kernels transformer-engine), "
                          f"not {backend.name!r}")
    available, missing = check()
    if not available:
        raise ConfigError(f"--fp8-format {precision.fp8}: {missing}")
    if run_config.parallel.pp > 1:
        raise ConfigError("--fp8-format with --pipeline-model-parallel-size > 1 is not supported: FP8 amaxes "
                          "are reduced over every rank, which pipeline stages do not reach together")
    te = importlib.import_module("transformer_engine.pytorch")
    return FP8Autocast(te, fp8_recipe(importlib.import_module("transformer_engine.common.recipe"), precision))

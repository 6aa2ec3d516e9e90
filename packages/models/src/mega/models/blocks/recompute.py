"""Activation recompute: drop a region's activations in forward, recompute them in backward.

Built on ``torch.utils.checkpoint`` (non-reentrant), which saves and restores the CPU RNG and the
RNG of the inputs' accelerator, so dropout draws the same masks when a region is recomputed.
Dropout that forks into a named stream of the core's :class:`RNGStatesTracker` (attention heads
split by tensor parallelism) is invisible to torch: the tracker's streams are snapshotted when
the region first runs and put back while it is recomputed, as Megatron's checkpoint does. So is
whether the region's linears deferred their weight gradients to a zero-bubble schedule's W step
(:mod:`mega.core.parallel.weight_grad_split`): the rerun must save what the first run saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from mega.core.parallel.weight_grad_split import replaying_weight_grad_deferral
from mega.models.config import TransformerConfig


def recomputed(function: Callable, *args, rng_tracker=None, **kwargs):
    """``function(*args, **kwargs)``, keeping only its inputs for backward."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=lambda: _contexts(rng_tracker), **kwargs)


def _contexts(tracker):
    """(forward context, recompute context): the recompute replays the tracker's streams and the
    weight-gradient deferral as the forward had them."""
    deferral = replaying_weight_grad_deferral()  # both capture now, at forward
    streams = _replaying_tracker(tracker) if tracker is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def replaying():
        with deferral, streams:
            yield

    return contextlib.nullcontext(), replaying()


def _replaying_tracker(tracker):
    states_at_forward = tracker.get_states()

    @contextlib.contextmanager
    def replaying():
        states_now = tracker.get_states()
        tracker.set_states(states_at_forward)
        try:
            yield
        finally:
            tracker.set_states(states_now)

    return replaying()


def is_recomputing_allowed(module: torch.nn.Module) -> bool:
    """Recompute only pays off (and only works) when gradients will be taken."""
    return module.training and torch.is_grad_enabled()


def layer_runs(config: TransformerConfig, num_layers: int) -> list[tuple[int, int, bool]]:
    """A stage's layers as consecutive runs ``(start, end, recompute)`` for full recompute.

    ``uniform`` recomputes every run of ``recompute_num_layers`` layers as one region; ``block``
    recomputes the first ``recompute_num_layers`` layers of the stage one at a time and keeps the
    activations of the rest (Megatron's two methods).
    """
    if config.recompute_granularity != "full":
        return [(0, num_layers, False)]
    chunk = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(start, min(start + chunk, num_layers), True) for start in range(0, num_layers, chunk)]
    recomputed_layers = min(chunk, num_layers)
    runs = [(index, index + 1, True) for index in range(recomputed_layers)]
    if recomputed_layers < num_layers:
        runs.append((recomputed_layers, num_layers, False))
    return runs

"""Random-number streams that make dropout agree, or differ, across ranks as the maths requires.

Megatron's convention, kept so runs and checkpoints line up:

* the default stream (used outside any fork) is seeded with ``seed + 100 * pp_rank``: tensor-
  parallel ranks draw the same numbers, so dropout on replicated activations stays replicated;
* the ``"model-parallel"`` stream is seeded with ``seed + 100 * pp_rank + 2718 + tp_rank``: code
  working on a rank's own shard (attention heads split by tp, activations split by sequence
  parallelism) forks into it so each shard is masked independently;
* the ``"expert-parallel"`` stream (``seed + 100 * pp_rank + 1024 + 100 * ep_rank + tp_rank``)
  serves expert layers.

Usage: ``tracker = seed_parallel_rng(seed, groups)`` once per run, then
``with tracker.fork(): x = dropout(x)`` where the activations are sharded. The tracker belongs to
the run (pass it to the model); no global state.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from mega.core.parallel.groups import ParallelGroups

MODEL_PARALLEL = "model-parallel"
EXPERT_PARALLEL = "expert-parallel"
TENSOR_PARALLEL_SEED_OFFSET = 2718
EXPERT_PARALLEL_SEED_OFFSET = 1024
PIPELINE_SEED_STRIDE = 100


class RNGStatesTracker:
    """Named generator states for one device; ``fork(name)`` runs a block on one of them.

    Forking swaps the device's default generator state in and out, so ordinary ``torch``
    calls (dropout, ``torch.rand``) inside the block draw from the named stream, and the stream
    advances across forks.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        self._states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def names(self) -> list[str]:
        return list(self._states)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of the states, for checkpoints."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added (have: {', '.join(self._states) or 'none'})")
        outside = get_device_rng_state(self.device)
        set_device_rng_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = get_device_rng_state(self.device)
            set_device_rng_state(self.device, outside)


def _device_module(device: torch.device):
    # torch.cuda, torch.xpu, ... by name, so the CPU path never touches torch.cuda.
    return getattr(torch, device.type)


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return _device_module(device).get_rng_state(device)


def set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        _device_module(device).set_rng_state(state, device)


def parallel_seeds(seed: int, groups: ParallelGroups) -> dict[str, int]:
    """The seed of every stream of this rank (``"default"``, model- and expert-parallel)."""
    base = seed + PIPELINE_SEED_STRIDE * groups.pp.rank
    tp_rank = groups.tp.rank
    return {
        "default": base,
        MODEL_PARALLEL: base + TENSOR_PARALLEL_SEED_OFFSET + tp_rank,
        EXPERT_PARALLEL: base + EXPERT_PARALLEL_SEED_OFFSET + 100 * max(groups.ep.rank, 0) + max(groups.etp.rank, 0),
    }


def seed_parallel_rng(seed: int, groups: ParallelGroups) -> RNGStatesTracker:
    """Seed Python, numpy and torch with the default stream; return a tracker of the others."""
    seeds = parallel_seeds(seed, groups)
    random.seed(seeds["default"])
    np.random.seed(seeds["default"])
    torch.manual_seed(seeds["default"])
    tracker = RNGStatesTracker(groups.device)
    tracker.add(MODEL_PARALLEL, seeds[MODEL_PARALLEL])
    tracker.add(EXPERT_PARALLEL, seeds[EXPERT_PARALLEL])
    return tracker

"""Routing replay (Megatron-LM's ``--moe-enable-routing-replay``): record which experts every MoE
layer chose for each token on one forward, and force that choice on later forwards over the
same tokens.

RL post-training of an MoE policy compares the policy being updated with the one that sampled
the rollouts, token by token; when an update flips a token's top-k choice, the two differ by
more than the update (the "routing replay" of the RL literature: R2 replays the old policy's
routing, R3 the inference engine's). Only the discrete choice is replayed: the weights of the
chosen experts are computed from the live router's logits (:func:`mega.models.moe.routing.route`
with ``experts``), so the router still learns.

:class:`RoutingReplay` over a model's MoE layers: ``recording()`` yields, per layer, the list of
``[tokens, k]`` choices of each forward in the order they ran; ``replaying(experts)`` takes one
``[tokens, k]`` tensor per layer, the choices of every forward to come in the order they will
run (each forward takes its next ``tokens`` rows), and checks on exit that they were all used.
A forward that runs twice over the same tokens (full activation recompute) would take rows
twice: replay refuses models that recompute whole layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from mega.models.moe.layer import MoELayer


class RoutingReplayError(ValueError):
    """The choices given do not fit the forwards that ran."""


class _Recorder:
    def __init__(self):
        self.choices: list[torch.Tensor] = []

    def experts(self, tokens: int) -> None:
        return None

    def chose(self, experts: torch.Tensor) -> None:
        self.choices.append(experts.detach())


class _Replayer:
    def __init__(self, index: int, experts: torch.Tensor):
        self.index, self.rows, self.used = index, experts, 0

    def experts(self, tokens: int) -> torch.Tensor:
        if self.used + tokens > len(self.rows):
            raise RoutingReplayError(f"MoE layer {self.index}: a forward of {tokens} tokens, but only "
                                     f"{len(self.rows) - self.used} of the replayed choices are left")
        rows = self.rows[self.used:self.used + tokens]
        self.used += tokens
        return rows

    def chose(self, experts: torch.Tensor) -> None:
        pass


class RoutingReplay:
    def __init__(self, *modules: nn.Module):
        self.layers = [layer for module in modules for layer in module.modules() if isinstance(layer, MoELayer)]
        if not self.layers:
            raise RoutingReplayError("routing replay needs a mixture-of-experts model: this one has no MoE layer")
        recompute = {getattr(layer.config, "recompute_granularity", None) for layer in self.layers}
        if "full" in recompute:
            raise RoutingReplayError("routing replay with --recompute-granularity full would replay a layer's "
                                     "choice twice (forward and recompute); use selective or no recompute")

    @contextlib.contextmanager
    def _attached(self, hooks: list) -> Iterator[None]:
        for layer, hook in zip(self.layers, hooks, strict=True):
            if layer.routing_replay is not None:
                raise RoutingReplayError("routing replay is already recording or replaying on this model")
            layer.routing_replay = hook
        try:
            yield
        finally:
            for layer in self.layers:
                layer.routing_replay = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[list[torch.Tensor]]]:
        """Yields one list per MoE layer, filled with each forward's ``[tokens, k]`` choice."""
        recorders = [_Recorder() for _ in self.layers]
        with self._attached(recorders):
            yield [recorder.choices for recorder in recorders]

    @contextlib.contextmanager
    def replaying(self, experts: list[torch.Tensor]) -> Iterator[None]:
        """Forces ``experts[i]`` (``[tokens, k]``, every forward's tokens one after the other) on MoE layer ``i``."""
        if len(experts) != len(self.layers):
            raise RoutingReplayError(f"{len(experts)} choices for {len(self.layers)} MoE layers")
        replayers = [_Replayer(index, rows) for index, rows in enumerate(experts)]
        with self._attached(replayers):
            yield
        for replayer in replayers:
            if replayer.used != len(replayer.rows):
                raise RoutingReplayError(f"MoE layer {replayer.index}: {len(replayer.rows)} replayed choices, "
                                         f"{replayer.used} used by the forwards that ran")

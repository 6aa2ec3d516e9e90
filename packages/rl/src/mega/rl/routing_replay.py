"""Routing replay in the GRPO step (``--moe-enable-routing-replay``): the experts each token was
routed to when the trainer recomputed the old policy's log-probabilities are forced on every
update forward over the same sequences, so a token's ratio compares the same experts (R2 of the
RL literature, "vanilla routing replay"; :mod:`mega.models.moe.replay` does the forcing).

The rollout engine runs the trainer's own module and weights in this process, so its routing is
the old policy's up to numerics (the engine-vs-trainer gap in the log measures what is left);
recording at the trainer's forward is where the choices line up with packed sequences.
"""

from __future__ import annotations

import torch

from mega.models.moe.replay import RoutingReplay, RoutingReplayError


class StepRouting:
    """The old policy's routing of one step's sequences, per sequence and MoE layer."""

    def __init__(self, policy):
        self.replay = RoutingReplay(*policy.trainer.chunks)
        self.per_sequence: list[tuple[torch.Tensor, ...]] = []

    def old_logprobs(self, policy, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """``policy.logprobs`` of ``sequences``, recording each token's experts."""
        with self.replay.recording() as choices:
            logprobs = policy.logprobs({"tokens": sequences})
        lengths = [len(s) for s in sequences]
        per_layer = [torch.cat(layer_choices) for layer_choices in choices]
        for index, rows in enumerate(per_layer):
            if len(rows) != sum(lengths):
                raise RoutingReplayError(f"MoE layer {index} routed {len(rows)} tokens for sequences of "
                                         f"{sum(lengths)}: routing replay needs each sequence's tokens in order")
        self.per_sequence = list(zip(*(rows.split(lengths) for rows in per_layer), strict=True))
        return logprobs

    def replaying(self, indices: range):
        """Force the recorded choices of sequences ``indices`` (one forward_backward over them, in order)."""
        layers = len(self.replay.layers)
        return self.replay.replaying([torch.cat([self.per_sequence[i][layer] for i in indices])
                                      for layer in range(layers)])

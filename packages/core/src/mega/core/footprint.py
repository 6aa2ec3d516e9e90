"""What a model family tells the planner about one pipeline stage (``ModelFamily.memory_model``).

The family knows its layers; the planner knows parallelism, precision, optimizers and schedules.
They meet here: ``memory_model(config, layers=..., first_layer=..., ...) -> StageFootprint`` for
one rank of one stage (or virtual chunk) whose layers start at ``first_layer``, for a single
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageFootprint:
    """One rank of one stage.

    * ``parameters``: elements of the parameters this rank holds (its tensor-parallel shard,
      replicated norms and biases whole, a tied embedding's last-stage copy included).
    * ``activation_bytes``: what one micro-batch's forward keeps for the backward (recompute
      applied: a recomputed region keeps only its input).
    * ``recompute_bytes``: the largest recomputed region's activations, rebuilt for a moment in
      the backward (0 without recompute).
    * ``expert_parameters``: of ``parameters``, the routed experts' (the distributed optimizer
      shards them over the expert-data-parallel group, not over dp x cp).
    * ``weight_grad_bytes``: what one micro-batch holds from its B to its W under a zero-bubble
      schedule (its deferred weight-gradient products' operands: the linears' inputs and output
      gradients); None where the family does not say, and the planner then keeps the whole
      ``activation_bytes`` until W.
    """

    parameters: int
    activation_bytes: int
    recompute_bytes: int = 0
    expert_parameters: int = 0
    weight_grad_bytes: int | None = None

"""``--calculate-per-token-loss``: the loss averaged over every loss token of the global batch.

By default each micro-batch's loss is its own mean over its loss tokens, and the step averages
micro-batches and data-parallel ranks alike, so a token of a short row weighs more than one of a
long row. Megatron's ``--calculate-per-token-loss`` weighs every token alike: the sum over all
tokens divided by their number in the whole global batch. The schedule divides each micro-batch's
loss by the number of micro-batches and data parallelism averages gradients over ranks; a
micro-batch whose mean covers ``n`` tokens therefore counts ``n * micro_batches * dp / N``, with
``N`` the global batch's tokens, which this module counts before the step (every rank that computes
the loss reads its micro-batches first, then the count is summed over the data-parallel group).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist


def read_step(data: Iterator, num_microbatches: int) -> list:
    """The next step's micro-batches of ``data`` (``(inputs, targets)`` pairs), read ahead."""
    return list(itertools.islice(data, num_microbatches))


def token_weight(step: list, num_microbatches: int, dp_group) -> float:
    """``micro_batches * dp / N``: what one loss token of this step weighs, times the number of
    tokens a micro-batch's mean covers, in the schedule's average (0 when no token counts)."""
    tokens = sum((targets["loss_mask"].sum() for _, targets in step), torch.zeros((), dtype=torch.float64))
    tokens = tokens.to(step[0][1]["loss_mask"].device) if step else tokens
    if dp_group is not None and dp_group.size > 1:
        dist.all_reduce(tokens, group=dp_group.group)
        size = dp_group.size
    else:
        size = 1
    total = float(tokens)
    return num_microbatches * size / total if total else 0.0

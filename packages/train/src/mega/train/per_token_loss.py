"""``--calculate-per-token-loss``: the loss averaged over every loss token of the global batch.

By default each micro-batch's loss is its own mean over its loss tokens, and the step averages
micro-batches and data-parallel ranks alike, so a token of a short row weighs more than one of a
long row. Megatron's ``--calculate-per-token-loss`` weighs every token alike: the sum over all
tokens divided by their number in the whole global batch. The schedule divides each micro-batch's
loss by the number of micro-batches and data parallelism averages gradients over ranks; a
micro-batch whose mean covers ``n`` tokens therefore counts ``n * micro_batches * dp / N``, with
``N`` the global batch's tokens, which this module counts before the step (every rank that computes
the loss reads its micro-batches first, then the count is summed over the data-parallel group).

Under context parallelism each rank holds part of every micro-batch's tokens, and the family's
loss is already the mean over the whole micro-batch (summed over the context group, as Megatron
reduces the loss sums and token counts over ``dp x cp``): ``N`` is counted over the data- and
context-parallel ranks, and a micro-batch's ``n`` over the context ranks (:func:`micro_batch_tokens`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist


def read_step(data: Iterator, num_microbatches: int) -> list:
    """The next step's micro-batches of ``data`` (``(inputs, targets)`` pairs), read ahead."""
    return list(itertools.islice(data, num_microbatches))


def token_weight(step: list, num_microbatches: int, dp_group, cp_group=None, dp_cp_group=None) -> float:
    """``micro_batches * dp / N``: what one loss token of this step weighs, times the number of
    tokens a micro-batch's mean covers, in the schedule's average (0 when no token counts).
    Under context parallelism (``cp_group`` of more than one rank) the tokens are counted over
    ``dp_cp_group``, every context rank holding a part."""
    tokens = sum((targets["loss_mask"].sum() for _, targets in step), torch.zeros((), dtype=torch.float64))
    tokens = tokens.to(step[0][1]["loss_mask"].device) if step else tokens
    counting = dp_cp_group if cp_group is not None and cp_group.size > 1 else dp_group
    if counting is not None and counting.size > 1:
        dist.all_reduce(tokens, group=counting.group)
    size = dp_group.size if dp_group is not None else 1
    total = float(tokens)
    return num_microbatches * size / total if total else 0.0


def micro_batch_tokens(loss_mask: torch.Tensor, cp_group=None) -> torch.Tensor:
    """The loss tokens of the whole micro-batch: this rank's, summed over the context group."""
    tokens = loss_mask.sum()
    if cp_group is not None and cp_group.size > 1:
        tokens = tokens.detach().float()
        dist.all_reduce(tokens, group=cp_group.group)
    return tokens

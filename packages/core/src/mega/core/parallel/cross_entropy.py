"""Cross-entropy over logits whose vocabulary is split across the tensor group.

The LM head is column-parallel, so rank ``r`` holds logits for vocabulary ids
``[r*V/tp, (r+1)*V/tp)``. Gathering ``[s, b, V]`` logits would cost memory and bandwidth
proportional to the vocabulary; instead each rank reduces its shard to a few numbers per token
and two all-reduces of ``[s, b]``-sized tensors finish the job: the max (for a numerically
stable log-sum-exp), then the sum of exponentials together with the target's logit (and, with
label smoothing, the sum of logits).

The vocabulary is padded (to a multiple of ``make_vocab_size_divisible_by x tp``), so the last
rows of the output layer are no token at all. Every function here takes ``vocab_size``, the
number of real rows, and leaves the rest out of the softmax: otherwise the loss (and a resume at
another tensor-parallel size, which pads differently) would depend on the layout.

Label smoothing follows ``torch.nn.functional.cross_entropy``: the target distribution is
``(1 - eps) * one_hot + eps / V``, so the loss is ``(1 - eps) * nll + eps * mean_j(-log p_j)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega.core.parallel.collectives import all_reduce
from mega.core.parallel.groups import Group


class SoftmaxStatistics(NamedTuple):
    """What a vocabulary-sharded cross-entropy's forward knows per token: enough to rebuild any
    slice of the logits' gradient from those logits (:func:`softmax_of` then :func:`loss_grad_`)."""

    local_target: torch.Tensor  # the target's row in this shard (0 where it is elsewhere)
    outside: torch.Tensor  # [...] bool: the target is not in this shard
    max: torch.Tensor  # [...] float32: the largest logit over the whole vocabulary
    sum_exp: torch.Tensor  # [...] float32: sum of exp(logit - max) over the whole vocabulary
    real: int  # this shard's real rows (the rest is vocabulary padding)


def softmax_statistics(logits: torch.Tensor, target: torch.Tensor, group: Group, label_smoothing: float,
                       vocab_size: int) -> tuple[torch.Tensor, SoftmaxStatistics, torch.Tensor]:
    """The per-token loss (float32) and statistics of vocabulary-sharded ``logits``, and this
    shard's softmax (float32, in a buffer of its own: the logits are not written)."""
    shard = logits.float()
    partition = shard.shape[-1]
    vocab_start = group.rank * partition
    real = min(max(vocab_size - vocab_start, 0), partition)  # this shard's real rows

    if real > 0:
        global_max = shard[..., :real].max(dim=-1).values
    else:  # a shard of padding only: the other ranks hold the maximum
        global_max = shard.new_full(shard.shape[:-1], float("-inf"))
    all_reduce(global_max, group, op=dist.ReduceOp.MAX)
    shifted = _shifted(shard, global_max, real, copy=shard is logits)

    outside = (target < vocab_start) | (target >= vocab_start + real)
    local_target = (target - vocab_start).masked_fill(outside, 0)
    target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    sums = [target_logit, None]
    if label_smoothing > 0:
        sums.append(shifted[..., :real].sum(dim=-1))
    exp = shifted.exp_()  # shifted is no longer needed as logits: reuse its memory
    sums[1] = exp.sum(dim=-1)
    # One all-reduce for every per-token sum (target logit, sum of exp[, sum of logits]).
    stacked = torch.stack(sums)
    all_reduce(stacked, group)
    target_logit, sum_exp = stacked[0], stacked[1]

    log_sum_exp = sum_exp.log()
    loss = log_sum_exp - target_logit
    if label_smoothing > 0:
        mean_neg_log_prob = log_sum_exp - stacked[2] / vocab_size
        loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_log_prob
    softmax = exp.div_(sum_exp.unsqueeze(-1))
    return loss, SoftmaxStatistics(local_target, outside, global_max, sum_exp, real), softmax


def _shifted(shard: torch.Tensor, global_max: torch.Tensor, real: int, copy: bool) -> torch.Tensor:
    """``shard - max`` with the padded rows at -inf (probability 0): in a new buffer where ``copy``
    (the float32 shard is the caller's logits), else in ``shard``'s own."""
    shifted = shard - global_max.unsqueeze(-1) if copy else shard.sub_(global_max.unsqueeze(-1))
    shifted[..., real:] = float("-inf")
    return shifted


def softmax_of(logits: torch.Tensor, stats: SoftmaxStatistics, rows: slice) -> torch.Tensor:
    """The softmax of the shard's vocabulary ``rows`` from their ``logits`` ``[..., rows]`` (made
    for this: float32 logits are overwritten) and the forward's statistics: the same operations,
    in the same order, as the forward's."""
    real_here = min(max(stats.real - rows.start, 0), logits.shape[-1])
    shifted = _shifted(logits.float(), stats.max, real_here, copy=False)
    return shifted.exp_().div_(stats.sum_exp.unsqueeze(-1))


def loss_grad_(softmax: torch.Tensor, stats: SoftmaxStatistics, grad_loss: torch.Tensor, label_smoothing: float,
               vocab_size: int, rows: slice | None = None) -> torch.Tensor:
    """The logits' gradient, made in ``softmax``'s buffer, of the shard's vocabulary ``rows``
    (default: all): ``d loss / d logit_j = softmax_j - (1 - eps) [j == target] - eps / V`` for a
    real row ``j``, times ``grad_loss``; a padded row has softmax 0 and gets no gradient."""
    start = 0 if rows is None else rows.start
    width = softmax.shape[-1]
    flat = softmax.view(-1, width)
    target = stats.local_target.reshape(-1) - start
    hit = ~stats.outside.reshape(-1) & (target >= 0) & (target < width)
    tokens = torch.arange(flat.shape[0], device=flat.device)
    flat[tokens, target.clamp(0, width - 1)] -= hit.to(flat.dtype) * (1.0 - label_smoothing)
    if label_smoothing > 0:
        real_here = min(max(stats.real - start, 0), width)
        softmax[..., :real_here].sub_(label_smoothing / vocab_size)
    return softmax.mul_(grad_loss.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, vocab_size):
        loss, stats, softmax = softmax_statistics(logits, target, group, label_smoothing, vocab_size)
        ctx.save_for_backward(softmax)
        ctx.stats, ctx.label_smoothing, ctx.vocab, ctx.logits_dtype = stats, label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (softmax,) = ctx.saved_tensors
        grad = loss_grad_(softmax, ctx.stats, grad_loss, ctx.label_smoothing, ctx.vocab)
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss (float32, shape of ``target``) from vocabulary-sharded ``logits [..., V/tp]``.

    ``vocab_size``: the real vocabulary (default: every row); rows from ``vocab_size`` on are
    padding and left out. On a tensor group of size 1 this is ``F.cross_entropy(logits[...,
    :vocab_size], target, reduction="none", label_smoothing=label_smoothing)`` in float32.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree")
    padded = logits.shape[-1] * group.size
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {padded}] (the logits' padded vocabulary)")
    return _VocabParallelCrossEntropy.apply(logits, target, group, label_smoothing, vocab_size)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group | None, vocab_size: int,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss (float32) of the first ``vocab_size`` rows of ``logits [..., V (shard)]``:
    in one process (``group`` None or of size 1) by ``F.cross_entropy``, else vocab-parallel."""
    if group is not None and group.size > 1:
        return vocab_parallel_cross_entropy(logits, target, group, label_smoothing, vocab_size)
    losses = F.cross_entropy(logits[..., :vocab_size].float().flatten(0, -2), target.flatten(),
                             reduction="none", label_smoothing=label_smoothing)
    return losses.view(target.shape)

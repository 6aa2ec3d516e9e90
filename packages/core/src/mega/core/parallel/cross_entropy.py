"""Cross-entropy over logits whose vocabulary is split across the tensor group.

The LM head is column-parallel, so rank ``r`` holds logits for vocabulary ids
``[r*V/tp, (r+1)*V/tp)``. Gathering ``[s, b, V]`` logits would cost memory and bandwidth
proportional to the vocabulary; instead each rank reduces its shard to a few numbers per token
and two all-reduces of ``[s, b]``-sized tensors finish the job: the max (for a numerically
stable log-sum-exp), then the sum of exponentials together with the target's logit (and, with
label smoothing, the sum of logits).

Label smoothing follows ``torch.nn.functional.cross_entropy``: the target distribution is
``(1 - eps) * one_hot + eps / V``, so the loss is ``(1 - eps) * nll + eps * mean_j(-log p_j)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mega.core.parallel.collectives import all_reduce
from mega.core.parallel.groups import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing):
        shard = logits.float()
        partition = shard.shape[-1]
        vocab = partition * group.size
        vocab_start = group.rank * partition

        global_max = shard.max(dim=-1).values
        all_reduce(global_max, group, op=dist.ReduceOp.MAX)
        shifted = shard - global_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + partition)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        sums = [target_logit, None]
        if label_smoothing > 0:
            sums.append(shifted.sum(dim=-1))
        exp = shifted.exp_()  # shifted is no longer needed as logits: reuse its memory
        sums[1] = exp.sum(dim=-1)
        # One all-reduce for every per-token sum (target logit, sum of exp[, sum of logits]).
        stacked = torch.stack(sums)
        all_reduce(stacked, group)
        target_logit, sum_exp = stacked[0], stacked[1]

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            mean_neg_log_prob = log_sum_exp - stacked[2] / vocab
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_log_prob

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab, ctx.logits_dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        # d loss / d logit_j = softmax_j - (1 - eps) * [j == target] - eps / V
        grad = softmax
        rows = grad.view(-1, grad.shape[-1])
        hit = (~outside).reshape(-1).to(grad.dtype) * (1.0 - eps)
        rows[torch.arange(rows.shape[0], device=rows.device), local_target.reshape(-1)] -= hit
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss (float32, shape of ``target``) from vocabulary-sharded ``logits [..., V/tp]``.

    On a tensor group of size 1 this is ``F.cross_entropy(logits, target, reduction="none",
    label_smoothing=label_smoothing)`` computed in float32.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree")
    return _VocabParallelCrossEntropy.apply(logits, target, group, label_smoothing)

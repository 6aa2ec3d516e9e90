"""The output layer and its cross-entropy as one function whose W rebuilds the logits' gradient.

Under a zero-bubble schedule (:mod:`mega.core.parallel.weight_grad_split`) the last stage's output
layer leaves its weight gradient ``grad_logits^T @ hidden`` to W, and a product held for W keeps
its operands: the hidden ``[tokens, h]`` and the logits' gradient ``[tokens, vocabulary]``. The
second is by far the largest thing a pending W keeps (LLaMA 3's vocabulary of 128,256 at 8,192
tokens a micro-batch: 2.1 GB in bf16, against the hidden's 34 MB), and ZB-H1's last stage keeps
``pp - 1`` of them.

Here B computes the hidden's gradient from the softmax the forward saved, as the separate layer
and loss would, and defers a product that holds the hidden, the output weight and five numbers
per token (the target's row, whether it is in this shard, the logits' maximum and sum of
exponentials over the whole vocabulary, the loss's gradient). W rebuilds the gradient from them:
one more output-layer product (the logits again) in W, which nothing waits for, made a slice of
vocabulary rows at a time, so W never holds more than a ``[tokens, h]``-sized slab of logits and
needs no collective under tensor parallelism (the statistics are already the whole vocabulary's).

Outside W (no deferral) the function is not used: the output layer and the loss run as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.parallel.cross_entropy import SoftmaxStatistics, loss_grad_, softmax_of, softmax_statistics
from mega.core.parallel.grad_accumulation_fusion import Linear, accumulate_weight_grad, fuses_at_w
from mega.core.parallel.groups import Group
from mega.core.parallel.layers import ColumnParallelLinear
from mega.core.parallel.weight_grad_split import Deferred, WeightGrad, defer, deferral_target

# A vocabulary held whole: a group of one, whose collectives do nothing.
_WHOLE_VOCABULARY = Group("tensor", (0,), 0, None)


def output_layer_defers(weight: torch.Tensor) -> bool:
    """Whether the output layer run now leaves ``weight``'s gradient to a W step (a frozen
    weight, LoRA's, has none to leave)."""
    return weight.requires_grad and deferral_target(weight) is not None


def output_layer_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               group: Group | None, vocab_size: int | None = None,
                               label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token float32 loss of ``hidden [tokens, h] @ weight.T`` (this rank's vocabulary shard
    over ``group``, None: the whole vocabulary; ``hidden`` after the output layer's input
    collective) against ``target [tokens]``, over the first ``vocab_size`` rows (default: all),
    with the weight's gradient left to W; called where :func:`output_layer_defers`."""
    group = _WHOLE_VOCABULARY if group is None else group
    vocab_size = weight.shape[0] * group.size if vocab_size is None else vocab_size
    pending = deferral_target(weight)
    if pending is None:
        raise RuntimeError("output_layer_cross_entropy runs inside a W-deferring forward only (a zero-bubble "
                           "schedule's); elsewhere the output layer and the loss run apart")
    # The parameter travels in a tuple, which autograd does not track: its gradient comes from W only.
    return _OutputLayerCrossEntropy.apply(hidden, weight.detach(), target, group, vocab_size, label_smoothing,
                                          (weight,), pending)


def rebuildable_input(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The input of ``layer``'s own product (after its tensor-parallel copy or sequence-parallel
    gather), where that product is mega's plain ``hidden @ weight.T`` that W can make again; None
    where the layer computes otherwise (a bias, gathered logits, another backend's or FP8's product)."""
    if type(layer) is Linear and layer.bias is None:
        return hidden
    if type(layer) is ColumnParallelLinear and layer.bias is None and not layer.gather_output:
        return layer.local_input(hidden)
    return None


class _OutputLayerCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_size, label_smoothing, parameter: tuple[torch.Tensor],
                pending: list[Deferred]):
        loss, stats, softmax = softmax_statistics(F.linear(hidden, weight), target, group, label_smoothing,
                                                  vocab_size)
        ctx.save_for_backward(hidden, weight, softmax)
        ctx.stats, ctx.smoothing, ctx.vocab, ctx.dtype = stats, label_smoothing, vocab_size, hidden.dtype
        ctx.parameter, ctx.pending = parameter, pending
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, softmax = ctx.saved_tensors
        grad_logits = loss_grad_(softmax, ctx.stats, grad_loss, ctx.smoothing, ctx.vocab).to(ctx.dtype)
        grad_hidden = grad_logits.matmul(weight)
        del grad_logits  # W rebuilds it: holding it is what this function is for
        (parameter,) = ctx.parameter
        defer(ctx.pending, rebuilt_weight_grad(parameter, hidden.detach(), weight, ctx.stats, grad_loss,
                                               ctx.smoothing, ctx.vocab), ctx.parameter)
        return grad_hidden, None, None, None, None, None, None, None


def rebuilt_weight_grad(parameter: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                        stats: SoftmaxStatistics, grad_loss: torch.Tensor, label_smoothing: float,
                        vocab_size: int) -> WeightGrad:
    """The W product: the output weight's gradient, ``[rows, h]`` slices of vocabulary rows at a
    time (as many rows as the hidden size, so each slice's logits are the hidden's size), each
    from its logits made again; accumulated into ``main_grad`` where it is fused."""

    def product():
        fused = fuses_at_w(parameter)
        grad = None if fused else torch.empty_like(weight)
        step = hidden.shape[-1]
        for start in range(0, weight.shape[0], step):
            rows = slice(start, min(start + step, weight.shape[0]))
            softmax = softmax_of(F.linear(hidden, weight[rows]), stats, rows)
            grad_logits = loss_grad_(softmax, stats, grad_loss, label_smoothing, vocab_size, rows).to(hidden.dtype)
            if fused:
                accumulate_weight_grad(parameter.main_grad[rows], grad_logits, hidden)
            else:
                torch.mm(grad_logits.t(), hidden, out=grad[rows])
        return [(parameter, grad)]

    return product

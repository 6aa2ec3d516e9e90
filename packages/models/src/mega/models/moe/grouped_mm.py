"""The experts' grouped GEMM (``torch._grouped_mm``), with its weight gradient deferred to a
zero-bubble schedule's W step inside ``deferring_weight_grads``.

``y = grouped_mm(x, W^T)``: group ``e`` of rows ``x`` times expert ``e``'s weight. Its backward
is two grouped GEMMs, the ones torch's own derivative runs: B the input gradient
``grouped_mm(dy, W)``, W the weight gradient ``grouped_mm(dy^T, x)`` (for the column-major
``W^T`` torch computes its gradient transposed, ``(dy^T x)^T``, and hands back the transpose:
the same GEMM). So the split gradients equal autograd's bit for bit (checked against it).
"""

from __future__ import annotations

import torch

from mega.core.parallel.weight_grad_split import defer, deferral_target, eager_while_deferring


@eager_while_deferring
def grouped_mm(tokens: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(tokens, weight^T, offs=offsets)``; ``weight`` [experts, out, in]."""
    pending = deferral_target(weight)
    if pending is None or not weight.requires_grad:
        return torch._grouped_mm(tokens, weight.transpose(-2, -1), offs=offsets)
    # The weight enters detached: its gradient reaches autograd (and its hooks) at the W step.
    return _GroupedMMDeferringWeightGrad.apply(tokens, weight.detach(), offsets, weight, pending)


class _GroupedMMDeferringWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, offsets, parameter, pending):
        ctx.save_for_backward(tokens, weight, offsets)
        ctx.parameter, ctx.pending = parameter, pending
        return torch._grouped_mm(tokens, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad_output):
        tokens, weight, offsets = ctx.saved_tensors
        grad_tokens = torch._grouped_mm(grad_output, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        parameter = ctx.parameter
        defer(ctx.pending, lambda: [(parameter, torch._grouped_mm(grad_output.t(), tokens, offs=offsets))],
              (parameter,))
        return grad_tokens, None, None, None, None

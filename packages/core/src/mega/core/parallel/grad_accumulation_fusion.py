"""Gradient-accumulation fusion (Megatron's ``--gradient-accumulation-fusion``): a linear layer's
weight-gradient product is accumulated straight into the parameter's fp32 ``main_grad`` buffer
(``main_grad += grad_output^T @ input``, one GEMM with beta=1) instead of producing a bf16
gradient that data parallelism's hook then adds to ``main_grad`` in a second kernel (4% of a GPT
step on an H200: 1,168 fp32 ``add`` launches).

The GEMM is :func:`accumulate_weight_grad`, the one function every device calls: with the
gradient buffer in the parameters' dtype it is ``addmm_`` (any device); with bf16/fp16
parameters and an fp32 buffer it is ``addmm`` with an fp32 output (``out_dtype``), which torch
has for CUDA only, so elsewhere the unfused path runs (:func:`can_fuse`).

The layer's autograd function then returns an uninitialised gradient (no kernel) and sets
``weight.grad_added_to_main_grad``, which tells the data-parallel hook the gradient is already in
``main_grad`` (Megatron's protocol); the hook still fires, so a bucket's reduction starts when
its last gradient is in. Weights are fused only where data parallelism marked them
(``param.fuse_grad_accumulation``, set with ``main_grad``): never a weight that another use
(the embedding lookup of a tied output layer) gives an ordinary gradient.

A zero-bubble pipeline schedule defers the weight-gradient product to its W step
(:mod:`mega.core.parallel.weight_grad_split`): :func:`linear` then computes only the input
gradient in backward, and the product runs later, fused or not as it would have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.parallel.weight_grad_split import WeightGrad, defer, deferral_target, eager_while_deferring


def can_fuse(main_grad: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`accumulate_weight_grad` runs fused for this buffer and weight here."""
    return main_grad.dtype == weight.dtype or (main_grad.dtype == torch.float32 and main_grad.is_cuda)


def accumulate_weight_grad(main_grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input`` in one GEMM (``grad_output`` ``[tokens, out]``,
    ``input`` ``[tokens, in]``, ``main_grad`` ``[out, in]``); see :func:`can_fuse`."""
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), input)
    else:  # bf16/fp16 operands, fp32 accumulation and output (CUDA)
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=main_grad.dtype, out=main_grad)


def fuses(weight: torch.Tensor) -> bool:
    """Whether a linear layer's backward accumulates ``weight``'s gradient into ``main_grad``."""
    # Under torch.compile the unfused path runs: the backward's write into a buffer the graph does
    # not see and the mark on the weight are side effects AOTAutograd does not trace.
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and fuses_at_w(weight)


def fuses_at_w(weight: torch.Tensor) -> bool:
    """Whether a deferred weight-gradient product accumulates into ``main_grad``."""
    return (getattr(weight, "fuse_grad_accumulation", False) and weight.requires_grad
            and can_fuse(weight.main_grad, weight))


class _LinearAccumulatingWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        accumulate_weight_grad(weight.main_grad, grad_2d, x.reshape(-1, x.shape[-1]))
        weight.grad_added_to_main_grad = True
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        # An uninitialised gradient (no kernel) so the data-parallel hook fires; it is dropped.
        return grad_input, torch.empty_like(weight), grad_bias


def linear_weight_grad(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                       grad_output: torch.Tensor) -> WeightGrad:
    """The deferred weight (and bias) gradient of ``y = x @ weight.T + bias``: a W-step product.
    It keeps ``x`` detached: a stage's input (a leaf) would keep its gradient, sent in B, alive too."""
    x = x.detach()

    def product():
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        pairs = []
        if weight.requires_grad:
            if fuses_at_w(weight):
                accumulate_weight_grad(weight.main_grad, grad_2d, x_2d)
                pairs.append((weight, None))
            else:
                pairs.append((weight, grad_2d.t().matmul(x_2d)))
        if bias is not None and bias.requires_grad:
            pairs.append((bias, grad_2d.sum(0)))
        return pairs

    return product


class _LinearDeferringWeightGrad(torch.autograd.Function):
    """``F.linear`` whose backward computes the input gradient and defers the weight gradients.

    The weights enter detached (``params`` holds the parameters themselves), so autograd's
    accumulation of them does not run in B: it runs, with its hooks, when W hands it the gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, params, pending):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.pending = params, pending
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        defer(ctx.pending, linear_weight_grad(*ctx.params, x, grad_output), ctx.params)
        return grad_input, None, None, None, None


@eager_while_deferring
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with the weight gradient accumulated into ``weight.main_grad`` where it is
    fused (:func:`fuses`), and deferred to the W step inside ``deferring_weight_grads`` (from a
    compiled layer too: the product then runs eagerly, between the layer's compiled pieces)."""
    pending = deferral_target(weight)
    if pending is not None and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _LinearDeferringWeightGrad.apply(x, weight.detach(), None if bias is None else bias.detach(),
                                                (weight, bias), pending)
    if fuses(weight):
        return _LinearAccumulatingWeightGrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`linear` (the torch kernel backend's ``linear`` component)."""

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False`` leaves the bias to the caller (a fused bias + activation)."""
        return linear(x, self.weight, self.bias if add_bias else None)

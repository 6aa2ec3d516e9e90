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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
    return (getattr(weight, "fuse_grad_accumulation", False) and weight.requires_grad and torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and can_fuse(weight.main_grad, weight))


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with the weight gradient accumulated into ``weight.main_grad`` where it is
    fused (:func:`fuses`)."""
    if fuses(weight):
        return _LinearAccumulatingWeightGrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`linear` (the torch kernel backend's ``linear`` component)."""

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False`` leaves the bias to the caller (a fused bias + activation)."""
        return linear(x, self.weight, self.bias if add_bias else None)

"""The experts' SwiGLU MLPs as one autograd function: ``fc1 -> silu(gate) * up -> fc2``, each
matmul a loop over experts.

Where the device has no grouped GEMM (a CPU, or fp32) this is how the experts run. Against the
plain loop (``rows @ weight[e].T`` per expert, ``torch.cat``, then the activation on every row)
it saves, forward and backward:

* the selections ``weight[e]``: autograd would give each a backward that zeroes and adds a whole
  ``[experts, out, in]`` tensor (per expert, per projection), where this writes each expert's
  weight gradient once, straight into its row of the gradient;
* the ``cat`` of the per-expert outputs and of the activation's two gradients: every product
  is written by ``torch.mm(..., out=)`` into its final place;
* autograd's bookkeeping of the small ops: the activation and its gradient are a handful of
  elementwise ops over every row (each one parallel region: per-expert blocks would multiply
  them, and on a busy CPU each region waits for its slowest thread).

The numbers are those of the unfused ops (the same products in the same order, the SwiGLU of
:mod:`mega.models.torch_kernels`: ``silu(gate) * up``, gradients ``silu_backward(grad * up,
gate)`` and ``grad * silu(gate)``). Saved for backward: the input rows and fc1's output; each
expert's activation is recomputed from the latter. Under a zero-bubble schedule B makes the
activation once more for W, which then holds it (``ffn`` wide) rather than fc1's output (``2 ffn``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from mega.core.parallel.weight_grad_split import defer, deferral_target, eager_while_deferring


@eager_while_deferring
def grouped_swiglu_mlp(rows: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``rows`` [N, hidden] in consecutive groups of ``counts[e]`` rows; group ``e`` goes through
    expert ``e``: ``fc1`` [experts, 2 * ffn, hidden] (``[gate; up]``), ``fc2`` [experts, hidden, ffn]."""
    pending = deferral_target(fc1, fc2)
    if pending is not None and (fc1.requires_grad or fc2.requires_grad):
        # The weights enter detached: their gradients reach autograd (and its hooks) at the W step.
        return _GroupedSwiGLUMLP.apply(rows, fc1.detach(), fc2.detach(), counts, (pending, fc1, fc2))
    return _GroupedSwiGLUMLP.apply(rows, fc1, fc2, counts, None)


class _GroupedSwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, fc1, fc2, counts, deferred):
        ffn = fc2.shape[2]
        projected = rows.new_empty(rows.shape[0], fc1.shape[1])  # fc1's output, kept for backward
        for e, (x, h) in enumerate(zip(rows.split(counts), projected.split(counts), strict=True)):
            torch.mm(x, fc1[e].t(), out=h)
        activation = F.silu(projected[:, :ffn]) * projected[:, ffn:]
        out = rows.new_empty(rows.shape[0], fc2.shape[1])
        for e, (a, y) in enumerate(zip(activation.split(counts), out.split(counts), strict=True)):
            torch.mm(a, fc2[e].t(), out=y)
        ctx.save_for_backward(rows, fc1, fc2, projected)
        ctx.counts, ctx.deferred = counts, deferred
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rows, fc1, fc2, projected = ctx.saved_tensors
        counts, ffn = ctx.counts, fc2.shape[2]
        want_rows, want_fc1, want_fc2 = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()
        gate, up = projected[:, :ffn], projected[:, ffn:]
        silu_gate = F.silu(gate)
        grad_rows = grad_fc1 = grad_fc2 = None
        if ctx.deferred is not None:  # B now, the weight gradients at W
            pending, fc1_param, fc2_param = ctx.deferred
            grad_projected = _grad_projected(grad_out, fc2, gate, up, silu_gate, counts)
            # W keeps fc2's input, the activation (ffn wide), not fc1's output it is made from (2 ffn)
            activation = silu_gate.mul_(up)
            defer(pending, partial(_weight_grads, rows, fc1_param, fc2_param, grad_out, grad_projected, activation,
                                   counts), (fc1_param, fc2_param))
            return (_grad_rows(grad_projected, fc1, rows, counts) if want_rows else None), None, None, None, None
        if want_fc2:
            grad_fc2 = _grad_fc2(grad_out, silu_gate * up, fc2, counts)
        if not (want_rows or want_fc1):
            return None, None, grad_fc2, None, None
        grad_projected = _grad_projected(grad_out, fc2, gate, up, silu_gate, counts)
        del silu_gate
        if want_fc1:
            grad_fc1 = _grad_fc1(grad_projected, rows, fc1, counts)
        if want_rows:
            grad_rows = _grad_rows(grad_projected, fc1, rows, counts)
        return grad_rows, grad_fc1, grad_fc2, None, None


def _grad_projected(grad_out, fc2, gate, up, silu_gate, counts):
    """The gradient of fc1's output ``[gate; up]``."""
    ffn = fc2.shape[2]
    grad_act = grad_out.new_empty(grad_out.shape[0], ffn)
    for e, (dy, da) in enumerate(zip(grad_out.split(counts), grad_act.split(counts), strict=True)):
        torch.mm(dy, fc2[e], out=da)
    grad_projected = grad_out.new_empty(grad_out.shape[0], 2 * ffn)
    torch.mul(grad_act, silu_gate, out=grad_projected[:, ffn:])  # d up
    # d gate (silu_backward straight into the strided half is many times slower than this copy)
    grad_projected[:, :ffn].copy_(torch.ops.aten.silu_backward(grad_act.mul_(up), gate))
    return grad_projected


def _grad_rows(grad_projected, fc1, rows, counts):
    grad_rows = rows.new_empty(rows.shape)
    for e, (dh, dx) in enumerate(zip(grad_projected.split(counts), grad_rows.split(counts), strict=True)):
        torch.mm(dh, fc1[e], out=dx)
    return grad_rows


def _grad_fc1(grad_projected, rows, fc1, counts):
    grad_fc1 = fc1.new_empty(fc1.shape)  # (an expert with no rows: zeros)
    for e, (dh, x) in enumerate(zip(grad_projected.split(counts), rows.split(counts), strict=True)):
        torch.mm(dh.t(), x, out=grad_fc1[e])
    return grad_fc1


def _grad_fc2(grad_out, activation, fc2, counts):
    grad_fc2 = fc2.new_empty(fc2.shape)  # (an expert with no rows: zeros)
    for e, (dy, a) in enumerate(zip(grad_out.split(counts), activation.split(counts), strict=True)):
        torch.mm(dy.t(), a, out=grad_fc2[e])
    return grad_fc2


def _weight_grads(rows, fc1, fc2, grad_out, grad_projected, activation, counts):
    """The W step's products: both weight gradients (a frozen weight gets none)."""
    pairs = []
    if fc1.requires_grad:
        pairs.append((fc1, _grad_fc1(grad_projected, rows, fc1, counts)))
    if fc2.requires_grad:
        pairs.append((fc2, _grad_fc2(grad_out, activation, fc2, counts)))
    return pairs

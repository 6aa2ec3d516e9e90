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
expert's activation is recomputed from the latter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_swiglu_mlp(rows: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``rows`` [N, hidden] in consecutive groups of ``counts[e]`` rows; group ``e`` goes through
    expert ``e``: ``fc1`` [experts, 2 * ffn, hidden] (``[gate; up]``), ``fc2`` [experts, hidden, ffn]."""
    return _GroupedSwiGLUMLP.apply(rows, fc1, fc2, counts)


class _GroupedSwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, fc1, fc2, counts):
        ffn = fc2.shape[2]
        projected = rows.new_empty(rows.shape[0], fc1.shape[1])  # fc1's output, kept for backward
        for e, (x, h) in enumerate(zip(rows.split(counts), projected.split(counts), strict=True)):
            torch.mm(x, fc1[e].t(), out=h)
        activation = F.silu(projected[:, :ffn]) * projected[:, ffn:]
        out = rows.new_empty(rows.shape[0], fc2.shape[1])
        for e, (a, y) in enumerate(zip(activation.split(counts), out.split(counts), strict=True)):
            torch.mm(a, fc2[e].t(), out=y)
        ctx.save_for_backward(rows, fc1, fc2, projected)
        ctx.counts = counts
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
        if want_fc2:
            grad_fc2 = fc2.new_empty(fc2.shape)  # (an expert with no rows: zeros)
            activation = silu_gate * up
            for e, (dy, a) in enumerate(zip(grad_out.split(counts), activation.split(counts), strict=True)):
                torch.mm(dy.t(), a, out=grad_fc2[e])
            del activation
        if not (want_rows or want_fc1):
            return None, None, grad_fc2, None
        grad_act = rows.new_empty(rows.shape[0], ffn)
        for e, (dy, da) in enumerate(zip(grad_out.split(counts), grad_act.split(counts), strict=True)):
            torch.mm(dy, fc2[e], out=da)
        grad_projected = torch.empty_like(projected)
        torch.mul(grad_act, silu_gate, out=grad_projected[:, ffn:])  # d up
        # d gate (silu_backward straight into the strided half is many times slower than this copy)
        grad_projected[:, :ffn].copy_(torch.ops.aten.silu_backward(grad_act.mul_(up), gate))
        del grad_act, silu_gate
        if want_fc1:
            grad_fc1 = fc1.new_empty(fc1.shape)
            for e, (dh, x) in enumerate(zip(grad_projected.split(counts), rows.split(counts), strict=True)):
                torch.mm(dh.t(), x, out=grad_fc1[e])
        if want_rows:
            grad_rows = rows.new_empty(rows.shape)
            for e, (dh, dx) in enumerate(zip(grad_projected.split(counts), grad_rows.split(counts), strict=True)):
                torch.mm(dh, fc1[e], out=dx)
        return grad_rows, grad_fc1, grad_fc2, None

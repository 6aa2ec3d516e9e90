"""The experts' SwiGLU MLPs as one autograd function: a loop over experts, each expert's
``fc1 -> silu(gate) * up -> fc2`` done while its rows are still in cache.

Where the device has no grouped GEMM (a CPU, or fp32) this is how the experts run. Against the
plain loop (``rows @ weight[e].T`` per expert, ``torch.cat``, then the activation on every row)
it saves, forward and backward:

* the selections ``weight[e]``: autograd would give each a backward that zeroes and adds a whole
  ``[experts, out, in]`` tensor (per expert, per projection), where this writes each expert's
  weight gradient once, straight into its row of the gradient;
* the ``cat`` of the per-expert outputs and of the activation's two gradients: every product
  is written by ``torch.mm(..., out=)`` into its final place;
* passes over memory: the activation and its gradient run on one expert's block at a time, just
  after the matmul that produced it, instead of over every row after all the matmuls.

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
        out = rows.new_empty(rows.shape[0], fc2.shape[1])
        activation = rows.new_empty(max(counts, default=0), ffn)  # one expert's block, reused
        for e, (x, h, y) in enumerate(zip(rows.split(counts), projected.split(counts), out.split(counts), strict=True)):
            torch.mm(x, fc1[e].t(), out=h)
            act = activation[:x.shape[0]]
            torch.mul(F.silu(h[:, :ffn]), h[:, ffn:], out=act)
            torch.mm(act, fc2[e].t(), out=y)
        ctx.save_for_backward(rows, fc1, fc2, projected)
        ctx.counts = counts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rows, fc1, fc2, projected = ctx.saved_tensors
        counts, ffn = ctx.counts, fc2.shape[2]
        want_rows, want_fc1, want_fc2 = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()
        grad_rows = rows.new_empty(rows.shape) if want_rows else None
        grad_fc1 = fc1.new_empty(fc1.shape) if want_fc1 else None  # (an expert with no rows: zeros)
        grad_fc2 = fc2.new_empty(fc2.shape) if want_fc2 else None
        block = max(counts, default=0)
        grad_projected = rows.new_empty(block, 2 * ffn)  # one expert's blocks, reused
        grad_act, scratch = rows.new_empty(block, ffn), rows.new_empty(block, ffn)
        grad_groups = grad_rows.split(counts) if want_rows else [None] * len(counts)
        splits = zip(rows.split(counts), projected.split(counts), grad_out.split(counts), grad_groups, strict=True)
        for e, (x, h, dy, dx) in enumerate(splits):
            n = x.shape[0]
            gate, up = h[:, :ffn], h[:, ffn:]
            silu_gate = F.silu(gate)
            if want_fc2:
                torch.mm(dy.t(), torch.mul(silu_gate, up, out=scratch[:n]), out=grad_fc2[e])
            if not (want_rows or want_fc1):
                continue
            dact, dh = grad_act[:n], grad_projected[:n]
            torch.mm(dy, fc2[e], out=dact)
            torch.mul(dact, silu_gate, out=dh[:, ffn:])  # d up
            torch.ops.aten.silu_backward.grad_input(torch.mul(dact, up, out=scratch[:n]), gate,
                                                    grad_input=dh[:, :ffn])  # d gate
            if want_fc1:
                torch.mm(dh.t(), x, out=grad_fc1[e])
            if want_rows:
                torch.mm(dh, fc1[e], out=dx)
        return grad_rows, grad_fc1, grad_fc2, None

"""The grouped MoE experts under a split backward: B gives the rows' gradient, W the two weight
gradients, each equal to the unsplit backward's bit for bit."""

from __future__ import annotations

import torch

from mega.core.parallel.weight_grad_split import deferring_weight_grads, run_weight_grads
from mega.models.moe.grouped_mlp import grouped_swiglu_mlp


def test_grouped_experts_defer_their_weight_gradients():
    generator = torch.Generator().manual_seed(0)
    fc1 = torch.nn.Parameter(torch.randn(3, 8, 4, generator=generator))
    fc2 = torch.nn.Parameter(torch.randn(3, 4, 4, generator=generator))
    rows = torch.randn(7, 4, generator=generator, requires_grad=True)
    counts, grad = [2, 0, 5], torch.randn(7, 4, generator=generator)
    grouped_swiglu_mlp(rows, fc1, fc2, counts).backward(grad)
    whole = [t.grad.clone() for t in (rows, fc1, fc2)]
    for tensor in (rows, fc1, fc2):
        tensor.grad = None
    pending = []
    with deferring_weight_grads(pending):
        out = grouped_swiglu_mlp(rows, fc1, fc2, counts)
    out.backward(grad)
    assert torch.equal(rows.grad, whole[0]) and fc1.grad is None and fc2.grad is None and len(pending) == 1
    run_weight_grads(pending)
    assert torch.equal(fc1.grad, whole[1]) and torch.equal(fc2.grad, whole[2]) and pending == []

"""The models' layers under a split backward (B, then W) give the unsplit backward's gradients bit
for bit: the grouped MoE experts, and a region under activation recompute, whose rerun in B must
replay the deferral its forward had."""

from __future__ import annotations

import torch

from mega.core.parallel.grad_accumulation_fusion import Linear
from mega.core.parallel.weight_grad_split import deferring_weight_grads, run_weight_grads
from mega.models.moe.grouped_mlp import grouped_swiglu_mlp
from mega.models.recompute import recomputed


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


def test_a_recomputed_region_defers_as_its_forward_did():
    torch.manual_seed(0)
    fc1, fc2 = Linear(8, 16), Linear(16, 8)

    def region(x):
        return fc2(torch.tanh(fc1(x)))

    x = torch.randn(4, 8, requires_grad=True)
    region(x).square().sum().backward()
    tensors = (x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    whole = [t.grad.clone() for t in tensors]
    for tensor in tensors:
        tensor.grad = None
    pending = []
    with deferring_weight_grads(pending):
        out = recomputed(region, x)
    out.square().sum().backward()  # reruns the region, deferring as its forward did
    assert fc1.weight.grad is None and len(pending) == 2
    run_weight_grads(pending)
    assert all(torch.equal(t.grad, grad) for t, grad in zip(tensors, whole, strict=True))

"""The models' layers under a split backward (B, then W) give the unsplit backward's gradients bit
for bit: the grouped MoE experts, and a region under activation recompute, whose rerun in B must
replay the deferral its forward had."""

from __future__ import annotations

import pytest
import torch

from mega.core.kernels import Kernels
from mega.core.parallel.grad_accumulation_fusion import Linear
from mega.core.parallel.weight_grad_split import deferring_weight_grads, run_weight_grads
from mega.models.blocks.recompute import recomputed
from mega.models.moe.experts import GroupedExperts
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_experts_defer_their_weight_gradients(dtype):
    """CPU (torch._grouped_mm has a CPU kernel; a GPU runs the same code): the experts' two
    grouped GEMMs, split into B and W, give torch's own derivative of torch._grouped_mm."""
    experts = GroupedExperts(3, 16, 16, Kernels(), grouped_gemm=True).to(dtype)
    generator = torch.Generator().manual_seed(0)
    for weight in (experts.linear_fc1.weight, experts.linear_fc2.weight):
        weight.data.copy_(torch.randn(weight.shape, generator=generator))
    rows = torch.randn(40, 16, generator=generator).to(dtype).requires_grad_()
    counts, grad = [16, 0, 24], torch.randn(40, 16, generator=generator).to(dtype)
    weights = (experts.linear_fc1.weight, experts.linear_fc2.weight)
    torch.autograd.backward(_grouped_gemm(experts, rows, counts), grad)
    whole = [t.grad.clone() for t in (rows, *weights)]
    for tensor in (rows, *weights):
        tensor.grad = None
    pending = []
    with deferring_weight_grads(pending):
        out = _grouped_gemm(experts, rows, counts)
    out.backward(grad)
    assert torch.equal(rows.grad, whole[0]) and all(w.grad is None for w in weights) and len(pending) == 2
    run_weight_grads(pending)
    assert all(torch.equal(w.grad, g) for w, g in zip(weights, whole[1:], strict=True)) and pending == []


def _grouped_gemm(experts, rows, counts):
    """The experts' grouped-GEMM path (a GPU's with bf16), on whatever device ``rows`` is."""
    return experts.linear_fc2(experts.activation(experts.linear_fc1(rows, counts)), counts)


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

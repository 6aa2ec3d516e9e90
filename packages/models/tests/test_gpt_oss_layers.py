"""gpt-oss's clamped SwiGLU keeps only its input for the backward and recomputes the rest: its
output and gradient equal plain autograd's over the same ops bit for bit, on both sides of the
clamps. CPU, fp32 and bf16, so it passes on a GPU machine as well."""

from __future__ import annotations

import pytest
import torch

from mega.models.gpt_oss.experts import clamped_swiglu, clamped_swiglu_ops
from mega.testing.saved_activations import saved_activation_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recomputed_activation_equals_autograd_and_keeps_only_its_input(dtype):
    generator = torch.Generator().manual_seed(0)
    projected = (torch.randn(24, 2 * 16, generator=generator) * 4).to(dtype)  # many values past the limit
    grad = torch.randn(24, 16, generator=generator).to(dtype)
    results = []
    for function in (clamped_swiglu, clamped_swiglu_ops):
        leaf = projected.clone().requires_grad_()
        out = function(leaf, 3.0, 1.702)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    leaf = projected.clone().requires_grad_()
    saved, _ = saved_activation_bytes(lambda: clamped_swiglu(leaf * 1, 3.0, 1.702).sum(), exclude=[leaf])
    assert saved == projected.numel() * projected.element_size()

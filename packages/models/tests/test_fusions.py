"""Megatron's fusions (mega.models.blocks.fusions) equal their unfused forms in fp32 to 1e-6, forward
and gradients. CPU: the functions run as written (on a GPU the same functions are compiled)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mega.core.kernels import Kernels
from mega.core.parallel.cross_entropy import cross_entropy
from mega.models import torch_kernels
from mega.models.blocks import fusions
from mega.models.blocks.mlp import MLP
from mega.models.config import TransformerConfig

TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def _inputs(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, dtype=torch.float32, requires_grad=True) for shape in shapes]


def _assert_same(fused, unfused, inputs):
    torch.testing.assert_close(fused, unfused, **TOLERANCE)
    grad = torch.randn(fused.shape, generator=torch.Generator().manual_seed(9))
    for a, b in zip(torch.autograd.grad(fused, inputs, grad), torch.autograd.grad(unfused, inputs, grad), strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(approximate):
    x, bias = _inputs((6, 2, 16), (16,))
    _assert_same(fusions.bias_gelu(x, bias, approximate), F.gelu(x + bias, approximate=approximate), [x, bias])


def test_bias_swiglu():
    x, bias = _inputs((6, 2, 32), (32,))
    _assert_same(fusions.bias_swiglu(x, bias), torch_kernels.activation("swiglu")(x + bias), [x, bias])


@pytest.mark.parametrize("training", [True, False])
def test_bias_dropout_add(training):
    x, bias, residual = _inputs((6, 2, 16), (16,), (6, 2, 16))
    torch.manual_seed(3)
    fused = fusions.bias_dropout_add(x, bias, residual, 0.25, training)
    torch.manual_seed(3)
    dropout = torch.nn.Dropout(0.25).train(training)
    _assert_same(fused, residual + dropout(x + bias), [x, bias, residual])


def test_cross_entropy_over_the_real_vocabulary():
    (logits,) = _inputs((5, 3, 40))
    labels = torch.randint(0, 33, (5, 3), generator=torch.Generator().manual_seed(1))
    _assert_same(fusions.cross_entropy(logits, labels, 33), cross_entropy(logits, labels, None, 33), [logits])


@pytest.mark.parametrize("swiglu", [False, True])
def test_the_mlp_with_its_bias_fused_equals_the_unfused_mlp(swiglu):
    shape = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, swiglu=swiglu)
    torch.manual_seed(0)
    fused = MLP(TransformerConfig(**shape), Kernels())
    unfused = MLP(TransformerConfig(**shape, bias_gelu_fusion=False, bias_swiglu_fusion=False), Kernels())
    unfused.load_state_dict(fused.state_dict())
    assert fused.bias_activation is not None and unfused.bias_activation is None
    (x,) = _inputs((4, 2, 16))
    _assert_same(fused(x), unfused(x), [x])


def test_the_compiled_fusions_on_a_gpu_equal_the_unfused_forms():
    """CUDA only (skipped on the CPU): the functions as compiled there (inductor), fp32; 1e-5
    since a compiled reduction may sum in another order."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the fusions compile only for GPU tensors")
    x, bias, residual = (t.detach().cuda().requires_grad_() for t in _inputs((6, 2, 32), (32,), (6, 2, 32)))
    labels = torch.randint(0, 30, (6, 2), device="cuda")
    checks = [(fusions.bias_gelu(x, bias), F.gelu(x + bias), [x, bias]),
              (fusions.bias_swiglu(x, bias), torch_kernels.activation("swiglu")(x + bias), [x, bias]),
              (fusions.bias_dropout_add(x, bias, residual, 0.1, False), residual + x + bias, [x, bias, residual]),
              (fusions.cross_entropy(x, labels, 30), cross_entropy(x, labels, None, 30), [x])]
    for fused, unfused, inputs in checks:
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
        grad = torch.ones_like(fused)
        for a, b in zip(torch.autograd.grad(fused, inputs, grad), torch.autograd.grad(unfused, inputs, grad),
                        strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

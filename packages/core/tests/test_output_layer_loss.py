"""The output layer + cross-entropy whose W rebuilds the logits' gradient (CPU, one process).

Against torch: ``F.cross_entropy`` of ``F.linear``'s logits (the padded vocabulary rows left out,
with and without label smoothing) and autograd's gradients, fp32. The weight has more rows than
the hidden size, and not a multiple of it, so W makes the gradient in three slices. Tensor
parallelism (the vocabulary-sharded statistics) is checked by the pipeline runs against one
process (tests/test_pipeline_schedules_training.py, tp2 x pp2 interleaved zero bubble).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mega.core.parallel.output_layer_loss import output_layer_cross_entropy, output_layer_defers
from mega.core.parallel.weight_grad_split import deferring_weight_grads, run_weight_grads

TOKENS, HIDDEN, ROWS, VOCAB = 12, 8, 20, 18  # rows 18 and 19: vocabulary padding


def inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(ROWS, HIDDEN, generator=generator).to(dtype))
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    weights = torch.rand(TOKENS, generator=generator)  # a loss mask's role: each token's share
    return hidden, weight, target, weights


def reference(hidden, weight, target, weights, smoothing):
    logits = F.linear(hidden, weight)[:, :VOCAB].float()
    loss = (F.cross_entropy(logits, target, reduction="none", label_smoothing=smoothing) * weights).sum()
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    return loss.detach(), grad_hidden, grad_weight


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_b_gives_the_hidden_gradient_and_w_rebuilds_the_weight_gradient(smoothing):  # device: cpu
    hidden, weight, target, weights = inputs()
    expected_loss, expected_hidden, expected_weight = reference(hidden, weight, target, weights, smoothing)
    pending = []
    with deferring_weight_grads(pending):
        loss = (output_layer_cross_entropy(hidden, weight, target, None, VOCAB, smoothing) * weights).sum()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-6, atol=1e-6)
    loss.backward()  # B
    torch.testing.assert_close(hidden.grad, expected_hidden, rtol=1e-6, atol=1e-6)
    assert weight.grad is None and len(pending) == 1
    run_weight_grads(pending)  # W
    torch.testing.assert_close(weight.grad, expected_weight, rtol=1e-6, atol=1e-6)
    assert weight.grad[VOCAB:].abs().max() == 0  # padding rows get nothing


def test_w_accumulates_into_main_grad_where_the_accumulation_is_fused():  # device: cpu
    hidden, weight, target, weights = inputs()
    _, _, expected_weight = reference(hidden, weight, target, weights, 0.0)
    weight.main_grad = torch.full_like(weight, 0.5)  # what earlier micro-batches left
    weight.fuse_grad_accumulation = True
    pending = []
    with deferring_weight_grads(pending):
        loss = (output_layer_cross_entropy(hidden, weight, target, None, VOCAB) * weights).sum()
    loss.backward()
    run_weight_grads(pending)
    assert weight.grad_added_to_main_grad
    torch.testing.assert_close(weight.main_grad, expected_weight + 0.5, rtol=1e-6, atol=1e-6)


def test_bf16_matches_the_separate_layer_and_loss():  # device: cpu
    hidden, weight, target, weights = inputs(torch.bfloat16)
    _, expected_hidden, expected_weight = reference(hidden, weight, target, weights, 0.0)
    pending = []
    with deferring_weight_grads(pending):
        loss = (output_layer_cross_entropy(hidden, weight, target, None, VOCAB) * weights).sum()
    loss.backward()
    run_weight_grads(pending)
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.grad, expected_hidden, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weight.grad, expected_weight, rtol=2e-2, atol=2e-2)


def test_refused_outside_a_deferring_forward_and_not_used_for_a_frozen_weight():  # device: cpu
    hidden, weight, target, _ = inputs()
    with pytest.raises(RuntimeError, match="W-deferring forward"):
        output_layer_cross_entropy(hidden, weight, target, None, VOCAB)
    with deferring_weight_grads([]):
        assert output_layer_defers(weight)
        weight.requires_grad_(False)  # LoRA's frozen output layer: nothing for W
        assert not output_layer_defers(weight)

"""The torch ``block_attention`` component against torch's own attention and autograd (fp64).

Keys are split into two blocks; the blocks' outputs merged by their log-sum-exps must be full
attention's output, and each block's backward (given the merged output and log-sum-exp) must
return its share of autograd's gradients: the contract context parallelism's ring relies on.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mega.models.torch_kernels import BlockAttention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_blocks_merge_to_full_attention_and_its_gradients(causal, kv_heads):
    torch.manual_seed(0)
    blocks, scale, repeats = BlockAttention(), 1 / math.sqrt(8), 4 // kv_heads
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, 10, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, 10, 8, dtype=torch.float64, requires_grad=True)
    causal_mask = torch.ones(6, 10, dtype=torch.bool).tril(4) if causal else None
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1),
                                               attn_mask=causal_mask, scale=scale)
    grad = torch.randn_like(reference)
    reference.backward(grad)

    q_, k_, v_ = q.detach(), k.detach(), v.detach()
    whole, _ = blocks.forward(q_, k_, v_, causal=causal, softmax_scale=scale)
    # Causal, aligned at the end: every query sees all of the first block's keys.
    out1, lse1 = blocks.forward(q_, k_[:, :, :5], v_[:, :, :5], causal=False, softmax_scale=scale)
    out2, lse2 = blocks.forward(q_, k_[:, :, 5:], v_[:, :, 5:], causal=causal, softmax_scale=scale)
    lse = torch.logaddexp(lse1, lse2)
    out = out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None]
    torch.testing.assert_close(whole, reference.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, reference.detach(), rtol=1e-12, atol=1e-12)

    share1 = blocks.backward(grad, q_, k_[:, :, :5], v_[:, :, :5], out, lse, causal=False, softmax_scale=scale)
    share2 = blocks.backward(grad, q_, k_[:, :, 5:], v_[:, :, 5:], out, lse, causal=causal, softmax_scale=scale)
    torch.testing.assert_close(share1[0] + share2[0], q.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([share1[1], share2[1]], 2), k.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([share1[2], share2[2]], 2), v.grad, rtol=1e-10, atol=1e-10)

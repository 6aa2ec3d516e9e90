"""CPU. Grouped-query attention of one query per head (a decode step) folds each group's query
heads into the query dimension; the outputs equal attention over keys and values repeated per
query head (the textbook form), for every mask a cache hands the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mega.core.kernels import AttentionMask
from mega.models.torch_kernels import sdpa_attention

BATCH, HEADS, GROUPS, KEYS, DIM = 3, 8, 2, 11, 16


def _reference(query, key, value, additive):
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=additive)


def _masks():
    generator = torch.Generator().manual_seed(1)
    padding = torch.ones(BATCH, KEYS, dtype=torch.bool)
    padding[0, 7:] = padding[2, :3] = False
    bias = torch.zeros(BATCH, 1, 1, KEYS).masked_fill_(torch.arange(KEYS) > torch.tensor([4, 9, 10])[:, None, None, None],
                                                       torch.finfo(torch.float32).min)
    per_head = torch.randn(1, HEADS, 1, KEYS, generator=generator)
    min_value = torch.finfo(torch.float32).min
    return {
        "causal": (AttentionMask(causal=True), None),
        "padding": (AttentionMask(causal=True, padding=padding),
                    torch.zeros(BATCH, 1, 1, KEYS).masked_fill_(~padding[:, None, None, :], min_value)),
        "static-cache bias": (AttentionMask(bias=bias), bias),
        "per-head bias": (AttentionMask(causal=True, bias=per_head), per_head),
    }


@pytest.mark.parametrize("name", list(_masks()))
def test_one_query_per_head_equals_repeated_keys_and_values(name):
    mask, additive = _masks()[name]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(BATCH, HEADS, 1, DIM, generator=generator)
    key, value = (torch.randn(BATCH, GROUPS, KEYS, DIM, generator=generator) for _ in range(2))
    got = sdpa_attention(query, key, value, mask=mask)
    torch.testing.assert_close(got, _reference(query, key, value, additive), rtol=1e-5, atol=1e-6)

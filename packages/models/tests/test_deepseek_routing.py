"""DeepSeek-V3's routing against megatron-core's own functions (``moe_utils``, on the CPU): the
sigmoid top-k chosen with the expert bias and weighted without it, renormalised, group-limited,
scaled; softmax routing over groups; the sigmoid scores of the load-balancing loss; and the
expert bias after a step (``get_updated_expert_bias``, its collective a no-op on one rank)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mega.models.deepseek_v3.family import PRESETS
from mega.models.moe.routing import aux_loss_scores, choose_experts, updated_expert_bias

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

TOKENS, EXPERTS = 64, 16


def dense(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.zeros(weights.shape[0], EXPERTS).scatter(1, experts, weights)
    return probs, torch.zeros(weights.shape[0], EXPERTS, dtype=torch.bool).scatter(1, experts, True)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
@pytest.mark.parametrize("groups", [None, (4, 2)])
def test_routing_matches_megatron_core(score_function, groups):
    config = dataclasses.replace(
        PRESETS["tiny"], num_experts=EXPERTS, moe_router_topk=4, moe_router_score_function=score_function,
        moe_router_num_groups=groups and groups[0], moe_router_group_topk=groups and groups[1],
        moe_router_enable_expert_bias=score_function == "sigmoid", moe_router_topk_scaling_factor=2.5)
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(TOKENS, EXPERTS, generator=generator) * 2
    bias = torch.randn(EXPERTS, generator=generator) * 0.3 if score_function == "sigmoid" else None
    probs, chosen = dense(*choose_experts(logits, config, bias))
    expected_probs, expected_map = moe_utils.topk_routing_with_score_function(
        logits, 4, num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
        scaling_factor=2.5, score_function=score_function, expert_bias=bias)
    assert torch.equal(chosen, expected_map)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-6, atol=1e-7)
    if bias is not None:  # the bias changed the choice (else the test would not see it)
        assert not torch.equal(dense(*choose_experts(logits, config))[1], expected_map)
    expected_scores = moe_utils.compute_routing_scores_for_aux_loss(logits, 4, score_function)[1]
    torch.testing.assert_close(aux_loss_scores(logits, config), expected_scores, rtol=1e-6, atol=1e-7)


def test_expert_bias_update_matches_megatron_core(monkeypatch):
    monkeypatch.setattr(moe_utils.torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda **kwargs: None)
    generator = torch.Generator().manual_seed(6)
    load = torch.randint(0, 50, (3, EXPERTS), generator=generator).float()
    bias = torch.randn(3, EXPERTS, generator=generator)
    expected = moe_utils.get_updated_expert_bias(load.clone(), bias, 1e-3)
    for layer in range(3):
        torch.testing.assert_close(updated_expert_bias(bias[layer], load[layer], 1e-3), expected[layer], rtol=0, atol=0)

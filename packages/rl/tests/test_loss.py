"""The loss beyond what TRL has: Megatron's one-sample entropy term, the aggregations TRL lacks
(seq-mean-token-sum, a global token count), and the errors. CPU only (pinned)."""

from __future__ import annotations

import math

import pytest
import torch

from mega.rl.loss import aggregate, grpo_token_losses, loss_metrics

DEVICE = torch.device("cpu")


def test_one_token_by_megatrons_formula():
    cur, old, ref, inf = -0.5, -0.7, -0.9, -0.4
    advantage, eps_lower, eps_upper, beta, weight, coef = -1.5, 0.1, 0.3, 0.05, 0.02, 1.2
    terms = grpo_token_losses(torch.tensor([[cur]]), torch.tensor([[old]]), torch.tensor([advantage]),
                              reference=torch.tensor([[ref]]), inference=torch.tensor([[inf]]),
                              clamp_eps_lower=eps_lower, clamp_eps_upper=eps_upper, kl_beta=beta,
                              entropy_weight=weight, is_truncation_coef=coef)
    ratio = math.exp(cur - old)
    clipped = min(max(ratio, 1 - eps_lower), 1 + eps_upper)
    k3 = math.exp(ref - cur) - (ref - cur) - 1
    entropy = -math.exp(cur) * cur  # the sampled token's share: Megatron's estimate without logits
    w_is = min(math.exp(old - inf), coef)
    expected = -w_is * min(ratio * advantage, clipped * advantage) + beta * k3 - weight * entropy
    assert abs(float(terms.loss) - expected) < 1e-6
    assert abs(float(terms.is_weight) - w_is) < 1e-7 and abs(float(terms.kl) - k3) < 1e-7


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(per_token, mask, "token-mean")) == 10 / 4
    assert float(aggregate(per_token, mask, "token-mean", total_tokens=8)) == 10 / 8  # the global batch's count
    assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == (2 + 4) / 2
    assert float(aggregate(per_token, mask, "seq-mean-token-sum")) == (6 + 4) / 2
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", max_tokens=5)) == 10 / (2 * 5)
    with pytest.raises(ValueError, match="needs max_tokens"):
        aggregate(per_token, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate(per_token, mask, "sum")


def test_errors_and_metrics_without_reference_or_engine():
    current = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs the reference"):
        grpo_token_losses(current, current, torch.ones(2), kl_beta=0.1)
    with pytest.raises(ValueError, match="differ in shape"):
        grpo_token_losses(current, torch.zeros(2, 2), torch.ones(2))
    terms = grpo_token_losses(current, current, torch.ones(2))
    metrics = loss_metrics(terms, torch.ones(2, 3))
    assert metrics["clip_fraction"] == 0.0 and "kl" not in metrics and "logprob_gap_max" not in metrics

"""The GRPO step without its separate old-policy pass (``mega.rl.grpo_step.old_from_update``):
where one pass makes one optimizer step over every rollout, the old log-probabilities are the
update forward's own, detached, and the step is the same as with the separate pass: the same
loss, clip fraction, engine-vs-trainer gap and, bit for bit, the same weights after it.

CPU, one process (pinned: ``cpu_only`` hides CUDA, whose nondeterministic gradient kernels would
make two runs differ bit for bit on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

import mega.rl.grpo_step as grpo
from mega.rl.grpo_step import GRPOSettings, grpo_step, old_from_update
from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, RolloutSampling

ARGV = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2", "--eval-iters", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "100"]
PROMPTS = [[17, 40, 99, 5], [64, 3, 120, 77, 8]]


@pytest.fixture(scope="module", autouse=True)
def cpu_only():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


def reward(rollouts) -> torch.Tensor:
    return torch.tensor([sum(t < 16 for t in c) / max(len(c), 1) for c in rollouts.completions])


def one_step(monkeypatch, separate_pass: bool, settings: GRPOSettings) -> tuple[dict, list[torch.Tensor]]:
    with monkeypatch.context() as patch:
        if separate_pass:
            patch.setattr(grpo, "old_from_update", lambda *_: False)
        policy = PolicyEngine.from_args(ARGV)
        engine = RolloutEngine(policy.model, vocab_size=128, max_positions=32)
        sampling = RolloutSampling(max_new_tokens=6, seed=3)
        log = grpo_step(policy, engine, PROMPTS, reward, settings, sampling, step_seed=7)
    return log, [p.detach().clone() for p in policy.model.parameters()]


@pytest.mark.parametrize("is_correction", [False, True])
def test_reused_old_logprobs_equal_the_separate_pass(monkeypatch, is_correction):
    settings = GRPOSettings(group_size=4, global_batch_size=8, is_correction=is_correction,
                            is_truncation_coef=2.0 if is_correction else None)
    reused, reused_weights = one_step(monkeypatch, False, settings)
    separate, separate_weights = one_step(monkeypatch, True, settings)
    assert reused["logprobs_s"] < separate["logprobs_s"]  # no pass at all
    for name in ("loss", "clip_fraction", "entropy", "reward_mean", "response_length", "logprob_gap_mean",
                 "logprob_gap_max"):
        assert reused[name] == separate[name], name
    assert reused["logprob_gap_max"] < 1e-4  # the engine against the update's own forward
    for got, want in zip(reused_weights, separate_weights, strict=True):
        assert torch.equal(got, want)


def test_the_separate_pass_stays_where_the_old_policy_differs():
    policy = PolicyEngine.from_args(ARGV)
    assert old_from_update(policy, GRPOSettings(group_size=4, global_batch_size=8), 8)
    assert not old_from_update(policy, GRPOSettings(group_size=4, global_batch_size=8, iterations=2), 8)
    assert not old_from_update(policy, GRPOSettings(group_size=4, global_batch_size=4), 8)  # two optimizer steps
    assert not old_from_update(policy, GRPOSettings(group_size=4, global_batch_size=8, routing_replay=True), 8)
    dropout = PolicyEngine.from_args([*ARGV, "--hidden-dropout", "0.1"])
    assert not old_from_update(dropout, GRPOSettings(group_size=4, global_batch_size=8), 8)

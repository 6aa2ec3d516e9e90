"""DAPO's dynamic sampling with refill, overlong punishment and overlong filtering in a GRPO step
(``mega.rl.dynamic_sampling``, ``mega.rl.grpo_step``).

CPU here, one process, a tiny LLaMA (the engine takes the machine's device; rewards and
losses are compared on the CPU, so it runs on a GPU machine too). The chosen
groups are checked against the engine's own completions of the same prompts and seeds, drawn
again outside the sampler.
"""

from __future__ import annotations

import pytest
import torch

from mega.rl.advantages import overlong_penalty
from mega.rl.dynamic_sampling import RoundSettings, sample
from mega.rl.grpo_step import GRPOSettings, grpo_step
from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, RolloutSampling

ARGV = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "128",
        "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "1e-2", "--eval-iters", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "100"]
GROUP, PROMPTS = 4, 4
SAMPLING = RolloutSampling(max_new_tokens=3, seed=7)


@pytest.fixture(scope="module")
def policy_and_engine():
    policy = PolicyEngine.from_args(ARGV)
    return policy, RolloutEngine(policy.model, vocab_size=128, max_positions=64)


def rounds_of_prompts(count: int) -> list[list[list[int]]]:
    """Round r's prompts; the odd ones get a reward of 0 whatever the completion (no signal)."""
    return [[[2 * (r * PROMPTS + i) + (i % 2), 50, 60] for i in range(PROMPTS)] for r in range(count)]


def reward(rollouts) -> torch.Tensor:
    """1 for a completion whose first token is below 64 when its prompt is even, else 0."""
    return torch.tensor([float(p[0] % 2 == 0 and c[0] < 64) for p, c in zip(rollouts.prompts, rollouts.completions,
                                                                          strict=True)])


def refiller(rounds):
    queue = iter(rounds[1:])

    def refill():
        return next(queue), reward

    return refill


def test_refill_until_every_group_has_signal(policy_and_engine):
    _, engine = policy_and_engine
    rounds = rounds_of_prompts(6)
    settings = RoundSettings(group_size=GROUP, dynamic_sampling=True, max_rounds=6)
    sampled = sample(engine, rounds[0], reward, settings, SAMPLING, step_seed=1000, refill=refiller(rounds))
    rewards = sampled.rewards.view(PROMPTS, GROUP)
    assert (rewards != rewards[:, :1]).any(dim=1).all()  # every group of the batch carries signal
    log = sampled.log
    assert log["sampling_rounds"] >= 2 and log["groups_without_signal"] == 0
    assert log["groups_filtered"] >= PROMPTS // 2 * (log["sampling_rounds"] - 1)  # the odd prompts' at least
    assert len(sampled.generated_rewards) == log["sampling_rounds"] * PROMPTS * GROUP
    # each chosen group is what the engine draws for its prompt at its round's seeds
    per_round = PROMPTS * GROUP
    for g in range(PROMPTS):
        prompt = sampled.rollouts.prompts[g * GROUP]
        r, i = next((r, i) for r, prompts in enumerate(rounds) for i, p in enumerate(prompts) if p == prompt)
        again = engine.generate(rounds[r], GROUP, SAMPLING, step_seed=1000 + r * per_round)
        assert sampled.rollouts.completions[g * GROUP:(g + 1) * GROUP] == again.completions[i * GROUP:(i + 1) * GROUP]


def test_the_round_cap_makes_up_the_batch_and_says_so(policy_and_engine):
    _, engine = policy_and_engine
    rounds = rounds_of_prompts(2)
    settings = RoundSettings(group_size=GROUP, dynamic_sampling=True, max_rounds=1)
    sampled = sample(engine, rounds[0], reward, settings, SAMPLING, step_seed=0, refill=refiller(rounds))
    assert sampled.log["sampling_rounds"] == 1 and sampled.log["groups_without_signal"] >= PROMPTS // 2
    assert len(sampled.rollouts.completions) == PROMPTS * GROUP


def test_overlong_punishment_lowers_the_rewards(policy_and_engine):
    _, engine = policy_and_engine
    prompts = rounds_of_prompts(1)[0]
    plain = sample(engine, prompts, reward, RoundSettings(group_size=GROUP), SAMPLING, step_seed=5)
    settings = RoundSettings(group_size=GROUP, max_new_tokens=3, overlong_buffer_length=2, overlong_penalty_factor=0.5)
    punished = sample(engine, prompts, reward, settings, SAMPLING, step_seed=5)
    lengths = torch.tensor([len(c) for c in plain.rollouts.completions])
    torch.testing.assert_close(punished.rewards, plain.rewards + overlong_penalty(lengths, 3, 2, 0.5))
    assert (punished.rewards < plain.rewards).any()


def test_overlong_filtering_takes_truncated_completions_out_of_the_loss(policy_and_engine):
    policy, engine = policy_and_engine
    prompts = [[2 * i, 50, 60] for i in range(2)]  # even: rewards differ within groups, the loss is not 0
    logs = {}
    for filtering in (False, True):
        settings = GRPOSettings(group_size=GROUP, global_batch_size=8, overlong_filtering=filtering, max_tokens=3)
        logs[filtering] = grpo_step(policy, engine, prompts, reward, settings, SAMPLING, step_seed=9)
    # no stop token: every completion runs to the limit
    assert logs[True]["truncated_fraction"] == 1.0 and logs[False]["loss"] != 0.0
    assert logs[True]["loss"] == 0.0

"""Routing replay for MoE policies (``mega.models.moe.replay``, ``mega.rl.routing_replay``).

CPU here, one process, a tiny Mixtral (4 experts, top-2); the engine takes the machine's
device and every comparison is between tensors of one device, so it runs on a GPU machine too. The replayed forward is checked against the model's own routing steered to the
recorded experts by a large bonus on their router logits (which leaves Mixtral's weights, a
softmax over the chosen logits, unchanged): two different paths to the same function.
"""

from __future__ import annotations

import pytest
import torch

from mega.models.moe.layer import MoELayer
from mega.models.moe.replay import RoutingReplay, RoutingReplayError
from mega.rl.grpo_step import GRPOSettings, grpo_step
from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, RolloutSampling
from mega.rl.routing_replay import StepRouting

ARGV = ["--model-family", "mixtral", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "128", "--micro-batch-size", "8",
        "--global-batch-size", "8", "--eval-iters", "0", "--seed", "5", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "100"]


def sequences(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=generator) for n in (5, 9, 3, 12)]


@pytest.fixture(scope="module")
def policy() -> PolicyEngine:
    return PolicyEngine.from_args([*ARGV, "--lr", "1e-1"])  # a large learning rate: the routers move


def test_replay_at_the_same_weights_changes_nothing(policy):
    routing = StepRouting(policy)
    recorded = routing.old_logprobs(policy, sequences())
    with routing.replaying(range(4)):
        replayed = policy.logprobs({"tokens": sequences()})
    for got, want in zip(replayed, recorded, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_replay_forces_the_recorded_experts_after_an_update(policy):
    routing = StepRouting(policy)
    routing.old_logprobs(policy, sequences())
    recorded = [torch.cat([per_layer[layer] for per_layer in routing.per_sequence]) for layer in range(2)]
    for _ in range(3):
        policy.forward_backward({"tokens": sequences(1)}, lambda lps, micro: -sum(lp.sum() for lp in lps) / 30)
        policy.optimizer_step()
    with routing.replay.recording() as now:
        natural = policy.logprobs({"tokens": sequences()})
    assert any((torch.cat(now[layer]) != recorded[layer]).any() for layer in range(2))  # some choices flipped
    with routing.replaying(range(4)):
        replayed = policy.logprobs({"tokens": sequences()})
    assert not torch.equal(torch.cat(replayed), torch.cat(natural))

    layers = [m for m in policy.model.modules() if isinstance(m, MoELayer)]
    originals = [layer.router.forward for layer in layers]
    try:
        for layer, experts, original in zip(layers, recorded, originals, strict=True):
            bonus = torch.zeros(len(experts), 4, device=experts.device).scatter_(1, experts, 100.0)
            layer.router.forward = lambda x, original=original, bonus=bonus: original(x) + bonus
        steered = policy.logprobs({"tokens": sequences()})
    finally:
        for layer, original in zip(layers, originals, strict=True):
            del layer.router.forward
            assert layer.router.forward == original
    torch.testing.assert_close(torch.cat(replayed), torch.cat(steered), rtol=1e-5, atol=1e-5)


def test_replay_refuses_choices_that_do_not_fit(policy):
    replay = RoutingReplay(policy.model)
    short = [torch.zeros(10, 2, dtype=torch.long)] * 2
    with pytest.raises(RoutingReplayError, match="only 10 of the replayed choices are left"):
        with replay.replaying(short):
            policy.logprobs({"tokens": sequences()})
    with pytest.raises(RoutingReplayError, match="30 replayed choices, 29 used"):
        with replay.replaying([torch.zeros(30, 2, dtype=torch.long)] * 2):
            policy.logprobs({"tokens": sequences()})
    with pytest.raises(RoutingReplayError, match="has no MoE layer"):
        RoutingReplay(torch.nn.Linear(2, 2))


def test_grpo_step_with_routing_replay_learns_on_a_mixtral_policy():
    policy = PolicyEngine.from_args([*ARGV, "--lr", "3e-2"])
    engine = RolloutEngine(policy.model, vocab_size=128, max_positions=64)
    settings = GRPOSettings(group_size=4, global_batch_size=8, iterations=2, routing_replay=True)
    generator = torch.Generator().manual_seed(1)
    rewards = []
    for step in range(10):
        prompts = [torch.randint(16, 128, (4,), generator=generator).tolist() for _ in range(4)]
        log = grpo_step(policy, engine, prompts, lambda r: torch.tensor(
            [sum(t < 16 for t in c) / max(len(c), 1) for c in r.completions]), settings,
            RolloutSampling(max_new_tokens=6, seed=3), step_seed=1000 * step)
        assert log["logprob_gap_max"] < 1e-4
        rewards.append(log["reward_mean"])
    assert policy.iteration == 10 * 2 * 2
    # measured: 0.17, 0.11, 0.16, 0.25, 0.34, 0.45, 0.44, 0.55, 0.67, 0.83
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards

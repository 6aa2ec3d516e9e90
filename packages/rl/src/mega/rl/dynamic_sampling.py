"""A step's rollouts and rewards: one round of the engine, or, with dynamic sampling, as many as
it takes to fill the batch with groups that carry signal (DAPO).

Each round rolls out ``group_size`` completions of its prompts and scores them; DAPO's soft
overlong punishment (``overlong_buffer_length`` > 0) is added to the rewards here, so the groups
are judged, and the advantages computed, on the rewards the loss sees. Without dynamic sampling
that is the step. With it, a group whose rewards are all equal (advantage 0 everywhere) is
dropped, and ``refill()`` draws the next prompts for another round (round ``r`` samples with
seeds ``step_seed + r * completions per round + i``) until ``len(prompts)`` groups carry signal,
or ``max_rounds`` rounds have run: then the batch is made up with dropped groups, in the order
they came, and the log says how many (``groups_without_signal``). Groups with signal beyond
the batch are left over (``groups_unused``); the prompts every round drew are consumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mega.rl.advantages import groups_with_signal, overlong_penalty
from mega.rl.rollouts import RolloutEngine, Rollouts, RolloutSampling

# Rewards of a round's rollouts (a replica's share: ``Rollouts.first_prompt`` says which), one
# float per completion (the RewardPool's scores, or a test's).
RewardFn = Callable[[Rollouts], torch.Tensor]
# The next round's prompts (token ids) and the reward function that knows them.
Refill = Callable[[], tuple[list[list[int]], RewardFn]]


@dataclass(frozen=True)
class RoundSettings:
    group_size: int
    dynamic_sampling: bool = False
    max_rounds: int = 1  # rounds of rollouts per step at most, the first one included
    max_new_tokens: int | None = None
    overlong_buffer_length: int = 0
    overlong_penalty_factor: float = 1.0


@dataclass
class Sampled:
    rollouts: Rollouts      # the step's batch: len(prompts) groups
    rewards: torch.Tensor   # theirs, the overlong punishment included
    generated_rewards: torch.Tensor  # every completion of every round (the policy's reward, unfiltered)
    tokens_per_second: float  # of every round
    log: dict


def sample(engine: RolloutEngine, prompts: list[list[int]], reward_fn: RewardFn, settings: RoundSettings,
           sampling: RolloutSampling, step_seed: int, refill: Refill | None = None) -> Sampled:
    group, wanted = settings.group_size, len(prompts)
    per_round = wanted * group
    rounds: list[tuple[Rollouts, torch.Tensor]] = []
    while True:
        # Each of the engine's replicas scores the completions it drew; every rank gets them all.
        rollouts = engine.generate(prompts, group, sampling, step_seed=step_seed + len(rounds) * per_round,
                                   reward_fn=reward_fn)
        rounds.append((rollouts, _shaped(rollouts, rollouts.rewards, settings)))
        if not settings.dynamic_sampling:
            rollouts, rewards = rounds[0]
            return Sampled(rollouts, rewards, rewards, rollouts.tokens_per_second, {})
        signal = sum(int(groups_with_signal(r, group).sum()) for _, r in rounds)
        if signal >= wanted or len(rounds) >= settings.max_rounds or refill is None:
            break
        prompts, reward_fn = refill()
        if len(prompts) != wanted:
            raise ValueError(f"refill() gave {len(prompts)} prompts; each round takes {wanted}")

    with_signal, without = [], []  # (round, group) in the order they came
    for index, (_, rewards) in enumerate(rounds):
        keep = groups_with_signal(rewards, group)
        with_signal += [(index, g) for g in range(len(keep)) if keep[g]]
        without += [(index, g) for g in range(len(keep)) if not keep[g]]
    chosen = with_signal[:wanted] + without[:max(0, wanted - len(with_signal))]
    batch, rewards = _select(rounds, chosen, group)
    generated = torch.cat([r for _, r in rounds])
    log = {"sampling_rounds": len(rounds), "groups_filtered": len(without),
           "groups_without_signal": max(0, wanted - len(with_signal)),
           "groups_unused": max(0, len(with_signal) - wanted)}
    tokens = sum(rollouts.generated_tokens for rollouts, _ in rounds)
    return Sampled(batch, rewards, generated, tokens / max(batch.seconds, 1e-9), log)


def _shaped(rollouts: Rollouts, rewards: torch.Tensor, settings: RoundSettings) -> torch.Tensor:
    if settings.overlong_buffer_length:
        lengths = torch.tensor([len(c) for c in rollouts.completions])
        rewards = rewards + overlong_penalty(lengths, settings.max_new_tokens, settings.overlong_buffer_length,
                                             settings.overlong_penalty_factor)
    return rewards


def _select(rounds: list[tuple[Rollouts, torch.Tensor]], chosen: list[tuple[int, int]],
            group: int) -> tuple[Rollouts, torch.Tensor]:
    """The chosen (round, group) pairs as one Rollouts, in the order given."""
    per_completion: dict[str, list] = {}
    rewards = []
    for index, g in chosen:
        rollouts, round_rewards = rounds[index]
        rows = list(range(g * group, (g + 1) * group))
        rewards.append(round_rewards[rows])
        for field in dataclasses.fields(Rollouts):
            values = getattr(rollouts, field.name)
            if isinstance(values, list):  # one entry per completion
                per_completion.setdefault(field.name, []).extend(values[row] for row in rows)
    seconds = sum(rollouts.seconds for rollouts, _ in rounds)
    first = rounds[0][0]
    batch = dataclasses.replace(first, **per_completion, seconds=seconds, rewards=torch.cat(rewards))
    return batch, batch.rewards

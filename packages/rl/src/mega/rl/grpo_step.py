"""One GRPO step on :class:`~mega.rl.policy_engine.PolicyEngine` and
:class:`~mega.rl.rollouts.RolloutEngine`, in one process:

    rollout -> rewards -> group advantages -> old log-probabilities (recomputed by the trainer)
    -> ``iterations`` passes of optimizer steps of ``global_batch_size`` sequences with the GRPO
    loss -> (refresh: nothing to copy, the engine holds the trainer's parameters)

Returns the step's log: phase times, rollout tokens/s, reward mean/std, response length, the
loss metrics (clip fraction, KL, entropy) and the engine-vs-trainer log-probability gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mega.rl.advantages import group_advantages
from mega.rl.config import RLConfig
from mega.rl.loss import aggregate, grpo_token_losses, loss_metrics
from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, Rollouts, RolloutSampling, completion_logprobs, logprob_gap

# Rewards of a step's rollouts, one float per completion (the RewardPool's scores, or a test's).
RewardFn = Callable[[Rollouts], torch.Tensor]


@dataclass(frozen=True)
class GRPOSettings:
    group_size: int
    global_batch_size: int
    iterations: int = 1
    clamp_eps_lower: float = 0.2
    clamp_eps_upper: float = 0.2
    entropy_weight: float = 0.0
    is_truncation_coef: float | None = None
    is_correction: bool = False  # weigh tokens by exp(old - inference)
    aggregation: str = "token-mean"
    max_tokens: int | None = None  # seq-mean-token-sum-norm's constant
    scale_by_std: bool = True

    @classmethod
    def from_config(cls, rl: RLConfig, global_batch_size: int) -> GRPOSettings:
        if rl.grpo_kl_beta:
            raise ValueError("--grpo-kl-beta needs a reference policy, which mega rl does not keep yet; use 0")
        return cls(group_size=rl.grpo_group_size, global_batch_size=global_batch_size,
                   iterations=rl.grpo_iterations, clamp_eps_lower=rl.grpo_clamp_eps_lower,
                   clamp_eps_upper=rl.grpo_clamp_eps_upper, entropy_weight=rl.grpo_entropy_term_weight,
                   is_truncation_coef=rl.rl_importance_sampling_truncation_coef,
                   is_correction=rl.rl_inference_logprobs_is_correction, aggregation=rl.grpo_loss_aggregation,
                   max_tokens=rl.rl_max_new_tokens, scale_by_std=rl.grpo_std_normalization)


def _padded(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max((len(p) for p in pieces), default=0)
    values = torch.zeros(len(pieces), longest)
    mask = torch.zeros(len(pieces), longest)
    for row, piece in enumerate(pieces):
        values[row, :len(piece)] = piece
        mask[row, :len(piece)] = 1.0
    return values, mask


def grpo_step(policy: PolicyEngine, engine: RolloutEngine, prompts: list[list[int]], reward_fn: RewardFn,
              settings: GRPOSettings, sampling: RolloutSampling, step_seed: int) -> dict:
    timings = {}
    start = time.perf_counter()
    rollouts = engine.generate(prompts, settings.group_size, sampling, step_seed=step_seed)
    timings["rollout_s"] = time.perf_counter() - start

    rewards = reward_fn(rollouts).float()
    advantages = group_advantages(rewards, settings.group_size, scale_by_std=settings.scale_by_std)

    start = time.perf_counter()
    sequences = rollouts.sequences
    old = completion_logprobs(policy.logprobs({"tokens": sequences}), rollouts)
    timings["logprobs_s"] = time.perf_counter() - start

    start = time.perf_counter()
    metrics: list[dict] = []
    losses: list[float] = []
    count = len(sequences)
    for _ in range(settings.iterations):
        for first in range(0, count, settings.global_batch_size):
            part = slice(first, first + settings.global_batch_size)
            batch = {"tokens": sequences[part], "old": old[part], "advantage": list(advantages[part]),
                     "inference": rollouts.inference_logprobs[part],
                     "prompt_length": [len(p) for p in rollouts.prompts[part]]}
            # The optimizer batch's loss is the micro-batches' sum: token-mean divides by the whole
            # batch's tokens, the per-sequence means weigh each micro-batch by its share of sequences.
            total_tokens = max(sum(len(o) for o in old[part]), 1)
            total_sequences = len(batch["tokens"])

            def loss_fn(logprobs, micro, total_tokens=total_tokens, total_sequences=total_sequences):
                current, mask = _padded([lp[n - 1:] for lp, n in zip(logprobs, micro["prompt_length"], strict=True)])
                old_values, _ = _padded(micro["old"])
                inference = _padded(micro["inference"])[0] if settings.is_correction else None
                terms = grpo_token_losses(current, old_values, torch.stack(micro["advantage"]), inference=inference,
                                          clamp_eps_lower=settings.clamp_eps_lower,
                                          clamp_eps_upper=settings.clamp_eps_upper,
                                          entropy_weight=settings.entropy_weight,
                                          is_truncation_coef=settings.is_truncation_coef)
                with torch.no_grad():  # the log line needs no graph
                    metrics.append(loss_metrics(terms, mask))
                losses.append(float(aggregate(terms.loss.detach(), mask, settings.aggregation,
                                              max_tokens=settings.max_tokens)))
                if settings.aggregation == "token-mean":
                    return aggregate(terms.loss, mask, total_tokens=total_tokens)
                share = len(micro["tokens"]) / total_sequences
                return aggregate(terms.loss, mask, settings.aggregation, max_tokens=settings.max_tokens) * share

            policy.forward_backward(batch, loss_fn)
            policy.optimizer_step()
    timings["update_s"] = time.perf_counter() - start
    timings["refresh_s"] = 0.0  # the engine holds the trainer's parameter objects: nothing to copy

    lengths = torch.tensor([len(c) for c in rollouts.completions], dtype=torch.float32)
    summary = {name: sum(m[name] for m in metrics) / len(metrics) for name in ("clip_fraction", "kl", "entropy")
               if metrics and name in metrics[0] and metrics[0][name] is not None}
    return {**timings, "rollout_tokens_per_s": rollouts.tokens_per_second, "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "response_length": lengths.mean().item(), "loss": sum(losses) / max(len(losses), 1), **summary,
            **logprob_gap(rollouts.inference_logprobs, old)}

"""One GRPO step on :class:`~mega.rl.policy_engine.PolicyEngine` and
:class:`~mega.rl.rollouts.RolloutEngine`, on every rank of the job:

    rollout (the engine's replicas split the prompts; the optimizer state may wait in host
    memory) -> rewards (once per completion, by the replica that drew it) -> group advantages
    -> old log-probabilities (recomputed by the trainer, each data-parallel rank its share)
    -> ``iterations`` passes of optimizer steps of ``global_batch_size`` sequences with the GRPO
    loss -> refresh (the engine's weights from the trainer's; nothing when it holds the
    trainer's own parameters)

Returns the step's log: phase times, rollout tokens/s, reward mean/std, response length, the
loss metrics (clip fraction, KL, entropy) and the engine-vs-trainer log-probability gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mega.rl.advantages import group_advantages
from mega.rl.config import RLConfig
from mega.rl.loss import aggregate, grpo_token_losses, loss_metrics
from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, Rollouts, RolloutSampling, logprob_gap

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
              settings: GRPOSettings, sampling: RolloutSampling, step_seed: int,
              offload_optimizer: bool = False) -> dict:
    """One GRPO step on every rank of the job (collective). The engine's replicas split the
    prompts and score their own completions; each data-parallel rank of the trainer takes its
    share of every optimizer batch. ``offload_optimizer``: the optimizer state and gradient
    buffers wait in host memory while the engine generates."""
    timings = {}
    start = time.perf_counter()
    if offload_optimizer:
        policy.offload(parameters=False)
    try:
        rollouts = engine.generate(prompts, settings.group_size, sampling, step_seed=step_seed, reward_fn=reward_fn)
    finally:
        if offload_optimizer:
            policy.onload()
    timings["rollout_s"] = time.perf_counter() - start

    rewards = rollouts.rewards
    advantages = group_advantages(rewards, settings.group_size, scale_by_std=settings.scale_by_std)

    # This data-parallel rank's share of every optimizer batch (the ranks average their gradients,
    # so each rank's loss counts the whole batch's tokens or sequences and is scaled back up).
    ranks, rank = policy.groups.dp.size, policy.groups.dp.rank
    count = len(rollouts.completions)
    batch_size = settings.global_batch_size
    mine = [index for first in range(0, count, batch_size)
            for index in range(first + batch_size * rank // ranks, first + batch_size * (rank + 1) // ranks)]
    position = {index: n for n, index in enumerate(mine)}
    sequences = rollouts.sequences

    start = time.perf_counter()
    own = [sequences[i] for i in mine]
    old_own = [lp[len(rollouts.prompts[i]) - 1:] for lp, i in zip(policy.logprobs({"tokens": own}), mine, strict=True)]
    timings["logprobs_s"] = time.perf_counter() - start

    start = time.perf_counter()
    metrics: list[dict] = []
    losses: list[float] = []
    for _ in range(settings.iterations):
        for first in range(0, count, batch_size):
            part = [i for i in range(first, min(first + batch_size, count)) if i in position]
            batch = {"tokens": [sequences[i] for i in part], "old": [old_own[position[i]] for i in part],
                     "advantage": [advantages[i] for i in part],
                     "inference": [rollouts.inference_logprobs[i] for i in part],
                     "prompt_length": [len(rollouts.prompts[i]) for i in part]}
            # The optimizer batch's loss is the micro-batches' sum: token-mean divides by the whole
            # batch's tokens, the per-sequence means weigh each micro-batch by its share of sequences.
            whole = range(first, min(first + batch_size, count))
            total_tokens = max(sum(len(rollouts.completions[i]) for i in whole), 1)
            total_sequences = len(whole)

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
                    return aggregate(terms.loss, mask, total_tokens=total_tokens) * ranks
                share = len(micro["tokens"]) / total_sequences
                return aggregate(terms.loss, mask, settings.aggregation, max_tokens=settings.max_tokens) * share * ranks

            policy.forward_backward(batch, loss_fn)
            policy.optimizer_step()
    timings["update_s"] = time.perf_counter() - start
    timings["refresh_s"] = engine.refresh()

    lengths = torch.tensor([len(c) for c in rollouts.completions], dtype=torch.float32)
    own_inference = [rollouts.inference_logprobs[i] for i in mine]
    summary = _over_ranks(metrics, losses, own_inference, old_own)
    return {**timings, "rollout_tokens_per_s": rollouts.tokens_per_second, "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "response_length": lengths.mean().item(), **summary}


def _over_ranks(metrics: list[dict], losses: list[float], inference: list[torch.Tensor],
                old: list[torch.Tensor]) -> dict:
    """The loss metrics (held where the loss is computed: the last pipeline stage of each
    data-parallel rank) and the engine-vs-trainer gap, over every rank of the job."""
    names = ("clip_fraction", "kl", "entropy")
    gap, tokens = logprob_gap(inference, old), sum(len(lp) for lp in old)
    mine = {"metrics": [{n: m[n] for n in names if m.get(n) is not None} for m in metrics], "losses": losses,
            "gap": (gap["logprob_gap_mean"] * tokens, gap["logprob_gap_max"], tokens)}
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    metrics = [m for rank in every for m in rank["metrics"]]
    losses = [loss for rank in every for loss in rank["losses"]]
    summary = {name: sum(m[name] for m in metrics) / len(metrics) for name in names
               if metrics and all(name in m for m in metrics)}
    total, largest, tokens = (sum(r["gap"][0] for r in every), max(r["gap"][1] for r in every),
                              sum(r["gap"][2] for r in every))
    return {"loss": sum(losses) / max(len(losses), 1), **summary,
            "logprob_gap_mean": total / tokens if tokens else 0.0, "logprob_gap_max": largest}

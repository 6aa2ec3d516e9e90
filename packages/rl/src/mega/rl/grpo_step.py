"""One GRPO step on :class:`~mega.rl.policy_engine.PolicyEngine` and
:class:`~mega.rl.rollouts.RolloutEngine`, on every rank of the job:

    rollout (the engine's replicas split the prompts; the optimizer state may wait in host
    memory) -> rewards (once per completion, by the replica that drew it; mega.rl.dynamic_sampling:
    DAPO's refill and overlong punishment) -> group advantages -> old log-probabilities
    (recomputed by the trainer, each data-parallel rank its share; each token's experts recorded
    for routing replay, mega.rl.routing_replay), and the reference's when there is a KL term
    (mega.rl.reference) -> ``iterations`` passes of optimizer steps of ``global_batch_size``
    sequences with the GRPO loss -> refresh (the engine's weights from the trainer's; nothing
    when it holds the trainer's own parameters)

Returns the step's log: phase times, rollout tokens/s, reward mean/std, response length, the
loss metrics (clip fraction, KL, entropy) and the engine-vs-trainer log-probability gap.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mega.rl.advantages import group_advantages, overlong_filter
from mega.rl.config import RLConfig
from mega.rl.dynamic_sampling import Refill, RewardFn, RoundSettings, sample
from mega.rl.loss import aggregate, grpo_token_losses, loss_metrics
from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, RolloutSampling, logprob_gap
from mega.rl.routing_replay import StepRouting

__all__ = ["GRPOSettings", "RewardFn", "Refill", "grpo_step"]


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
    kl_beta: float = 0.0  # k3 against the reference
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 1
    overlong_filtering: bool = False
    overlong_buffer_length: int = 0
    overlong_penalty_factor: float = 1.0
    routing_replay: bool = False  # MoE: the old policy's expert choices forced in the updates

    @classmethod
    def from_config(cls, rl: RLConfig, global_batch_size: int) -> GRPOSettings:
        return cls(group_size=rl.grpo_group_size, global_batch_size=global_batch_size,
                   iterations=rl.grpo_iterations, clamp_eps_lower=rl.grpo_clamp_eps_lower,
                   clamp_eps_upper=rl.grpo_clamp_eps_upper, entropy_weight=rl.grpo_entropy_term_weight,
                   is_truncation_coef=rl.rl_importance_sampling_truncation_coef,
                   is_correction=rl.rl_inference_logprobs_is_correction, aggregation=rl.grpo_loss_aggregation,
                   max_tokens=rl.rl_max_new_tokens, scale_by_std=rl.grpo_std_normalization, kl_beta=rl.grpo_kl_beta,
                   dynamic_sampling=rl.rl_dynamic_sampling, max_sampling_rounds=rl.rl_dynamic_sampling_max_rounds,
                   overlong_filtering=rl.rl_overlong_filtering, overlong_buffer_length=rl.rl_overlong_buffer_length,
                   overlong_penalty_factor=rl.rl_overlong_penalty_factor,
                   routing_replay=rl.moe_enable_routing_replay)

    def round_settings(self) -> RoundSettings:
        return RoundSettings(group_size=self.group_size, dynamic_sampling=self.dynamic_sampling,
                             max_rounds=self.max_sampling_rounds, max_new_tokens=self.max_tokens,
                             overlong_buffer_length=self.overlong_buffer_length,
                             overlong_penalty_factor=self.overlong_penalty_factor)


def _padded(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``pieces`` right-padded with zeros into ``[len(pieces), longest]`` on the CPU, and the mask of
    their entries (1.0; 0.0 on the padding)."""
    if not pieces:
        return torch.zeros(0, 0), torch.zeros(0, 0)
    values = torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True).to("cpu", torch.float32)
    lengths = torch.tensor([len(p) for p in pieces])
    mask = (torch.arange(values.shape[1])[None, :] < lengths[:, None]).float()
    return values, mask


def grpo_step(policy: PolicyEngine, engine: RolloutEngine, prompts: list[list[int]], reward_fn: RewardFn,
              settings: GRPOSettings, sampling: RolloutSampling, step_seed: int, *, reference=None,
              refill: Refill | None = None, offload_optimizer: bool = False) -> dict:
    """One GRPO step over ``prompts`` (token ids) on every rank of the job (collective). The
    engine's replicas split the prompts and score their own completions; each data-parallel rank
    of the trainer takes its share of every optimizer batch. ``reference`` (mega.rl.reference)
    when ``settings.kl_beta`` is not 0; ``refill`` draws more prompts for dynamic sampling;
    ``offload_optimizer``: the optimizer state and gradient buffers wait in host memory while the
    engine generates."""
    if settings.kl_beta and reference is None:
        raise ValueError("a KL term (kl_beta != 0) needs a reference policy (mega.rl.reference.reference_for)")
    timings = {}
    start = time.perf_counter()
    if offload_optimizer:
        policy.offload(parameters=False)
    try:
        sampled = sample(engine, prompts, reward_fn, settings.round_settings(), sampling, step_seed, refill)
    finally:
        if offload_optimizer:
            policy.onload()
    rollouts, rewards = sampled.rollouts, sampled.rewards
    timings["rollout_s"] = time.perf_counter() - start
    advantages = group_advantages(rewards, settings.group_size, scale_by_std=settings.scale_by_std)
    truncated = torch.tensor([reason == "length" for reason in rollouts.finish_reasons])
    # DAPO's overlong filtering: a completion cut at the length limit takes no part in the loss.
    weights = overlong_filter(truncated) if settings.overlong_filtering else torch.ones(len(truncated))

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
    routing = StepRouting(policy) if settings.routing_replay else None
    # Where the update's forward IS the old policy's (old_from_update), the old log-probabilities are
    # taken from it, detached, inside the loss; else the trainer recomputes them first.
    reuse = old_from_update(policy, settings, count)
    old_own: list[torch.Tensor] = []  # reuse: filled by the loss, in the order of mine
    if not reuse:
        old_own = _completions(routing.old_logprobs(policy, own) if routing is not None
                               else policy.logprobs({"tokens": own}), rollouts, mine)
    ref_own = (_completions(reference.logprobs(policy, {"tokens": own}), rollouts, mine)
               if reference is not None else [None] * len(mine))
    timings["logprobs_s"] = time.perf_counter() - start

    start = time.perf_counter()
    metrics: list[dict] = []
    losses: list[float] = []
    for _ in range(settings.iterations):
        for first in range(0, count, batch_size):
            part = [i for i in range(first, min(first + batch_size, count)) if i in position]
            batch = {"tokens": [sequences[i] for i in part],
                     "old": [None if reuse else old_own[position[i]] for i in part],
                     "advantage": [advantages[i] for i in part],
                     "inference": [rollouts.inference_logprobs[i] for i in part],
                     "reference": [ref_own[position[i]] for i in part], "weight": [weights[i] for i in part],
                     "prompt_length": [len(rollouts.prompts[i]) for i in part]}
            # The optimizer batch's loss is the micro-batches' sum: token-mean divides by the whole
            # batch's tokens, the per-sequence means weigh each micro-batch by its share of sequences.
            whole = range(first, min(first + batch_size, count))
            total_tokens = max(sum(len(rollouts.completions[i]) * float(weights[i]) for i in whole), 1)
            total_sequences = len(whole)

            def loss_fn(logprobs, micro, total_tokens=total_tokens, total_sequences=total_sequences):
                completions = [lp[n - 1:] for lp, n in zip(logprobs, micro["prompt_length"], strict=True)]
                current, mask = _padded(completions)
                mask = mask * torch.stack(micro["weight"])[:, None]
                if reuse:  # the old policy is this forward's, its values without their gradient
                    old_own.extend(lp.detach() for lp in completions)
                    old_values = current.detach()
                else:
                    old_values, _ = _padded(micro["old"])
                inference = _padded(micro["inference"])[0] if settings.is_correction else None
                reference_values = _padded(micro["reference"])[0] if micro["reference"][0] is not None else None
                terms = grpo_token_losses(current, old_values, torch.stack(micro["advantage"]), inference=inference,
                                          reference=reference_values, kl_beta=settings.kl_beta,
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

            replay = routing.replaying([position[i] for i in part]) if routing is not None else contextlib.nullcontext()
            with replay:
                policy.forward_backward(batch, loss_fn)
            policy.optimizer_step()
    timings["update_s"] = time.perf_counter() - start
    timings["refresh_s"] = engine.refresh()

    lengths = torch.tensor([len(c) for c in rollouts.completions], dtype=torch.float32)
    generated = sampled.generated_rewards
    # The engine-vs-trainer gap where this rank holds the old log-probabilities (reused: where
    # the loss ran, the last pipeline stage).
    own_inference = [rollouts.inference_logprobs[i] for i in mine] if old_own else []
    summary = _over_ranks(metrics, losses, own_inference, old_own)
    return {**timings, "rollout_tokens_per_s": sampled.tokens_per_second, "reward_mean": generated.mean().item(),
            "reward_std": generated.std().item() if len(generated) > 1 else 0.0,
            "response_length": lengths.mean().item(), "truncated_fraction": truncated.float().mean().item(),
            **sampled.log, **summary}


def old_from_update(policy: PolicyEngine, settings: GRPOSettings, count: int) -> bool:
    """Whether the old policy's log-probabilities are exactly the update forward's own, so that
    no separate pass computes them (TRL's ``per_token_logps.detach()`` at ``num_iterations`` 1):
    one pass (``iterations`` 1) making one optimizer step over all ``count`` rollouts (the update
    forward runs before any weight moves), a forward that is the same in training and in eval
    mode (no dropout) and no experts (MoE routing, whose replay records the old pass's choices)."""
    config = policy.trainer.run.model
    return (settings.iterations == 1 and count <= settings.global_batch_size and not settings.routing_replay
            and not config.hidden_dropout and not config.attention_dropout
            and getattr(config, "num_experts", None) is None)


def _completions(sequence_logprobs: list[torch.Tensor], rollouts, indices: list[int]) -> list[torch.Tensor]:
    """The completion part of the log-probabilities of sequences ``indices`` of ``rollouts``."""
    return [lp[len(rollouts.prompts[i]) - 1:] for lp, i in zip(sequence_logprobs, indices, strict=True)]


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

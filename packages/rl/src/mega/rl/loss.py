"""The GRPO policy loss per token, its aggregation over a batch, and the metrics it logs.

Megatron-RL's ``calculate_grpo_loss``, per completion token, with ``cur``, ``old``, ``ref`` and
``inf`` the log-probabilities of the sampled token under the current policy, the policy that
produced the rollouts (recomputed by the trainer), the reference, and the inference engine::

    ratio   = exp(cur - old)
    clipped = clamp(ratio, 1 - eps_lower, 1 + eps_upper)       # DAPO's clip-higher: eps_upper > eps_lower
    k3      = exp(ref - cur) - (ref - cur) - 1                  # Schulman's k3 estimate of KL(cur || ref)
    w_is    = min(exp(old - inf), truncation_coef)              # with the importance-sampling correction
    loss    = -w_is * min(ratio * A, clipped * A) + kl_beta * k3 - entropy_weight * entropy

The entropy is the full distribution's where the caller has it (from the logits), else Megatron's
one-sample estimate ``-exp(cur) * cur``. Every tensor is ``[batch, tokens]``; the advantage is one
per sequence (``[batch]``) or per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass
class TokenLosses:
    """The per-token loss and its parts, each ``[batch, tokens]`` (padding included: mask it)."""

    loss: torch.Tensor
    ratio: torch.Tensor              # exp(cur - old)
    kl: torch.Tensor | None          # the k3 term, None without a reference
    entropy: torch.Tensor            # the entropy the bonus rewards
    is_weight: torch.Tensor | None   # the truncated importance weight old/inference, None without the correction
    clipped_low: torch.Tensor        # the lower clip binds: ratio < 1 - eps_lower where the advantage is negative
    clipped_high: torch.Tensor       # the upper clip binds: ratio > 1 + eps_upper where the advantage is positive


def grpo_token_losses(
    current: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    reference: torch.Tensor | None = None,
    inference: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    clamp_eps_lower: float = 0.2,
    clamp_eps_upper: float = 0.2,
    kl_beta: float = 0.0,
    entropy_weight: float = 0.0,
    is_truncation_coef: float | None = None,
) -> TokenLosses:
    """The loss of every token (see the module's docstring). ``inference`` turns the
    importance-sampling correction on; ``reference`` is needed when ``kl_beta`` is not 0."""
    if current.shape != old.shape:
        raise ValueError(f"current log-probabilities {tuple(current.shape)} and old {tuple(old.shape)} differ in shape")
    if kl_beta != 0.0 and reference is None:
        raise ValueError("a KL term (kl_beta != 0) needs the reference log-probabilities")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(current - old)
    clipped = ratio.clamp(1 - clamp_eps_lower, 1 + clamp_eps_upper)
    loss = -torch.min(ratio * advantages, clipped * advantages)

    is_weight = None
    if inference is not None:
        # The engine sampled from its own numerics; reweight its samples to the trainer's old policy,
        # truncated from above (truncated importance sampling) so that rare tokens cannot blow up.
        is_weight = torch.exp(old - inference)
        if is_truncation_coef is not None:
            is_weight = is_weight.clamp(max=is_truncation_coef)
        loss = loss * is_weight

    kl = None
    if reference is not None:
        log_ratio = reference - current
        kl = torch.exp(log_ratio) - log_ratio - 1
        if kl_beta != 0.0:
            loss = loss + kl_beta * kl

    if entropy is None:
        entropy = -torch.exp(current) * current
    if entropy_weight != 0.0:
        loss = loss - entropy_weight * entropy

    return TokenLosses(
        loss=loss, ratio=ratio, kl=kl, entropy=entropy, is_weight=is_weight,
        clipped_low=(ratio < 1 - clamp_eps_lower) & (advantages < 0),
        clipped_high=(ratio > 1 + clamp_eps_upper) & (advantages > 0),
    )


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
              total_tokens: float | torch.Tensor | None = None, max_tokens: int | None = None) -> torch.Tensor:
    """One number from the per-token losses of a batch, over the tokens in ``mask``:

    * ``token-mean``: every token weighs the same (DAPO's token-level loss; Megatron's
      ``--calculate-per-token-loss``). ``total_tokens`` divides instead of this batch's token
      count: the count of the whole global batch when it is split into micro-batches.
    * ``seq-mean-token-mean``: each sequence's mean over its tokens, then the mean over sequences
      (GRPO as published, DeepSeekMath): a long completion's tokens weigh less.
    * ``seq-mean-token-sum``: each sequence's sum over its tokens, then the mean over sequences.
    * ``seq-mean-token-sum-norm``: the sums divided by the constant ``max_tokens`` (the longest
      completion allowed), then the mean over sequences (Dr. GRPO: no length bias).
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token-mean":
        denominator = mask.sum().clamp(min=1.0) if total_tokens is None else total_tokens
        return masked.sum() / denominator
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).mean()
    if mode == "seq-mean-token-sum-norm":
        if not max_tokens or max_tokens < 1:
            raise ValueError("seq-mean-token-sum-norm (Dr. GRPO) needs max_tokens, the longest completion allowed")
        return masked.sum() / (per_token.shape[0] * max_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}; one of {', '.join(AGGREGATIONS)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.to(values.dtype)
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))


def loss_metrics(terms: TokenLosses, mask: torch.Tensor, *, old: torch.Tensor | None = None,
                 inference: torch.Tensor | None = None) -> dict[str, float]:
    """The step's log line of the loss, token means over ``mask``: the clip fractions (where the
    clip binds), the KL, the entropy, the importance weight and the engine-vs-trainer gap
    ``|old - inference|`` (its mean and max) when the engine's log-probabilities are given."""
    metrics = {
        "clip_fraction": masked_mean((terms.clipped_low | terms.clipped_high).to(terms.ratio.dtype), mask),
        "clip_fraction_low": masked_mean(terms.clipped_low.to(terms.ratio.dtype), mask),
        "clip_fraction_high": masked_mean(terms.clipped_high.to(terms.ratio.dtype), mask),
        "entropy": masked_mean(terms.entropy, mask),
    }
    if terms.kl is not None:
        metrics["kl"] = masked_mean(terms.kl, mask)
    if terms.is_weight is not None:
        metrics["is_weight_mean"] = masked_mean(terms.is_weight, mask)
    if old is not None and inference is not None:
        gap = (old - inference).abs()[mask.bool()]
        metrics["logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
        metrics["logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
    return metrics

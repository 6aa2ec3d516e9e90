"""Group-relative advantages and the rollout filters that act on whole groups or completions.

A rollout batch holds ``group_size`` completions per prompt, one group after the other. Each
completion's advantage is its reward centred on its group's mean (GRPO, DeepSeekMath), divided by
the group's standard deviation unless that is turned off (Dr. GRPO: the division favours groups
that are nearly all right or all wrong). The standard deviation is the sample one (Bessel's
correction, as ``torch.std`` and TRL) plus ``eps``, so a group whose rewards are all equal gets
advantages of 0, not a division by 0.
"""

from __future__ import annotations

import torch

STD_EPS = 1e-4  # added to the group's standard deviation (Megatron-RL and TRL use the same)


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one number per completion, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                     eps: float = STD_EPS) -> torch.Tensor:
    """One advantage per completion: ``(r - mean(group)) / (std(group) + eps)``, or ``r - mean(group)``
    without ``scale_by_std``."""
    groups = _groups(rewards, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
        advantages = advantages / (std + eps)
    return advantages.reshape(-1)


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling (DAPO): a boolean per group, False where every reward of the group is the
    same. Such a group has advantages of 0 everywhere and only dilutes the batch; the rollout
    loop drops it and samples more prompts until the batch is full."""
    groups = _groups(rewards, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def completions_of_groups(keep: torch.Tensor, group_size: int) -> torch.Tensor:
    """The completion indices of the groups ``keep`` marks, in order."""
    return torch.nonzero(keep.repeat_interleave(group_size), as_tuple=False).flatten()


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each completion's reward: 0 up to
    ``max_new_tokens - buffer_length`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_new_tokens`` (and ``-penalty_factor`` beyond)."""
    if buffer_length < 1 or buffer_length > max_new_tokens:
        raise ValueError(f"the overlong buffer must be 1..{max_new_tokens} tokens, got {buffer_length}")
    start = max_new_tokens - buffer_length
    excess = (lengths.to(torch.float32) - start).clamp(min=0, max=buffer_length)
    return -penalty_factor * excess / buffer_length


def overlong_filter(truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: a 0/1 weight per completion that takes the completions cut at the
    length limit (no stop token) out of the loss, so that a good but unfinished answer is not
    punished for its length. Multiply it into the loss mask, ``mask * weight[:, None]``."""
    return (~truncated.bool()).to(torch.float32)

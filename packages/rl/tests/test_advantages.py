"""Group advantages (with and without the std), dynamic sampling's group filter and DAPO's overlong
penalty and filter, on numbers worked out by hand. CPU only (pinned)."""

from __future__ import annotations

import pytest
import torch

from mega.rl.advantages import (
    completions_of_groups,
    group_advantages,
    groups_with_signal,
    overlong_filter,
    overlong_penalty,
)

DEVICE = torch.device("cpu")


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], device=DEVICE)
    centred = group_advantages(rewards, 4, scale_by_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    # sample std of (1, 0, 0, 1) = sqrt(1/3); a group of equal rewards has std 0 and advantages 0
    scaled = group_advantages(rewards, 4)
    expected = 0.5 / (3 ** -0.5 + 1e-4)
    torch.testing.assert_close(scaled, torch.tensor([expected, -expected, -expected, expected, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="7 rewards do not split into groups of 4"):
        group_advantages(rewards[:7], 4)


def test_dynamic_sampling_keeps_groups_with_different_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    keep = groups_with_signal(rewards, 2)
    assert keep.tolist() == [False, False, True, False]
    assert completions_of_groups(keep, 2).tolist() == [4, 5]


def test_overlong_penalty_and_filter():
    lengths = torch.tensor([10, 96, 100, 112, 128, 140])
    # max 128 tokens, the last 32 a buffer: 0 up to 96 tokens, then down to -factor at 128
    torch.testing.assert_close(overlong_penalty(lengths, 128, 32, penalty_factor=0.5),
                               torch.tensor([0.0, 0.0, -0.0625, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 128, 0)
    assert overlong_filter(torch.tensor([False, True, False])).tolist() == [1.0, 0.0, 1.0]

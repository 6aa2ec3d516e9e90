import math

import pytest

from mega.train.lr_schedule import LearningRateSchedule


def test_warmup_then_cosine_to_min():
    schedule = LearningRateSchedule(lr=1.0, min_lr=0.1, style="cosine", warmup_iters=10, decay_iters=110)
    assert schedule(5) == pytest.approx(0.5)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)


def test_linear_and_constant():
    linear = LearningRateSchedule(lr=2.0, min_lr=0.0, style="linear", warmup_iters=0, decay_iters=100)
    assert linear(25) == pytest.approx(1.5)
    constant = LearningRateSchedule(lr=2.0, min_lr=0.0, style="constant", warmup_iters=4, decay_iters=100)
    assert constant(2) == pytest.approx(1.0) and constant(99) == 2.0


def test_bad_schedules():
    with pytest.raises(ValueError, match="unknown --lr-decay-style 'step'"):
        LearningRateSchedule(1.0, 0.0, "step", 0, 10)
    with pytest.raises(ValueError, match="--lr-decay-iters \\(5\\) must be >= --lr-warmup-iters \\(10\\)"):
        LearningRateSchedule(1.0, 0.0, "cosine", 10, 5)

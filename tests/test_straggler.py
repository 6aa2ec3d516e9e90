"""--log-straggler (issue 36, item 3): a rank slowed by 200 ms per step is named within 10
iterations, with its ratio to the median; in the same run without the delay no rank is named."""

from __future__ import annotations

import contextlib
import io
import time

import torch.distributed as dist

from mega.train.testing.training_runs import train_losses

ARGV = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1", "--train-iters", "10",
        "--eval-iters", "0", "--log-interval", "5", "--log-straggler"]
DELAY_S = 0.2
# Every rank's step also sleeps this long: a step of a few milliseconds on a shared 2-core machine
# (the suite runs two pytest workers) varies by more than 1.5x from scheduling alone; against a
# 100 ms step that jitter is a few percent, and the slowed rank still stands at about 2.8x.
BASE_S = 0.1


def reports(slow_rank: int | None) -> list[str]:
    """The straggler lines rank 0 prints, every rank sleeping ``BASE_S`` in each step and
    ``slow_rank`` (if any) 200 ms more."""
    from mega.train.trainer import Trainer

    step = Trainer.train_step

    delay = BASE_S + (DELAY_S if dist.get_rank() == slow_rank else 0.0)

    def slowed(self, data):
        time.sleep(delay)
        return step(self, data)

    Trainer.train_step = slowed
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            train_losses(ARGV)
    finally:
        Trainer.train_step = step
    return [line for line in out.getvalue().splitlines() if "straggler report" in line]


def both(slow_rank: int) -> tuple[list[str], list[str]]:
    return reports(None), reports(slow_rank)


def test_a_slowed_rank_is_named_and_no_rank_without_the_delay(worlds):
    steady, slowed = worlds.run(3, both, 1)[0]
    assert len(steady) == len(slowed) == 2  # iterations 5 and 10
    assert all(line.endswith("stragglers (>= 1.5x the median): none") for line in steady), steady
    named = [line.split("stragglers (>= 1.5x the median): ")[1] for line in slowed]
    assert any(line.startswith("rank 1 ") and ", rank" not in line for line in named), slowed
    ratio = float(named[-1].split("(")[1].split("x)")[0])
    assert ratio >= 1.5
    assert "slowest: rank 1 " in slowed[-1]

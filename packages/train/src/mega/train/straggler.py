"""``--log-straggler``: every ``--log-interval``, which ranks are slow, and how slow against the median.

A slow rank does not make its own step longer than the others': they all wait for it in the
step's collectives, so every rank's wall-clock step time is the same. What differs is the time a
rank spends on its own work: its step time minus the time it waited in blocking collectives (see
collective_history). The ranks gather both, averaged over the interval; rank 0 names the ranks
whose own time is at least :data:`STRAGGLER_RATIO` times the median, with their ratio, and the
``--straggler-minmax-count`` fastest and slowest ranks (Megatron's report). The numbers also go
to TensorBoard and W&B (``straggler/...``, through the step's metrics).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from mega.core.config import ConfigError
from mega.core.plugins import hookimpl
from mega.core.process_group import collective_timeout
from mega.train.collective_history import active_history

STRAGGLER_RATIO = 1.5  # a rank whose own time per step is this many times the median is named


class StragglerReport:
    def __init__(self, log_interval: int, count: int):
        if count < 1:
            raise ConfigError(f"--straggler-minmax-count must be at least 1, got {count}")
        self.log_interval, self.count = log_interval, count
        self.group = None
        self._reset()

    def _reset(self) -> None:
        self.step_seconds, self.wait_seconds, self.steps = 0.0, 0.0, 0

    @hookimpl
    def on_train_start(self, run):
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=collective_timeout())  # CPU numbers, whatever the training backend
        history = active_history()
        if history is not None:
            history.take_wait_seconds()  # from the first step on

    @hookimpl(tryfirst=True)  # before the loggers, which read metrics["straggler"]
    def on_step_end(self, run, iteration, metrics):
        history = active_history()
        self.wait_seconds += history.take_wait_seconds() if history is not None else 0.0
        self.step_seconds += metrics["elapsed_s"]
        self.steps += 1
        if iteration % self.log_interval and iteration != run.config.training.train_iters:
            return
        mine = torch.tensor([self.step_seconds / self.steps, self.wait_seconds / self.steps], dtype=torch.float64)
        self._reset()
        if self.group is None:
            return
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine, group=self.group)
        own = [float(step - wait) for step, wait in every]
        metrics["straggler"] = self._scalars(own)
        if run.is_logging_rank:
            print(self._line(iteration, own), flush=True)

    @staticmethod
    def _scalars(own: list[float]) -> dict[str, float]:
        median = statistics.median(own)
        slowest = max(range(len(own)), key=own.__getitem__)
        return {"straggler/median-own-time": median, "straggler/max-own-time": own[slowest],
                "straggler/slowest-rank": slowest, "straggler/max-ratio": own[slowest] / median if median else 0.0}

    def _line(self, iteration: int, own: list[float]) -> str:
        median = statistics.median(own)
        ratio = [value / median if median else 0.0 for value in own]
        order = sorted(range(len(own)), key=own.__getitem__)

        def ranks(which: list[int]) -> str:
            return ", ".join(f"rank {rank} {1000 * own[rank]:.1f} ms ({ratio[rank]:.2f}x)" for rank in which)

        named = [rank for rank in reversed(order) if ratio[rank] >= STRAGGLER_RATIO]
        return (f" straggler report at iteration {iteration}: own time per step (step minus waiting in "
                f"collectives) median {1000 * median:.1f} ms | fastest: {ranks(order[:self.count])} | "
                f"slowest: {ranks(order[::-1][:self.count])} | stragglers (>= {STRAGGLER_RATIO}x the median): "
                + (ranks(named) if named else "none"))


def straggler_report(run_config) -> StragglerReport | None:
    logging = run_config.logging
    return StragglerReport(logging.log_interval, logging.straggler_minmax_count) if logging.log_straggler else None

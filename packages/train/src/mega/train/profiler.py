"""``--profile``: a torch.profiler Chrome trace of iterations [--profile-step-start, --profile-step-end)."""

from __future__ import annotations

import os

import torch

from mega.core.config import ConfigError
from mega.core.plugins import hookimpl


class StepProfiler:
    def __init__(self, start: int, end: int, directory: str):
        if not 1 <= start < end:
            raise ConfigError(
                f"--profile-step-start {start} must be >= 1 and before --profile-step-end {end}"
            )
        self.start, self.end, self.directory = start, end, directory
        self.profile = None
        self.path = None

    @hookimpl
    def on_step_start(self, run, iteration):
        if iteration == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if run.groups.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profile.__enter__()

    @hookimpl
    def on_step_end(self, run, iteration):
        if self.profile is not None and iteration == self.end - 1:
            self._finish(run)

    @hookimpl
    def on_train_end(self, run):
        if self.profile is not None:  # training stopped inside the profiled range
            self._finish(run)

    def _finish(self, run) -> None:
        self.profile.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"profile_rank{run.groups.global_rank}.json")
        self.profile.export_chrome_trace(self.path)
        self.profile = None
        if run.is_logging_rank:
            print(f" profile of iterations {self.start}-{self.end - 1} written to {self.path}", flush=True)


def step_profiler(run_config) -> StepProfiler | None:
    logging = run_config.logging
    if not logging.profile:
        return None
    return StepProfiler(logging.profile_step_start, logging.profile_step_end, logging.profile_dir)

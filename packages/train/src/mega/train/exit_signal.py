"""Leaving a job cleanly before it is ended: ``--exit-signal-handler`` and ``--exit-duration-in-mins``.

A scheduler that preempts a job sends SIGTERM (``--exit-signal`` picks another) some time before it
kills it; a job with a time limit runs out of it. Either way the run finishes the iteration it is
in, saves a checkpoint under ``--save`` and exits 0, saying why, so the next job resumes with
``--load`` and loses nothing. Every rank must stop at the same iteration (a rank leaving alone
would hang the others' collectives), so each step the ranks agree on "stop" with one all-reduce
of a flag, as Megatron does.

A second signal during the save is not caught: it ends the process at once. The save is
atomic (see mega.core.checkpoint.directory), so the previous checkpoint stays the newest one.
"""

from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

from mega.core.plugins import hookimpl
from mega.core.process_group import collective_timeout


class ExitBeforeTheEnd:
    def __init__(self, exit_signal: str | None, duration_minutes: float | None):
        self.signal = signal.Signals[exit_signal] if exit_signal else None
        self.deadline = time.monotonic() + 60 * duration_minutes if duration_minutes else None
        self.duration_minutes = duration_minutes
        self.received: signal.Signals | None = None
        self.group = None
        self.reason: str | None = None

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum)
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process, mid-save or not
        print(f"mega train: received {self.received.name}: finishing this iteration, saving a checkpoint, "
              f"then exiting (a second {self.received.name} stops at once)", file=sys.stderr, flush=True)

    @hookimpl
    def on_train_start(self, run):
        if self.signal is not None:
            signal.signal(self.signal, self._on_signal)
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=collective_timeout())  # a CPU flag, whatever the training backend

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        out_of_time = self.deadline is not None and time.monotonic() >= self.deadline
        # 1: this rank got the signal, 2: its time is up; every rank takes the largest.
        flag = torch.tensor([2 if out_of_time else 1 if self.received else 0])
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() == 0:
            return
        self.reason = (f"--exit-duration-in-mins {self.duration_minutes:g} reached" if flag.item() == 2
                       else f"received {(self.received or self.signal).name} (--exit-signal-handler)")
        run.exit_reason = self.reason

    @hookimpl
    def on_train_end(self, run):
        if self.signal is not None and self.received is None:
            signal.signal(self.signal, signal.SIG_DFL)
        if self.reason is None or not run.is_logging_rank:
            return
        save = run.config.checkpoint.save
        saved = f"checkpoint of iteration {run.iteration} saved in {save}" if save else \
            "nothing saved (no --save)"
        print(f"mega train: exiting at iteration {run.iteration} of {run.config.training.train_iters}: "
              f"{self.reason}; {saved}", flush=True)


def exit_before_the_end(run_config) -> ExitBeforeTheEnd | None:
    training = run_config.training
    if not training.exit_signal_handler and not training.exit_duration_in_mins:
        return None
    return ExitBeforeTheEnd(training.exit_signal if training.exit_signal_handler else None,
                            training.exit_duration_in_mins)

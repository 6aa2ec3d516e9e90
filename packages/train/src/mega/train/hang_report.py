"""What every rank was doing when a collective timed out, written so a deadlock is diagnosed from files.

A rank whose collective times out writes its report (the collective it waited in, the last
collectives with their group, sizes and sequence numbers, the Python stack of every thread) to
``--save/debug/rank_R.txt``, or to stderr without ``--save``. Its peers may be stuck anywhere, in a
collective or not, so each rank also keeps a thread that writes the same report when the local
launcher asks (it does when a rank exits with a timeout), and the launcher compares the ranks'
sequence numbers to name the rank that is behind (mega.train.rank_reports).

On CUDA, PyTorch's NCCL flight recorder is switched on (its environment variables, unless the user
set them) and dumps its trace beside the reports when NCCL's watchdog sees a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mega.core.plugins import hookimpl
from mega.train.collective_history import active_history, start_recording, stop_recording
from mega.train.rank_reports import DEBUG_DIR_ENV, REQUEST_FILE

POLL_S = 0.2


def debug_dir(save: str | None) -> Path | None:
    return Path(save) / "debug" if save else None


def flight_recorder_env(save: str | None) -> None:
    """Switch on the NCCL flight recorder (read when the NCCL process group is created; gloo
    ignores it): keep the last 2000 collectives, dump them on a timeout, beside the reports as
    nccl_trace_rank_R (read them with ``python -m torch.distributed.flight_recorder.fr_trace``).
    torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE to these."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    directory = debug_dir(save)
    if directory is not None and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and torch.cuda.is_available():
        directory.mkdir(parents=True, exist_ok=True)
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(directory / "nccl_trace_rank_")


def thread_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def report_text(rank: int, reason: str) -> str:
    history = active_history()
    lines = [f"mega hang report: rank {rank}, pid {os.getpid()} on {socket.gethostname()}, "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}", f"why: {reason}"]
    if history is None:
        lines.append("no collectives were recorded (a single process, or before training started)")
    else:
        waiting = history.waiting()
        lines.append("in collective: " + (waiting.describe() if waiting else "none (between collectives)"))
        lines.append(f"last {len(history.calls)} collectives, oldest first (#n: the n-th on its group):")
        lines += ["  " + call.describe() for call in history.calls]
    lines += ["", "Python stacks of every thread:", thread_stacks()]
    return "\n".join(lines) + "\n"


def write_report(rank: int, save: str | None, reason: str) -> None:
    """This rank's report to --save/debug/rank_R.txt (or stderr); its data for the local launcher."""
    text = report_text(rank, reason)
    directory = debug_dir(save)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank_{rank}.txt").write_text(text)
        print(f"mega train: rank {rank}'s hang report: {directory / f'rank_{rank}.txt'}", file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)
    launcher_dir = os.environ.get(DEBUG_DIR_ENV)
    history = active_history()
    if launcher_dir and history is not None:
        waiting = history.waiting()
        data = {"rank": rank, "report": str(directory / f"rank_{rank}.txt") if directory else None,
                "waiting": None if waiting is None else vars(waiting), **history.snapshot()}
        path = Path(launcher_dir) / f"rank_{rank}.json"
        path.with_suffix(".part").write_text(json.dumps(data))
        os.replace(path.with_suffix(".part"), path)


class HangWatch:
    """Records the run's collectives and answers the launcher's request for a report."""

    def __init__(self, rank: int, save: str | None):
        self.rank, self.save = rank, save
        self.stopped = threading.Event()
        start_recording()
        launcher_dir = os.environ.get(DEBUG_DIR_ENV)
        if launcher_dir:
            threading.Thread(target=self._answer, args=(Path(launcher_dir) / REQUEST_FILE,),
                             name="mega-hang-report", daemon=True).start()

    def _answer(self, request: Path) -> None:
        while not self.stopped.wait(POLL_S):
            if request.exists():
                write_report(self.rank, self.save, f"the launcher asked: {request.read_text().strip()}")
                return

    @hookimpl
    def on_train_end(self, run):
        stop_recording()
        if run.finished:
            self.stopped.set()


def hang_watch(run_config) -> HangWatch | None:
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return HangWatch(dist.get_rank(), run_config.checkpoint.save)

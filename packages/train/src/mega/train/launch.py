"""Starting and joining a distributed job: under torchrun/SLURM, or local processes we spawn.

``mega train --nproc-per-node N`` (and ``mega bench comm``) re-run the same command in N child
processes with torchrun's environment variables; each child then calls
:func:`init_distributed`, which reads that environment wherever it came from.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from mega.core.rank_exit import FAILURE_FILE_ENV
from mega.train.rank_reports import DEBUG_DIR_ENV, name_the_rank_behind, request_reports

# How long ranks asked to stop (SIGTERM) may take to exit before they are killed.
STOP_GRACE_S = 10.0
# A rank whose collective timed out exits with this code (see mega.train.launch_run).
TIMEOUT_EXIT_CODE = 3
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(nproc: int, command: list[str], threads_per_process: int | None = None,
                 program: tuple[str, ...] = (sys.executable, "-m", "mega.core.cli.main"),
                 handled_signal: int | None = None) -> int:
    """Run ``python -m mega.core.cli.main <command>`` (``program`` + ``command``) on ``nproc`` local
    ranks; return the exit code.

    If a rank fails, the others are stopped, so a crash never leaves the job hanging, and the
    first failing rank is named with how it ended. SIGTERM and SIGINT sent to the launcher are
    passed on to the ranks; a launcher that dies however it dies (even SIGKILL) takes its ranks
    with it, so none is left training on its own.

    ``handled_signal`` is a signal the ranks act on themselves (``--exit-signal-handler``: save,
    then exit 0): it is passed on, and the job then ends as its ranks do.
    """
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be positive, got {nproc}")
    port = free_port()
    threads = threads_per_process or max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory(prefix="mega-launch-") as failure_dir:
        failure_files = [os.path.join(failure_dir, f"rank{rank}.json") for rank in range(nproc)]
        processes = []
        for rank in range(nproc):
            env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(threads), **{FAILURE_FILE_ENV: failure_files[rank], DEBUG_DIR_ENV: failure_dir},
            )
            processes.append(subprocess.Popen([*program, *command], env=env,
                                              preexec_fn=_die_with_parent(os.getpid())))
        with _forwarding_stop_signals(processes, handled_signal) as received:
            first_exit = _supervise(processes, received, failure_dir)
        if received:
            name = signal.Signals(received[0]).name
            print(f"mega: stopped by {name}; the ranks were stopped too", file=sys.stderr, flush=True)
            return 128 + received[0]
        if first_exit is None:
            return 0
        rank, returncode = first_exit
        # A rank that noted its failure (a clear error) explains the job better than the peers whose
        # collectives broke after it, unless a signal from outside killed a rank first.
        recorded = _first_recorded(failure_files)
        if recorded is not None and returncode > 0:
            rank, returncode = recorded
        print(f"mega: rank {rank} {describe_exit(returncode)}, first; the other ranks were stopped",
              file=sys.stderr, flush=True)
        if returncode == TIMEOUT_EXIT_CODE:
            behind = name_the_rank_behind(failure_dir)
            if behind:
                print(f"mega: {behind}", file=sys.stderr, flush=True)
        return returncode if returncode > 0 else 128 - returncode


def _die_with_parent(parent_pid: int):
    """A child's pre-exec step: ask Linux to SIGKILL it when the launcher dies (PR_SET_PDEATHSIG)."""
    def arrange() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the launcher died before the request was made
            os._exit(1)
    return arrange


class _forwarding_stop_signals:
    """While the ranks run, SIGTERM/SIGINT to the launcher are sent on to every rank (whose own
    handlers then exit); the signals received are listed, so the launcher can exit as killed."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, processes: list[subprocess.Popen], handled: int | None = None):
        self.processes, self.received, self.previous = processes, [], {}
        self.handled = handled  # the ranks' own (--exit-signal-handler): passed on, not a reason to stop them

    def _forward(self, signum, frame) -> None:
        if signum == self.handled:
            print(f"mega: {signal.Signals(signum).name} passed on to the ranks (--exit-signal-handler)",
                  file=sys.stderr, flush=True)
        else:
            self.received.append(signum)
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def __enter__(self) -> list[int]:
        for signum in {*self.SIGNALS, *([self.handled] if self.handled else [])}:
            self.previous[signum] = signal.signal(signum, self._forward)
        return self.received

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _supervise(processes: list[subprocess.Popen], received: list[int], debug_dir: str) -> tuple[int, int] | None:
    """Wait for every process; stop them all at the first failure or stop signal; return the first
    failing rank and its return code (negative: the signal that killed it), None if all succeeded.
    After a collective timeout the ranks still running are asked for their hang reports first."""
    failed = None
    try:
        while not received and any(p.poll() is None for p in processes):
            failed = next((p for p in processes if p.poll() not in (None, 0)), None)
            if failed is not None:
                break
            time.sleep(0.05)
        if failed is not None and failed.returncode == TIMEOUT_EXIT_CODE:
            running = [rank for rank, process in enumerate(processes) if process.poll() is None]
            request_reports(debug_dir, f"rank {processes.index(failed)}'s collective timed out", running)
        for rank, process in enumerate(processes):
            if _is_stopped(process.pid):  # its peers' collectives timed out waiting for it
                print(f"mega: rank {rank} (pid {process.pid}) is stopped (SIGSTOP or a debugger) and did not "
                      "take part in the collectives", file=sys.stderr, flush=True)
    finally:
        stop(processes)
    failed = failed or next((p for p in processes if p.returncode), None)
    return None if failed is None else (processes.index(failed), failed.returncode)


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stop(processes: list[subprocess.Popen], grace_s: float | None = None) -> None:
    """SIGTERM every running process, then SIGKILL those still running after ``grace_s``
    (default :data:`STOP_GRACE_S`)."""
    grace_s = STOP_GRACE_S if grace_s is None else grace_s
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def describe_exit(returncode: int) -> str:
    """``exited with code 2`` / ``was killed by SIGKILL``: how a process ended, in words."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def _first_recorded(paths: list[str]) -> tuple[int, int] | None:
    """(rank, exit code) of the rank that recorded its failure first; None if none did."""
    records = []
    for rank, path in enumerate(paths):
        try:
            with open(path) as stream:
                record = json.load(stream)
            records.append((record["time"], rank, record["exit_code"]))
        except (OSError, ValueError, KeyError):
            continue
    return min(records)[1:] if records else None

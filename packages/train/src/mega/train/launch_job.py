"""``mega train --nproc-per-node N``: start the local ranks with what the launcher must know of the run.

The launcher reads the run's configuration (flags and TOML, as a rank does) for the behaviour that
spans ranks: the signal the ranks save on (``--exit-signal-handler``), the checkpoints a restarted
job resumes from (``--max-restarts``, ``--save``). A configuration that does not parse is left to
the ranks, which report it with their usual one-line error.
"""

from __future__ import annotations

import contextlib
import io
import signal
import sys

from mega.train.in_job_restart import run_with_restarts
from mega.train.launch import launch_local
from mega.train.nodes import Nodes
from mega.train.run_parser import parse_run


def _run_config(argv: list[str]):
    """The run as its ranks will read it, or None when it does not parse."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the ranks parse it again and say what is wrong
            return parse_run(argv[1:])[0]
    except (Exception, SystemExit):  # noqa: BLE001
        return None


def launch_job(nproc: int, command: list[str], max_restarts: int | None = None,
               program: tuple[str, ...] = (sys.executable, "-m", "mega.core.cli.main"), nodes: Nodes | None = None) -> int:
    """Start ``nproc`` local ranks of ``command``; with ``max_restarts``, or as one node of a
    multi-node job (``nodes``), under the elastic agent (see in_job_restart). A configuration that
    does not parse runs once: its ranks say why."""
    run = _run_config(command)
    handled = signal.Signals[run.training.exit_signal] if run is not None and run.training.exit_signal_handler else None
    if nodes is not None:
        save = run.checkpoint.save if run is not None else None
        return run_with_restarts(nproc, command, max_restarts or 0, save, program=program, handled_signal=handled,
                                 nodes=nodes, batch_at=batch_at(run) if run is not None else None)
    if run is not None and max_restarts is not None:
        return run_with_restarts(nproc, command, max_restarts, run.checkpoint.save, program=program,
                                 handled_signal=handled)
    return launch_local(nproc, command, program=program, handled_signal=handled)


def batch_at(run):
    """``world size -> "data-parallel size D, gradient accumulation A"``: what the job becomes at
    another size. --global-batch-size stays; the ranks derive the accumulation from it (run_config's
    ``derive``), so the loss of an iteration does not depend on how many nodes computed it."""
    def describe(world_size: int) -> str:
        try:
            dp = run.parallel.data_parallel_size(world_size)
        except ValueError as error:
            return f"which the layout cannot use ({error})"
        global_batch = run.training.global_batch_size or run.training.micro_batch_size * dp
        accumulation, rest = divmod(global_batch, run.training.micro_batch_size * dp)
        if rest or not accumulation:
            return (f"data-parallel size {dp}, which does not divide the global batch of {global_batch} "
                    f"micro-batches of {run.training.micro_batch_size}")
        return f"data-parallel size {dp}, gradient accumulation {accumulation} (global batch {global_batch})"
    return describe

"""``mega train --nproc-per-node N``: start the local ranks with what the launcher must know of the run.

The launcher reads the run's configuration (flags and TOML, as a rank does) for the behaviour that
spans ranks: the signal the ranks save on (``--exit-signal-handler``). A configuration that does
not parse is left to the ranks, which report it with their usual one-line error.
"""

from __future__ import annotations

import contextlib
import io
import signal
import sys

from mega.core.launch import launch_local


def handled_signal(argv: list[str]) -> int | None:
    """The signal the ranks act on themselves, or None."""
    from mega.core.training.command import parse_run

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the ranks parse it again and say what is wrong
            run, _ = parse_run(argv[1:])
    except (Exception, SystemExit):  # noqa: BLE001
        return None
    return signal.Signals[run.training.exit_signal] if run.training.exit_signal_handler else None


def launch_job(nproc: int, command: list[str], program: tuple[str, ...] = (sys.executable, "-m", "mega.core.cli.main")) -> int:
    return launch_local(nproc, command, program=program, handled_signal=handled_signal(command))

"""`mega train` in-process for equivalence tests: the losses of one run, of several, and their check.

The functions are module-level so that :class:`~mega.testing.distributed.DistributedWorld`
ranks can be asked to run them (``worlds.run(2, train_each, [argv, ...])``): a rank runs every
layout it is given in sequence, sparing a process start per layout.
"""

from __future__ import annotations

from mega.train.launch_run import run_training
from mega.train.run_parser import parse_run


def train_losses(argv: list[str]) -> list[float]:
    """The per-iteration losses of ``mega train ARGV`` run in this process (every rank of a world
    reports the same list: losses are shared from the last pipeline stage)."""
    run, family = parse_run(argv)
    return run_training(run, family).losses


def train_each(argvs: list[list[str]]) -> list[list[float]]:
    return [train_losses(argv) for argv in argvs]


def assert_losses_close(losses: list[float], reference: list[float], what: str, tolerance: float = 1e-5) -> None:
    """Same number of steps, and every loss within ``tolerance`` (relative) of the reference's."""
    assert len(losses) == len(reference), f"{what}: {len(losses)} losses, expected {len(reference)}"
    for step, (got, want) in enumerate(zip(losses, reference, strict=True)):
        assert abs(got - want) <= tolerance * abs(want), f"{what}: step {step + 1} loss {got} != {want}"


def logged_losses(log: str) -> dict[int, float]:
    """iteration -> loss, read from the log lines `mega train` prints (`` iteration 3/ ... | lm loss:
    1.234567E+00 |``): the losses of a job run as a command, on whatever engine started it."""
    return {int(line.split("/")[0].split()[-1]): float(line.split("lm loss: ")[1].split()[0])
            for line in log.splitlines() if line.startswith(" iteration")}

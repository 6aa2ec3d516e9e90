"""The vocabulary of schedule tables: actions (F, B, W of one micro-batch on one model chunk),
the table of every rank's actions grouped into steps, and the error of a schedule that cannot be
built. :mod:`mega.core.pipeline.schedule_table` explains what a table means."""

from __future__ import annotations

from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"  # the whole backward, or its input-gradient half where the table has W actions
WEIGHT = "W"  # the weight-gradient half of a backward


class ScheduleError(ValueError):
    """A schedule that cannot be built for the numbers asked."""


@dataclass(frozen=True)
class Action:
    """One forward, backward (or its B and W halves) of one micro-batch through one model chunk."""

    kind: str  # FORWARD, BACKWARD or WEIGHT
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch} c{self.chunk}"


@dataclass(frozen=True)
class ScheduleTable:
    pp: int
    vpp: int
    num_microbatches: int
    steps: tuple[tuple[tuple[Action, ...], ...], ...]  # steps[rank][i]: one or two actions

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """``actions[rank]``: every action of ``rank`` in execution order."""
        return tuple(tuple(a for step in steps for a in step) for steps in self.steps)

    @property
    def splits_backward(self) -> bool:
        """Whether the backwards are split into B and W (a zero-bubble schedule)."""
        return any(action.kind == WEIGHT for actions in self.actions for action in actions)

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` computes."""
        return chunk * self.pp + rank

    def rank_and_chunk(self, stage: int) -> tuple[int, int]:
        chunk, rank = divmod(stage, self.pp)
        return rank, chunk

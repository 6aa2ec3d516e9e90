"""The vocabulary of schedule tables: actions (F, B, W of one micro-batch on one model chunk),
the table of every rank's actions grouped into steps, and the error of a schedule that cannot be
built. :mod:`mega.core.pipeline.schedule_table` explains what a table means."""

from __future__ import annotations

from dataclasses import dataclass

INTERLEAVED = "interleaved"  # chunk c of rank r is virtual stage c * pp + r (Megatron's)
V_SHAPE = "v"  # two chunks: rank r holds stages r and 2 pp - 1 - r (ZB-V, DualPipeV)

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
    steps: tuple[tuple[tuple[Action, ...], ...], ...]  # steps[rank][i]: no, one or two actions
    placement: str = INTERLEAVED
    # Slotted tables (the zero-bubble ones) are timed: step i of every rank is time slot i (an
    # empty step an idle slot), and a message is received in the slot after it was sent,
    # whenever its consumer runs (mega.core.pipeline.messages).
    slotted: bool = False

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
        return stage_of(rank, chunk, self.pp, self.placement)

    def rank_and_chunk(self, stage: int) -> tuple[int, int]:
        return rank_and_chunk_of(stage, self.pp, self.placement)


def stage_of(rank: int, chunk: int, pp: int, placement: str = INTERLEAVED) -> int:
    """The virtual stage chunk ``chunk`` of pipeline rank ``rank`` computes under ``placement``."""
    if placement == V_SHAPE and chunk == 1:
        return 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_and_chunk_of(stage: int, pp: int, placement: str = INTERLEAVED) -> tuple[int, int]:
    """The pipeline rank and model chunk that compute virtual stage ``stage``."""
    chunk, rank = divmod(stage, pp)
    if placement == V_SHAPE and chunk == 1:
        rank = pp - 1 - rank
    return rank, chunk

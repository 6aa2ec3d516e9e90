"""The schedule table: which micro-batch and model chunk each pipeline rank runs, in which order.

It is computed from the pipeline size, the number of model chunks per rank and the number of
micro-batches alone, without a model. The schedules execute exactly this order, and the tests
(whose unit-cost timeline checks the bubble arithmetic), docs and memory plan read it, so there
is one source of truth for what a schedule does.

Model chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r``: a micro-batch flows
through rank 0, 1, ..., pp-1 for chunk 0, then wraps to rank 0 for chunk 1, and so on (Megatron's
interleaved layout). With one chunk per rank the virtual stage is the rank.

Each rank's order is Megatron's: a warm-up of forwards, a steady state alternating one forward
and one backward, and a cool-down of backwards. With one chunk the warm-up is ``pp - rank - 1``
forwards, so stage ``rank`` never holds more than ``pp - rank`` micro-batches' activations; with
``pp == 1`` the order is forward, backward, forward, backward: plain gradient accumulation.

The actions of a rank are grouped into *steps*; stages exchange tensors between steps
(:mod:`mega.core.pipeline.messages`). Those exchanges must meet in lockstep between neighbouring
ranks or the pipeline deadlocks. In 1F1B every action is a step. In the interleaved schedule the
stages form a ring (the last rank feeds chunk ``c + 1`` of the first), which needs neighbours'
warm-ups to differ by two forwards, and then a steady-state step is one forward plus one backward.

A zero-bubble schedule (``schedule="zb-h1"``, :mod:`mega.core.pipeline.zero_bubble`) splits each
backward into B (the input gradient: what the previous stage waits for) and W (the weight
gradients, :mod:`mega.core.parallel.weight_grad_split`); its table has W actions. Without them,
B is the whole backward.

Peak live activations per rank (micro-batch chunks forwarded whose backward, or W, has not run):
1F1B ``min(pp - rank, m)``; interleaved ``warm-up + 1`` chunks (Megatron's); ZB-H1 the same as
1F1B, counted up to W. The table tests check these.
"""

from __future__ import annotations

from mega.core.pipeline.actions import BACKWARD, FORWARD, WEIGHT, Action, ScheduleError, ScheduleTable
from mega.core.pipeline.interleaved_order import interleaved_forward
from mega.core.pipeline.zero_bubble import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, zero_bubble_table

__all__ = ["BACKWARD", "FORWARD", "SCHEDULES", "V_SCHEDULES", "WEIGHT", "Action", "ScheduleError", "ScheduleTable",
           "schedule_table", "whole_backwards"]

SCHEDULES = ("1f1b", *ZERO_BUBBLE_SCHEDULES)


def schedule_table(pp: int, num_microbatches: int, vpp: int = 1, forward_only: bool = False,
                   schedule: str = "1f1b") -> ScheduleTable:
    """The table of the schedule the pipeline runs: no pipelining (``pp == 1``), 1F1B
    (``vpp == 1``) or interleaved 1F1B (``vpp > 1``), a zero-bubble schedule (``"zb-h1"``,
    interleaved with ``vpp > 1``; ``"zbv"`` and ``"dualpipev"`` with two chunks in a V:
    :mod:`mega.core.pipeline.zero_bubble`), or forwards only (evaluation)."""
    for name, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")
    if schedule in ZERO_BUBBLE_SCHEDULES:
        table = zero_bubble_table(schedule, pp, num_microbatches, vpp)
        if not forward_only:
            return table
        # Evaluation: the forwards in the slots the schedule runs them.
        return ScheduleTable(pp, vpp, num_microbatches, tuple(
            tuple(tuple(a for a in step if a.kind == FORWARD) for step in steps) for steps in table.steps),
            table.placement, slotted=True)
    if vpp > 1 and pp == 1:
        raise ScheduleError(f"vpp = {vpp} model chunks per rank needs pp > 1, got pp = 1")
    if vpp > 1 and num_microbatches % pp and schedule not in V_SCHEDULES:
        raise ScheduleError(
            f"the interleaved schedule (vpp = {vpp}) needs the number of micro-batches to be a "
            f"multiple of pp = {pp}, got {num_microbatches}"
        )
    steps = tuple(
        tuple(_rank_steps(pp, vpp, num_microbatches, rank, forward_only)) for rank in range(pp)
    )
    return ScheduleTable(pp, vpp, num_microbatches, steps)


def _rank_steps(pp: int, vpp: int, num_microbatches: int, rank: int, forward_only: bool) -> list[tuple[Action, ...]]:
    total = num_microbatches * vpp
    forwards = [Action(FORWARD, *_microbatch_and_chunk(k, pp, vpp, forward=True)) for k in range(total)]
    if forward_only:
        return [(action,) for action in forwards]
    backwards = [Action(BACKWARD, *_microbatch_and_chunk(k, pp, vpp, forward=False)) for k in range(total)]
    if vpp == 1:
        warmup = pp - rank - 1
    else:
        # Every rank first fills its later chunks (vpp - 1 groups of pp micro-batches); earlier
        # ranks run two more forwards per stage behind them, so that each backward's gradient
        # has arrived by the time the steady state asks for it.
        warmup = (pp - rank - 1) * 2 + (vpp - 1) * pp
    warmup = min(warmup, total)
    # The steady state pairs the forwards left after warm-up with the first backwards.
    pairs = list(zip(forwards[warmup:], backwards, strict=False))
    steady = pairs if vpp > 1 else [(action,) for pair in pairs for action in pair]
    return [(f,) for f in forwards[:warmup]] + steady + [(b,) for b in backwards[total - warmup:]]


def _microbatch_and_chunk(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """The ``k``-th forward (or backward) of a rank: micro-batches go through the chunks in
    groups of ``pp``; backwards visit the chunks in reverse."""
    microbatch, chunk = interleaved_forward(k, pp, vpp)
    return microbatch, chunk if forward else vpp - 1 - chunk


def whole_backwards(table: ScheduleTable, rank: int) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) of the first stage whose W directly follows its B on this rank:
    their B computes the weight gradients too (their W has nothing left), as 1F1B's backward does.
    The first stage's B sends nothing, so W's work done in B's place delays nobody, and the
    micro-batch does not hold its layers' inputs and output gradients through the rest of B: the
    first rank's memory stays 1F1B's (under ZB-H1 every W of the first rank follows its B)."""
    actions = table.actions[rank]
    return {(b.microbatch, b.chunk) for b, w in zip(actions, actions[1:], strict=False)
            if b.kind == BACKWARD and w == Action(WEIGHT, b.microbatch, b.chunk) and table.stage(rank, b.chunk) == 0}

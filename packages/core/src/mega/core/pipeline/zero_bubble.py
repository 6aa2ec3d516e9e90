"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradients).

In 1F1B a stage waits, during warm-up and cool-down, for the activations and gradients of the
others: the bubble of ``(pp - 1) / (m + pp - 1)``. B is all the previous stage waits for;
W (:mod:`mega.core.parallel.weight_grad_split`) waits for nothing and can fill those gaps
(Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

The schedules are list schedules over unit costs (F = B = W = 1 per model chunk), built the way
that paper builds its automatic ones: in every time slot each rank runs

1. its oldest W if ``max_deferred`` are pending (each holds a layer's input and output gradient), else
2. a B whose gradient has arrived (B is on the critical path), the oldest, else
3. an F whose input has arrived, if fewer than its ``live`` limit of chunks are held (forward
   run, B not yet): with interleaved chunks the next in interleaved 1F1B's order (groups of pp
   micro-batches per chunk, the order its memory bound holds in), in a V the one furthest down
   the pipeline (it reaches the loss soonest), else
4. its oldest W, else nothing (an idle slot).

The entries of ``schedule_table(..., schedule=...)``, with what the table tests check (m
micro-batches, bubbles with T_F = T_B = T_W against 1F1B's with a backward of B + W):

* ``zb-h1``, one chunk per rank: 1F1B's ``pp - rank`` live chunks, at most ``pp`` W pending;
  bubble ``(pp - 1) / (3 m + pp - 1)`` for ``m >= pp``, a third of 1F1B's slots.
* ``zb-h1`` with ``vpp`` chunks per rank (interleaved zero bubble, Megatron's placement):
  interleaved 1F1B's ``2 (pp - rank - 1) + (vpp - 1) pp + 1`` live chunks, at most ``pp`` W;
  bubble at most 3/4 of interleaved 1F1B's and no more than ZB-H1's.
* ``zbv``, two chunks per rank in a V (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``: the
  first rank also computes the loss): ``2 pp`` live chunks on every rank (1F1B's first-rank
  peak: pp micro-batches of half-stage chunks), at most ``pp`` W; bubble at most half of
  interleaved 1F1B's (two chunks) and no more than ZB-H1's.
* ``dualpipev``: the same V with DualPipeV's memory (``pp + 1`` micro-batches, ``2 pp + 2``
  chunks) and up to ``2 pp + 1`` W held back for a smaller bubble than ``zbv``'s on average.
  DeepSeek's DualPipeV also overlaps one micro-batch's forward with another's backward to hide
  expert-parallel communication; mega runs the actions of a slot one after the other.

The table is *slotted*: step ``i`` of every rank is time slot ``i``, and every message is
exchanged in the slot after the one that produced it, so an exchange always meets its
counterpart in the same slot (:mod:`mega.core.pipeline.messages`), a W never waits for a
transfer, and a run follows the unit-cost timeline as closely as its costs are equal.
"""

from __future__ import annotations

from collections.abc import Callable

from mega.core.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INTERLEAVED,
    V_SHAPE,
    WEIGHT,
    Action,
    ScheduleError,
    ScheduleTable,
    stage_of,
)
from mega.core.pipeline.interleaved_order import interleaved_forward

ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")


def placement_of(schedule: str) -> str:
    """Where a schedule puts the model chunks: a V for ``zbv`` and ``dualpipev``, else interleaved."""
    return V_SHAPE if schedule in V_SCHEDULES else INTERLEAVED


def live_limits(schedule: str, pp: int, vpp: int) -> list[int]:
    """The most model chunks' activations (forward run, B not yet) each rank holds."""
    if schedule == "zb-h1" and vpp == 1:
        return [pp - rank for rank in range(pp)]
    if schedule == "zb-h1":
        return [2 * (pp - rank - 1) + (vpp - 1) * pp + 1 for rank in range(pp)]
    if schedule == "zbv":
        return [2 * pp] * pp
    if schedule == "dualpipev":
        return [2 * (pp + 1)] * pp
    raise ScheduleError(f"{schedule!r} is not a zero-bubble schedule ({', '.join(ZERO_BUBBLE_SCHEDULES)})")


def max_deferred_weight_grads(schedule: str, pp: int) -> int:
    """The most W a rank holds back: ``pp`` (``2 pp + 1`` for dualpipev, which trades memory for bubble)."""
    return 2 * pp + 1 if schedule == "dualpipev" else pp


def zero_bubble_table(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> ScheduleTable:
    """The table of ``schedule`` (one of :data:`ZERO_BUBBLE_SCHEDULES`)."""
    if schedule in V_SCHEDULES and vpp != 2:
        raise ScheduleError(f"--pipeline-schedule {schedule} runs two model chunks per rank in a V; got vpp = {vpp}")
    return list_schedule(pp, num_microbatches, vpp, placement_of(schedule), live_limits(schedule, pp, vpp),
                         max_deferred_weight_grads(schedule, pp))


def list_schedule(pp: int, num_microbatches: int, vpp: int, placement: str, live: list[int],
                  max_deferred: int) -> ScheduleTable:
    """The slotted table of the list schedule described in the module docstring."""
    m, stages = num_microbatches, pp * vpp
    stage: Callable[[int, int], int] = lambda rank, chunk: stage_of(rank, chunk, pp, placement)  # noqa: E731
    forward_done: dict[tuple[int, int], int] = {}  # (micro-batch, stage) -> slot its F ended after
    backward_done: dict[tuple[int, int], int] = {}
    next_forward = [[0] * vpp for _ in range(pp)]
    waiting_backward: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (mb, chunk): F run, B not
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    slots: list[list[tuple[Action, ...]]] = [[] for _ in range(pp)]
    forward_order = None
    if placement == INTERLEAVED and vpp > 1:  # Megatron's: groups of pp micro-batches through each chunk
        forward_order = [interleaved_forward(k, pp, vpp) for k in range(m * vpp)]
    remaining = 3 * m * stages
    time = 0
    while remaining:
        finished = []
        for rank in range(pp):
            action = _choose(rank, time, stage, stages, m, vpp, live[rank], max_deferred, forward_done,
                             backward_done, next_forward[rank], waiting_backward[rank], deferred[rank], forward_order)
            slots[rank].append((action,) if action else ())
            if action is None:
                continue
            remaining -= 1
            if action.kind == FORWARD:
                next_forward[rank][action.chunk] += 1
                waiting_backward[rank].append((action.microbatch, action.chunk))
                finished.append((forward_done, action.microbatch, stage(rank, action.chunk)))
            elif action.kind == BACKWARD:
                waiting_backward[rank].remove((action.microbatch, action.chunk))
                deferred[rank].append((action.microbatch, action.chunk))
                finished.append((backward_done, action.microbatch, stage(rank, action.chunk)))
            else:
                deferred[rank].remove((action.microbatch, action.chunk))
        for done, microbatch, where in finished:  # results are there from the next slot on
            done[(microbatch, where)] = time + 1
        time += 1
        if time > 4 * m * stages + 4 * stages:
            raise ScheduleError(f"the list schedule of pp = {pp}, vpp = {vpp}, {m} micro-batches made no progress")
    return ScheduleTable(pp, vpp, m, tuple(tuple(rank_slots) for rank_slots in slots), placement, slotted=True)


def _chunk_of_next_forward(next_forward: list[int], order: list[tuple[int, int]]) -> int | None:
    """The chunk of the first (micro-batch, chunk) of ``order`` not run yet."""
    done = sum(next_forward)
    return order[done][1] if done < len(order) else None


def _choose(rank, time, stage, stages, m, vpp, live, max_deferred, forward_done, backward_done, next_forward,
            waiting_backward, deferred, forward_order) -> Action | None:
    def arrived(done, key):
        return done.get(key, time + 1) <= time

    ready_backward = [
        (mb, chunk) for mb, chunk in waiting_backward
        if (arrived(forward_done, (mb, stage(rank, chunk))) if stage(rank, chunk) == stages - 1
            else arrived(backward_done, (mb, stage(rank, chunk) + 1)))
    ]
    if len(deferred) >= max_deferred:
        return Action(WEIGHT, *deferred[0])
    if ready_backward:
        mb, chunk = min(ready_backward, key=lambda item: (item[0], -stage(rank, item[1])))
        return Action(BACKWARD, mb, chunk)
    if len(waiting_backward) < live:
        chunks = range(vpp) if forward_order is None else [_chunk_of_next_forward(next_forward, forward_order)]
        ready_forward = [
            (next_forward[chunk], chunk) for chunk in chunks
            if chunk is not None and next_forward[chunk] < m
            and (stage(rank, chunk) == 0 or arrived(forward_done, (next_forward[chunk], stage(rank, chunk) - 1)))
        ]
        if ready_forward:
            mb, chunk = max(ready_forward, key=lambda item: (stage(rank, item[1]), -item[0]))
            return Action(FORWARD, mb, chunk)
    if deferred:
        return Action(WEIGHT, *deferred[0])
    return None

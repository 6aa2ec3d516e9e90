"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradients).

In 1F1B a stage waits, during warm-up and cool-down, for the activations and gradients of the
others: the bubble of ``(pp - 1) / (m + pp - 1)``. B is all the previous stage waits for;
W (:mod:`mega.core.parallel.weight_grad_split`) waits for nothing and can fill those gaps
(Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

ZB-H1 (``--pipeline-schedule zb-h1``) is built here the way that paper builds its schedules: a
list schedule over unit costs (F = B = W = 1), each rank at each moment running

1. the oldest B whose gradient has arrived (B is on the critical path), else
2. its next F, if its input has arrived and fewer than ``pp - rank`` micro-batches are live on it
   (forward run, W not yet: W still needs the layers' inputs), 1F1B's memory, else
3. its oldest pending W, else nothing.

The last stage then runs F B W F B W...; the earlier ones hold W back until the cool-down, where
it fills the time 1F1B spends waiting for gradients. With T_F = T_B = T_W the bubble is
``(pp - 1) / (3 m + pp - 1)``: a third of 1F1B's ``3 (pp - 1) / (3 m + 3 (pp - 1))`` for m >> pp.
Each action is a step of its own (as in 1F1B), so the exchanges of
:mod:`mega.core.pipeline.messages` apply unchanged; the tests check they never deadlock.
"""

from __future__ import annotations

from mega.core.pipeline.actions import BACKWARD, FORWARD, WEIGHT, Action, ScheduleError, ScheduleTable


def zb_h1_table(pp: int, num_microbatches: int) -> ScheduleTable:
    """The ZB-H1 schedule of ``pp`` ranks (one model chunk each) and ``num_microbatches``."""
    m = num_microbatches
    forward_done: dict[tuple[int, int], int] = {}  # (micro-batch, stage) -> time its F ends
    backward_done: dict[tuple[int, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(pp)]
    next_forward = [0] * pp
    next_backward = [0] * pp
    weights: list[list[int]] = [[] for _ in range(pp)]  # micro-batches whose W is pending
    live = [0] * pp
    time = 0
    while any(len(order) < 3 * m for order in orders):
        started = []
        for rank in range(pp):
            b, f = next_backward[rank], next_forward[rank]
            gradient_in = b < f and (backward_done.get((b, rank + 1), time + 1) <= time if rank < pp - 1
                                     else forward_done[(b, rank)] <= time)
            input_in = f < m and (rank == 0 or forward_done.get((f, rank - 1), time + 1) <= time)
            if gradient_in:
                action = Action(BACKWARD, b, 0)
                next_backward[rank] += 1
                weights[rank].append(b)
            elif input_in and live[rank] < pp - rank:
                action = Action(FORWARD, f, 0)
                next_forward[rank] += 1
                live[rank] += 1
            elif weights[rank]:
                action = Action(WEIGHT, weights[rank].pop(0), 0)
                live[rank] -= 1
            else:
                continue
            orders[rank].append(action)
            started.append((rank, action))
        for rank, action in started:  # every action takes one unit
            done = forward_done if action.kind == FORWARD else backward_done if action.kind == BACKWARD else None
            if done is not None:
                done[(action.microbatch, rank)] = time + 1
        time += 1
        if time > 10 * pp * m + 10:
            raise ScheduleError(f"the ZB-H1 list schedule of pp = {pp}, {m} micro-batches made no progress")
    steps = tuple(tuple((action,) for action in order) for order in orders)
    return ScheduleTable(pp, 1, m, steps)

"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradients).

In 1F1B a stage waits, during warm-up and cool-down, for the activations and gradients of the
others: the bubble of ``(pp - 1) / (m + pp - 1)``. B is all the previous stage waits for;
W (:mod:`mega.core.parallel.weight_grad_split`) waits for nothing and can fill those gaps
(Qi et al., "Zero Bubble Pipeline Parallelism", 2023).

ZB-H1 with one chunk per rank is the paper's own order, placed in unit-cost slots (below). The
others are list schedules over unit costs (F = B = W = 1 per model chunk), built the way that
paper builds its automatic ones: in every time slot each rank runs

1. its oldest W if ``max_deferred`` are pending (each holds a layer's input and output gradient), else
2. a B whose gradient has arrived (B is on the critical path), the oldest, else
3. an F whose input has arrived, if fewer than its ``live`` limit of chunks are held (forward
   run, B not yet): with interleaved chunks the next in interleaved 1F1B's order (groups of pp
   micro-batches per chunk, the order its memory bound holds in), in a V the one furthest down
   the pipeline (it reaches the loss soonest), else
4. its oldest W, else nothing (an idle slot).

The entries of ``schedule_table(..., schedule=...)``, with what the table tests check (m
micro-batches, bubbles with T_F = T_B = T_W against 1F1B's with a backward of B + W):

* ``zb-h1``, one chunk per rank, is not a list schedule but the paper's own order
  (:func:`zb_h1_orders`): 1F1B's with each backward split, rank ``r`` holding back its first
  ``r`` W, so every rank holds at most ``pp`` micro-batches from F to W, 1F1B's peak (its first
  rank's) in the paper's accounting, where a pending W still holds its layers' inputs; 1F1B's
  ``pp - rank`` live chunks up to B. In bytes (docs/pipeline.md): the first rank 1F1B's, the
  others about as much where a W holds as much as its forward saved (the output layer's W
  rebuilds its logits' gradient rather than hold it: :mod:`mega.core.parallel.output_layer_loss`). Bubble ``(pp - 1) / (3 m + pp - 1)`` for ``m >= pp``:
  ``(pp - 1)`` idle slots per rank, a third of 1F1B's ``3 (pp - 1)`` (the paper's
  ``(p - 1)(T_F + T_B - T_W)`` against ``(p - 1)(T_F + T_B + T_W)``). The list schedule would
  reach the same bubble only by holding up to ``pp`` W more (``2 pp - 1`` micro-batches to W on
  the first rank), and with the F-to-W limit instead its greedy choices leave a larger bubble.
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
    if schedule == "zb-h1" and vpp == 1:
        return slotted_in_order(pp, num_microbatches, zb_h1_orders(pp, num_microbatches))
    return list_schedule(pp, num_microbatches, vpp, placement_of(schedule), live_limits(schedule, pp, vpp),
                         max_deferred_weight_grads(schedule, pp))


def zb_h1_orders(pp: int, num_microbatches: int) -> list[list[Action]]:
    """Every rank's actions under ZB-H1 (Qi et al.'s Figure 3): 1F1B's warm-up of ``pp - rank - 1``
    forwards, a steady state of F then B, and W after B once the rank holds back ``rank`` of them
    (those fill its wait for gradients in the cool-down), then B and W, then the W held back."""
    orders = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, num_microbatches)
        forwards = [Action(FORWARD, mb, 0) for mb in range(num_microbatches)]
        order, backwards, weights = forwards[:warmup], 0, 0
        for k, forward in enumerate(forwards[warmup:]):
            order += [forward, Action(BACKWARD, backwards, 0)]
            backwards += 1
            if k >= rank:
                order.append(Action(WEIGHT, weights, 0))
                weights += 1
        for mb in range(backwards, num_microbatches):
            order += [Action(BACKWARD, mb, 0), Action(WEIGHT, weights, 0)]
            weights += 1
        orders.append(order + [Action(WEIGHT, mb, 0) for mb in range(weights, num_microbatches)])
    return orders


def slotted_in_order(pp: int, num_microbatches: int, orders: list[list[Action]]) -> ScheduleTable:
    """The slotted table of one chunk per rank running ``orders[rank]`` in order, each action in
    the first slot after its input arrived (an idle slot while it has not)."""
    done: set[tuple[str, int, int]] = set()  # (kind, micro-batch, stage) whose result is there
    position = [0] * pp
    slots: list[list[tuple[Action, ...]]] = [[] for _ in range(pp)]
    while any(position[rank] < len(orders[rank]) for rank in range(pp)):
        ran = []
        for rank in range(pp):
            action = orders[rank][position[rank]] if position[rank] < len(orders[rank]) else None
            needs = None if action is None else _input_of(action, rank, pp)
            if action is not None and (needs is None or needs in done):
                ran.append((action.kind, action.microbatch, rank))
                position[rank] += 1
                slots[rank].append((action,))
            else:
                slots[rank].append(())
        if not ran:
            raise ScheduleError(f"the order of pp = {pp}, {num_microbatches} micro-batches cannot make progress")
        done.update(ran)
    return ScheduleTable(pp, 1, num_microbatches, tuple(tuple(rank_slots) for rank_slots in slots), INTERLEAVED,
                         slotted=True)


def _input_of(action: Action, stage: int, pp: int) -> tuple[str, int, int] | None:
    """The result (of another stage) that ``action`` of ``stage`` waits for, one chunk per rank."""
    if action.kind == FORWARD and stage > 0:
        return (FORWARD, action.microbatch, stage - 1)
    if action.kind == BACKWARD and stage < pp - 1:
        return (BACKWARD, action.microbatch, stage + 1)
    return None  # the first forward, the last stage's backward (its own loss), W (its own B)


def list_schedule(pp: int, num_microbatches: int, vpp: int, placement: str, live: list[int],
                  max_deferred: int) -> ScheduleTable:
    """The slotted table of the list schedule described in the module docstring."""
    scheduler = _ListScheduler(pp, num_microbatches, vpp, placement, live, max_deferred)
    slots: list[list[tuple[Action, ...]]] = [[] for _ in range(pp)]
    remaining = 3 * num_microbatches * pp * vpp
    while remaining:
        actions = [scheduler.choose(rank) for rank in range(pp)]
        for rank, action in enumerate(actions):
            slots[rank].append((action,) if action else ())
        remaining -= sum(action is not None for action in actions)
        scheduler.advance(actions)
        if scheduler.time > 4 * (num_microbatches + 1) * pp * vpp:
            raise ScheduleError(f"the list schedule of pp = {pp}, vpp = {vpp}, {num_microbatches} micro-batches "
                                f"made no progress")
    return ScheduleTable(pp, vpp, num_microbatches, tuple(tuple(rank_slots) for rank_slots in slots), placement,
                         slotted=True)


class _ListScheduler:
    """Every rank's state during the list schedule, one unit-time slot after another."""

    def __init__(self, pp, num_microbatches, vpp, placement, live, max_deferred):
        self.pp, self.m, self.vpp, self.placement = pp, num_microbatches, vpp, placement
        self.live, self.max_deferred = live, max_deferred
        self.time = 0
        self.forward_done: dict[tuple[int, int], int] = {}  # (micro-batch, stage) -> slot its result is there
        self.backward_done: dict[tuple[int, int], int] = {}
        self.next_forward = [[0] * vpp for _ in range(pp)]  # per rank and chunk: the next micro-batch
        self.waiting_backward: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (mb, chunk): F run, B not
        self.deferred: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (mb, chunk): B run, W not
        # Interleaved chunks run their forwards in Megatron's order, groups of pp micro-batches per chunk.
        self.forward_order = None
        if placement == INTERLEAVED and vpp > 1:
            self.forward_order = [interleaved_forward(k, pp, vpp) for k in range(num_microbatches * vpp)]

    def stage(self, rank: int, chunk: int) -> int:
        return stage_of(rank, chunk, self.pp, self.placement)

    def arrived(self, done: dict, key: tuple[int, int]) -> bool:
        return done.get(key, self.time + 1) <= self.time

    def choose(self, rank: int) -> Action | None:
        """What ``rank`` runs in this slot (the rules of the module docstring)."""
        deferred, waiting = self.deferred[rank], self.waiting_backward[rank]
        if len(deferred) >= self.max_deferred:
            return Action(WEIGHT, *deferred[0])
        last = self.pp * self.vpp - 1
        ready_backward = [
            (mb, chunk) for mb, chunk in waiting
            if (self.arrived(self.forward_done, (mb, last)) if self.stage(rank, chunk) == last
                else self.arrived(self.backward_done, (mb, self.stage(rank, chunk) + 1)))
        ]
        if ready_backward:
            mb, chunk = min(ready_backward, key=lambda item: (item[0], -self.stage(rank, item[1])))
            return Action(BACKWARD, mb, chunk)
        if len(waiting) < self.live[rank]:
            ready_forward = [(self.next_forward[rank][chunk], chunk) for chunk in self._forward_chunks(rank)
                             if self._input_arrived(rank, chunk)]
            if ready_forward:
                mb, chunk = max(ready_forward, key=lambda item: (self.stage(rank, item[1]), -item[0]))
                return Action(FORWARD, mb, chunk)
        return Action(WEIGHT, *deferred[0]) if deferred else None

    def _forward_chunks(self, rank: int) -> list[int]:
        """The chunks whose next forward ``rank`` may run now (the next in order, if ordered)."""
        if self.forward_order is None:
            return [chunk for chunk in range(self.vpp) if self.next_forward[rank][chunk] < self.m]
        done = sum(self.next_forward[rank])
        return [self.forward_order[done][1]] if done < len(self.forward_order) else []

    def _input_arrived(self, rank: int, chunk: int) -> bool:
        stage = self.stage(rank, chunk)
        return stage == 0 or self.arrived(self.forward_done, (self.next_forward[rank][chunk], stage - 1))

    def advance(self, actions: list[Action | None]) -> None:
        """Book this slot's actions; their results are there from the next slot on."""
        for rank, action in enumerate(actions):
            if action is None:
                continue
            item, stage = (action.microbatch, action.chunk), self.stage(rank, action.chunk)
            if action.kind == FORWARD:
                self.next_forward[rank][action.chunk] += 1
                self.waiting_backward[rank].append(item)
                self.forward_done[(action.microbatch, stage)] = self.time + 1
            elif action.kind == BACKWARD:
                self.waiting_backward[rank].remove(item)
                self.deferred[rank].append(item)
                self.backward_done[(action.microbatch, stage)] = self.time + 1
            else:
                self.deferred[rank].remove(item)
        self.time += 1

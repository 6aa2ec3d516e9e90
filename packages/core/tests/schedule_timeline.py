"""Test support: the idealised timeline of a schedule table, for the bubble arithmetic.

Each rank runs its actions in table order, as early as its dependencies allow, with free
communication and given per-chunk costs of a forward, a backward and, where the table splits
backwards (zero bubble), of its weight-gradient half W (B then costs ``backward_cost``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.pipeline.schedule_table import BACKWARD, FORWARD, WEIGHT, Action, ScheduleError, ScheduleTable


@dataclass(frozen=True)
class Slot:
    """When an action runs in the timeline."""

    start: float
    end: float
    action: Action


def slots(table: ScheduleTable, forward_cost: float = 1.0, backward_cost: float = 1.0,
          weight_cost: float = 1.0) -> list[list[Slot]]:
    """Start and end of every action of every rank."""
    cost = {FORWARD: forward_cost, BACKWARD: backward_cost, WEIGHT: weight_cost}
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, stage) -> end time
    timeline: list[list[Slot]] = [[] for _ in range(table.pp)]
    free_at = [0.0] * table.pp
    position = [0] * table.pp
    actions = table.actions
    remaining = sum(len(rank_actions) for rank_actions in actions)
    while remaining:
        progressed = False
        for rank in range(table.pp):
            while position[rank] < len(actions[rank]):
                action = actions[rank][position[rank]]
                stage = table.stage(rank, action.chunk)
                dependency = _dependency(table, action, stage)
                if dependency is not None and dependency not in done:
                    break
                start = max(free_at[rank], done[dependency] if dependency else 0.0)
                end = start + cost[action.kind]
                done[(action.kind, action.microbatch, stage)] = free_at[rank] = end
                timeline[rank].append(Slot(start, end, action))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {rank: str(actions[rank][position[rank]]) for rank in range(table.pp)
                     if position[rank] < len(actions[rank])}
            raise ScheduleError(f"the schedule cannot make progress; waiting actions: {stuck}")
    return timeline


def _dependency(table: ScheduleTable, action: Action, stage: int) -> tuple[str, int, int] | None:
    """The action (elsewhere in the pipeline) whose result this action consumes."""
    if action.kind == WEIGHT:  # its own B, earlier on the same rank
        return None
    if action.kind == FORWARD:
        return (FORWARD, action.microbatch, stage - 1) if stage > 0 else None
    if stage == table.num_stages - 1:  # the loss's backward starts from its own forward
        return (FORWARD, action.microbatch, stage)
    return (BACKWARD, action.microbatch, stage + 1)


def bubble_fraction(table: ScheduleTable, forward_cost: float = 1.0, backward_cost: float = 1.0,
                    weight_cost: float = 1.0) -> float:
    """The share of the makespan a rank sits idle (the same on every rank: all do equal work)."""
    timeline = slots(table, forward_cost, backward_cost, weight_cost)
    makespan = max(slot.end for rank_slots in timeline for slot in rank_slots)
    busy = sum(slot.end - slot.start for slot in timeline[0])
    return 1.0 - busy / makespan


def in_flight(table: ScheduleTable, rank: int) -> int:
    """Most micro-batch chunks whose activations ``rank`` holds at once (forward done, backward
    not yet; where backwards are split, W not yet: W still needs the layers' inputs)."""
    freed_by = WEIGHT if table.splits_backward else BACKWARD
    held = peak = 0
    for action in table.actions[rank]:
        held += 1 if action.kind == FORWARD else -1 if action.kind == freed_by else 0
        peak = max(peak, held)
    return peak


def timeline_text(table: ScheduleTable) -> str:
    """One line per rank of the unit-cost timeline; ``.`` marks an idle slot."""
    timeline = slots(table)
    makespan = max(slot.end for rank_slots in timeline for slot in rank_slots)
    width = max(len(str(action)) for actions in table.actions for action in actions)
    lines = []
    for rank, rank_slots in enumerate(timeline):
        cells, clock = [], 0.0
        for slot in rank_slots:
            cells += ["." * width] * int(slot.start - clock) + [str(slot.action).ljust(width)]
            clock = slot.end
        cells += ["." * width] * int(makespan - clock)
        lines.append(f"rank {rank}: " + " ".join(cells))
    return "\n".join(lines)

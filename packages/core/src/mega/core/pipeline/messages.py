"""Which activations and gradients cross between stages, and when, derived from the schedule table.

Before each step of the table (one action, or a forward-backward pair in the interleaved steady
state) a rank runs one *exchange*: it sends what its previous step produced (activations for the
next virtual stage, input gradients for the previous one) and receives what this step consumes,
as one batch of isend/irecv. So in 1F1B a forward's output travels together with the receive of
the gradient the following backward needs: Megatron's ``send_forward_recv_backward``, derived
here for every schedule instead of written out per loop.

NCCL (and gloo, for one tag) pairs the sends from rank A to rank B with the receives on B from A
in the order they are posted, so data arrives in the right buffer only if both sides post a
pair's messages in the same order. :func:`check_exchanges` proves that for a table, together with
freedom from deadlock, by simulating every rank's exchanges without running any model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mega.core.pipeline.schedule_table import FORWARD, WEIGHT, Action, ScheduleError, ScheduleTable

ACTIVATION = "activation"
GRADIENT = "gradient"


@dataclass(frozen=True)
class Message:
    """One tensor sent from virtual stage ``source`` to ``destination`` for one micro-batch."""

    kind: str  # ACTIVATION (flows forward) or GRADIENT (flows backward)
    microbatch: int
    source: int
    destination: int

    @property
    def send_op(self) -> str:
        return "send_forward" if self.kind == ACTIVATION else "send_backward"

    @property
    def recv_op(self) -> str:
        return "recv_forward" if self.kind == ACTIVATION else "recv_backward"


@dataclass(frozen=True)
class Exchange:
    sends: tuple[Message, ...] = ()
    recvs: tuple[Message, ...] = ()


def consumed(table: ScheduleTable, rank: int, action: Action) -> Message | None:
    """The message ``action`` needs from another stage before it can run."""
    if action.kind == WEIGHT:  # W uses what its B left on this rank
        return None
    stage = table.stage(rank, action.chunk)
    if action.kind == FORWARD:
        return Message(ACTIVATION, action.microbatch, stage - 1, stage) if stage > 0 else None
    if stage == table.num_stages - 1:
        return None  # the last stage starts the backward from its own loss
    return Message(GRADIENT, action.microbatch, stage + 1, stage)


def produced(table: ScheduleTable, rank: int, action: Action) -> Message | None:
    """The message ``action`` sends to another stage once it has run."""
    if action.kind == WEIGHT:
        return None
    stage = table.stage(rank, action.chunk)
    if action.kind == FORWARD:
        last = stage == table.num_stages - 1
        return None if last else Message(ACTIVATION, action.microbatch, stage, stage + 1)
    return Message(GRADIENT, action.microbatch, stage, stage - 1) if stage > 0 else None


def exchanges(table: ScheduleTable, rank: int) -> list[Exchange]:
    """``exchanges[i]`` runs before step ``i`` of ``rank``; one more runs after the last step.

    It sends what step ``i - 1`` produced and receives what step ``i`` consumes. Within an
    exchange activations come before gradients on both sides, so that with pp = 2 (where the
    next and the previous rank are the same peer) both post the pair's messages in one order.
    In a slotted table it receives instead what the other ranks' steps ``i - 1`` sent it.
    """
    if table.slotted:
        return _slotted_exchanges(table, rank)
    steps = table.steps[rank]

    def ordered(messages):
        return tuple(sorted(filter(None, messages), key=lambda m: m.kind != ACTIVATION))

    plan = []
    for i in range(len(steps) + 1):
        sends = [crossing(table, rank, produced(table, rank, action)) for action in steps[i - 1]] if i > 0 else []
        recvs = [crossing(table, rank, consumed(table, rank, action)) for action in steps[i]] if i < len(steps) else []
        plan.append(Exchange(ordered(sends), ordered(recvs)))
    return plan


def crossing(table: ScheduleTable, rank: int, message: Message | None) -> Message | None:
    """``message`` if it crosses to another rank; None if both its stages are on ``rank`` (in a
    V the last rank holds the two middle stages: the schedule hands it over in memory)."""
    if message is None:
        return None
    local = table.rank_and_chunk(message.source)[0] == table.rank_and_chunk(message.destination)[0] == rank
    return None if local else message


def _slotted_exchanges(table: ScheduleTable, rank: int) -> list[Exchange]:
    """Every message travels between the slot that produced it and the next: sender and
    receiver post it in the same exchange, in one order (kind, micro-batch, stages)."""
    slots = len(table.steps[rank])
    if any(len(steps) != slots for steps in table.steps):
        raise ScheduleError("a slotted table needs the same number of steps (slots) on every rank")
    sent: list[list[Message]] = [[] for _ in range(slots + 1)]  # sent[i]: produced in slot i - 1
    received: list[list[Message]] = [[] for _ in range(slots + 1)]
    for other in range(table.pp):
        for slot, step in enumerate(table.steps[other]):
            for action in step:
                message = produced(table, other, action)
                if message is None or table.rank_and_chunk(message.destination)[0] == other:
                    continue
                if other == rank:
                    sent[slot + 1].append(message)
                if table.rank_and_chunk(message.destination)[0] == rank:
                    received[slot + 1].append(message)

    def key(message: Message):
        return message.kind != ACTIVATION, message.microbatch, message.source, message.destination

    return [Exchange(tuple(sorted(sent[i], key=key)), tuple(sorted(received[i], key=key))) for i in range(slots + 1)]


def check_exchanges(table: ScheduleTable) -> None:
    """Simulate all ranks' exchanges; raise :class:`ScheduleError` on a deadlock or on a message
    that a receiver would take in place of another.

    Pessimistic model: an exchange completes only once every send in it met its receive and
    every receive its send (true of NCCL; gloo may complete a send earlier).
    """
    plans = [exchanges(table, rank) for rank in range(table.pp)]
    position = [0] * table.pp
    posted = [False] * table.pp
    # Per (sender rank, receiver rank): messages in the order each side posted them.
    sent: dict[tuple[int, int], list[Message]] = defaultdict(list)
    received: dict[tuple[int, int], list[Message]] = defaultdict(list)
    pending: list[list[tuple[tuple[int, int], int]]] = [[] for _ in range(table.pp)]  # (pair, index)

    def owner(stage: int) -> int:
        return table.rank_and_chunk(stage)[0]

    while any(position[rank] < len(plans[rank]) for rank in range(table.pp)):
        for rank in range(table.pp):
            if position[rank] < len(plans[rank]) and not posted[rank]:
                exchange = plans[rank][position[rank]]
                for message in exchange.sends:
                    pair = (rank, owner(message.destination))
                    pending[rank].append((pair, len(sent[pair])))
                    sent[pair].append(message)
                for message in exchange.recvs:
                    pair = (owner(message.source), rank)
                    pending[rank].append((pair, len(received[pair])))
                    received[pair].append(message)
                posted[rank] = True
        progressed = False
        for rank in range(table.pp):
            if not posted[rank]:
                continue
            matched = all(index < min(len(sent[pair]), len(received[pair])) for pair, index in pending[rank])
            if not matched:
                continue
            for pair, index in pending[rank]:
                if sent[pair][index] != received[pair][index]:
                    raise ScheduleError(
                        f"rank {pair[1]} would receive {sent[pair][index]} from rank {pair[0]} "
                        f"into the buffer of {received[pair][index]}"
                    )
            pending[rank], posted[rank] = [], False
            position[rank] += 1
            progressed = True
        if not progressed:
            waiting = {rank: plans[rank][position[rank]] for rank in range(table.pp) if posted[rank]}
            raise ScheduleError(f"the exchanges deadlock; ranks waiting: {waiting}")

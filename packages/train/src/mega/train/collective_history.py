"""What this rank's collectives were doing: the last N, their group, sizes and sequence numbers,
and the time the rank spent waiting in them.

The record wraps torch.distributed's collective functions for the length of a run (every call
made through ``torch.distributed.<name>``), so the training code needs no change. A collective's
sequence number counts the collectives this rank entered on that process group, so ranks that
agree on everything before a hang show the same numbers, and the rank that is behind shows a
smaller one. Waiting is the time spent inside blocking calls (an ``async_op`` call counts only
its launch): the straggler report subtracts it from the step time to get each rank's own work.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

# The collectives (and point-to-point calls) recorded; a name this torch lacks is skipped. isend and
# irecv stay unwrapped: torch's P2POp accepts only those very functions (batch_isend_irecv records them).
RECORDED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
            "broadcast", "reduce", "gather", "scatter", "barrier", "monitored_barrier", "all_to_all",
            "all_to_all_single", "send", "recv", "batch_isend_irecv",
            "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
HISTORY_LENGTH = 64  # the last collectives a hang report lists


@dataclass
class CollectiveCall:
    op: str
    group: str  # the process group's name, the same on every rank of it
    ranks: list[int]
    sequence: int  # the n-th collective this rank entered on this group
    shapes: list[list[int]]
    dtype: str | None
    started: float  # time.time()
    seconds: float | None = None  # None: still waiting (or an async call's launch not returned)
    failed: bool = False  # it raised (a timeout, a peer's broken connection)

    def describe(self) -> str:
        state = ("WAITING" if self.seconds is None else f"FAILED after {self.seconds:.1f} s" if self.failed
                 else f"{1000 * self.seconds:.1f} ms")
        sizes = ", ".join("x".join(map(str, shape)) or "scalar" for shape in self.shapes) or "-"
        return (f"#{self.sequence:<6d} {self.op:<22s} group {self.group} ranks {self.ranks} "
                f"sizes [{sizes}] {self.dtype or ''} {state}")


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _group_of(signature: inspect.Signature | None, args, kwargs, op: str):
    """The ``group`` argument, given by name or by position."""
    if op == "batch_isend_irecv":
        return getattr(args[0][0], "group", None) if args and args[0] else None
    if "group" in kwargs or signature is None:
        return kwargs.get("group")
    try:
        return signature.bind_partial(*args, **kwargs).arguments.get("group")
    except TypeError:
        return None


class CollectiveHistory:
    def __init__(self, length: int = HISTORY_LENGTH):
        self.calls: deque[CollectiveCall] = deque(maxlen=length)
        self.sequences: dict[str, int] = {}
        self.wait_seconds = 0.0  # since the last reset (the straggler report resets it each interval)
        self._lock = threading.Lock()
        self._inside = threading.local()  # broadcast_object_list calls broadcast: record the outer one
        self._originals: dict[str, object] = {}

    # -- recording -----------------------------------------------------------------------------
    def install(self) -> None:
        for name in RECORDED:
            original = getattr(dist, name, None)
            if original is not None and name not in self._originals:
                self._originals[name] = original
                setattr(dist, name, self._recorded(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _recorded(self, op: str, original):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(original)
        def call(*args, **kwargs):
            if getattr(self._inside, "depth", 0):
                return original(*args, **kwargs)
            entry = self._enter(op, _group_of(signature, args, kwargs, op), _tensors(args, kwargs))
            self._inside.depth = 1
            try:
                return original(*args, **kwargs)
            except BaseException:
                entry.failed = True
                raise
            finally:
                self._inside.depth = 0
                entry.seconds = time.time() - entry.started
                if not kwargs.get("async_op"):
                    with self._lock:
                        self.wait_seconds += entry.seconds
        return call

    def _enter(self, op: str, group, tensors: list[torch.Tensor]) -> CollectiveCall:
        group = group or dist.group.WORLD
        name = getattr(group, "group_name", None) or "default"
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):
            ranks = []
        with self._lock:
            sequence = self.sequences[name] = self.sequences.get(name, 0) + 1
            entry = CollectiveCall(op, name, ranks, sequence, [list(t.shape) for t in tensors],
                                   str(tensors[0].dtype).removeprefix("torch.") if tensors else None, time.time())
            self.calls.append(entry)
        return entry

    def take_wait_seconds(self) -> float:
        with self._lock:
            seconds, self.wait_seconds = self.wait_seconds, 0.0
        return seconds

    # -- reading -------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The record as plain data (for the launcher): the calls, oldest first, and the sequences."""
        with self._lock:
            return {"calls": [asdict(call) for call in self.calls], "sequences": dict(self.sequences)}

    def waiting(self) -> CollectiveCall | None:
        """The collective this rank is inside now, or the last one that failed, if any."""
        with self._lock:
            return next((call for call in reversed(self.calls) if call.seconds is None or call.failed), None)


_history: CollectiveHistory | None = None


def active_history() -> CollectiveHistory | None:
    """The record of the run in this process (None outside a multi-rank run)."""
    return _history


def start_recording() -> CollectiveHistory:
    """A fresh record for a run, wrapping torch.distributed's collectives until :func:`stop_recording`."""
    global _history
    stop_recording()
    _history = CollectiveHistory()
    _history.install()
    return _history


def stop_recording() -> None:
    """Unwrap torch.distributed's functions; the record stays readable for a hang report."""
    if _history is not None:
        _history.uninstall()

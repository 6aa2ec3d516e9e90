"""A timeline of the pipeline schedule, written as a Chrome trace (chrome://tracing, Perfetto).

:class:`PipelineTimeline` listens to the schedule's events and records, on every rank, when each
micro-batch's forward (``F3 c0``: micro-batch 3, model chunk 0) and backward ran (under a
zero-bubble schedule the backward's input-gradient half ``B3 c0`` and its weight-gradient half
``W3 c0``, category ``weight_grad``, separately), when the rank
sent or waited for tensors (``send_forward+recv_backward``: one batched exchange), and the
gradient sync. :meth:`PipelineTimeline.write` gathers all ranks on rank 0, which writes one JSON
file with one track per rank and the gaps between spans as explicit ``idle`` spans. The pipeline
bubble shows up as time spent waiting in receives and as idle time.

Ranks are aligned by wall-clock time (``time.time_ns``), exact on one machine and as good as
the clock synchronisation across machines. On an accelerator each event synchronises the
device first, so spans measure the work rather than its launch (at some cost in overlap).
Spans are kept in memory until written: record a short run, not a whole training job.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from mega.core.plugins import hookimpl


class PipelineTimeline:
    """Per-run listener of the schedule events; ``path`` is where rank 0 writes the trace."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = path
        self.spans: list[dict] = []  # this rank's complete ("X") events, timestamps in µs
        self._starts: dict[tuple, float] = {}
        self._grad_sync_starts: list[float] = []  # a stack: a DDP wrapper may nest its own sync
        self._exchange_start = 0.0
        self._exchange_ops: list[str] = []
        self._exchange_details: list[str] = []
        self._open_transfers = 0
        self._iteration = None  # set by the training loop's on_step_start

    @staticmethod
    def _now() -> float:
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        return time.time_ns() / 1000.0

    def _record(self, name: str, category: str, start: float, **args) -> None:
        end = self._now()
        self.spans.append({
            "name": name, "cat": category, "ph": "X", "ts": start, "dur": end - start,
            "args": {"iteration": self._iteration, **args},
        })

    @hookimpl
    def on_step_start(self, iteration):
        self._iteration = iteration

    def _pass_start(self, kind: str, microbatch: int, chunk: int) -> None:
        self._starts[(kind, microbatch, chunk)] = self._now()

    def _pass_end(self, kind: str, category: str, microbatch: int, chunk: int) -> None:
        start = self._starts.pop((kind, microbatch, chunk))
        self._record(f"{kind}{microbatch} c{chunk}", category, start, microbatch=microbatch, chunk=chunk)

    @hookimpl
    def on_forward_start(self, microbatch, chunk):
        self._pass_start("F", microbatch, chunk)

    @hookimpl
    def on_forward_end(self, microbatch, chunk):
        self._pass_end("F", "forward", microbatch, chunk)

    @hookimpl
    def on_backward_start(self, microbatch, chunk):
        self._pass_start("B", microbatch, chunk)

    @hookimpl
    def on_backward_end(self, microbatch, chunk):
        self._pass_end("B", "backward", microbatch, chunk)

    @hookimpl
    def on_weight_grad_start(self, microbatch, chunk):
        self._pass_start("W", microbatch, chunk)

    @hookimpl
    def on_weight_grad_end(self, microbatch, chunk):
        self._pass_end("W", "weight_grad", microbatch, chunk)

    # The transfers of one exchange start together and are waited for together: one span.
    @hookimpl
    def on_p2p_start(self, op, peer, microbatch):
        if self._open_transfers == 0:
            self._exchange_start = self._now()
            self._exchange_ops, self._exchange_details = [], []
        self._open_transfers += 1
        if op not in self._exchange_ops:
            self._exchange_ops.append(op)
        direction = "to" if op.startswith("send") else "from"
        self._exchange_details.append(f"{op} micro-batch {microbatch} {direction} rank {peer}")

    @hookimpl
    def on_p2p_end(self, op, peer, microbatch):
        self._open_transfers -= 1
        if self._open_transfers == 0:
            self._record("+".join(self._exchange_ops), "p2p", self._exchange_start, ops=self._exchange_details)

    @hookimpl
    def on_grad_sync_start(self):
        self._grad_sync_starts.append(self._now())

    @hookimpl
    def on_grad_sync_end(self):
        self._record("grad_sync", "grad_sync", self._grad_sync_starts.pop())

    @hookimpl
    def on_train_end(self, run):
        self.write()

    def write(self, path: str | os.PathLike | None = None) -> Path | None:
        """Gather every rank's spans on rank 0 and write the trace there (a collective: every
        rank calls it). Returns the path on rank 0, None elsewhere."""
        if path is None and self.path is None:
            raise ValueError("PipelineTimeline.write needs a path (or one given to PipelineTimeline)")
        path = Path(path or self.path)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(self.spans, gathered, dst=0)
            if dist.get_rank() != 0:
                return None
        else:
            gathered = [self.spans]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(chrome_trace(gathered)))
        partial.replace(path)  # a reader never sees half a file
        return path


def chrome_trace(spans_per_rank: list[list[dict]]) -> dict:
    """The trace of all ranks: one process track per rank, time from the first span in µs, and
    ``idle`` spans filling each rank's gaps within every iteration (from the iteration's first
    span on any rank to its last end on any rank). ``otherData`` holds each rank's total time
    per category."""
    everything = [span for spans in spans_per_rank for span in spans]
    origin = min((span["ts"] for span in everything), default=0.0)
    windows: dict[int | None, list[float]] = {}
    for span in everything:
        iteration = span["args"]["iteration"]
        begin, end = windows.get(iteration, (span["ts"], span["ts"] + span["dur"]))
        windows[iteration] = [min(begin, span["ts"]), max(end, span["ts"] + span["dur"])]

    events, totals = [], {}
    for rank, spans in enumerate(spans_per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        timeline = sorted(spans + _idle_spans(spans, windows), key=lambda span: span["ts"])
        per_category: dict[str, float] = defaultdict(float)
        for span in timeline:
            per_category[span["cat"]] += span["dur"]
            events.append({**span, "ts": span["ts"] - origin, "pid": rank, "tid": 0})
        totals[f"rank {rank}"] = dict(per_category)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"time_us_per_category": totals}}


def _idle_spans(spans: list[dict], windows: dict[int | None, list[float]]) -> list[dict]:
    by_iteration: dict[int | None, list[dict]] = defaultdict(list)
    for span in spans:
        by_iteration[span["args"]["iteration"]].append(span)
    idle = []
    for iteration, mine in by_iteration.items():
        clock, window_end = windows[iteration]
        for span in sorted(mine, key=lambda span: span["ts"]) + [{"ts": window_end, "dur": 0.0}]:
            if span["ts"] > clock:
                idle.append({"name": "idle", "cat": "idle", "ph": "X", "ts": clock, "dur": span["ts"] - clock,
                             "args": {"iteration": iteration}})
            clock = max(clock, span["ts"] + span["dur"])
    return idle


def timeline_callback(run_config) -> PipelineTimeline | None:
    """The ``pipeline-timeline`` callback factory: a timeline when the run sets
    ``logging.pipeline_timeline`` (``mega train --pipeline-timeline PATH``), else None."""
    path = run_config.logging.pipeline_timeline
    return PipelineTimeline(path) if path else None

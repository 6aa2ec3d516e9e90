"""``ServerMetrics``: what ``GET /metrics`` reports, in Prometheus' text exposition format.

Requests by route and status and their latencies (recorded by the server's middleware), the
time sequences wait in the queue before the engine takes them, the batch occupancy of each
engine step (running sequences / ``--max-batch-size``), generated tokens, and the sequences
running and queued now. Histograms are cumulative, with ``_bucket``, ``_sum`` and ``_count``.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OCCUPANCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, cumulative = [], 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        suffix = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{suffix} {self.total}", f"{name}_count{suffix} {self.count}"]
        return out


class ServerMetrics:
    """Thread-safe: the event loop records requests, the engine's thread steps and queue times."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = {}
        self.queue_time = Histogram(LATENCY_BUCKETS_S)
        self.occupancy = Histogram(OCCUPANCY_BUCKETS)
        self.generated_tokens = 0
        self.steps = 0
        self.running = 0
        self.queued = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, found there (not prefilled)
        self.draft_tokens = 0  # speculative decoding: tokens drafted
        self.accepted_tokens = 0  # of those, accepted by the target
        self.verified_tokens = 0  # tokens speculative steps yielded (accepted, and one of the target's per row)
        self.verify_rows = 0  # sequences verified, summed over speculative steps

    def request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS_S)).observe(seconds)

    def admitted(self, waited_s: float) -> None:
        with self._lock:
            self.queue_time.observe(waited_s)

    def generated(self, tokens: int) -> None:
        with self._lock:
            self.generated_tokens += tokens

    def step(self, running: int, capacity: int, queued: int, tokens: int) -> None:
        with self._lock:
            self.steps += 1
            self.running, self.queued = running, queued
            self.generated_tokens += tokens
            self.occupancy.observe(running / capacity if capacity else 0.0)

    def prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        """The prefix cache's running totals (the allocator counts them)."""
        with self._lock:
            self.prefix_queried_tokens, self.prefix_hit_tokens = queried_tokens, hit_tokens

    def speculated(self, drafted: int, accepted: int, tokens: int, rows: int) -> None:
        """One speculative step: ``drafted`` draft tokens, ``accepted`` of them, ``tokens`` yielded
        over ``rows`` sequences."""
        with self._lock:
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            self.verified_tokens += tokens
            self.verify_rows += rows

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence gets per speculative step (1 + accepted drafts), on average."""
        return self.verified_tokens / self.verify_rows if self.verify_rows else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def render(self, in_flight: int | None = None) -> str:
        """The text of ``/metrics``. ``in_flight``: the sequences the server holds unfinished (its
        admission count); the running and queued gauges never exceed it, so they read 0 on an
        idle server whatever the engine's last step saw."""
        with self._lock:
            running, queued = self.running, self.queued
            if in_flight is not None:
                running = min(running, in_flight)
                queued = min(queued, in_flight - running)
            lines = ["# HELP mega_requests_total HTTP requests by route and status.",
                     "# TYPE mega_requests_total counter"]
            lines += [f'mega_requests_total{{route="{route}",status="{status}"}} {count}'
                      for (route, status), count in sorted(self.requests.items())]
            lines += ["# HELP mega_request_latency_seconds Time from a request's arrival to its whole answer.",
                      "# TYPE mega_request_latency_seconds histogram"]
            for route, histogram in sorted(self.latency.items()):
                lines += histogram.lines("mega_request_latency_seconds", f'route="{route}"')
            lines += ["# HELP mega_queue_time_seconds Time a sequence waits before the engine takes it.",
                      "# TYPE mega_queue_time_seconds histogram", *self.queue_time.lines("mega_queue_time_seconds"),
                      "# HELP mega_batch_occupancy Running sequences over --max-batch-size, per engine step.",
                      "# TYPE mega_batch_occupancy histogram", *self.occupancy.lines("mega_batch_occupancy"),
                      "# HELP mega_generated_tokens_total Tokens generated.",
                      "# TYPE mega_generated_tokens_total counter", f"mega_generated_tokens_total {self.generated_tokens}",
                      "# HELP mega_engine_steps_total Engine steps (forwards of the running batch).",
                      "# TYPE mega_engine_steps_total counter", f"mega_engine_steps_total {self.steps}",
                      "# HELP mega_running_sequences Sequences in the running batch.",
                      "# TYPE mega_running_sequences gauge", f"mega_running_sequences {running}",
                      "# HELP mega_queued_sequences Sequences waiting for the engine.",
                      "# TYPE mega_queued_sequences gauge", f"mega_queued_sequences {queued}",
                      "# HELP mega_prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
                      "# TYPE mega_prefix_cache_queries_total counter",
                      f"mega_prefix_cache_queries_total {self.prefix_queried_tokens}",
                      "# HELP mega_prefix_cache_hits_total Prompt tokens found in the prefix cache (not prefilled).",
                      "# TYPE mega_prefix_cache_hits_total counter", f"mega_prefix_cache_hits_total {self.prefix_hit_tokens}",
                      "# HELP mega_prefix_cache_hit_rate Hits over queries since the start.",
                      "# TYPE mega_prefix_cache_hit_rate gauge",
                      f"mega_prefix_cache_hit_rate {self.prefix_cache_hit_rate:.6f}",
                      "# HELP mega_spec_decode_draft_tokens_total Speculative draft tokens proposed.",
                      "# TYPE mega_spec_decode_draft_tokens_total counter",
                      f"mega_spec_decode_draft_tokens_total {self.draft_tokens}",
                      "# HELP mega_spec_decode_accepted_tokens_total Speculative draft tokens the target accepted.",
                      "# TYPE mega_spec_decode_accepted_tokens_total counter",
                      f"mega_spec_decode_accepted_tokens_total {self.accepted_tokens}",
                      "# HELP mega_spec_decode_acceptance_rate Accepted over drafted tokens since the start.",
                      "# TYPE mega_spec_decode_acceptance_rate gauge",
                      f"mega_spec_decode_acceptance_rate {self.acceptance_rate:.6f}",
                      "# HELP mega_spec_decode_tokens_per_step Tokens per sequence per speculative step (1 + accepted).",
                      "# TYPE mega_spec_decode_tokens_per_step gauge",
                      f"mega_spec_decode_tokens_per_step {self.tokens_per_step:.6f}"]
        return "\n".join(lines) + "\n"

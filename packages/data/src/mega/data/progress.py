"""A one-line progress display for long runs: documents, tokens, tokens/s, percent and ETA.

It draws only on a terminal (``stream.isatty()``), at most a few times a second, so output
captured in logs or CI stays clean; the caller prints a summary at the end either way.
"""

from __future__ import annotations

import sys
import time


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total_bytes: int | None = None, enabled: bool | None = None, stream=None, interval: float = 0.25):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total_bytes = total_bytes or None
        self.interval = interval
        self.start = time.monotonic()
        self._last_draw = 0.0
        self.documents = 0
        self.tokens = 0
        self.bytes_done = 0

    def update(self, documents: int = 0, tokens: int = 0, bytes_done: int | None = None) -> None:
        self.documents += documents
        self.tokens += tokens
        if bytes_done is not None:
            self.bytes_done = bytes_done
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= self.interval:
            self._last_draw = now
            self.stream.write("\r" + self.line(now) + "\x1b[K")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = max((time.monotonic() if now is None else now) - self.start, 1e-9)
        parts = [f"{self.documents:,} docs", f"{_count(self.tokens)} tokens", f"{_count(self.tokens / elapsed)} tok/s"]
        if self.total_bytes and self.bytes_done:
            fraction = min(self.bytes_done / self.total_bytes, 1.0)
            parts.append(f"{100 * fraction:.1f}%")
            parts.append(f"ETA {_duration(elapsed * (1 - fraction) / max(fraction, 1e-9))}")
        parts.append(_duration(elapsed))
        return " | ".join(parts)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

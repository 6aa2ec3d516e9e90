"""One progress line while a conversion writes: layer, bytes, rate and time left.

It draws only on a terminal (or when forced), at most a few times a second, so logs stay clean.
"""

from __future__ import annotations

import re
import sys
import time

LAYER = re.compile(r"layers\.(\d+)\.")


class Progress:
    def __init__(self, total_bytes: int, num_layers: int, enabled: bool | None = None, stream=None,
                 interval: float = 0.2):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total_bytes, self.num_layers, self.interval = max(total_bytes, 1), num_layers, interval
        self.start = time.monotonic()
        self.bytes_done = 0
        self.where = ""
        self._last_draw = 0.0

    def advance(self, name: str, nbytes: int) -> None:
        """One tensor (``name``, ``nbytes``) was written."""
        self.bytes_done += nbytes
        match = LAYER.search(name)
        self.where = f"layer {int(match.group(1)) + 1}/{self.num_layers}" if match else name
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= self.interval:
            self._last_draw = now
            self.stream.write("\r" + self.line(now) + "\x1b[K")
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        fraction = min(self.bytes_done / self.total_bytes, 1.0)
        left = elapsed * (1 - fraction) / max(fraction, 1e-9)
        return (f"{self.where} | {self.bytes_done / 2**30:.2f}/{self.total_bytes / 2**30:.2f} GiB "
                f"{100 * fraction:.0f}% | {self.bytes_done / 2**20 / elapsed:.0f} MiB/s | "
                f"{elapsed:.0f} s, ~{left:.0f} s left")

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

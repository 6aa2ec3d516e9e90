"""Memory a large request body used goes back to the operating system once it is freed.

glibc's ``malloc`` raises its mmap threshold to the size of the largest block freed (up to 32
MiB), so after the first megabyte-sized body the next ones come from the heap, and when several
arrive at once the heap keeps their pages after they are freed: resident memory that never
comes back (a few ~4 MB prompts at once left a server ~12% larger). ``malloc_trim(0)`` hands
the free pages back; :func:`trim_soon` asks for it at most once a second, a moment after a
large body was handled. A no-op where the C library has no ``malloc_trim`` (not glibc).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

LARGE_BODY_BYTES = 1 << 20  # a body this large is worth giving its pages back for
TRIM_DELAY_S = 1.0


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None


_trim = _malloc_trim()
_pending: dict[asyncio.AbstractEventLoop, asyncio.TimerHandle] = {}


def trim_soon() -> None:
    """On the event loop: free heap pages go back to the system within :data:`TRIM_DELAY_S`
    (on a worker thread: trimming walks the heap)."""
    if _trim is None:
        return
    loop = asyncio.get_running_loop()
    if loop in _pending:
        return

    def trim() -> None:
        del _pending[loop]
        loop.run_in_executor(None, _trim, 0)

    _pending[loop] = loop.call_later(TRIM_DELAY_S, trim)

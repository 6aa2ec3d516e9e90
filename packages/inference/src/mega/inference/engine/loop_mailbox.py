"""``post``: calls from the engine's thread to the event loop, many per wake-up.

The engine thread hands every streamed token, result and error to the event loop.
``loop.call_soon_threadsafe`` per call would write to the loop's wake-up pipe each time: a
system call on the engine thread per generated token, and a wake-up of the loop per token. On
a GPU that work is the host's share of each decode step; with 32 streams it cost about as much
as the step itself. So calls for a loop go into one mailbox, and only the first call into an
empty mailbox wakes the loop; the loop then runs everything in it, in the order posted.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable


class Mailbox:
    """The calls posted for one event loop (:func:`mailbox_for`), run there in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # a mailbox must not keep its loop (its key) alive
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable, tuple]] = []
        self._wake_pending = False  # the loop has been woken and has not emptied the mailbox yet

    def post(self, callback: Callable, *args) -> None:
        """Run ``callback(*args)`` on the loop soon, after every call posted before it. A closed
        (or gone) loop drops it: the server is shutting down."""
        with self._lock:
            self._calls.append((callback, args))
            if self._wake_pending:
                return
            self._wake_pending = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._deliver, loop)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._calls.clear()
                self._wake_pending = False

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            self._wake_pending = False
        for callback, args in calls:
            try:
                callback(*args)
            except Exception as error:  # as the loop treats a failing callback: reported, the others still run
                loop.call_exception_handler({"message": f"exception in {callback!r}", "exception": error})


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """``loop``'s one mailbox (a job keeps it: no lookup per token)."""
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = Mailbox(loop)
        return box


def post(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
    """``mailbox_for(loop).post(callback, *args)``."""
    mailbox_for(loop).post(callback, *args)

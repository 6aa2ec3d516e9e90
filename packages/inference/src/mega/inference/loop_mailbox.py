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


class _Mailbox:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[tuple[Callable, tuple]] = []
        self.wake_pending = False  # the loop has been woken and has not emptied the mailbox yet


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _Mailbox()
        return box


def post(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
    """Run ``callback(*args)`` on ``loop`` soon, after every call posted before it. A closed
    loop (the server is shutting down) drops it."""
    box = _mailbox(loop)
    with box.lock:
        box.calls.append((callback, args))
        if box.wake_pending:
            return
        box.wake_pending = True
    try:
        loop.call_soon_threadsafe(_deliver, loop, box)
    except RuntimeError:  # the loop is closed
        with box.lock:
            box.calls.clear()
            box.wake_pending = False


def _deliver(loop: asyncio.AbstractEventLoop, box: _Mailbox) -> None:
    with box.lock:
        calls, box.calls = box.calls, []
        box.wake_pending = False
    for callback, args in calls:
        try:
            callback(*args)
        except Exception as error:  # as the loop treats a failing callback: reported, the others still run
            loop.call_exception_handler({"message": f"exception in {callback!r}", "exception": error})

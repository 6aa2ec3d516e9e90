"""``mega serve``'s whole ``main`` running in the test's process: its app is handed to the test
instead of a socket (``uvicorn.run`` waits until the test ends, so main's worker keeps running).
Test modules import this file by putting the tests' directory on ``sys.path``."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def serving(argv: list[str]) -> Iterator[Callable]:
    """Yields ``send(method, path, json=None)`` answering through ``mega serve argv``'s app; on
    leaving, ``main`` returns and must have returned 0."""
    import httpx
    import uvicorn

    from mega.inference.cli import serve as serve_cli

    apps, done, outcome = [], threading.Event(), []

    def hold_the_app(app, **_):
        apps.append(app)
        done.wait()

    original, uvicorn.run = uvicorn.run, hold_the_app
    try:
        thread = threading.Thread(target=lambda: outcome.append(serve_cli.main(argv)), daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not apps:
            assert thread.is_alive() and time.monotonic() < deadline, f"mega serve did not start: {outcome}"
            time.sleep(0.05)
    finally:
        uvicorn.run = original

    def send(method: str, path: str, json: dict | None = None) -> httpx.Response:
        async def request():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(apps[0]), base_url="http://mega") as client:
                return await client.request(method, path, json=json, timeout=60)
        return asyncio.run(request())

    send.app = apps[0]  # for clients of their own (httpx.ASGITransport)
    try:
        yield send
    finally:
        done.set()
        thread.join(timeout=30)
    assert outcome == [0]

"""The engine thread's calls reach the event loop in order, many per wake-up (CPU, no model)."""

from __future__ import annotations

import asyncio
import threading

from mega.inference.engine.loop_mailbox import post


def test_calls_from_another_thread_run_on_the_loop_in_order_with_fewer_wake_ups():
    received: list[int] = []
    wake_ups = 0

    async def main() -> None:
        nonlocal wake_ups
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal wake_ups
            wake_ups += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        all_posted = threading.Event()

        def engine_thread() -> None:
            for step in range(50):
                for row in range(32):  # one step's tokens, as the decode step hands them out
                    post(loop, received.append, step * 32 + row)
            all_posted.set()

        thread = threading.Thread(target=engine_thread)
        thread.start()
        await asyncio.get_running_loop().run_in_executor(None, all_posted.wait)
        thread.join()
        while len(received) < 50 * 32:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert received == list(range(50 * 32))
    assert 1 <= wake_ups < 50 * 32


def test_a_failing_call_is_reported_and_the_others_still_run():
    received, reported = [], []

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
        post(loop, received.append, 1)
        post(loop, fail)
        post(loop, received.append, 2)
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert received == [1, 2]
    assert [str(error) for error in reported] == ["boom"]


def test_a_closed_loop_drops_the_call_and_a_new_loop_still_gets_its_own():
    closed = asyncio.new_event_loop()
    closed.close()
    post(closed, print, "never")  # no error: the server is shutting down
    post(closed, print, "never again")  # the mailbox did not stay marked as waking a dead loop

    received = []

    async def main() -> None:
        post(asyncio.get_running_loop(), received.append, "delivered")
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert received == ["delivered"]

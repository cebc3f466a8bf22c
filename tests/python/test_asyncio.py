"""``await queue.dequeue_async()`` (issue 45 item 6), in an event loop with several
queues whose writers are other real processes: one waiter thread for the loop (not one
per queue), gone once nothing waits; the loop runs while readers wait; timeouts; each
writer's messages in order; a writer's shutdown and a writer's death as from
``dequeue``; a cancelled wait loses no message."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

from _processes.harness import STEP, wait_for
from _processes.named_children import named_writer
from shmq import MessageQueue, PeerDiedError, QueueShutDownError

WAITER = "shmq-asyncio-waiter"


def _waiters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WAITER]


def _open_writers(children, n: int, messages: int, how: str = "shutdown"):
    """``n`` writer processes of named queues, each to send ``messages`` messages
    ``(i, j)`` once ``go`` is set and to end as ``how`` says once ``end`` is set; their
    readers here, ready."""
    out, go, end = children.queue(), children.event(), children.event()
    names = [f"aio {os.getpid()}-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
    procs = [
        children.start(named_writer, out, name, go, [(i, j) for j in range(messages)], end, how)
        for i, name in enumerate(names)
    ]
    for _ in names:
        children.expect(out, "ready")
    readers = [MessageQueue.open(name, 0) for name in names]
    for r in readers:
        r.wait_until_ready(timeout=STEP)
    return readers, procs, out, go, end


def test_one_loop_waits_for_several_writers_with_one_thread(children) -> None:
    readers, _, out, go, end = _open_writers(children, 3, 20)
    ticks = 0

    async def ticker() -> None:
        # Runs while every reader waits: the waits do not block the loop. It lets the
        # writers send only after it has run, so a dequeue_async that blocked the loop
        # would never see a message.
        nonlocal ticks
        while ticks < 50:
            ticks += 1
            await asyncio.sleep(0)
        go.set()

    async def drain(r: MessageQueue) -> list:
        got = []
        while True:
            try:
                got.append(await r.dequeue_async(timeout=STEP))
            except QueueShutDownError:
                return got

    async def main() -> list:
        # Nothing sent yet: every wait times out, all of them in one waiter thread.
        waits = [asyncio.ensure_future(r.dequeue_async(timeout=0.2)) for r in readers]
        await asyncio.sleep(0)
        assert len(_waiters()) == 1
        for w in await asyncio.gather(*waits, return_exceptions=True):
            assert isinstance(w, TimeoutError) and "within 0.2 s" in str(w), w
        drains = [asyncio.ensure_future(drain(r)) for r in readers]
        end.set()  # each writer shuts its queue down once it has sent everything
        await ticker()
        assert len(_waiters()) <= 1
        return await asyncio.gather(*drains)

    results = asyncio.run(main())
    assert results == [[(i, j) for j in range(20)] for i in range(3)]
    for _ in readers:
        children.expect(out, "sent")
    children.join()
    wait_for(lambda: not _waiters(), what="the waiter thread to exit with its loop's last wait")


def test_a_writer_that_dies_is_reported_after_its_messages(children) -> None:
    readers, procs, out, go, end = _open_writers(children, 2, 3, how="kill")

    async def main() -> tuple:
        go.set()
        end.set()
        first = [await readers[0].dequeue_async(timeout=STEP) for _ in range(3)]
        with pytest.raises(PeerDiedError, match=f"pid {procs[0].pid}"):
            await readers[0].dequeue_async(timeout=STEP)
        second = [await readers[1].dequeue_async(timeout=STEP) for _ in range(3)]
        return first, second

    first, second = asyncio.run(main())
    assert first == [(0, j) for j in range(3)] and second == [(1, j) for j in range(3)]


def test_a_cancelled_wait_loses_no_message_and_shutdown_cancels(children) -> None:
    readers, _, out, go, end = _open_writers(children, 1, 2)
    (r,) = readers

    async def main() -> list:
        waiting = asyncio.ensure_future(r.dequeue_async())
        await asyncio.sleep(0)
        assert len(_waiters()) == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        go.set()
        got = [await r.dequeue_async(timeout=STEP) for _ in range(2)]
        # The reader's own shutdown ends a wait in progress, as it ends dequeue's.
        pending = asyncio.ensure_future(r.dequeue_async(timeout=STEP))
        await asyncio.sleep(0)
        r.shutdown()
        with pytest.raises(RuntimeError, match="cancelled"):
            await pending
        return got

    assert asyncio.run(main()) == [(0, 0), (0, 1)]
    end.set()
    children.join()
    wait_for(lambda: not _waiters(), what="the waiter thread to exit")


def test_the_writer_cannot_dequeue_async() -> None:
    w = MessageQueue(1, 1)
    try:
        with pytest.raises(RuntimeError, match="only readers can dequeue_async"):
            asyncio.run(w.dequeue_async())
    finally:
        w.shutdown()


def test_a_remote_reader_dequeues_async_through_the_executor() -> None:
    writer = MessageQueue(1, 0, connect_ip="127.0.0.1")
    try:
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        ready = threading.Thread(target=writer.wait_until_ready, args=(STEP,))
        ready.start()
        reader.wait_until_ready(timeout=STEP)
        ready.join()

        async def main() -> object:
            with pytest.raises(TimeoutError):
                await reader.dequeue_async(timeout=0.1)
            writer.enqueue({"over": "tcp"})
            return await reader.dequeue_async(timeout=STEP)

        assert asyncio.run(main()) == {"over": "tcp"}
    finally:
        writer.shutdown()

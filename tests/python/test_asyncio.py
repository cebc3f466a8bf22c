"""``await queue.dequeue_async()`` (issue 45 item 6), in an event loop with several
queues whose writers are other real processes: one waiter thread for the loop (not one
per queue), gone once nothing waits; the loop runs while readers wait; timeouts; each
writer's messages in order; a writer's shutdown and a writer's death as from
``dequeue``; a cancelled wait loses no message.

Issue 54 (items 6, 7): a cancelled or timed-out wait, local or remote, gives up its claim
on the next message (the next wait gets it; asyncio.run returns); a thread blocked in
``dequeue`` never holds up another thread's timeout, nor the event loop; one loop awaits
any number of queues (more than one ``futex_waitv`` takes)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from typing import Any, Callable

import pytest

from _processes.harness import STEP, blocked_in_queue, wait_for
from _processes.named_children import (
    cancelling_async_reader,
    many_writers,
    named_writer,
    remote_numbers_writer,
)
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


# How long a call that must return about at once (a timeout of a second or less, a wait
# for a message already sent) may take here before the test calls it stuck: generous, so
# that a loaded machine never fails it; the calls it bounds hang without end when broken.
BOUND = 10.0


def _one_reader(children, kind: str, n: int) -> tuple[MessageQueue, Any, Any]:
    """A reader here (``kind``: ``"local"`` through shared memory, ``"remote"`` over TCP)
    of a writer process that sends ``0 .. n-1`` once ``go`` is set and ends once ``end``
    is set; ``(reader, go, end)``."""
    out, go, end = children.queue(), children.event(), children.event()
    if kind == "local":
        name = f"aio {os.getpid()}-{uuid.uuid4().hex[:8]}"
        children.start(named_writer, out, name, go, list(range(n)), end, "shutdown")
        children.expect(out, "ready")
        reader = MessageQueue.open(name, 0)
    else:
        children.start(remote_numbers_writer, out, go, n, end)
        _, handle, _ = children.expect(out, "handle")
        reader = MessageQueue.create_from_handle(handle, 0)
    reader.wait_until_ready(timeout=STEP)
    return reader, go, end


def _bounded(call: Callable[[], Any], what: str) -> Any:
    """``call()`` in a thread of its own, which must end within ``BOUND``: its value (or
    its exception, raised here)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND)
    assert not t.is_alive(), f"{what} did not return within {BOUND} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _blocked_in_dequeue(reader: MessageQueue, kind: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread blocked in ``reader.dequeue()`` (no timeout), and where its result goes."""
    got: dict[str, Any] = {}

    def run() -> None:
        try:
            got["value"] = reader.dequeue()
        except BaseException as e:
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if kind == "local":
        assert reader.buffer is not None
        wait_for(lambda: blocked_in_queue(reader.buffer.name, 0), what="the thread to block in dequeue")
    else:
        # Inside MessageQueue.dequeue (its one call is the core's blocking dequeue).
        wait_for(
            lambda: (f := sys._current_frames().get(t.ident or 0)) is not None and f.f_code.co_name == "dequeue",
            what="the thread to block in dequeue",
        )
    return t, got


def test_a_cancelled_remote_wait_leaves_its_message_for_the_next(children) -> None:
    out, go, end = children.queue(), children.event(), children.event()
    children.start(remote_numbers_writer, out, go, 3, end)
    _, handle, _ = children.expect(out, "handle")
    # The reader in a process of its own: where a cancelled wait wedges its loop, that
    # process hangs, not this one.
    children.start(cancelling_async_reader, out, handle, go)
    # Two processes report on one queue: the reader's "got" may come before the
    # writer's "sent" (each process's feeder thread flushes on its own).
    reports = dict(children.receive(out, timeout=STEP) for _ in range(2))
    assert sorted(reports) == ["got", "sent"], reports
    assert reports["got"] == [0, 1, 2]
    end.set()
    children.join()


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_a_thread_blocked_in_dequeue_does_not_hold_up_another_threads_timeout(children, kind: str) -> None:
    reader, go, end = _one_reader(children, kind, 2)
    first, got = _blocked_in_dequeue(reader, kind)
    try:
        with pytest.raises(TimeoutError):
            _bounded(lambda: reader.dequeue(timeout=1), "a second thread's dequeue(timeout=1)")
    finally:
        go.set()
        first.join(BOUND)
    assert got == {"value": 0}
    assert reader.dequeue(timeout=STEP) == 1
    end.set()
    children.join()


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_a_thread_blocked_in_dequeue_does_not_block_the_loop(children, kind: str) -> None:
    reader, go, end = _one_reader(children, kind, 2)
    first, got = _blocked_in_dequeue(reader, kind)

    async def main() -> Any:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        with pytest.raises(TimeoutError):
            await reader.dequeue_async(timeout=0.3)
        seen = ticks
        go.set()
        # One message each: the thread's wait and this one.
        message = await reader.dequeue_async(timeout=STEP)
        tick.cancel()
        assert seen > 0  # the loop ran while the wait waited
        return message

    try:
        message = _bounded(lambda: asyncio.run(main()), "asyncio.run(...) beside a thread blocked in dequeue")
    finally:
        go.set()
        first.join(BOUND)
    assert sorted([got["value"], message]) == [0, 1]
    end.set()
    children.join()


def test_a_loop_awaits_more_queues_than_one_sleep_can_watch(children) -> None:
    """futex_waitv takes at most 128 words; 130 queues awaited at once are all watched:
    a message on any of them ends its wait at once, the last registered included."""
    n = 130
    out, cmds = children.queue(), children.queue()
    children.start(many_writers, out, n, cmds)
    _, handles = children.expect(out, "handles")
    readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
    for r in readers:
        r.wait_until_ready(timeout=STEP)

    async def main() -> list[Any]:
        pending = {i: asyncio.ensure_future(r.dequeue_async()) for i, r in enumerate(readers)}
        await asyncio.sleep(0)
        got = []
        for i in (n - 1, 0, n // 2, n - 2):
            cmds.put((i, f"to {i}"))
            done, _ = await asyncio.wait([pending[i]], timeout=BOUND)
            assert done, f"queue {i} got its message only when its wait ended"
            got.append(pending.pop(i).result())
            assert not any(t.done() for t in pending.values())
        for t in pending.values():
            t.cancel()
        await asyncio.gather(*pending.values(), return_exceptions=True)
        return got

    try:
        assert asyncio.run(main()) == ["to 129", "to 0", "to 65", "to 128"]
    finally:
        cmds.put(None)
    children.join()
    wait_for(lambda: not _waiters(), what="the waiter threads to exit")

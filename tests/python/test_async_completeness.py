"""Async completeness, Python side (issue 59 item 3), in real processes: a ``Gather``
shut down by a ``WorkerMonitor`` (a worker's failure wakes the scheduler's wait for
results), by another thread while a coroutine awaits it, and closed (its writers go on
without it); ``MessageQueue.enqueue_async`` that leaves the loop running while the ring is
full, sends nothing when cancelled or timed out, and keeps the order; ``WorkerProcesses``'
``wait_until_ready_async`` / ``join_async`` with the loop running meanwhile."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import numpy as np
import pytest

from _processes.async_children import filling_writer, gated_worker, reader_on_go, results_worker
from _processes.harness import STEP
from shmq import Gather, MessageQueue, WorkerDiedError, WorkerProcesses


def _name(what: str) -> str:
    return f"{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class _Ticker:
    """A coroutine that counts its turns: proof that the loop runs while another
    coroutine waits."""

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.001)

    async def turns(self, n: int) -> None:
        """Return once the ticker has had ``n`` more turns."""
        start = self.ticks
        while self.ticks < start + n:
            await asyncio.sleep(0.001)


# ---------------------------------------------------------------------------------
# Gather.shutdown / close


def test_a_monitor_shuts_a_gather_down_and_wakes_the_wait_for_results() -> None:
    steps = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=4)
    with WorkerProcesses(results_worker, 2, args=(steps.export_handle(),)) as workers:
        handles = workers.wait_until_ready(timeout=STEP)
        gather = Gather([MessageQueue.create_from_handle(h, 0) for h in handles])
        steps.wait_until_ready(timeout=STEP)
        gather.wait_until_ready(timeout=STEP)
        with pytest.raises(WorkerDiedError) as info:
            # The Gather first: it is cancelled before the steps' end lets worker 0 end
            # its queue too.
            with workers.monitor(gather, steps):
                steps.enqueue({"fail": 1}, timeout=STEP)
                gather.recv(timeout=STEP)  # worker 0 sends nothing: only the monitor ends this
        assert info.value.name == "Worker_1" and info.value.exitcode == 3
        cause = info.value.__cause__
        assert type(cause) is RuntimeError and str(cause) == "cancelled", repr(cause)
        assert gather.shutting_down
        with pytest.raises(RuntimeError, match="^cancelled$"):
            gather.recv(timeout=0)
        gather.close()
        gather.close()  # idempotent
    steps.shutdown()


def test_shutdown_from_another_thread_wakes_recv_async_and_close_lets_the_writer_go_on(children) -> None:
    out, go = children.queue(), children.event()
    name = _name("results")
    writer = children.start(filling_writer, out, name, go, 10)
    children.expect(out, "ready")
    gather = Gather.open([name])
    gather.wait_until_ready(timeout=STEP)

    async def main() -> BaseException:
        ticker = _Ticker()
        tick = asyncio.create_task(ticker.run())
        task = asyncio.create_task(gather.recv_async(timeout=STEP))
        await ticker.turns(10)
        assert not task.done(), "recv_async returned with nothing sent"
        threading.Thread(target=gather.shutdown).start()
        try:
            await task
        except BaseException as e:  # noqa: BLE001 - the error is what is checked
            return e
        finally:
            tick.cancel()
        raise AssertionError("recv_async returned after shutdown()")

    error = asyncio.run(main())
    assert type(error) is RuntimeError and str(error) == "cancelled", repr(error)

    async def again() -> None:
        await gather.recv_async(timeout=0)

    with pytest.raises(RuntimeError, match="^cancelled$"):
        asyncio.run(again())
    # Closed, its reader leaves the queue: the writer sends 10 messages into a ring of 2
    # that nobody reads, going on without it (it would wait, and time out, for a reader
    # still there).
    gather.close()
    go.set()
    assert children.expect(out, "sent") == ("sent", 10)
    writer.join(STEP)
    assert writer.exitcode == 0


# ---------------------------------------------------------------------------------
# MessageQueue.enqueue_async


def test_enqueue_async_waits_for_room_without_blocking_the_loop_and_cancels_cleanly(children) -> None:
    name = _name("steps")
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name=name)
    out, go = children.queue(), children.event()
    reader = children.start(reader_on_go, out, mq.export_handle(), go)
    children.expect(out, "ready")
    mq.wait_until_ready(timeout=STEP)
    large = bytes(range(256)) * 1024  # 256 KiB: larger than a chunk (the overflow socket)
    array = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: through the tensor arena

    async def main() -> None:
        ticker = _Ticker()
        tick = asyncio.create_task(ticker.run())
        try:
            await mq.enqueue_async(0, timeout=STEP)
            await mq.enqueue_async(1, timeout=STEP)  # the ring (2 chunks) is full now
            # Cancelled while waiting for room: none of these is ever sent, in part or whole.
            for lost in ("lost", large, array):
                task = asyncio.create_task(mq.enqueue_async(lost, timeout=STEP))
                await ticker.turns(10)  # the loop runs while it waits
                assert not task.done(), "enqueue_async returned with the ring full"
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(mq.enqueue_async("lost too"), 0.05)
            with pytest.raises(TimeoutError, match=f"no room in queue '{name}'"):
                await mq.enqueue_async("late", timeout=0.05)
            go.set()  # the reader reads: room again
            await mq.enqueue_async(2, timeout=STEP)
            await mq.enqueue_async(large, timeout=STEP)
            await mq.enqueue_async(array, timeout=STEP)
            await mq.enqueue_async(None, timeout=STEP)
        finally:
            tick.cancel()

    asyncio.run(main())
    got = children.expect(out, "got")[1]
    assert got[:4] == [0, 1, 2, large], "the cancelled and timed-out sends left nothing"
    assert len(got) == 5 and np.array_equal(got[4], array)
    reader.join(STEP)
    assert reader.exitcode == 0
    mq.shutdown()


def test_enqueue_async_on_a_reader_is_refused() -> None:
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    with pytest.raises(RuntimeError, match="only the writer can enqueue_async"):
        asyncio.run(reader.enqueue_async(1))
    mq.shutdown()


# ---------------------------------------------------------------------------------
# WorkerProcesses.wait_until_ready_async / join_async


def test_workers_wait_until_ready_async_and_join_async_leave_the_loop_running(tmp_path) -> None:
    with WorkerProcesses(gated_worker, 2, args=(str(tmp_path), [0, 0])) as workers:

        async def main() -> tuple[list, dict]:
            ticker = _Ticker()
            tick = asyncio.create_task(ticker.run())
            try:
                # A wait given up leaves the group as it was.
                task = asyncio.create_task(workers.wait_until_ready_async(timeout=STEP))
                await ticker.turns(10)
                assert not task.done()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert not workers.closed
                task = asyncio.create_task(workers.wait_until_ready_async(timeout=STEP))
                await ticker.turns(10)  # the workers wait for the gate: so does the task
                assert not task.done()
                (tmp_path / "ready").touch()
                infos = await task
                joined = asyncio.create_task(workers.join_async(timeout=STEP))
                await ticker.turns(10)
                assert not joined.done(), "join_async returned with the workers running"
                (tmp_path / "exit").touch()
                return infos, await joined
            finally:
                tick.cancel()

        infos, codes = asyncio.run(main())
        assert infos == [0, 10]
        assert codes == {"Worker_0": 0, "Worker_1": 0}


def test_join_async_raises_a_workers_failure(tmp_path) -> None:
    (tmp_path / "ready").touch()
    with WorkerProcesses(gated_worker, 2, args=(str(tmp_path), [0, 3])) as workers:

        async def main() -> dict:
            assert await workers.wait_until_ready_async(timeout=STEP) == [0, 10]
            (tmp_path / "exit").touch()
            with pytest.raises(WorkerDiedError) as info:
                await workers.join_async(timeout=STEP)
            assert info.value.name == "Worker_1" and info.value.exitcode == 3
            # Reported: the next join waits for the others and returns every code.
            return await workers.join_async(timeout=STEP)

        assert asyncio.run(main()) == {"Worker_0": 0, "Worker_1": 3}

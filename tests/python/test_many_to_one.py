"""Many writers to one reader (issue 45 item 7): ``Gather`` reads several workers' result
queues with one wait, in real processes. Each writer's messages come in the order it
sent them; a writer that ends normally (its queue shut down, or just its process's
normal end) is left out quietly; one that is killed is reported by name, after every
message it sent, and the others go on."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

from _processes.harness import STEP, wait_for
from _processes.named_children import named_writer
from shmq import Gather, MessageQueue, PeerDiedError, QueueShutDownError

N = 30
ENDS = {"worker-0": "shutdown", "worker-1": "exit", "worker-2": "kill"}


def _workers(children):
    """One writer process per entry of ``ENDS``, each with its own named queue, sending
    ``N`` messages ``(name, j)`` once ``go`` is set, then ending as its entry says. The
    Gather of their queues here, ready; the workers' processes by name."""
    out, go, end = children.queue(), children.event(), children.event()
    suffix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    queue_names = {name: f"{name} results {suffix}" for name in ENDS}
    procs = {
        name: children.start(named_writer, out, queue_names[name], go, [(name, j) for j in range(N)], end, how)
        for name, how in ENDS.items()
    }
    for _ in ENDS:
        children.expect(out, "ready")
    gather = Gather({name: MessageQueue.open(q, 0) for name, q in queue_names.items()})
    gather.wait_until_ready(timeout=STEP)
    go.set()
    end.set()
    return gather, procs


def _check(got: dict[str, list], died: list[PeerDiedError], gather: Gather, procs) -> None:
    for name in ENDS:
        assert got[name] == [(name, j) for j in range(N)], f"{name}'s messages, in order"
    # The killed worker, and only it, is reported dead: by name, after its last message.
    assert len(died) == 1
    assert died[0].writer == "worker-2"  # type: ignore[attr-defined]
    assert "writer 'worker-2' of this Gather died" in str(died[0]) and f"pid {procs['worker-2'].pid}" in str(died[0])
    assert sorted(gather.ended) == ["worker-0", "worker-1"] and gather.died == ["worker-2"] and gather.live == []


def test_gather_reads_every_worker_in_order_and_names_the_dead_one(children) -> None:
    gather, procs = _workers(children)
    got: dict[str, list] = {name: [] for name in ENDS}
    died: list[PeerDiedError] = []
    while True:
        try:
            for name, obj in gather:
                got[name].append(obj)
                assert len(got[name]) <= N
            break
        except PeerDiedError as e:
            assert len(got[e.writer]) == N, "reported dead before all of its messages"  # type: ignore[attr-defined]
            died.append(e)
    _check(got, died, gather, procs)
    with pytest.raises(QueueShutDownError, match="every writer of this Gather has ended"):
        gather.recv(timeout=STEP)


def test_gather_in_an_event_loop(children) -> None:
    gather, procs = _workers(children)
    got: dict[str, list] = {name: [] for name in ENDS}
    died: list[PeerDiedError] = []

    async def main() -> None:
        while True:
            try:
                name, obj = await gather.recv_async(timeout=STEP)
            except QueueShutDownError:
                return
            except PeerDiedError as e:
                died.append(e)
                continue
            got[name].append(obj)

    asyncio.run(main())
    _check(got, died, gather, procs)


def test_gather_times_out_and_refuses_what_it_cannot_read() -> None:
    writers = [MessageQueue(1, 1) for _ in range(2)]
    try:
        readers = {f"w{i}": MessageQueue.create_from_handle(w.export_handle(), 0) for i, w in enumerate(writers)}
        gather = Gather(readers)
        with pytest.raises(TimeoutError, match=r"no message from \['w0', 'w1'\] within 0.1 s"):
            gather.recv(timeout=0.1)
        with pytest.raises(ValueError, match="queue '0' is not a local reader"):
            Gather([writers[0]])
    finally:
        for w in writers:
            w.shutdown()


def test_messages_larger_than_a_chunk_come_through_gather_and_dequeue_async() -> None:
    # Larger than a chunk: an overflow mark in the ring, the bytes over the queue's socket.
    writers = [MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=4) for _ in range(2)]
    try:
        readers = {f"w{i}": MessageQueue.create_from_handle(w.export_handle(), 0) for i, w in enumerate(writers)}
        ready = [threading.Thread(target=w.wait_until_ready, args=(STEP,)) for w in writers]
        for t in ready:
            t.start()
        gather = Gather(readers)
        gather.wait_until_ready(timeout=STEP)
        for t in ready:
            t.join()
        big = [bytes([i]) * (64 << 10) for i in range(3)]
        for i, w in enumerate(writers):
            for b in big:
                w.enqueue((i, b), timeout=STEP)
        got = [gather.recv(timeout=STEP) for _ in range(6)]
        assert [obj for name, obj in got if name == "w0"] == [(0, b) for b in big]
        assert [obj for name, obj in got if name == "w1"] == [(1, b) for b in big]

        async def main() -> list:
            for b in big:
                writers[1].enqueue(b, timeout=STEP)
            return [await readers["w1"].dequeue_async(timeout=STEP) for _ in big]

        assert asyncio.run(main()) == big
    finally:
        for w in writers:
            w.shutdown()


def test_a_death_is_reported_while_another_writer_keeps_the_gather_busy(children) -> None:
    # Writer "busy" (here) always has messages waiting, so the Gather never waits; writer
    # "doomed" (another process) is killed. Its death must still be reported.
    out, go = children.queue(), children.event()
    name = f"doomed {os.getpid()}-{uuid.uuid4().hex[:8]}"
    doomed = children.start(named_writer, out, name, go, [], None, "kill")
    children.expect(out, "ready")
    busy = MessageQueue(1, 1, max_chunks=10)
    try:
        gather = Gather(
            {"busy": MessageQueue.create_from_handle(busy.export_handle(), 0), "doomed": MessageQueue.open(name, 0)}
        )
        ready = threading.Thread(target=busy.wait_until_ready, args=(STEP,))
        ready.start()
        gather.wait_until_ready(timeout=STEP)
        ready.join()
        sent = 0
        for _ in range(9):
            busy.enqueue(sent, timeout=STEP)
            sent += 1
        go.set()
        got = []

        def busy_until_the_death() -> bool:
            nonlocal sent
            try:
                got.append(gather.recv(timeout=STEP))
            except PeerDiedError as e:
                assert e.writer == "doomed" and f"pid {doomed.pid}" in str(e)  # type: ignore[attr-defined]
                return True
            busy.enqueue(sent, timeout=STEP)  # "busy" never runs dry
            sent += 1
            return False

        wait_for(busy_until_the_death, what="the killed writer to be reported while the other keeps sending")
        assert got == [("busy", i) for i in range(len(got))] and gather.died == ["doomed"]
    finally:
        busy.shutdown()

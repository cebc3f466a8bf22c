"""The writer's end of a queue (issue 18 item 5): after the writer's ``shutdown()``, or
its normal end (the object dropped, the interpreter exiting), its calls raise
``QueueShutDownError`` (also one blocked in another thread), and every reader, local
or remote, gets every message sent before (in a chunk, over the overflow socket, in the
tensor arena) and then ``QueueShutDownError`` from ``dequeue``: not a timeout, not a
hang, not ``PeerDiedError``. A reader's own ``shutdown()`` still says "cancelled".

Readers run in their own processes and block in ``dequeue()`` without a timeout; each
test is bounded by the reports' timeouts.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import shmq
from shmq import MessageQueue, PeerDiedError
from shmq.message_queue import QueueShutDownError

from _processes import STEP, blocked_in_queue, wait_for

SHUT_DOWN = "the queue was shut down: this writer's shutdown"
WRITER_SHUT_DOWN = "shut down: every message it sent before has been received"

# A small object (in a chunk), one larger than a chunk (the overflow socket) and an array
# above the arena threshold (the tensor arena, for local readers).
CHUNK = 4096
ARENA_THRESHOLD = 64 * 1024


def _messages(large: int = 3 * CHUNK) -> list[Any]:
    return [
        "small",
        b"x" * large,
        np.arange(ARENA_THRESHOLD // 4 * 2, dtype=np.float32),
        {"last": True},
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


def _make_writer(n_remote: int) -> MessageQueue:
    return MessageQueue(
        n_reader=1 + n_remote,
        n_local_reader=1,
        max_chunk_bytes=CHUNK,
        max_chunks=4,
        connect_ip="127.0.0.1",
        arena_threshold=ARENA_THRESHOLD,
    )


# ---------------------------------------------------------------------------------
# Children (module level: the spawn context pickles targets by reference)


def reader_until_the_end(out: Any, handle: Any, rank: int, got_all: Any = None, large: int = 3 * CHUNK) -> None:
    """Take messages with ``dequeue()`` (no timeout) until it raises; report them all
    and how it ended. ``got_all``: an event it sets once it has every message of
    ``_messages()`` (and goes back into ``dequeue()``)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    got = []
    while True:
        try:
            got.append(mq.dequeue())
            if got_all is not None and len(got) == len(_messages(large)):
                got_all.set()
        except BaseException as e:
            outcome = {
                "type": type(e).__name__,
                "message": str(e),
                "shut_down": isinstance(e, QueueShutDownError),
                "runtime_error": isinstance(e, RuntimeError),
                "peer_died": isinstance(e, PeerDiedError),
            }
            break
    # Asked again, it says the same at once.
    t0 = time.monotonic()
    try:
        mq.dequeue(timeout=STEP)
        again = "returned"
    except BaseException as e:
        again = type(e).__name__
    out.put(("ended", got, outcome, again, time.monotonic() - t0))


_KEEP: list[Any] = []


def _ready_then_go(out: Any, mq: MessageQueue, go: Any) -> None:
    """The writer's ``wait_until_ready``; with ``go``, report ``("writer ready",)`` (every
    reader has subscribed) and wait for ``go`` before sending."""
    mq.wait_until_ready(timeout=STEP)
    if go is not None:
        out.put(("writer ready",))
        assert go.wait(STEP), "never told to send"


def writer_that_exits(out: Any, n_remote: int, large: int = 3 * CHUNK, go: Any = None) -> None:
    """Make the queue, send the messages (once ``go`` is set, when one is given), keep the
    queue in a module-level list with a daemon thread alive, and exit normally (the
    interpreter's exit ends the queue)."""
    mq = _make_writer(n_remote)
    out.put(("handle", mq.export_handle()))
    _ready_then_go(out, mq, go)
    for m in _messages(large):
        mq.enqueue(m, timeout=STEP)
    _KEEP.append(mq)
    # Not synchronisation: a daemon thread still running at the interpreter's exit.
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    out.put(("sent",))


# ---------------------------------------------------------------------------------
# The writer's own calls


def test_the_writers_calls_after_shutdown_raise_queue_shut_down():
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    mq.enqueue("before")
    mq.shutdown()
    mq.shutdown()  # twice is fine
    assert mq.shutting_down is True
    calls = {
        "enqueue": lambda: mq.enqueue("after"),
        "enqueue of buffers": lambda: mq.enqueue(np.zeros(1 << 20, dtype=np.uint8)),
        "wait_until_ready": lambda: mq.wait_until_ready(timeout=1),
        "acquire_write": lambda: mq.acquire_write(timeout=1).__enter__(),
    }
    for what, call in calls.items():
        with pytest.raises(QueueShutDownError, match=SHUT_DOWN) as info:
            call()
        assert isinstance(info.value, RuntimeError) and not isinstance(info.value, PeerDiedError), what
    assert shmq.message_queue.QueueShutDownError is shmq._core.QueueShutDownError
    assert reader.dequeue(timeout=STEP) == "before"
    with pytest.raises(QueueShutDownError, match=WRITER_SHUT_DOWN):
        reader.dequeue(timeout=STEP)


def test_an_enqueue_blocked_in_another_thread_ends_saying_why():
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)  # never reads
    mq.enqueue("m0")
    mq.enqueue("m1")  # the ring is full
    ended: list[BaseException] = []

    def blocked() -> None:
        try:
            mq.enqueue("blocked", timeout=STEP)
        except BaseException as e:
            ended.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    wait_for(lambda: blocked_in_queue(mq.buffer.name), STEP, "the enqueue blocked on the full ring")
    t0 = time.monotonic()
    mq.shutdown()  # never waits for room in the full ring
    took = time.monotonic() - t0
    t.join(STEP)
    assert not t.is_alive()
    assert took < 1.0, took
    assert len(ended) == 1 and isinstance(ended[0], QueueShutDownError), ended
    assert SHUT_DOWN in str(ended[0])
    # The readers still get what was sent before, then the end.
    assert [reader.dequeue(timeout=STEP) for _ in range(2)] == ["m0", "m1"]
    with pytest.raises(QueueShutDownError, match=WRITER_SHUT_DOWN):
        reader.dequeue(timeout=STEP)


def test_a_readers_own_shutdown_still_says_cancelled():
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    threading.Timer(0.3, reader.shutdown).start()
    with pytest.raises(RuntimeError, match="^cancelled$") as info:
        reader.dequeue()
    assert not isinstance(info.value, QueueShutDownError)
    mq.enqueue("the writer goes on")


# ---------------------------------------------------------------------------------
# Readers in other processes, blocked in dequeue() without a timeout


def _check_reader(report: tuple, what: str, large: int = 3 * CHUNK) -> None:
    _, got, outcome, again, again_took = report
    expected = _messages(large)
    same = len(got) == len(expected) and all(_same(a, b) for a, b in zip(got, expected, strict=True))
    assert same, f"{what}: {got!r:.300}"
    assert outcome["shut_down"] and outcome["runtime_error"] and not outcome["peer_died"], (what, outcome)
    assert WRITER_SHUT_DOWN in outcome["message"], (what, outcome)
    assert again == "QueueShutDownError" and again_took < 1.0, (what, again, again_took)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["shutdown", "dropped"])
def test_readers_get_every_message_then_the_writers_end(children, end):
    mq = _make_writer(n_remote=1)
    outs = [children.queue(), children.queue()]
    got_all = [children.event(), children.event()]
    for rank, out in enumerate(outs):  # rank 0 local, rank 1 remote
        children.start(reader_until_the_end, out, mq.export_handle(), rank, got_all[rank])
    mq.wait_until_ready(timeout=STEP)
    for out in outs:
        children.expect(out, "ready")
    ring = mq.buffer.name
    for m in _messages():
        mq.enqueue(m, timeout=STEP)
    # The readers are asleep in dequeue(): both have every message, and the local one
    # is blocked past its spin and yield (a remote reader has no slot to show it).
    for rank, ev in enumerate(got_all):
        assert ev.wait(STEP), f"reader {rank} never got every message"
    wait_for(lambda: blocked_in_queue(ring, 0, for_at_least=0.1), STEP, "the local reader asleep in dequeue()")
    if end == "shutdown":
        mq.shutdown()
    else:
        del mq
    for out, what in zip(outs, ["local reader", "remote reader"], strict=True):
        _check_reader(children.expect(out, "ended"), what)
    children.join()


@pytest.mark.timeout(120)
def test_readers_get_every_message_then_the_end_of_a_writer_process_that_exits(children):
    writer_out = children.queue()
    children.start(writer_that_exits, writer_out, 1)
    handle = children.expect(writer_out, "handle")[1]
    outs = [children.queue(), children.queue()]
    for rank, out in enumerate(outs):
        children.start(reader_until_the_end, out, handle, rank)
    for out in outs:
        children.expect(out, "ready")
    children.expect(writer_out, "sent")
    for out, what in zip(outs, ["local reader", "remote reader"], strict=True):
        _check_reader(children.expect(out, "ended"), what)
    children.join()


def _stopped_while_the_writer_exits(children: Any, writer: tuple, reader: Any) -> Any:
    """Start ``writer`` (its target and arguments after ``out``, then a ``go`` event: it
    reports its handle, becomes ready, sends once told, and exits normally) and the reader
    ``reader(handle)`` names (target and arguments after ``out``), and stop the reader
    (SIGSTOP) once both are ready (a reader's own readiness waits for nothing, so the
    writer's says that the reader's subscription is in), until the writer's process has
    exited and its ring's name is gone. Returns the reader's reports."""
    writer_out, go = children.queue(), children.event()
    writer_proc = children.start(writer[0], writer_out, *writer[1:], go)
    handle = children.expect(writer_out, "handle")[1]
    out = children.queue()
    target, *args = reader(handle)
    reader_proc = children.start(target, out, *args)
    children.expect(out, "ready")
    children.expect(writer_out, "writer ready")
    os.kill(reader_proc.pid, signal.SIGSTOP)
    go.set()
    try:
        children.expect(writer_out, "sent")
        writer_proc.join(STEP)
        assert writer_proc.exitcode == 0, writer_proc.exitcode
        ring = handle.buffer_handle[3]
        wait_for(lambda: not os.path.exists(f"/dev/shm/{ring}"), STEP, "the writer's exit to remove its ring's name")
    finally:
        os.kill(reader_proc.pid, signal.SIGCONT)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("large", [3 * CHUNK, 8 << 20], ids=["12KiB", "8MiB"])
def test_a_reader_stopped_while_the_writer_process_exits_still_gets_every_message(children, large):
    """Issue 54: a reader that has not read yet when the writer process ends normally
    (stopped here, SIGSTOP: slow, or not scheduled) lost the message whose array was in
    the tensor arena (``FileNotFoundError``: the writer's exit removed the arena's name
    before the reader opened it) and the message larger than a chunk (it went over the
    overflow socket, whose queued bytes died with the writer), and then heard that every
    message had been received. Now a body too large for a chunk goes through the arena
    too, and the arena's name outlives the writer until its readers have left."""
    out = _stopped_while_the_writer_exits(
        children, (writer_that_exits, 0, large), lambda handle: (reader_until_the_end, handle, 0, None, large)
    )
    _check_reader(children.expect(out, "ended"), "a local reader stopped while the writer exited", large)
    children.join()


def writer_of_one_too_large_for_the_arena(out: Any, go: Any = None) -> None:
    """A writer with no tensor arena (``arena_bytes=0``): its 8 MiB message can only go
    over the queue's socket. Sends three messages (once ``go`` is set, when one is given)
    and exits normally."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=CHUNK, max_chunks=4, arena_bytes=0)
    out.put(("handle", mq.export_handle()))
    _ready_then_go(out, mq, go)
    for m in ["before", b"x" * (8 << 20), "after"]:
        mq.enqueue(m, timeout=STEP)
    _KEEP.append(mq)
    out.put(("sent",))


def reader_of_whatever_comes(out: Any, handle: Any) -> None:
    """Dequeue until ``QueueShutDownError``, reporting each message (or the name of each
    other error) in order."""
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    got: list[Any] = []
    while True:
        try:
            m = mq.dequeue(timeout=STEP)
            got.append(m if isinstance(m, str) else len(m))
        except QueueShutDownError:
            break
        except Exception as e:
            got.append((type(e).__name__, str(e)))
            if len(got) > 10:
                break
    out.put(("ended", got))


@pytest.mark.timeout(120)
def test_a_message_lost_with_the_writers_process_is_reported_as_lost_and_the_rest_still_read(children):
    """Issue 54: where a message cannot go through shared memory (no arena here), a reader
    stopped while the writer's process exited loses it with the socket's queue. It heard
    ``QueueShutDownError`` (a clean end) and lost the message after it too; now it gets
    ``MessageLostError`` for the lost one, then the next message, then the end."""
    out = _stopped_while_the_writer_exits(
        children, (writer_of_one_too_large_for_the_arena,), lambda handle: (reader_of_whatever_comes, handle)
    )
    got = children.expect(out, "ended")[1]
    assert got[0] == "before" and got[-1] == "after" and len(got) == 3, got
    # 8 MiB is far more than the kernel's socket buffers hold for a stopped reader.
    kind, message = got[1]
    assert kind == "MessageLostError" and "that message is lost" in message, got
    assert issubclass(shmq.MessageLostError, RuntimeError)
    assert not issubclass(shmq.MessageLostError, (QueueShutDownError, PeerDiedError))
    children.join()


def test_shutdown_with_a_full_ring_does_not_wait_and_readers_still_learn_it():
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    t = threading.Thread(target=reader.wait_until_ready, args=(STEP,))
    t.start()
    mq.wait_until_ready(timeout=STEP)  # the overflow socket has its subscriber
    t.join(STEP)
    mq.enqueue("a")
    mq.enqueue(b"b" * 5000)  # over the overflow socket
    t0 = time.monotonic()
    mq.shutdown()
    assert time.monotonic() - t0 < 0.5
    assert reader.dequeue(timeout=STEP) == "a"
    assert reader.dequeue(timeout=STEP) == b"b" * 5000
    with pytest.raises(QueueShutDownError, match=WRITER_SHUT_DOWN):
        reader.dequeue()  # no timeout: it must not hang


def test_shutdown_from_a_signal_handler_inside_the_writers_own_wait():
    # The handler runs while the enqueue waits for room, with the writer let go (see
    # test_binding_locks): it shuts the queue down, and the enqueue ends with it.
    import signal

    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=1)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)  # reads only later
    mq.enqueue("m0")  # the ring is full
    old = signal.signal(signal.SIGALRM, lambda *args: mq.shutdown())
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(QueueShutDownError, match=SHUT_DOWN):
            mq.enqueue("blocked", timeout=STEP)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert reader.dequeue(timeout=STEP) == "m0"
    t0 = time.monotonic()
    with pytest.raises(QueueShutDownError, match=WRITER_SHUT_DOWN):
        reader.dequeue(timeout=STEP)
    assert time.monotonic() - t0 < 1.0

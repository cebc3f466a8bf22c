"""Child entry points of the remote stream's bounds tests (each takes the report queue
first): a remote reader that stops reading, a writer whose port is flooded."""

from __future__ import annotations

import os
from typing import Any

from shmq import Handle, MessageQueue

from .harness import STEP

MIB = 1 << 20


def numbered_message(i: int, size: int = 2 * MIB) -> bytes:
    """Message ``i`` of ``size`` bytes (its number in the first 8)."""
    return i.to_bytes(8, "little") + bytes(size - 8)


def stalled_remote_reader(out: Any, handle: Handle, rank: int, cmds: Any) -> None:
    """Get ready, then read nothing until told: each command ``(n, timeout)`` reads up to
    ``n`` messages and reports their numbers and the error that ended it (if any);
    ``None`` ends the child."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=STEP * 2)
        if cmd is None:
            return
        n, timeout = cmd
        got: list[int] = []
        err = None
        for _ in range(n):
            try:
                m = mq.dequeue(timeout=timeout)
            except Exception as e:  # reported, not raised: the test checks which
                err = (type(e).__name__, str(e))
                break
            got.append(int.from_bytes(m[:8], "little"))
        out.put(("got", got, err))


def guarded_writer(out: Any, cmds: Any) -> None:
    """A writer for one remote reader: report its handle and pid, wait for the reader
    (serving HELLOs all along), send one message, then wait to be told to end."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    out.put(("handle", mq.export_handle(), os.getpid()))
    mq.wait_until_ready(timeout=STEP * 2)
    mq.enqueue("after the flood", timeout=STEP)
    out.put(("sent",))
    cmds.get(timeout=STEP * 2)


def one_message_reader(out: Any, handle: Handle, rank: int) -> None:
    """Join as ``rank`` and report the first message."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("got", mq.dequeue(timeout=STEP)))


# ---------------------------------------------------------------------------------
# The remote stream's faults (test_remote_faults.py, issue 33)


def counting_writer(out: Any, n: int, cmds: Any) -> None:
    """A writer for one remote reader (rank 0): report its handle and pid, wait for the
    reader, send ``n`` numbers, report ``sent``; then on command ``"shutdown"`` shut the
    queue down and leave at once (``os._exit``: no clean-up beyond what shutdown did),
    on ``None`` return. The test may kill or stop it instead."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    out.put(("handle", mq.export_handle(), os.getpid()))
    mq.wait_until_ready(timeout=STEP)
    for i in range(n):
        mq.enqueue(i, timeout=STEP)
    out.put(("sent",))
    cmd = cmds.get(timeout=STEP * 2)
    if cmd == "shutdown":
        mq.shutdown()
        os._exit(0)


def busy_writer(out: Any, busy_s: float) -> None:
    """A writer for one remote reader that is busy (not in any call of the queue) for
    ``busy_s`` seconds after it made the queue, then waits for its reader and sends one
    message; reports its handle first and ``sent`` at the end."""
    import time

    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    out.put(("handle", mq.export_handle(), os.getpid()))
    time.sleep(busy_s)  # not synchronisation: busy, in no call of the queue (the behaviour under test)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue("after the flood", timeout=STEP)
    out.put(("sent",))


def joining_reader(out: Any, handle: Handle, rank: int, wait_s: float) -> None:
    """Join as ``rank`` (its HELLO goes at once), report ``hello``, then wait up to
    ``wait_s`` for the writer's start and the first message; report ``got`` with it,
    or ``failed`` with the exception's type, text and the seconds the wait took."""
    import time

    mq = MessageQueue.create_from_handle(handle, rank)
    out.put(("hello", os.getpid()))
    t0 = time.monotonic()
    try:
        mq.wait_until_ready(timeout=wait_s)
        out.put(("got", mq.dequeue(timeout=wait_s)))
    except Exception as e:  # reported, not raised: the test checks which
        out.put(("failed", type(e).__name__, str(e), time.monotonic() - t0))


def hello_then_sleep(out: Any, handle: Handle, rank: int) -> None:
    """Join as ``rank`` (say HELLO) and report ``hello``, then never wait for the start:
    the test kills it."""
    import time

    mq = MessageQueue.create_from_handle(handle, rank)
    out.put(("hello", os.getpid()))
    time.sleep(STEP * 2)  # not synchronisation: alive until killed
    del mq

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


# ---------------------------------------------------------------------------------
# A slow link (test_remote_slow_link.py, issue 54 item 8)


def large_writer(out: Any, cmds: Any) -> None:
    """A writer for one remote reader (rank 0): report its handle; then each command
    ``(n_bytes, fill)`` enqueues one message of ``n_bytes`` bytes of ``fill`` and reports
    ``sent``; ``None`` returns."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    out.put(("handle", mq.export_handle(), os.getpid()))
    mq.wait_until_ready(timeout=STEP)
    while True:
        cmd = cmds.get(timeout=STEP * 4)
        if cmd is None:
            return
        n_bytes, fill = cmd
        mq.enqueue(bytes([fill]) * n_bytes, timeout=STEP * 4)
        out.put(("sent",))


def slow_proxy(out: Any, target_port: int, rate: int, cmds: Any) -> None:
    """A TCP proxy on 127.0.0.1 to ``target_port`` whose link is slow: what the target
    sends goes on at ``rate`` bytes a second (the other way at once). Reports ``port``.
    Command ``("stall after", n)``: once ``n`` more bytes went from the target, forwarding
    stops either way, the connections left open (a link that fails without a FIN or a
    RST: nothing more arrives), and it reports ``stalled``; ``None`` ends the child. Each
    direction is a thread that reads up to 16 KiB, sends it, then sleeps until the link
    would have carried it."""
    import socket
    import threading
    import time

    chunk = 16 * 1024
    stalled = threading.Event()
    lock = threading.Lock()
    # Bytes from the target still to forward before the link fails (None: never).
    left: list[int | None] = [None]
    listener = socket.create_server(("127.0.0.1", 0))
    out.put(("port", listener.getsockname()[1]))

    def forwarded(n: int) -> None:
        with lock:
            if left[0] is None or stalled.is_set():
                return
            left[0] -= n
            if left[0] <= 0:
                stalled.set()
                out.put(("stalled",))

    def pump(src: socket.socket, dst: socket.socket, paced: bool) -> None:
        start, sent = time.monotonic(), 0
        try:
            while True:
                data = src.recv(chunk)
                if not data:
                    break
                while stalled.is_set():
                    time.sleep(3600)  # not synchronisation: a dead link stays dead
                dst.sendall(data)
                if paced:
                    forwarded(len(data))
                    sent += len(data)
                    ahead = start + sent / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)  # not synchronisation: the link's rate
                    else:
                        start, sent = time.monotonic(), 0  # idle: no burst credit
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def serve() -> None:
        while True:
            client, _ = listener.accept()
            try:
                server = socket.create_connection(("127.0.0.1", target_port))
            except OSError:  # the target is gone: so is this connection
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=pump, args=(server, client, True), daemon=True).start()
            threading.Thread(target=pump, args=(client, server, False), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    while True:
        cmd = cmds.get(timeout=STEP * 8)
        if cmd is None:
            return
        _, n = cmd
        with lock:
            left[0] = n
        if n <= 0:
            forwarded(0)

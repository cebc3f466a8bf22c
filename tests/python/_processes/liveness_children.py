"""Child entry points of test_liveness.py (idle CPU, dead peers, env wait policy)."""

from __future__ import annotations

import os
import time
from typing import Any

from shmq import Handle, MessageQueue

from .harness import STEP
from .objects import describe


def _cpu_seconds() -> float:
    """CPU time (user + system) this process has used so far, all threads."""
    t = os.times()
    return t.user + t.system


def idle_cpu_reader(out: Any, handle: Handle, rank: int) -> None:
    """Report the CPU this reader uses while blocked in dequeue(timeout=3) with nothing
    sent ("idle"), then while blocked until the writer sends one message ("late"; the
    test sends it about 2 s after the "waiting" report)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    w0, c0 = time.monotonic(), _cpu_seconds()
    try:
        obj = mq.dequeue(timeout=3.0)
    except BaseException as e:
        outcome = (type(e).__name__, str(e))
    else:
        outcome = ("returned", describe(obj))
    out.put(("idle", outcome, _cpu_seconds() - c0, time.monotonic() - w0))
    out.put(("waiting", time.monotonic()))
    w0, c0 = time.monotonic(), _cpu_seconds()
    obj = mq.dequeue(timeout=STEP)
    received = time.monotonic()
    out.put(("late", obj, received, _cpu_seconds() - c0, received - w0))


def sequence_reader(out: Any, handle: Handle, rank: int, stop: Any, delay: float, report_after: int) -> None:
    """Read until a ``None`` message, or until ``stop`` is set and nothing more comes;
    sleep ``delay`` s after each message; after ``report_after`` messages report
    ("progress", rank, count). Reports ("got", rank, messages) at the end."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready", rank))
    got: list[Any] = []
    last = time.monotonic()
    while True:
        try:
            obj = mq.dequeue(timeout=0.2)
        except TimeoutError:
            if stop is not None and stop.is_set():
                break
            if time.monotonic() - last > STEP:
                raise TimeoutError(f"reader {rank}: nothing for {STEP} s after {len(got)} messages") from None
            continue
        last = time.monotonic()
        if obj is None:
            break
        got.append(obj)
        if len(got) == report_after:
            out.put(("progress", rank, len(got)))
        if delay:
            time.sleep(delay)  # not synchronisation: a slow reader, as asked
    out.put(("got", rank, got))


def doomed_writer(out: Any, n_messages: int) -> None:
    """Create a queue with one local reader, report its handle, send ``n_messages``
    messages, report "sent", then sleep until killed."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=4)
    out.put(("handle", mq.export_handle()))
    mq.wait_until_ready(timeout=STEP)
    for i in range(n_messages):
        mq.enqueue(i, timeout=STEP)
    out.put(("sent",))
    time.sleep(STEP)  # not synchronisation: alive until killed
    del mq


def orphan_reader(out: Any, handle: Handle, rank: int, n_messages: int, spin_us: Any, yield_us: Any) -> None:
    """Read ``n_messages`` messages, report "waiting", then block in dequeue() with no
    timeout until something ends it; report how it ended and when."""
    mq = MessageQueue.create_from_handle(handle, rank, spin_us=spin_us, yield_us=yield_us)
    mq.wait_until_ready(timeout=STEP)
    got = [mq.dequeue(timeout=STEP) for _ in range(n_messages)]
    out.put(("waiting", got))
    import shmq

    try:
        obj = mq.dequeue()
    except BaseException as e:
        outcome = {
            "type": type(e).__name__,
            "message": str(e),
            "is_peer_died": isinstance(e, shmq.PeerDiedError),
            "is_runtime_error": isinstance(e, RuntimeError),
        }
    else:
        outcome = {"type": "returned", "message": describe(obj)}
    out.put(("ended", outcome, time.monotonic()))


def segment_creator(out: Any, janitor: bool = False) -> None:
    """Create a queue (and so a segment) and its arena, report its handle, sleep until
    killed. Without ``janitor`` the process starts none (``SHMQ_NO_JANITOR=1``), so that
    a SIGKILL leaves its segments for ``cleanup``, as the tests of cleanup need."""
    if not janitor:
        os.environ["SHMQ_NO_JANITOR"] = "1"
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    mq.reserve_arena(0)  # the arena is made at first use: make it now
    out.put(("handle", mq.export_handle()))
    time.sleep(STEP)  # not synchronisation: alive until killed
    del mq


def _thread_busy_seconds() -> float:
    """Time the calling thread has been running or waiting to run (not sleeping): CPU
    time plus run-queue delay from /proc/thread-self/schedstat, which unlike CPU time
    does not shrink when other processes load the machine. CPU time where schedstat is
    missing."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, run_delay = f.read().split()[:2]
    except (OSError, ValueError):
        return time.thread_time()
    return (int(on_cpu) + int(run_delay)) / 1e9


def env_policy_reader(out: Any, handle: Handle, env: dict[str, str], ranks: tuple[int, int]) -> None:
    """With ``env`` set in this process before its first queue, open reader ``ranks[0]``
    with the default wait policy and reader ``ranks[1]`` with spin_us=0, yield_us=0;
    report how long the calling thread is busy (running or runnable, see
    ``_thread_busy_seconds``) in a dequeue(timeout=0.4) with nothing sent, then read
    one message with each."""
    os.environ.update(env)  # before this process's first wait: the defaults are read once
    by_env = MessageQueue.create_from_handle(handle, ranks[0])
    explicit = MessageQueue.create_from_handle(handle, ranks[1], spin_us=0, yield_us=0)
    by_env.wait_until_ready(timeout=STEP)
    explicit.wait_until_ready(timeout=STEP)
    cpu = {}
    for label, mq in (("env", by_env), ("explicit", explicit)):
        b0, w0 = _thread_busy_seconds(), time.monotonic()
        try:
            mq.dequeue(timeout=0.4)
        except TimeoutError:
            outcome = "TimeoutError"
        else:
            outcome = "returned"
        cpu[label] = (outcome, _thread_busy_seconds() - b0, time.monotonic() - w0)
    out.put(("busy", cpu))
    out.put(("got", by_env.dequeue(timeout=STEP), explicit.dequeue(timeout=STEP)))


def load_policy_reader(out: Any, handle: Handle, env: dict[str, str], rank: int, timeout: float) -> None:
    """With ``env`` set in this process before its first queue, open reader ``rank`` with
    the default wait policy; report ``("cpu", rank, outcome, CPU s)`` for a
    dequeue(timeout=timeout) with nothing sent (the calling thread's CPU time: not its
    run-queue delay, which a sleeper's periodic wake-ups also pay on a loaded machine),
    then ``("got", rank, message)`` for the next message."""
    os.environ.update(env)  # before this process's first wait: read once
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    cpu0 = time.thread_time()
    try:
        mq.dequeue(timeout=timeout)
    except TimeoutError:
        outcome = "TimeoutError"
    else:
        outcome = "returned"
    out.put(("cpu", rank, outcome, time.thread_time() - cpu0))
    out.put(("got", rank, mq.dequeue(timeout=STEP)))

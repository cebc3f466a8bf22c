"""Child entry points of the queue and ring tests (each takes the report queue first)."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from typing import Any

from shmq import Handle, MessageQueue, ShmRingBuffer

from .harness import STEP, LogRecords, wait_for
from .objects import describe, digest_update, iter_objects, same


def stream_reader(out: Any, handle: Handle, rank: int, seed: int, n: int, big: int) -> None:
    """Join as reader ``rank``, dequeue ``n`` objects and check each against the stream;
    then check that nothing more arrives."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("done", {"rank": rank, **read_stream(mq, seed, n, big)}))


def read_stream(mq: MessageQueue, seed: int, n: int, big: int) -> dict[str, Any]:
    """Dequeue ``n`` objects, check each against the stream, then check that nothing
    more arrives; the findings as a report dict."""
    h = hashlib.sha256()
    mismatches: list[tuple[int, str, str]] = []
    n_mismatch = 0
    count = 0
    for i, expected in enumerate(iter_objects(seed, n, big)):
        obj = mq.dequeue(timeout=STEP)
        count += 1
        digest_update(h, obj)
        if not same(obj, expected):
            n_mismatch += 1
            if len(mismatches) < 5:
                mismatches.append((i, describe(obj), describe(expected)))
    try:
        extra = describe(mq.dequeue(timeout=0.3))
    except TimeoutError:
        extra = None
    # `_is_local_reader` and `local_reader_rank` are the engines' attribute names.
    return {
        "local": mq._is_local_reader,
        "local_reader_rank": mq.local_reader_rank if mq._is_local_reader else None,
        "count": count,
        "n_mismatch": n_mismatch,
        "mismatches": mismatches,
        "digest": h.hexdigest(),
        "extra": extra,
    }


def handle_roundtrip_reader(out: Any, handle_pickle: bytes, rank: int, n: int) -> None:
    """Unpickle a Handle, send it back pickled, and read ``n`` messages through it."""
    import pickle

    handle = pickle.loads(handle_pickle)
    assert type(handle) is Handle, type(handle)
    out.put(("handle", pickle.dumps(handle)))
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("got", [mq.dequeue(timeout=STEP) for _ in range(n)]))


def ring_buffer_peer(out: Any, ring_pickle: bytes, pattern: bytes, reply: bytes) -> None:
    """Unpickle a ShmRingBuffer, report what the parent wrote to chunk 1, and write
    ``reply`` and flags to chunk 2."""
    import pickle

    buf = pickle.loads(ring_pickle)
    assert isinstance(buf, ShmRingBuffer), type(buf)
    with buf.get_data(1) as data:
        seen = bytes(data[: len(pattern)])
        data_len = len(data)
    with buf.get_metadata(1) as meta:
        seen_meta = bytes(meta)
    with buf.get_data(2) as data:
        data[: len(reply)] = reply
    with buf.get_metadata(2) as meta:
        meta[:] = bytes([1] + [1] * (len(meta) - 1))
    out.put(
        (
            "seen",
            {
                "handle": buf.handle(),
                "is_creator": buf.is_creator,
                "data": seen,
                "data_len": data_len,
                "metadata": seen_meta,
            },
        )
    )


def missing_ring_user(out: Any, ring_pickle: bytes) -> None:
    """Unpickle a ShmRingBuffer whose segment does not exist here and try to use it."""
    import pickle

    buf = pickle.loads(ring_pickle)
    outcome = {"handle": buf.handle()}
    for what in ("get_data", "get_metadata"):
        try:
            with getattr(buf, what)(0):
                pass
        except BaseException as e:
            outcome[what] = (type(e).__name__, str(e))
        else:
            outcome[what] = None
    out.put(("missing", outcome))


def idle_reader(out: Any, handle: Handle, rank: int, go: Any, n: int) -> None:
    """Get ready, then read nothing until ``go`` is set; then read ``n`` messages and
    check that no further one arrives."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    if not go.wait(STEP):
        raise TimeoutError("the test never set go")
    got = [mq.dequeue(timeout=STEP) for _ in range(n)]
    try:
        extra = mq.dequeue(timeout=0.3)
    except TimeoutError:
        extra = None
    out.put(("got", got, extra))


def timeout_reader(out: Any, handle: Handle, rank: int) -> None:
    """dequeue(timeout=0.2) with nothing sent must raise TimeoutError; the reader must
    still work afterwards."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    t0 = time.monotonic()
    try:
        obj = mq.dequeue(timeout=0.2)
    except BaseException as e:
        outcome = (type(e).__name__, str(e))
    else:
        outcome = ("returned", describe(obj))
    out.put(("timeout", outcome, time.monotonic() - t0))
    out.put(("got", mq.dequeue(timeout=STEP)))


def cancel_reader(out: Any, handle: Handle, rank: int, how: str) -> None:
    """Block in dequeue and end it from another thread: ``how`` is "event" (a
    threading.Event passed as ``cancel``), "event-indefinite" (the same with
    ``indefinite=True``) or "shutdown" (``mq.shutdown()``)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    ev = threading.Event()
    fired_at: list[float] = []
    began: list[float] = []  # when the dequeue began
    main = threading.get_ident()

    def in_dequeue() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "dequeue":
                return True
            frame = frame.f_back
        return False

    def fire() -> None:
        # Once the main thread is in its dequeue, and has been for 0.3 s (the test checks
        # that the call really blocked until this thread acted).
        wait_for(
            lambda: began and in_dequeue() and time.monotonic() - began[0] >= 0.3,
            STEP,
            "the main thread blocked in dequeue() for 0.3 s",
        )
        fired_at.append(time.monotonic())
        if how == "shutdown":
            mq.shutdown()
        else:
            ev.set()

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    t0 = time.monotonic()
    began.append(t0)
    try:
        if how == "shutdown":
            obj = mq.dequeue(timeout=STEP)
        else:
            obj = mq.dequeue(timeout=STEP, cancel=ev, indefinite=how == "event-indefinite")
    except BaseException as e:
        outcome = (type(e).__name__, str(e))
    else:
        outcome = ("returned", describe(obj))
    ended = time.monotonic()
    t.join(STEP)
    out.put(
        (
            "cancel",
            {
                "outcome": outcome,
                "blocked_for": ended - t0,
                "wake_latency": ended - fired_at[0] if fired_at else None,
                "shutting_down": mq.shutting_down,
            },
        )
    )
    if how != "shutdown":
        # A cancelled dequeue loses nothing: the next message still arrives.
        out.put(("got", mq.dequeue(timeout=STEP)))


def zero_copy_reader(out: Any, handle: Handle, rank: int, commands: Any) -> None:
    """Obey ("read", nbytes) / "release" / "exit" commands: report the first nbytes of
    the chunk from acquire_read while still inside it, leave it on "release"."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready", rank))
    while True:
        cmd = commands.get(timeout=STEP)
        if cmd == "exit":
            break
        _, nbytes = cmd
        with mq.acquire_read(timeout=STEP) as buf:
            out.put(("inside", rank, bytes(buf[:nbytes]), len(buf)))
            cmd = commands.get(timeout=STEP)
            assert cmd == "release", cmd
        out.put(("done", rank))


def broadcast_reader(out: Any, handle: Handle, rank: int, n: int) -> None:
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("got", rank, [mq.broadcast_object() for _ in range(n)]))


def warning_reader(out: Any, handle: Handle, rank: int, env: dict[str, str]) -> None:
    """With ``env`` set in this process, report what Python logging receives during a
    dequeue(timeout=1) with nothing sent, then during one with indefinite=True."""
    os.environ.update(env)  # before this process's first wait: the interval is read once
    capture = LogRecords()
    logging.getLogger().addHandler(capture)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    results = {}
    for label, kwargs in (("plain", {}), ("indefinite", {"indefinite": True})):
        capture.records.clear()
        t0 = time.monotonic()
        try:
            mq.dequeue(timeout=1.0, **kwargs)
        except TimeoutError:
            outcome = "TimeoutError"
        else:
            outcome = "returned"
        results[label] = {"outcome": outcome, "elapsed": time.monotonic() - t0, "records": list(capture.records)}
    out.put(("log", results))


def warning_writer(out: Any, env: dict[str, str]) -> None:
    """With ``env`` set in this process, report what Python logging receives while the
    writer waits (timeout=1) for a chunk that no reader frees."""
    os.environ.update(env)
    capture = LogRecords()
    logging.getLogger().addHandler(capture)
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=1)
    mq.enqueue("fills the only chunk", timeout=STEP)
    t0 = time.monotonic()
    try:
        mq.enqueue("waits for a reader", timeout=1.0)
    except TimeoutError:
        outcome = "TimeoutError"
    else:
        outcome = "returned"
    out.put(("log", {"outcome": outcome, "elapsed": time.monotonic() - t0, "records": list(capture.records)}))


def killed_reader(out: Any, handle: Handle, rank: int) -> None:
    """Get ready, then sleep until killed."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready", rank))
    time.sleep(STEP)  # not synchronisation: alive until killed
    del mq

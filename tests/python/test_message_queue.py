"""MessageQueue across real processes (the engines' ``MessageQueue`` API): ordered exactly-once
delivery to local and remote readers, overflow, timeouts, cancellation, misuse, zero-copy
chunks, broadcast_object, remote-only and IPv6 queues, the "still waiting" warning."""

from __future__ import annotations

import hashlib
import pickle
import re
import socket
import threading
import time

import numpy as np
import pytest

import shmq
from shmq import Handle, MessageQueue, PeerDiedError, ShmRingBuffer, sched_yield

from _processes import (
    STEP,
    broadcast_reader,
    cancel_reader,
    digest_update,
    idle_reader,
    iter_objects,
    killed_reader,
    same,
    stream_reader,
    timeout_reader,
    warning_reader,
    warning_writer,
    zero_copy_reader,
)

KIB = 1024


def _ipv6_loopback_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def _run_stream(children, mq: MessageQueue, ranks: list[int], seed: int, n: int, big: int) -> list[dict]:
    """Start a stream_reader per rank, send the stream, and return the readers' reports
    (checked: every reader got every object, in order, exactly once)."""
    handle = mq.export_handle()
    outs = []
    for rank in ranks:
        out = children.queue()
        children.start(stream_reader, out, handle, rank, seed, n, big)
        outs.append(out)
    mq.wait_until_ready(timeout=STEP)
    h = hashlib.sha256()
    n_big = 0
    try:
        for obj in iter_objects(seed, n, big):
            digest_update(h, obj)
            n_big += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) > big
            mq.enqueue(obj, timeout=STEP)
    except TimeoutError:
        # A reader stopped reading: show why, if it said.
        for out in outs:
            try:
                children.receive(out, timeout=1)
            except AssertionError as e:
                if "failed:" in str(e):
                    raise
        raise
    reports = [children.expect(out, "done")[1] for out in outs]
    children.join()
    assert n_big > 0, "the stream must contain objects larger than a chunk"
    for r in reports:
        assert r["count"] == n, r
        assert r["n_mismatch"] == 0, r
        assert r["digest"] == h.hexdigest(), r
        assert r["extra"] is None, f"reader {r['rank']} got an extra object: {r['extra']}"
    assert sorted(r["rank"] for r in reports) == sorted(ranks)
    return reports


# ---------------------------------------------------------------------------------
# 1. Every reader gets every object, in order, exactly once


def test_local_and_remote_readers_get_every_object_in_order(children):
    big = 64 * KIB
    mq = MessageQueue(n_reader=4, n_local_reader=3, max_chunk_bytes=big, max_chunks=4, connect_ip="127.0.0.1")
    handle = mq.export_handle()
    assert handle.local_reader_ranks == [0, 1, 2]
    assert handle.buffer_handle == (3, big, 4, mq.buffer.name)
    assert handle.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    reports = _run_stream(children, mq, [0, 1, 2, 3], seed=20240601, n=2000, big=big)
    kinds = {r["rank"]: (r["local"], r["local_reader_rank"]) for r in reports}
    assert kinds == {0: (True, 0), 1: (True, 1), 2: (True, 2), 3: (False, None)}


def test_local_reader_ranks_map_to_reader_indices(children):
    big = 4 * KIB
    mq = MessageQueue(
        n_reader=3,
        n_local_reader=2,
        local_reader_ranks=[7, 4],
        max_chunk_bytes=big,
        max_chunks=3,
        connect_ip="127.0.0.1",
    )
    assert mq.export_handle().local_reader_ranks == [7, 4]
    reports = _run_stream(children, mq, [4, 7, 0], seed=7, n=150, big=big)
    kinds = {r["rank"]: (r["local"], r["local_reader_rank"]) for r in reports}
    assert kinds == {7: (True, 0), 4: (True, 1), 0: (False, None)}


# ---------------------------------------------------------------------------------
# 8. Remote-only queues, and IPv6


def test_remote_only_queue(children):
    big = 16 * KIB
    mq = MessageQueue(n_reader=2, n_local_reader=0, max_chunk_bytes=big, max_chunks=2, connect_ip="127.0.0.1")
    handle = mq.export_handle()
    assert handle.local_reader_ranks == []
    assert handle.buffer_handle is None
    assert handle.local_subscribe_addr is None
    assert handle.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    assert mq.buffer is None
    reports = _run_stream(children, mq, [0, 1], seed=11, n=300, big=big)
    assert all(not r["local"] for r in reports)


@pytest.mark.skipif(not _ipv6_loopback_works(), reason="no IPv6 loopback (::1) on this machine")
def test_ipv6_loopback(children):
    big = 16 * KIB
    mq = MessageQueue(n_reader=2, n_local_reader=1, max_chunk_bytes=big, max_chunks=2, connect_ip="::1")
    handle = mq.export_handle()
    assert handle.remote_addr_ipv6 is True
    assert handle.remote_subscribe_addr.startswith("tcp://[::1]:")
    reports = _run_stream(children, mq, [0, 1], seed=12, n=200, big=big)
    assert sorted(r["local"] for r in reports) == [False, True]


# ---------------------------------------------------------------------------------
# 3. Timeouts


def test_enqueue_times_out_while_the_ring_is_full(children):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    out, go = children.queue(), children.event()
    children.start(idle_reader, out, mq.export_handle(), 0, go, 4)
    mq.wait_until_ready(timeout=STEP)
    children.expect(out, "ready")
    mq.enqueue("m0", timeout=STEP)
    mq.enqueue("m1", timeout=STEP)  # the ring (2 chunks) is now full
    for lost in ("lost", b"L" * 5000):  # one that fits a chunk, one that overflows
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            mq.enqueue(lost, timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 10
    go.set()
    # Once the reader reads, the writer goes on; the timed-out messages were never sent.
    big = b"B" * 5000
    mq.enqueue("m2", timeout=STEP)
    mq.enqueue(big, timeout=STEP)
    _, got, extra = children.expect(out, "got")
    children.join()
    assert got == ["m0", "m1", "m2", big]
    assert extra is None


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_dequeue_times_out_with_nothing_sent(children, kind):
    n_local = 1 if kind == "local" else 0
    mq = MessageQueue(n_reader=1, n_local_reader=n_local, max_chunk_bytes=1024, max_chunks=2, connect_ip="127.0.0.1")
    out = children.queue()
    children.start(timeout_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    _, outcome, elapsed = children.expect(out, "timeout")
    assert outcome[0] == "TimeoutError", outcome
    assert 0.15 <= elapsed < 10
    mq.enqueue("after the timeout", timeout=STEP)
    assert children.expect(out, "got")[1] == "after the timeout"
    children.join()


# ---------------------------------------------------------------------------------
# 4. cancel events and shutdown() end a blocked dequeue


@pytest.mark.parametrize("kind", ["local", "remote"])
@pytest.mark.parametrize("how", ["event", "event-indefinite", "shutdown"])
def test_blocked_dequeue_is_cancelled_from_another_thread(children, kind, how):
    n_local = 1 if kind == "local" else 0
    mq = MessageQueue(n_reader=1, n_local_reader=n_local, max_chunk_bytes=1024, max_chunks=2, connect_ip="127.0.0.1")
    out = children.queue()
    children.start(cancel_reader, out, mq.export_handle(), 0, how)
    mq.wait_until_ready(timeout=STEP)
    r = children.expect(out, "cancel")[1]
    assert r["outcome"] == ("RuntimeError", "cancelled"), r
    assert r["blocked_for"] >= 0.25, r  # it really blocked until the other thread acted
    assert r["wake_latency"] is not None and r["wake_latency"] < 5, r  # a hang bound only
    if how == "shutdown":
        assert r["shutting_down"] is True
    else:
        assert r["shutting_down"] is False
        mq.enqueue("after the cancel", timeout=STEP)
        assert children.expect(out, "got")[1] == "after the cancel"
    children.join()


def test_shutdown_sets_shutting_down_in_this_process():
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    assert reader.shutting_down is False
    t = threading.Timer(0.2, reader.shutdown)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="^cancelled$"):
        reader.dequeue(timeout=STEP)
    assert time.monotonic() - t0 < 10
    t.join()
    assert reader.shutting_down is True


# ---------------------------------------------------------------------------------
# 5. Misuse


@pytest.fixture
def local_queue():
    """A writer with one local reader opened in this process (no data is exchanged)."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    pair = [mq, MessageQueue.create_from_handle(mq.export_handle(), 0)]
    del mq
    yield pair
    pair.clear()  # pytest keeps the fixture value until after the leftover check


def test_writer_cannot_dequeue(local_queue):
    mq, _ = local_queue
    with pytest.raises(RuntimeError):
        mq.dequeue(timeout=0.1)
    with pytest.raises(RuntimeError):
        with mq.acquire_read(timeout=0.1):
            pass


def test_reader_cannot_enqueue(local_queue):
    _, reader = local_queue
    with pytest.raises(RuntimeError):
        reader.enqueue("x", timeout=0.1)
    with pytest.raises(RuntimeError):
        with reader.acquire_write(timeout=0.1):
            pass


def test_handle_less_object_raises_runtime_error():
    mq = MessageQueue.__new__(MessageQueue)
    with pytest.raises(RuntimeError):
        mq.dequeue(timeout=0.1)
    with pytest.raises(RuntimeError):
        mq.enqueue("x", timeout=0.1)
    with pytest.raises(RuntimeError):
        mq.wait_until_ready(timeout=0.1)


@pytest.mark.parametrize("ranks", [[0], [0, 1, 2], []])
def test_wrong_number_of_local_reader_ranks(ranks):
    with pytest.raises(ValueError):
        MessageQueue(n_reader=3, n_local_reader=2, local_reader_ranks=ranks, max_chunk_bytes=1024, max_chunks=2)


def test_more_local_readers_than_readers():
    with pytest.raises(ValueError):
        MessageQueue(n_reader=1, n_local_reader=2, max_chunk_bytes=1024, max_chunks=2)


def _enqueue_on_full_ring(mq, reader, timeout):
    mq.enqueue("a", timeout=STEP)
    mq.enqueue("b", timeout=STEP)  # both chunks written, none read: the next one waits
    mq.enqueue("c", timeout=timeout)


def _dequeue_with_a_message_pending(mq, reader, timeout):
    mq.enqueue("pending", timeout=STEP)
    reader.dequeue(timeout=timeout)


def _acquire_read(mq, reader, timeout):
    with reader.acquire_read(timeout=timeout):
        pass


def _acquire_write(mq, reader, timeout):
    with mq.acquire_write(timeout=timeout):
        pass


_TIMED_CALLS = {
    "reader.dequeue, nothing sent": lambda mq, reader, t: reader.dequeue(timeout=t),
    "reader.dequeue, a message pending": _dequeue_with_a_message_pending,
    "reader.wait_until_ready": lambda mq, reader, t: reader.wait_until_ready(timeout=t),
    "writer.wait_until_ready": lambda mq, reader, t: mq.wait_until_ready(timeout=t),
    "reader.acquire_read": _acquire_read,
    "writer.acquire_write": _acquire_write,
    "writer.enqueue, ring free": lambda mq, reader, t: mq.enqueue("x", timeout=t),
    "writer.enqueue, ring full": _enqueue_on_full_ring,
}


@pytest.mark.parametrize("call", list(_TIMED_CALLS))
@pytest.mark.parametrize("bad", [-1, -0.001, float("nan")])
def test_bad_timeouts_are_value_errors(local_queue, bad, call):
    mq, reader = local_queue
    with pytest.raises(ValueError, match="timeout"):
        _TIMED_CALLS[call](mq, reader, bad)


def test_out_of_range_chunk_index(local_queue):
    mq, reader = local_queue
    for buf in (mq.buffer, reader.buffer):
        with pytest.raises(ValueError):
            with buf.get_data(2):
                pass
        with pytest.raises(ValueError):
            with buf.get_metadata(2):
                pass


# ---------------------------------------------------------------------------------
# 6. Zero-copy chunks and the chunk state machine


def _flags(mq: MessageQueue, i: int) -> list[int]:
    with mq.buffer.get_metadata(i) as meta:
        return list(meta)


def test_zero_copy_write_and_read_follow_the_state_machine(children):
    size = 4096
    mq = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=size, max_chunks=2)
    handle = mq.export_handle()
    outs, cmds = {}, {}
    for rank in (0, 1):
        outs[rank], cmds[rank] = children.queue(), children.queue()
        children.start(zero_copy_reader, outs[rank], handle, rank, cmds[rank])
    mq.wait_until_ready(timeout=STEP)
    for rank in (0, 1):
        children.expect(outs[rank], "ready")

    def read(rank: int, nbytes: int, expected_flags_inside: list[int], chunk: int) -> tuple[bytes, int]:
        cmds[rank].put(("read", nbytes))
        _, r, data, length = children.expect(outs[rank], "inside")
        assert r == rank
        # While the reader is inside acquire_read its flag is still 0.
        assert _flags(mq, chunk) == expected_flags_inside
        cmds[rank].put("release")
        children.expect(outs[rank], "done")
        return data, length

    assert _flags(mq, 0) == [0, 0, 0]  # state 1: not written
    payload0 = bytes(range(256)) * 4
    with mq.acquire_write(timeout=STEP) as buf:
        assert isinstance(buf, memoryview) and len(buf) == size and not buf.readonly
        assert _flags(mq, 0)[0] == 0
        buf[: len(payload0)] = payload0
    with mq.buffer.get_data(0) as data:  # zero-copy: the bytes are in the chunk itself
        assert bytes(data[: len(payload0)]) == payload0
    assert _flags(mq, 0) == [1, 0, 0]  # state 2: written, unread

    data, length = read(0, len(payload0), [1, 0, 0], chunk=0)
    assert data == payload0 and length == size
    assert _flags(mq, 0) == [1, 1, 0]  # state 3: read by some, the writer must wait

    payload1 = b"second chunk"
    with mq.acquire_write(timeout=STEP) as buf:  # chunk 1 is free
        buf[: len(payload1)] = payload1
    assert _flags(mq, 1) == [1, 0, 0]
    with pytest.raises(TimeoutError):  # chunk 0 is in state 3
        with mq.acquire_write(timeout=0.3):
            pass

    data, length = read(1, len(payload0), [1, 1, 0], chunk=0)
    assert data == payload0 and length == size
    assert _flags(mq, 0) == [1, 1, 1]  # state 4: read by all, the writer may write

    for rank in (0, 1):
        data, _ = read(rank, len(payload1), [1, 1, 0] if rank == 1 else [1, 0, 0], chunk=1)
        assert data == payload1
    assert _flags(mq, 1) == [1, 1, 1]

    payload2 = b"third, in chunk 0 again"
    with mq.acquire_write(timeout=STEP) as buf:
        # The writer cleared the written flag before filling; read flags reset at the end.
        assert _flags(mq, 0) == [0, 1, 1]
        buf[: len(payload2)] = payload2
    assert _flags(mq, 0) == [1, 0, 0]
    for rank in (0, 1):
        data, _ = read(rank, len(payload2), [1, 1, 0] if rank == 1 else [1, 0, 0], chunk=0)
        assert data == payload2
    assert _flags(mq, 0) == [1, 1, 1]
    for rank in (0, 1):
        cmds[rank].put("exit")
    children.join()


# ---------------------------------------------------------------------------------
# 7. broadcast_object


def test_broadcast_object(children):
    mq = MessageQueue(n_reader=3, n_local_reader=2, max_chunk_bytes=8 * KIB, max_chunks=2, connect_ip="127.0.0.1")
    objects = [
        {"cmd": "execute_model", "args": (1, 2.5, "x")},
        None,
        np.arange(10_000, dtype=np.int64).reshape(100, 100),  # overflows a chunk
        "é" * 20_000,  # overflows a chunk
        [b"", b"\x00" * 10],
    ]
    outs = {}
    for rank in (0, 1, 2):
        outs[rank] = children.queue()
        children.start(broadcast_reader, outs[rank], mq.export_handle(), rank, len(objects) + 1)
    mq.wait_until_ready(timeout=STEP)
    for obj in objects:
        assert mq.broadcast_object(obj) is obj
    assert mq.broadcast_object() is None
    for rank in (0, 1, 2):
        _, r, got = children.expect(outs[rank], "got")
        assert r == rank
        assert same(got, objects + [None])
    children.join()


# ---------------------------------------------------------------------------------
# Crash: a reader dies without cleaning up


def test_a_killed_reader_never_hangs_the_writer(children):
    """The writer's blocked enqueue ends: by its timeout, or (once the writer's liveness
    check has run, about every 0.5 s) with PeerDiedError; see test_liveness.py for that."""
    mq = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1024, max_chunks=3)
    handle = mq.export_handle()
    out_dead, out_live = children.queue(), children.queue()
    dead = children.start(killed_reader, out_dead, handle, 0)
    children.start(stream_reader, out_live, handle, 1, 5, 3, 1024)
    mq.wait_until_ready(timeout=STEP)
    children.expect(out_dead, "ready")
    dead.kill()
    dead.join(STEP)
    objs = list(iter_objects(5, 3, 1024))
    for obj in objs:  # the ring has 3 chunks: these fit although reader 0 is gone
        mq.enqueue(obj, timeout=STEP)
    with pytest.raises((TimeoutError, PeerDiedError)):
        mq.enqueue("no room: reader 0 never frees its chunks", timeout=0.3)
    r = children.expect(out_live, "done")[1]
    assert r["count"] == 3 and r["n_mismatch"] == 0
    children.procs.remove(dead)
    children.join()


# ---------------------------------------------------------------------------------
# 10. The "still waiting" warning

_FAST_WARNINGS = {"SHMQ_RINGBUFFER_WARNING_INTERVAL": "0.2"}
_DURATION = r"\d+(\.\d+)?\s*(ns|µs|us|ms|s)\b"


def _shmq_warnings(records):
    return [r for r in records if r[0].startswith("shmq") and r[1] >= 30]  # 30: WARNING


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_still_waiting_warning_names_the_waiting_reader(children, kind):
    n_local = 1 if kind == "local" else 0
    mq = MessageQueue(n_reader=1, n_local_reader=n_local, max_chunk_bytes=1024, max_chunks=2, connect_ip="127.0.0.1")
    out = children.queue()
    children.start(warning_reader, out, mq.export_handle(), 0, _FAST_WARNINGS)
    mq.wait_until_ready(timeout=STEP)
    results = children.expect(out, "log")[1]
    children.join()
    plain = results["plain"]
    assert plain["outcome"] == "TimeoutError"
    warnings = _shmq_warnings(plain["records"])
    assert len(warnings) >= 2, f"expected a warning every 0.2 s during a 1 s wait, got {plain['records']}"
    for _, _, message in warnings:
        assert f"{kind} reader" in message and "waiting for the writer" in message, message
        assert re.search(_DURATION, message), message
    quiet = results["indefinite"]
    assert quiet["outcome"] == "TimeoutError"
    assert _shmq_warnings(quiet["records"]) == [], "indefinite=True must not warn"


def test_still_waiting_warning_names_the_waiting_writer(children):
    out = children.queue()
    children.start(warning_writer, out, _FAST_WARNINGS)
    r = children.expect(out, "log")[1]
    children.join()
    assert r["outcome"] == "TimeoutError"
    warnings = _shmq_warnings(r["records"])
    assert len(warnings) >= 2, r["records"]
    for _, _, message in warnings:
        assert "writer" in message and "waiting" in message, message


# ---------------------------------------------------------------------------------
# 9. The package surface


def test_public_names():
    from shmq import Handle as H, MessageQueue as M, ShmRingBuffer as S, sched_yield as y  # noqa: F401

    for name in ("MessageQueue", "Handle", "ShmRingBuffer", "sched_yield"):
        assert name in shmq.__all__
        assert getattr(shmq, name) is not None
    assert (H, M, S, y) == (Handle, MessageQueue, ShmRingBuffer, sched_yield)


# Every name the engines' users import from `shmq` (StatelessProcessGroup comes with the
# process-group work and is not exported yet).
SPEC_EXPORTS = {
    "MessageQueue",
    "Handle",
    "ShmRingBuffer",
    "ObjectStorage",
    "ObjectStorageHandle",
    "RingBuffer",
    "ObjectSerde",
    "MsgpackSerde",
    "PickleSerde",
    "sched_yield",
    "SingleWriterShmObjectStorage",
    "ShmObjectStorageHandle",
    "SingleWriterShmRingBuffer",
}


def test_every_spec_name_is_exported():
    missing = SPEC_EXPORTS - set(shmq.__all__)
    assert not missing, f"not in shmq.__all__: {sorted(missing)}"
    for name in shmq.__all__:
        getattr(shmq, name)  # every listed name exists
    assert shmq.SingleWriterShmObjectStorage is shmq.ObjectStorage
    assert shmq.ShmObjectStorageHandle is shmq.ObjectStorageHandle
    assert shmq.SingleWriterShmRingBuffer is shmq.RingBuffer


def test_sched_yield_uses_the_os_call_or_a_zero_sleep(monkeypatch):
    import os as _os
    import time as _time

    calls = []
    monkeypatch.setattr(_os, "sched_yield", lambda: calls.append("sched_yield"))
    assert sched_yield() is None
    assert calls == ["sched_yield"]
    monkeypatch.delattr(_os, "sched_yield")
    monkeypatch.setattr(_time, "sleep", lambda s: calls.append(("sleep", s)))
    assert sched_yield() is None
    assert calls[-1] == ("sleep", 0)

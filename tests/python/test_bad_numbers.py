"""Bad input that crashed, and words that were wrong (issue 32, items 7 and 8).

Item 7: every numeric argument is checked in the core, never a panic
(``pyo3_runtime.PanicException``, a ``BaseException`` with a Rust backtrace) or an abort
(a failed allocation ends the interpreter): a timeout longer than 10⁹ s (an int too
large for a float included) means no timeout, as ``inf`` does; a negative one or NaN is
a ``ValueError``; ``spin_us`` / ``yield_us`` beyond 10 s, and more readers or workers
than a ring or a group can have, are ``ValueError`` naming the argument and its limit.
What used to abort runs in a child interpreter, so that it cannot take pytest with it.

Item 8: a remote-only writer's timeout names the remote reader it waited for and what
to do; a loan too large for the arena and for ordinary memory says so, with the sizes;
a ``MessageQueue`` that is neither writer nor reader does not call itself a reader.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading

import pytest

from _processes import worker_targets as targets
from _processes import STEP, stalled_remote_reader
from shmq import MessageQueue, ObjectStorage, RingBuffer, WorkerProcesses, _core
from shmq.encoder_cache import EncoderCacheProducer

# Timeouts that mean "no timeout": beyond 10⁹ s (a float, an int past u64, an int past a
# float's range), or infinite. Each panicked in the Duration conversion but inf.
NO_TIMEOUT = [1e9 + 1, 1e300, 2**64, 10**400, math.inf]
NO_TIMEOUT_IDS = ["1e9+1", "1e300", "2**64", "10**400", "inf"]
# Timeouts refused: negative, NaN, an int more negative than a float can be.
BAD_TIMEOUT = [-1, -1e-9, math.nan, -math.inf, -(10**400)]
BAD_TIMEOUT_IDS = ["-1", "-1e-9", "nan", "-inf", "-10**400"]
TIMEOUT_RULE = "timeout must be a non-negative number of seconds"


def _in_a_child(code: str) -> str:
    """Run ``code`` in a fresh interpreter; what it printed. A crash (an abort, a panic
    that escapes) fails the test with the child's stderr."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=STEP)
    assert r.returncode == 0, f"the child died (exit {r.returncode}):\n{r.stderr[-3000:]}"
    return r.stdout


# ---------------------------------------------------------------------------------
# Item 7: timeouts


@pytest.mark.parametrize("timeout", NO_TIMEOUT, ids=NO_TIMEOUT_IDS)
def test_a_huge_or_infinite_timeout_means_no_timeout_on_every_queue_call(timeout):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    ready = threading.Thread(target=mq.wait_until_ready, args=(timeout,))
    ready.start()
    reader.wait_until_ready(timeout=timeout)
    ready.join(STEP)
    mq.enqueue("one", timeout=timeout)
    assert reader.dequeue(timeout=timeout) == "one"
    with mq.acquire_write(timeout=timeout) as buf:
        buf[:3] = b"two"
    with reader.acquire_read(timeout=timeout) as buf:
        assert bytes(buf[:3]) == b"two"
    # A wait under it really waits (no deadline): only the cancel event ends it.
    cancel = threading.Event()
    timer = threading.Timer(0.3, cancel.set)
    timer.start()
    try:
        with pytest.raises(RuntimeError, match="^cancelled$"):
            reader.dequeue(timeout=timeout, cancel=cancel)
    finally:
        timer.cancel()
    assert cancel.is_set()


@pytest.mark.parametrize("timeout", BAD_TIMEOUT, ids=BAD_TIMEOUT_IDS)
def test_a_negative_or_nan_timeout_is_a_value_error_on_every_queue_call(timeout):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    calls = [
        lambda: mq.wait_until_ready(timeout),
        lambda: mq.enqueue("x", timeout=timeout),
        lambda: mq.acquire_write(timeout=timeout).__enter__(),
        lambda: reader.wait_until_ready(timeout),
        lambda: reader.dequeue(timeout=timeout),
        lambda: reader.acquire_read(timeout=timeout).__enter__(),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=TIMEOUT_RULE):
            call()


@pytest.mark.parametrize("timeout", NO_TIMEOUT, ids=NO_TIMEOUT_IDS)
def test_encoder_cache_timeouts_beyond_the_longest_mean_none(cache_name, timeout):
    producer = EncoderCacheProducer(cache_name, capacity=1 << 20, timeout=timeout)
    try:
        assert producer.save("k", b"x" * 100, timeout=timeout)
        producer.flush(timeout=timeout)
        producer.wait_loaded("k", timeout=timeout)  # no consumer: loaded by all at once
    finally:
        producer.close(timeout=timeout)
    # What the package's own waits (a semaphore, futures) are given: None for no limit.
    assert _core.timeout_seconds(timeout) is None
    assert _core.timeout_seconds(2.5) == 2.5
    assert _core.timeout_seconds(None) is None


@pytest.mark.parametrize("timeout", BAD_TIMEOUT, ids=BAD_TIMEOUT_IDS)
def test_encoder_cache_refuses_a_negative_or_nan_timeout(cache_name, timeout):
    with pytest.raises(ValueError, match=TIMEOUT_RULE):
        EncoderCacheProducer(cache_name, capacity=1 << 20, timeout=timeout)
    producer = EncoderCacheProducer(cache_name, capacity=1 << 20)
    try:
        for call in [
            lambda: producer.save("k", b"x", timeout=timeout),
            lambda: producer.flush(timeout=timeout),
            lambda: producer.wait_loaded("k", timeout=timeout),
        ]:
            with pytest.raises(ValueError, match=TIMEOUT_RULE):
                call()
    finally:
        producer.close()


def test_worker_waits_and_grace_beyond_the_longest_mean_none():
    workers = WorkerProcesses(targets.ready_then_exit, 1, args=(0,), grace=1e300)
    try:
        assert workers.wait_until_ready(timeout=1e300) == [0]
        assert workers.join_first(timeout=2**64) is not None
        assert workers.join(timeout=10**400) == {"Worker_0": 0}
    finally:
        workers.close(grace=1e300)
    with pytest.raises(ValueError, match=TIMEOUT_RULE):
        workers.join(timeout=-1)


# ---------------------------------------------------------------------------------
# Item 7: counts and wait phases


@pytest.mark.parametrize("value", [1e300, 2**64, 10.000001e6, math.inf, -1, math.nan])
@pytest.mark.parametrize("name", ["spin_us", "yield_us"])
def test_spin_and_yield_beyond_ten_seconds_are_value_errors_naming_the_limit(name, value):
    rule = rf"{name} must be a non-negative number of microseconds, at most 10000000 \(10 s\)"
    with pytest.raises(ValueError, match=rule):
        MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, **{name: value})
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    with pytest.raises(ValueError, match=rule):
        MessageQueue.create_from_handle(mq.export_handle(), 0, **{name: value})
    # The limit itself is a time like any other.
    MessageQueue.create_from_handle(mq.export_handle(), 0, **{name: 10_000_000})


def test_more_local_readers_than_a_ring_has_is_a_value_error_not_an_abort():
    # Aborted the interpreter ("memory allocation of 8796093022208 bytes failed"): the
    # default ranks were made before the ring checked the count.
    out = _in_a_child(
        """
        from shmq import MessageQueue
        for n in (2**40, 2**62, 4097):
            try:
                MessageQueue(n, n)
            except ValueError as e:
                print(e)
        """
    )
    assert out.splitlines() == [
        f"n_local_reader must be at most 4096 (the most readers a ring has), got {n}" for n in (2**40, 2**62, 4097)
    ]


def test_more_workers_than_a_group_supervises_is_a_value_error_not_an_abort():
    # WorkerProcesses(print, 2**40) aborted the interpreter ("memory allocation of
    # 395824185999360 bytes failed", exit 134).
    out = _in_a_child(
        """
        from shmq import WorkerProcesses
        for kwargs in ({"n_workers": 2**40}, {"n_workers": 0, "n_remote": 2**40}, {"n_workers": 4097}):
            try:
                WorkerProcesses(print, **kwargs)
            except ValueError as e:
                print(e)
        """
    )
    assert out.splitlines() == [
        f"too many workers: {local} local (n_workers) + {remote} remote (n_remote); "
        "a group supervises at most 4096 workers in all"
        for local, remote in [(2**40, 0), (0, 2**40), (4097, 0)]
    ]


# ---------------------------------------------------------------------------------
# Item 8: words


def test_a_remote_only_writers_timeout_names_the_remote_reader_and_what_to_do(children):
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_hwm=2)
    out, cmds = children.queue(), children.queue()
    children.start(stalled_remote_reader, out, mq.export_handle(), 0, cmds)
    mq.wait_until_ready(timeout=STEP)
    children.expect(out, "ready")
    try:
        with pytest.raises(TimeoutError) as info:
            for i in range(10):
                mq.enqueue(i.to_bytes(8, "little"), timeout=0.5)
        message = str(info.value)
        assert "free a chunk" not in message, message  # it has no chunks
        assert "remote reader rank 0 (host 127.0.0.1) has not taken the 2 messages" in message, message
        for advice in ["dequeue", "longer timeout", "remote_hwm", 'slow_remote_reader="drop"']:
            assert advice in message, message
    finally:
        cmds.put(None)


def test_a_loan_too_large_for_the_arena_and_for_memory_says_the_sizes():
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2, arena_bytes=1 << 24)
    holds = "the queue's tensor arena holds 16777216 bytes"
    for nbytes in [2**62, 2**64]:
        with pytest.raises(MemoryError, match=rf"^cannot loan {nbytes} bytes: {holds}, and this process"):
            mq.loan(nbytes)
    with pytest.raises(MemoryError, match=rf"^cannot loan {2**64} bytes: {holds}"):
        mq.loan_array((2**31, 2**31), "float32")  # 2**64 bytes (numpy's product wrapped)
    with pytest.raises(MemoryError, match=rf"^cannot loan {2**63} bytes: {holds}"):
        mq.loan_tensor((2**30, 2**31))
    no_arena = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2, arena_bytes=0)
    with pytest.raises(MemoryError, match=r"this queue has no tensor arena \(arena_bytes=0"):
        no_arena.loan(2**62)
    ring = RingBuffer(1 << 20, create=True)
    store = ObjectStorage(1 << 16, 1, ring)
    try:
        with pytest.raises(MemoryError, match=rf"^cannot loan {2**64} bytes: the store's ring holds 1048576 bytes"):
            store.loan(2**64)
    finally:
        store.close()
        ring.close()


def test_a_message_queue_without_a_role_does_not_say_it_is_a_reader():
    nobody = MessageQueue.__new__(MessageQueue)  # neither MessageQueue(...) nor create_from_handle
    for call, action in [
        (lambda: nobody.enqueue("x"), "enqueue"),
        (lambda: nobody.loan(8), "loan memory"),
        (lambda: nobody.reserve_arena(8), "reserve the tensor arena"),
    ]:
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        assert "is a reader" not in message, message
        assert message.startswith(f"only the writer can {action}: this MessageQueue has no handle"), message
    assert "without a handle" in repr(nobody)
    # A reader still says so.
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    with pytest.raises(RuntimeError, match="^only the writer can enqueue: this MessageQueue is a reader$"):
        reader.enqueue("x")

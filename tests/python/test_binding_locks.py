"""The locks of the binding objects (``src/python/wait.rs``: ``BindingLock``, ``lock``,
``blocking_on``).

Each binding object guards its core state with a mutex, and runs no user code while it
holds it: a ``free_buf`` callback runs with the ring unlocked, so it may use the ring and
its store; a blocking queue call lets go of its reader or writer every few milliseconds
to run signal handlers and its cancel event's ``is_set``, which may therefore call the
same object (its getters, ``shutdown()``), and goes on where it stopped. What could
still meet a held lock is a finalizer that the garbage collector runs while a call makes
a Python object under the lock: calling the same object from there is an error that
names it (``RuntimeError``), never a hang, and the object stays usable.

A lock poisoned by a panic makes every later call that needs it a ``RuntimeError``; no
user code runs under a lock any more, so only a bug in shmq could poison one, and these
tests show instead that a ``PanicException`` raised by user code poisons nothing.
"""

from __future__ import annotations

import pytest

from shmq import MessageQueue, ObjectStorage, RingBuffer

REENTERED = "was called from code that one of its own calls is running"


def test_a_free_buf_callback_may_call_its_ring_and_its_store():
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring)
    try:
        _, first = ring.allocate_buf(8)
        second_address, second = ring.allocate_buf(16)
        seen = []

        def uses_both(i: int, v: memoryview) -> bool:
            # The ring's state as it is while the chunk is asked about (still live), the
            # store's own lock, and the view of this chunk.
            seen.append((i, ring.monotonic_id_start, dict(ring.metadata), store.is_cached("x"), len(v)))
            return i == first

        assert list(ring.free_buf(uses_both)) == [first]
        assert seen == [
            (first, first, {first: 0, second: second_address}, False, 8),
            (second, second, {second: second_address}, False, 16),
        ]
        # vLLM's own check, through the store, inside a callback of ours.
        h = store.put("x", {"a": 1})
        assert list(ring.free_buf(lambda i, v: i == second or store.default_is_free_check(i, v))) == [second]
        assert store.is_cached("x") and ring.monotonic_id_start == h[1]
    finally:
        store.close()


class _EventThatReadsTheReader:
    """A cancel event whose ``is_set`` calls the reader that is waiting on it, and is set
    after a few calls."""

    def __init__(self, reader: MessageQueue, calls: int = 3):
        self.reader = reader
        self.seen: list[int] = []
        self.calls = calls

    def is_set(self) -> bool:
        self.seen.append(self.reader.current_idx)
        return len(self.seen) >= self.calls


def _blocked_reader() -> tuple[MessageQueue, MessageQueue]:
    """A writer and its reader, with nothing sent: the reader's dequeue blocks."""
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    return writer, MessageQueue.create_from_handle(writer.export_handle(), 0)


def test_a_cancel_check_may_call_its_reader():
    writer, reader = _blocked_reader()
    event = _EventThatReadsTheReader(reader)
    with pytest.raises(RuntimeError, match="cancelled"):
        reader.dequeue(timeout=10, cancel=event)
    # It ran while the reader waited (the reader let go of its lock for it), and read it.
    assert event.seen == [0, 0, 0]
    writer.enqueue("then it reads", timeout=10)
    assert reader.dequeue(timeout=10) == "then it reads"


def test_a_cancel_check_may_shut_its_reader_down():
    writer, reader = _blocked_reader()

    class ShutsDown:
        def is_set(self) -> bool:
            # What needs the reader's lock (its state) as well as what does not.
            if reader.current_idx == 0:
                reader.shutdown()
            return False

    with pytest.raises(RuntimeError, match="cancelled"):
        reader.dequeue(timeout=10, cancel=ShutsDown())


def test_a_signal_handler_may_call_the_blocked_writer_and_the_wait_goes_on():
    # The handler runs while the writer waits for room, with the writer let go: it reads
    # the writer, and the enqueue then goes on waiting under its first deadline.
    import signal
    import time

    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.enqueue("m0")  # the ring is full
    idx = writer.current_idx
    seen: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda *args: seen.append(writer.current_idx))
    signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            writer.enqueue("blocked", timeout=0.6)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    waited = time.monotonic() - t0
    assert len(seen) >= 2 and set(seen) == {idx}, seen
    # One deadline for the whole wait, not one per stretch between handlers.
    assert 0.6 <= waited < 5, waited
    assert reader.dequeue(timeout=10) == "m0"
    writer.enqueue("m1", timeout=10)
    assert reader.dequeue(timeout=10) == "m1"


def test_a_call_whose_reader_another_thread_took_meanwhile_still_ends_at_its_deadline():
    # The main thread's dequeue lets go of the reader for its (slow) cancel check; another
    # thread's dequeue takes the reader then and keeps it for its own whole wait (no
    # check: not the main thread, no cancel event). The first call must still end at its
    # own deadline, not wait for the other's.
    import threading
    import time

    writer, reader = _blocked_reader()

    checking = threading.Event()  # the main thread's dequeue is waiting: it checks

    class SlowCheck:
        def is_set(self) -> bool:
            checking.set()
            # Not synchronisation: the slow check under test (run at every check of the
            # call, so the other thread, with the GIL and the reader let go, gets in).
            time.sleep(0.05)
            return False

    other: list[BaseException] = []

    def takes_the_reader() -> None:
        if not checking.wait(10):  # once the main thread's dequeue is waiting
            other.append(AssertionError("the main thread's dequeue never checked its cancel event"))
            return
        try:
            reader.dequeue(timeout=4)
        except BaseException as e:
            other.append(e)

    t = threading.Thread(target=takes_the_reader)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="another thread is using"):
        reader.dequeue(timeout=1.0, cancel=SlowCheck())
    waited = time.monotonic() - t0
    t.join(10)
    assert 1.0 <= waited < 2.5, waited
    assert len(other) == 1 and isinstance(other[0], TimeoutError), other


def test_a_finalizer_that_calls_its_reader_under_its_lock_gets_an_error_not_a_deadlock():
    # The one way left to meet a held lock: the garbage collector runs a finalizer while
    # the reader makes the message's objects under its lock. The core reader is called
    # directly so that the first object made after the collector is armed is the
    # message's tuple of parts, made under the lock.
    import gc
    import pickle

    import threading

    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    t = threading.Thread(target=reader.wait_until_ready, args=(10,))
    t.start()
    writer.wait_until_ready(timeout=10)
    t.join(10)
    errors: list[BaseException] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            try:
                _ = reader.current_idx
            except RuntimeError as e:
                errors.append(e)

    writer.enqueue(pickle.PickleBuffer(bytearray(1 << 20)), timeout=10)  # a part out of band
    core = reader._reader
    old_threshold = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            Cycle()
        gc.set_threshold(1)
        gc.enable()
        got = core.dequeue(10.0, None, False)
    finally:
        gc.set_threshold(*old_threshold)
        gc.enable()
    gc.collect()
    body, buffers = got.body, got.buffers
    assert isinstance(body, bytes) and [len(b) for b in buffers] == [1 << 20]
    # The finalizers ran under the reader's lock: each got the error, none waited.
    assert len(errors) == 10, errors
    assert all(f"this queue reader {REENTERED}" in str(e) for e in errors), errors
    writer.enqueue("still usable", timeout=10)
    assert reader.dequeue(timeout=10) == "still usable"


class _PanickingEvent:
    """A cancel event whose ``is_set`` raises shmq's ``PanicException``."""

    def __init__(self, panic_exception: type[BaseException]):
        self.panic_exception = panic_exception

    def is_set(self) -> bool:
        raise self.panic_exception("a bug in a cancel check")


def _panic_exception() -> type[BaseException]:
    """shmq's ``pyo3_runtime.PanicException`` (made by pyo3 when the extension first
    fetches a Python error; not importable by name)."""
    ring = RingBuffer(4096, create=True)
    try:
        ring.allocate_buf(8)
        with pytest.raises(ZeroDivisionError):
            ring.free_buf(lambda i, v: 1 / 0)
    finally:
        ring.close()
    found = [
        t for t in BaseException.__subclasses__() if t.__module__ == "pyo3_runtime" and t.__name__ == "PanicException"
    ]
    assert found, "pyo3's PanicException was not created"
    # Other pyo3 extensions loaded in this process have their own; any of them works
    # here (none may poison anything).
    return found[0]


def test_a_panic_in_a_free_buf_callback_propagates_and_poisons_nothing():
    panic_exception = _panic_exception()
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(1 << 12, 1, ring)
    try:
        _, first = ring.allocate_buf(8)
        address, monotonic_id = store.put("kept", {"a": 1})

        def panics_at_the_second(i: int, v: memoryview) -> bool:
            if i != first:
                raise panic_exception("a bug in a callback")
            return True

        with pytest.raises(panic_exception):
            ring.free_buf(panics_at_the_second)
        # The callback ran with the ring unlocked: nothing is poisoned. What it approved
        # before the panic stays freed, the rest stays live.
        assert ring.monotonic_id_start == monotonic_id
        assert dict(ring.metadata) == {monotonic_id: address}
        assert store.get(address, monotonic_id) == {"a": 1}
        ring.allocate_buf(8)
        store.put("new", {"b": 2})
        assert list(store.free_unused()) == [], "'kept' was handed out and not read yet"
        ring.clear()
        assert ring.monotonic_id_start == ring.monotonic_id_end
    finally:
        store.close()


def test_a_panic_in_a_cancel_check_propagates_and_poisons_nothing():
    panic_exception = _panic_exception()
    writer, reader = _blocked_reader()
    with pytest.raises(panic_exception):
        reader.dequeue(timeout=10, cancel=_PanickingEvent(panic_exception))
    # The check ran with the reader let go: it is usable, and so is the writer.
    assert reader.current_idx == 0
    writer.enqueue("still works", timeout=10)
    assert reader.dequeue(timeout=10) == "still works"


def test_put_and_free_buf_with_the_stores_check_on_two_threads_do_not_deadlock():
    # vLLM's idiom `ring.free_buf(store.default_is_free_check)` on one thread: the check
    # takes the store's lock with the ring unlocked, each free takes the ring's; `put` on
    # the other thread takes both (ring first) and evicts too. Chunks come and go between
    # a check and its free: the loop frees only the chunk its check approved.
    import threading

    ring = RingBuffer(64 * 1024, create=True)
    # Any reader lock makes the writer's own gets count as reads (the store only checks
    # that there is one).
    store = ObjectStorage(4096, 1, ring, reader_lock=object())
    errors: list[BaseException] = []
    stop = threading.Event()
    freeing = threading.Event()
    done = {"puts": 0, "frees": 0}

    def putter() -> None:
        try:
            # Once the other thread is inside its loop: on a busy machine this one could
            # otherwise finish before that one is first scheduled.
            assert freeing.wait(timeout=30), "the free_buf thread never ran"
            for i in range(3000):
                try:
                    h = store.put(f"k{i}", {"i": i, "pad": b"x" * 500})
                except MemoryError:
                    continue
                store.get(*h)  # counted (reader_lock): the object may then be evicted
                done["puts"] += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            stop.set()

    def freer() -> None:
        try:
            while not stop.is_set():
                ring.free_buf(store.default_is_free_check)
                done["frees"] += 1
                freeing.set()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=putter, daemon=True), threading.Thread(target=freer, daemon=True)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "put and free_buf deadlocked"
        assert errors == []
        # Both sides really ran (a 64 KiB ring holds ~100 of these objects: most puts
        # reused memory that a free, the thread's or put's own, gave back).
        assert done["puts"] > 200 and done["frees"] > 0, done
    finally:
        stop.set()
        store.close()

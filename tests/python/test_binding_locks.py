"""The locks of the binding objects (``src/python/wait.rs``: ``BindingLock``, ``lock``).

Each binding object guards its core state with a mutex, and runs no user code while it
holds it where it can help it: a ``free_buf`` callback runs with the ring unlocked, so it
may use the ring and its store. What still runs under a lock is the check for signals
and a cancel event during a blocking queue call (the wait needs the reader's or the
writer's state). Two ways of misusing a lock are errors that name the object, never a
hang or a silent use:

- **Re-entry**: such a check (a cancel event's ``is_set``, a signal handler) calling the
  same object again would wait for itself forever; it raises ``RuntimeError`` instead,
  and the object stays usable.
- **Poisoning**: a panic while the lock is held (a bug in shmq, or a ``PanicException``
  raised by such a check: pyo3 resumes that as a panic in Rust) may leave the state
  half-updated, so every later call that needs the lock raises ``RuntimeError``. The
  tests poison a lock through that real path; a ``PanicException`` from a ``free_buf``
  callback, which runs with no lock held, poisons nothing.
"""

from __future__ import annotations

import pytest

from shmq import MessageQueue, ObjectStorage, RingBuffer

POISONED = "is unusable: an earlier call panicked while holding its lock"
REENTERED = "was called from a callback that one of its own calls is running"


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
    """A cancel event whose ``is_set`` calls the reader that is waiting on it."""

    def __init__(self, reader: MessageQueue):
        self.reader = reader

    def is_set(self) -> bool:
        return self.reader.current_idx < 0


def test_a_cancel_check_that_calls_its_reader_gets_an_error_not_a_deadlock():
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    with pytest.raises(RuntimeError, match=f"this queue reader {REENTERED}"):
        reader.dequeue(timeout=10, cancel=_EventThatReadsTheReader(reader))
    writer.enqueue("then it reads", timeout=10)
    assert reader.dequeue(timeout=10) == "then it reads"


class _PanickingEvent:
    """A cancel event whose ``is_set`` raises shmq's ``PanicException``."""

    def __init__(self, panic_exception: type[BaseException]):
        self.panic_exception = panic_exception

    def is_set(self) -> bool:
        raise self.panic_exception("a bug in a cancel check")


def _blocked_reader() -> tuple[MessageQueue, MessageQueue]:
    """A writer and its reader, with nothing sent: the reader's dequeue blocks, so its wait
    checks the cancel event with the reader's lock held."""
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    return writer, MessageQueue.create_from_handle(writer.export_handle(), 0)


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
    # Other pyo3 extensions loaded in this process have their own: find shmq's by trying.
    return found[0] if len(found) == 1 else _shmq_panic_exception(found)


def _shmq_panic_exception(candidates: list[type[BaseException]]) -> type[BaseException]:
    for t in candidates:
        writer, reader = _blocked_reader()  # the writer kept: the reader waits for it
        try:
            reader.dequeue(timeout=10, cancel=_PanickingEvent(t))
        except BaseException:
            pass
        try:
            _ = reader.current_idx
        except RuntimeError as e:
            if POISONED in str(e):
                return t
    raise AssertionError("none of pyo3's PanicException types is shmq's")


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


def test_a_panic_in_a_cancel_check_makes_the_reader_unusable():
    panic_exception = _panic_exception()
    writer, reader = _blocked_reader()
    with pytest.raises(panic_exception):
        reader.dequeue(timeout=10, cancel=_PanickingEvent(panic_exception))

    unusable = f"this queue reader {POISONED}"
    with pytest.raises(RuntimeError, match=unusable):
        reader.dequeue(timeout=0)
    with pytest.raises(RuntimeError, match=unusable):
        _ = reader.current_idx
    # The writer is another object, with its own lock: it goes on.
    writer.enqueue("still works", timeout=10)
    assert writer.current_idx == 1


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

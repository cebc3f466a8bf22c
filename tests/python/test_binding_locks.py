"""The locks of the binding objects (``src/python/wait.rs``: ``BindingLock``, ``lock``).

Each binding object guards its core state with a mutex. Two ways of misusing one are
errors that name the object, never a hang or a silent use:

- **Re-entry**: a Python callback that one of the object's calls runs under the lock (a
  ``free_buf`` callback, a cancel event's ``is_set``) calling the same object again would
  wait for itself forever; it raises ``RuntimeError`` instead, and the object stays
  usable.
- **Poisoning**: a panic while the lock is held (a bug in shmq, or a ``PanicException``
  raised by such a callback: pyo3 resumes that as a panic in Rust) may leave the state
  half-updated, so every later call that needs the lock raises ``RuntimeError``. The
  tests poison the locks through those real paths.
"""

from __future__ import annotations

import pytest

from shmq import MessageQueue, ObjectStorage, RingBuffer

POISONED = "is unusable: an earlier call panicked while holding its lock"
REENTERED = "was called from a callback that one of its own calls is running"


def test_a_free_buf_callback_that_calls_its_ring_gets_an_error_not_a_deadlock():
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring)
    try:
        _, first = ring.allocate_buf(8)
        with pytest.raises(RuntimeError, match=f"this ring buffer {REENTERED}"):
            ring.free_buf(lambda i, v: ring.data_buffer_start >= 0)
        seen = []

        def other_objects_are_fine(i: int, v: memoryview) -> bool:
            # The store has a lock of its own; the view is this chunk's.
            seen.append((store.is_cached("x"), len(v)))
            return True

        assert list(ring.free_buf(other_objects_are_fine)) == [first]
        assert seen == [(False, 8)]
        ring.allocate_buf(8)  # not poisoned: an error is not a panic
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
        ring = RingBuffer(4096, create=True)
        try:
            ring.allocate_buf(8)

            def panic(i: int, v: memoryview, t: type[BaseException] = t) -> bool:
                raise t("probe")

            try:
                ring.free_buf(panic)
            except BaseException:
                pass
            try:
                ring.allocate_buf(8)
            except RuntimeError as e:
                if POISONED in str(e):
                    return t
        finally:
            ring.close()
    raise AssertionError("none of pyo3's PanicException types is shmq's")


def test_a_panic_in_a_free_buf_callback_makes_the_ring_and_its_store_unusable():
    panic_exception = _panic_exception()
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(1 << 12, 1, ring)
    try:
        address, monotonic_id = store.put("kept", {"a": 1})

        def panics(i: int, v: memoryview) -> bool:
            raise panic_exception("a bug under the ring's lock")

        with pytest.raises(panic_exception):
            ring.free_buf(panics)

        unusable = f"this ring buffer {POISONED}"
        with pytest.raises(RuntimeError, match=unusable):
            ring.allocate_buf(8)
        with pytest.raises(RuntimeError, match=unusable):
            ring.free_buf(lambda i, v: True)
        with pytest.raises(RuntimeError, match=unusable):
            ring.clear()
        with pytest.raises(RuntimeError, match=unusable):
            _ = ring.monotonic_id_end
        with pytest.raises(RuntimeError, match=unusable):
            store.put("new", {"b": 2})
        with pytest.raises(RuntimeError, match=unusable):
            store.free_unused()
        # What needs no lock still works: the object's bytes and index are intact.
        assert store.is_cached("kept")
        with ring.access_buf(address) as (_, (header_id, _size)):
            assert header_id == monotonic_id
    finally:
        store.close()  # closing needs no lock: the segment is removed all the same


class _PanickingEvent:
    """A cancel event whose ``is_set`` raises shmq's ``PanicException``."""

    def __init__(self, panic_exception: type[BaseException]):
        self.panic_exception = panic_exception

    def is_set(self) -> bool:
        raise self.panic_exception("a bug in a cancel check")


def test_a_panic_in_a_cancel_check_makes_the_reader_unusable():
    panic_exception = _panic_exception()
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    # The reader blocks (nothing sent), so its wait checks the event with its lock held.
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
    # vLLM's idiom `ring.free_buf(store.default_is_free_check)` holds the ring's lock
    # while the check takes the store's; `put` takes both. Both take the ring first, so
    # two threads doing these at once never wait for each other forever.
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

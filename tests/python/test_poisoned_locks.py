"""A binding object whose lock a panic poisoned is unusable, and says so
(``src/python/wait.rs::lock``).

The bindings guard each core object with a mutex. A panic while it is held (a bug in
shmq, or a ``PanicException`` raised by a Python callback that runs under the lock:
pyo3 resumes that as a panic in Rust) may leave the object half-updated, so every later
call that needs the lock raises ``RuntimeError`` naming the object, instead of using it.
The tests poison the locks through real paths: a ``free_buf`` callback (run with the
ring's lock held) and a cancel event checked during a blocked ``dequeue`` (run with the
reader's lock held).
"""

from __future__ import annotations

import pytest

from shmq import MessageQueue, ObjectStorage, RingBuffer

POISONED = "is unusable: an earlier call panicked while holding its lock"


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

"""The object store: ``RingBuffer``, ``ObjectStorage`` and ``ObjectStorageHandle``.

One writer process puts objects under keys; any process reads them by
``(address, monotonic_id)``. The names, signatures and errors are the engines' (vLLM's
``SingleWriterShmRingBuffer`` / ``SingleWriterShmObjectStorage``); the allocator, the
bounds checks and the reader counts are in Rust (``shmq._core``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from . import _core
from ._cleanup import track
from .serde import MsgpackSerde, ObjectSerde

__all__ = ["ObjectStorage", "ObjectStorageHandle", "RingBuffer"]


class _SharedMemory:
    """The ring's memory, shaped like ``multiprocessing.shared_memory.SharedMemory``
    (``name``, ``size``, ``buf``) without its resource tracker."""

    def __init__(self, ring: _core.ChunkRing):
        self._ring = ring
        self.name: str = ring.name
        self.size: int = ring.capacity

    @property
    def buf(self) -> memoryview:
        return memoryview(self._ring.buf())

    def __repr__(self) -> str:
        return f"SharedMemory(name={self.name!r}, size={self.size})"


class RingBuffer:
    """A FIFO allocator of variable-size chunks over a shared-memory ring of
    ``data_buffer_size`` bytes. ``create=True`` makes the segment and this object its
    only writer; otherwise ``name`` opens an existing one for reading.

    Each chunk is ``[4-byte id][4-byte size][data]``, ``size`` counting the header.
    Addresses grow monotonically (``address % data_buffer_size`` is the offset) and ids
    count up from 0, wrapping at ``2**31``.
    """

    ID_NBYTES = 4
    SIZE_NBYTES = 4
    MD_SIZE = ID_NBYTES + SIZE_NBYTES
    ID_MAX = 2**31

    def __init__(self, data_buffer_size: int, name: Optional[str] = None, create: bool = False):
        self.data_buffer_size = data_buffer_size
        self.is_writer = bool(create)
        if create:
            self._core = _core.ChunkRing.create(data_buffer_size, name)
            track(self._core)
        elif name is None:
            raise ValueError("a reader needs the name of an existing ring buffer (create=True makes a new one)")
        else:
            self._core = _core.ChunkRing.open(name, data_buffer_size)
        self.shared_memory = _SharedMemory(self._core)

    def handle(self) -> tuple[int, str]:
        """``(data_buffer_size, name)``: ``RingBuffer(*handle)`` opens it as a reader."""
        return (self.data_buffer_size, self.shared_memory.name)

    def __reduce__(self):
        return (self.__class__, self.handle())

    @staticmethod
    def int2byte(integer: int) -> bytes:
        return integer.to_bytes(4, "little")

    @staticmethod
    def byte2int(byte_data: bytes) -> int:
        return int.from_bytes(byte_data, "little")

    def _state(self) -> tuple[int, int, int, int]:
        return self._core.state() or (0, 0, 0, 0)

    @property
    def data_buffer_start(self) -> int:
        return self._state()[0]

    @property
    def data_buffer_end(self) -> int:
        return self._state()[1]

    @property
    def monotonic_id_start(self) -> int:
        return self._state()[2]

    @property
    def monotonic_id_end(self) -> int:
        return self._state()[3]

    @property
    def metadata(self) -> dict[int, int]:
        """Live chunks on the writer: monotonic id → address."""
        return self._core.live()

    def allocate_buf(self, size: int) -> tuple[int, int]:
        """A chunk for ``size`` bytes of data: ``(address, monotonic_id)``. ``MemoryError``
        when the live chunks leave no room (free some with ``free_buf``)."""
        return self._core.allocate(size)

    @contextmanager
    def access_buf(self, address: int) -> Iterator[tuple[memoryview, tuple[int, int]]]:
        """``(data view, (id, size))`` of the chunk at ``address``; ``ValueError`` if no
        chunk can be there."""
        header = self._core.header(address)
        with memoryview(self._core.data(address)) as view:
            yield view, header

    def free_buf(self, is_free_fn: Callable[[int, memoryview], bool], nbytes: Optional[int] = None) -> Sequence[int]:
        """Free chunks oldest first while ``is_free_fn(id, data)`` is true and fewer than
        ``nbytes`` bytes (default: all) have been freed. Returns the freed ids (a
        ``range``, or a list when they wrap at ``2**31``)."""
        return self._core.free(is_free_fn, nbytes)

    def clear(self) -> None:
        """Forget every chunk (writer only). Handles issued before fail from now on."""
        self._core.clear()

    def __repr__(self) -> str:
        role = "writer" if self.is_writer else "reader"
        return f"<RingBuffer {role} {self.shared_memory.name!r} {self.data_buffer_size} bytes>"


@dataclass
class ObjectStorageHandle:
    """What a reader process needs to open an ``ObjectStorage``; picklable."""

    max_object_size: int
    n_readers: int
    ring_buffer_handle: tuple[int, str]
    serde_class: type[ObjectSerde]
    reader_lock: Any = None


class ObjectStorage:
    """Key → object store on a ``RingBuffer``: one writer, ``n_readers`` reader processes.

    Objects are stored as ``[4-byte reader count][metadata][data]``. Readers increment the
    count atomically when they ``get``; an object is evicted (oldest first, when ``put``
    needs room) only once every reader has read it as many times as it was handed out
    (``put`` and each ``get_cached``). ``reader_lock`` is accepted for compatibility; it is
    not needed. A ``get`` in the writer's process counts as a read only if it was given.
    """

    def __init__(
        self,
        max_object_size: int,
        n_readers: int,
        ring_buffer: RingBuffer,
        serde_class: type[ObjectSerde] = MsgpackSerde,
        reader_lock: Any = None,
    ):
        self.max_object_size = max_object_size
        self.n_readers = n_readers
        self.ring_buffer = ring_buffer
        self.serde_class = serde_class
        self.ser_de = serde_class()
        self.is_writer = ring_buffer.is_writer
        self.flag_bytes = 4
        self._reader_lock = reader_lock
        self._core = _core.ObjectStore(ring_buffer._core, max_object_size, n_readers, reader_lock is not None)
        self._deserialize = self.ser_de.deserialize

    def put(self, key: str, value: Any) -> tuple[int, int]:
        """Store ``value`` under ``key``: ``(address, monotonic_id)``. ``ValueError`` if the
        key exists or the serialized object exceeds ``max_object_size``; ``MemoryError``
        if there is no room after freeing every object all readers have finished with."""
        if not self.is_writer:
            raise RuntimeError("Only the writer can put objects.")
        data, _, metadata, _ = self.ser_de.serialize(value)
        parts = [metadata, *data] if isinstance(data, list) else [metadata, data]
        return self._core.put(key, parts)

    def get(self, address: int, monotonic_id: int) -> Any:
        """The object at ``(address, monotonic_id)``; ``ValueError`` ("has been modified or
        is invalid") if it was evicted, cleared or never there."""
        return self._core.get(address, monotonic_id, self._deserialize)

    def is_cached(self, key: str) -> bool:
        return self._core.is_cached(key)

    def get_cached(self, key: str) -> tuple[int, int]:
        """``(address, monotonic_id)`` of a stored key, handing the object out once more
        (each reader is expected to read it once more before it can be evicted)."""
        return self._core.get_cached(key)

    def free_unused(self) -> Sequence[int]:
        """Free the oldest objects that every reader has finished with; their ids."""
        return self._core.free_unused()

    def clear(self) -> None:
        """Forget every object (writer only); old handles fail from now on."""
        if not self.is_writer:
            raise RuntimeError("Only the writer can clear the storage.")
        self._core.clear()

    def handle(self) -> ObjectStorageHandle:
        return ObjectStorageHandle(
            self.max_object_size, self.n_readers, self.ring_buffer.handle(), self.serde_class, self._reader_lock
        )

    @staticmethod
    def create_from_handle(handle: ObjectStorageHandle) -> "ObjectStorage":
        """Open the store of ``handle`` as a reader."""
        ring = RingBuffer(*handle.ring_buffer_handle)
        return ObjectStorage(handle.max_object_size, handle.n_readers, ring, handle.serde_class, handle.reader_lock)

    def reader_count(self, address: int, monotonic_id: int) -> int:
        """How many reads the object at ``(address, monotonic_id)`` has had."""
        return self._core.reader_count(address, monotonic_id)

    @property
    def key_index(self) -> Optional[dict[str, tuple[int, int]]]:
        """Writer side: key → ``(address, monotonic_id)`` (``None`` on readers)."""
        if not self.is_writer:
            return None
        return {k: (a, i) for k, (a, i, _) in self._core.entries().items()}

    @property
    def id_index(self) -> Optional[dict[int, str]]:
        """Writer side: monotonic id → key (``None`` on readers)."""
        if not self.is_writer:
            return None
        return {i: k for k, (_, i, _) in self._core.entries().items()}

    @property
    def writer_flag(self) -> Optional[dict[int, int]]:
        """Writer side: monotonic id → times handed out (``None`` on readers)."""
        if not self.is_writer:
            return None
        return {i: n for _, (_, i, n) in self._core.entries().items()}

    def __repr__(self) -> str:
        role = "writer" if self.is_writer else "reader"
        return f"<ObjectStorage {role} {self.ring_buffer.shared_memory.name!r} n_readers={self.n_readers}>"

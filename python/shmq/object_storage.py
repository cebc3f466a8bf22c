"""The object store: ``RingBuffer``, ``ObjectStorage`` and ``ObjectStorageHandle``.

One writer process puts objects under keys; any process reads them by
``(address, monotonic_id)``. The names, signatures, errors and behaviour are vLLM 0.33's
(``SingleWriterShmRingBuffer`` / ``SingleWriterShmObjectStorage``), signed handles
included; the allocator, the bounds checks, the reader counts and the HMAC are in Rust
(``shmq._core``). Where shmq differs from vLLM 0.33, ``docs/compatibility.md`` says so.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import multiprocessing.util as _mp_util
import struct
import weakref
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterator,
    Literal,
    NamedTuple,
    NoReturn,
    Optional,
    Sequence,
    Union,
    cast,
)

from . import _core, _ipc
from ._cleanup import created_segments
from ._device import Device, address_of
from ._device_reader import DeviceReader, DeviceSources, tensor_leaves
from ._loans import loan_memory, loaned_array, loaned_tensor
from ._segment_memory import SegmentMemory
from .serde import Buffer, MsgpackSerde, ObjectSerde, store_codec

if TYPE_CHECKING:  # for annotations only: importing shmq imports neither
    import numpy.typing as npt
    import torch

__all__ = [
    "ObjectStorage",
    "ObjectStorageHandle",
    "ReaderSlotInfo",
    "RingBuffer",
    "StoreReaderDiedError",
    "VIEW_THRESHOLD",
]

#: Default ``ObjectStorage.view_threshold``: below it a private mapping costs more than
#: a copy.
VIEW_THRESHOLD = 256 * 1024


class StoreReaderDiedError(_core.PeerDiedError, MemoryError):
    """``put`` found no room because the oldest object waits for a reader that died
    before reading it (``on_dead_reader="raise"``, the default): the message names the
    reader (its slot and pid). A ``PeerDiedError``, as the queue's, and a ``MemoryError``
    too: a full store, which vLLM's callers catch as such."""


@dataclass(frozen=True)
class ObjectRef:
    """One object of a store, as a reader needs it: what the writer's ``ref(key)``
    returns and a reader's ``get(ref)`` takes. Picklable and small (a few dozen bytes):
    the writer hands it to readers in a message (e.g. in a ``MessageQueue`` step) instead
    of the four values ``get`` otherwise takes. It names the object, not the store: each
    reader gets it from its own ``ObjectStorage`` of that store."""

    address: int
    monotonic_id: int
    #: The signature of the object's handle (32 ints): the reader's check that the
    #: reference came from the writer and names this object.
    signature: tuple[int, ...]
    key: str


class ReaderSlotInfo(NamedTuple):
    """A reader slot of a store, as ``ObjectStorage.readers()`` shows it."""

    slot: int
    #: The process that took it last (``None``: nobody has).
    pid: Optional[int]
    #: ``"empty"``, ``"attaching"``, ``"alive"``, ``"unknown"`` (alive as far as can be
    #: told from here), ``"left"`` (its reader closed the store), ``"dead"`` (died without
    #: closing it: its lock is free), ``"dropped"`` (the writer went on without it).
    status: str
    #: Reads counted by its readers.
    reads: int


class _Closed:
    """Stands in for a closed store's or ring's core: every use says it is closed."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"{self._what} has been closed")


class _LiveBlocks(Mapping):
    """The writer's live blocks, monotonic id → address (vLLM's ``metadata`` dict), read
    from the allocator on each access: no copy is kept in Python."""

    def __init__(self, ring: "RingBuffer"):
        # Weak: the ring owns this mapping, which must not keep it (and its segment) alive.
        self._ring = weakref.ref(ring)

    @property
    def _core(self) -> Any:
        ring = self._ring()
        return ring._core if ring is not None else _Closed("the ring buffer")

    def __getitem__(self, monotonic_id: int) -> int:
        address = self._core.block_address(monotonic_id) if type(monotonic_id) is int else None
        if address is None:
            raise KeyError(monotonic_id)
        return address

    def __iter__(self) -> Iterator[int]:
        return iter(self._core.live())

    def __len__(self) -> int:
        return self._core.live_len()

    def __repr__(self) -> str:
        return repr(dict(self))


class RingBuffer:
    """A FIFO allocator of variable-size blocks over a shared-memory ring of
    ``data_buffer_size`` bytes (vLLM's ``SingleWriterShmRingBuffer``). ``create=True``
    makes the segment (named ``name``, or a fresh name) and this object its only writer;
    otherwise ``name`` opens an existing one for reading.

    Each block is ``[4-byte id][4-byte size][data]``, ``size`` counting the header, and
    the next block starts right after it. Addresses and ids follow vLLM 0.33's
    arithmetic: ``address % data_buffer_size`` is the offset; ids count up from 0,
    wrapping at ``2**31``, and keep counting across ``clear()``, after which addresses
    restart at 0.
    """

    # vLLM's names for the core's layout constants (defined once, in the core).
    MD_SIZE: int = _core.BLOCK_HEADER_BYTES  # [id][size]
    ID_NBYTES = SIZE_NBYTES = MD_SIZE // 2
    ID_MAX: int = _core.ID_MAX
    AUTH_SECRET_BYTES: int = _core.SECRET_BYTES
    #: Where the ring starts in ``shared_memory.buf``: at 0 (the signing secret is in the
    #: segment's header, outside ``buf``; vLLM keeps it in the first 32 bytes of ``buf``).
    DATA_OFFSET = 0

    def __init__(self, data_buffer_size: int, name: Optional[str] = None, create: bool = False):
        self.data_buffer_size = data_buffer_size
        self.is_writer = bool(create)
        #: The writer of a segment named by its caller: an ``ObjectStorage`` on it can be
        #: opened by that name (``ObjectStorage.open``).
        self._named = bool(create) and name is not None
        if create:
            self._core: Any = _core.BlockFifo.create(data_buffer_size, name)
            created_segments()
        elif name is None:
            raise ValueError("a reader needs the name of an existing ring buffer (create=True makes a new one)")
        else:
            self._core = _core.BlockFifo.open(name, data_buffer_size)
        core = self._core  # not self: the memory must not keep the ring alive
        self.shared_memory = SegmentMemory(core.name, lambda: core, core.size)
        self._metadata = _LiveBlocks(self)

    def handle(self) -> tuple[int, str]:
        """``(data_buffer_size, name)``: ``RingBuffer(*handle)`` opens it as a reader."""
        return (self.data_buffer_size, self.shared_memory.name)

    def __reduce__(self):
        return (self.__class__, self.handle())

    def int2byte(self, integer: int) -> bytes:
        """4 bytes, little-endian, signed (the header's encoding)."""
        return integer.to_bytes(self.ID_NBYTES, "little", signed=True)

    def byte2int(self, byte_data: bytes | memoryview) -> int:
        return int.from_bytes(byte_data, "little", signed=True)

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
    def metadata(self) -> Mapping[int, int]:
        """Live blocks on the writer: monotonic id → address."""
        return self._metadata

    def get_auth_secret(self) -> bytes:
        """The 32-byte secret that signs the store's handles (any process that can open
        the segment can read it; the segment is owner-only)."""
        return self._core.secret()

    def allocate_buf(self, size: int) -> tuple[int, int]:
        """A block for ``size`` bytes of data: ``(address, monotonic_id)``. ``MemoryError``
        when the live blocks leave no room (free some with ``free_buf``)."""
        return self._core.allocate(size)

    def access_buf(self, address: int) -> AbstractContextManager[tuple[memoryview, tuple[int, int]]]:
        """``(data view, (id, size))`` of the block at ``address``; ``ValueError`` if no
        block can be there. The view is released when the ``with`` statement ends."""
        return _BlockAccess(self, address)

    def free_buf(self, is_free_fn: Callable[[int, memoryview], bool], nbytes: Optional[int] = None) -> Sequence[int]:
        """Free blocks oldest first while ``is_free_fn(id, data)`` is true and fewer than
        ``nbytes`` bytes (default: all) have been freed. Returns the freed ids (a
        ``range``, or a list when they wrap at ``2**31`` or are not consecutive).
        ``is_free_fn`` runs with the ring unlocked: it may use the ring (its state,
        ``metadata``, allocating, freeing, clearing) and its store, as may other threads
        meanwhile. Only blocks live when ``free_buf`` starts are asked about, and only a
        block ``is_free_fn`` approved is freed: one that went meanwhile is skipped and the
        next oldest asked. An exception from ``is_free_fn`` propagates; the blocks it
        approved before stay freed."""
        return self._core.free(is_free_fn, nbytes)

    def clear(self) -> None:
        """Forget every block (writer only). Ids keep counting and addresses restart at
        0; handles issued before read their data until the memory is reused."""
        self._core.clear()

    def close(self) -> None:
        """Let go of the segment: the writer removes its name; the memory is unmapped
        once no object of this process uses it. Idempotent."""
        core = self._core
        if isinstance(core, _Closed):
            return
        self._core = _Closed("the ring buffer")
        self.shared_memory.close()
        if self.is_writer:
            core.unlink()

    def __repr__(self) -> str:
        role = "writer" if self.is_writer else "reader"
        return f"<RingBuffer {role} {self.shared_memory.name!r} {self.data_buffer_size} bytes>"


class _BlockAccess:
    """``RingBuffer.access_buf``'s context manager: the block is looked up on entry and
    its view released on exit, as a ``@contextmanager`` generator would, at half the
    cost of one (a generator frame and its wrapper on every access)."""

    __slots__ = ("_ring", "_address", "_view")

    def __init__(self, ring: RingBuffer, address: int):
        self._ring = ring
        self._address = address

    def __enter__(self) -> tuple[memoryview, tuple[int, int]]:
        core = self._ring._core
        header = core.header(self._address)
        self._view = view = memoryview(core.data(self._address))
        return view, header

    def __exit__(self, *exc: object) -> None:
        self._view.release()


@dataclass
class ObjectStorageHandle:
    """What a reader process needs to open an ``ObjectStorage``; picklable."""

    max_object_size: int
    n_readers: int
    ring_buffer_handle: tuple[int, str]
    serde_class: type[ObjectSerde]
    reader_lock: Any = None


class _KeyIndex(Mapping):
    """key → ``(address, monotonic_id)`` of the stored objects (vLLM's ``key_index``),
    read from the core on each access."""

    def __init__(self, store: "ObjectStorage"):
        # Weak: the store owns this mapping, which must not keep it (and its segment)
        # alive until a garbage collection.
        self._store = weakref.ref(store)

    @property
    def _core(self) -> Any:
        store = self._store()
        return store._core if store is not None else _Closed("the object storage")

    def __getitem__(self, key: str) -> tuple[int, int]:
        entry = self._core.entry(key) if type(key) is str else None
        if entry is None:
            raise KeyError(key)
        return entry[0], entry[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._core.entries())

    def __len__(self) -> int:
        return len(self._core)

    def __repr__(self) -> str:
        return repr(dict(self))


class _IdIndex(_KeyIndex):
    """monotonic id → key (vLLM's ``id_index``)."""

    def __getitem__(self, monotonic_id: int) -> str:  # type: ignore[override]
        key = self._core.key_of(monotonic_id) if type(monotonic_id) is int else None
        if key is None:
            raise KeyError(monotonic_id)
        return key

    def __iter__(self) -> Iterator[int]:  # type: ignore[override]
        return iter([i for _, i, _ in self._core.entries().values()])


class _WriterFlag(_IdIndex):
    """monotonic id → times handed out (vLLM's ``writer_flag``)."""

    def __getitem__(self, monotonic_id: int) -> int:  # type: ignore[override]
        entry = self._core.entry(super().__getitem__(monotonic_id))
        # Removed by another thread between the two lookups, or removed and put again
        # (then the key names a newer object: not this id's count).
        if entry is None or entry[1] != monotonic_id:
            raise KeyError(monotonic_id)
        return entry[2]


def _to_device(tensor: Any, device: Any) -> Any:
    return tensor.to(device)


def _buffer_of(memory: Any) -> memoryview:
    return cast(memoryview, memory.buf)


def _close_quietly(reader: DeviceReader) -> None:
    try:
        reader.close()
    except Exception as e:  # a finalizer: say so, never raise
        logging.getLogger("shmq.device").warning("shmq: closing a store's device registration failed: %s", e)


class ObjectStorage:
    """Key → object store on a ``RingBuffer``: one writer, ``n_readers`` reader processes
    (vLLM's ``SingleWriterShmObjectStorage``).

    Readers increment an object's count atomically when they ``get`` it; an object is
    evicted (oldest first, when ``put`` needs room) only once every reader has read it
    as many times as it was handed out (``put`` and each ``get_cached``), and not while
    the writer protects it with ``touch(key)``. Handles are signed: a reader's ``get`` and
    ``touch`` need ``signature`` and ``key`` (from the writer's ``get_signature(key)``)
    and refuse anything else with ``ValueError`` ("SHM handle signature") before reading
    at the address. ``reader_lock`` is accepted for compatibility and not needed (counts
    are atomic); a ``get`` in the writer's process counts as a read only if it was given.

    Each reader takes a *reader slot* (one of the first ``n_readers``; ``reader_slot``),
    whose lock proves it alive, and counts its reads there; ``close()`` gives it back. A
    ``put`` that finds no room because the oldest object waits for a reader that died
    (without closing the store) does what ``on_dead_reader`` says: ``"raise"`` (the
    default) raises ``StoreReaderDiedError`` (a ``PeerDiedError`` and a ``MemoryError``)
    naming it; ``"drop"`` goes on without it: from then on no object waits for its reads
    (``dropped_readers``), until a reader that opens the store takes its slot (then the
    objects stored from then on wait for that one). A reader that is alive, however slow, is never dropped; one that
    closed the store is not dead: its reads are still expected, of the next reader that
    opens the store. Other full stores are a ``MemoryError`` saying what holds the room;
    ``clear()`` empties the store at once.
    """

    def __init__(
        self,
        max_object_size: int,
        n_readers: int,
        ring_buffer: RingBuffer,
        serde_class: type[ObjectSerde] = MsgpackSerde,
        reader_lock: Any = None,
        *,
        view_threshold: int = VIEW_THRESHOLD,
        on_dead_reader: Literal["raise", "drop"] = "raise",
        device_seam: Union[None, str, Device] = None,
        ipc: bool = False,
    ):
        if type(view_threshold) is not int or view_threshold < 0:
            raise ValueError(f"view_threshold must be an int >= 0, got {view_threshold!r}")
        self.max_object_size = max_object_size
        #: Tensor and array data of this many bytes or more come out of ``get`` as views
        #: of the shared memory; smaller ones as copies.
        self.view_threshold = view_threshold
        self.n_readers = n_readers
        self.ring_buffer = ring_buffer
        self.serde_class = serde_class
        self.ser_de = serde_class()
        #: A serde that puts tensors on a device itself (``shmq.vllm_serde`` under
        #: ``SHMQ_DEVICE_PATH=1``): where a plain ``get`` puts them, and which.
        self._read_device: Optional[Callable[[], Any]] = getattr(self.ser_de, "shmq_read_device", None)
        #: Writer: device tensors are put by IPC handle (see ``put``); ``_exported`` keeps
        #: them by key while their object is in the store.
        self.ipc = bool(ipc)
        self._exported: dict[str, list[Any]] = {}
        self.is_writer = ring_buffer.is_writer
        #: Bytes vLLM counts for the reader flag of an object in ``max_object_size`` (vLLM's
        #: name; the core stores an 8-byte count word, count and id tag, in front of it).
        self.flag_bytes: int = _core.COUNT_BYTES
        self._reader_lock = reader_lock
        self._core: Any = _core.ObjectStore(
            ring_buffer._core, max_object_size, n_readers, reader_lock is not None, on_dead_reader
        )
        #: What the writer's ``put`` does about a reader that died holding the room.
        self.on_dead_reader: str = on_dead_reader
        #: The device seam of ``get(..., device=)``: ``"twin"``, ``"cuda"``, a ``Device``,
        #: or ``None`` for ``SHMQ_DEVICE`` (see ``shmq._device.device_for``).
        self.device_seam = device_seam
        self._device: Optional[DeviceReader] = None
        #: Copies on the device of tensors put by IPC handle.
        self._ipc_copies: Optional[DeviceSources] = None
        if not self.is_writer:
            # A reader gives its slot back when it closes, when it is dropped, and at the
            # process's normal exit (multiprocessing runs exit finalizers also in children
            # that leave through os._exit): the writer never takes it for a dead one.
            self._leave: Any = _mp_util.Finalize(self, self._core.close, exitpriority=0)
        codec = store_codec(self.ser_de)
        self._parts: Optional[Callable[[Any], list[Buffer]]]
        self._load: Callable[[Any], Any]
        if codec is not None:
            # Built-in serdes: the store frames the parts itself and keeps tensor and
            # array data 64-byte aligned in shared memory.
            self._parts, self._load = codec
            self._split = True
            load = self._load
            self._load_owned: Optional[Callable[[list[Any]], Any]] = lambda parts: load(parts, True)
        else:
            self._parts, self._load, self._split = None, self.ser_de.deserialize, False
            self._load_owned = None
        self._name_release: Optional[Callable[[], Any]] = None
        if self.is_writer and ring_buffer._named:
            self._claim_name()
        if self.is_writer:
            self.key_index: Optional[Mapping[str, tuple[int, int]]] = _KeyIndex(self)
            self.id_index: Optional[Mapping[int, str]] = _IdIndex(self)
            self.writer_flag: Optional[Mapping[int, int]] = _WriterFlag(self)
        else:
            self.key_index = self.id_index = self.writer_flag = None

    # -- writer ----------------------------------------------------------------------

    def put(self, key: str, value: Any) -> tuple[int, int]:
        """Store ``value`` under ``key``: ``(address, monotonic_id)``. ``ValueError`` if the
        key exists or the serialized object exceeds ``max_object_size``; ``MemoryError``
        if there is no room after freeing every object all readers have finished with,
        saying what holds the room (the oldest object, and which readers it waits for);
        ``StoreReaderDiedError`` (a ``PeerDiedError`` and a ``MemoryError``) if one of
        them died, unless ``on_dead_reader="drop"``, which goes on without it.

        With ``ipc=True`` (the store's option, for readers on this machine): the value's
        device tensors (CUDA; with the CPU twin of the device seam, every tensor) are put
        by IPC handle, not copied; a reader's ``get`` opens each allocation once (while
        it holds the object) and gets that device memory, or, with ``device=``, a copy
        of it there. This process keeps each tensor while its object is in the store
        (a reader that opened it holds the memory itself). Not yet run on a GPU."""
        if self.ipc and self.is_writer:
            return self._put_by_handle(key, value)
        return self._put(key, value)

    def _put(self, key: str, value: Any) -> tuple[int, int]:
        core = self._core
        # core.put refuses a reader ("Only the writer can put objects.") and a known key
        # ("Key '...' already exists in the storage.") under the lock it takes anyway:
        # neither check is repeated here.
        parts_of = self._parts
        try:
            if parts_of is not None:
                return core.put(key, parts_of(value), 1)
            data, _, metadata, _ = self.ser_de.serialize(value)
            parts = [metadata, *data] if isinstance(data, list) else [metadata, data]
            return core.put(key, parts, len(parts))
        except _core.PeerDiedError as e:
            raise StoreReaderDiedError(*e.args) from None

    def _put_by_handle(self, key: str, value: Any) -> tuple[int, int]:
        """``put`` with ``ipc=True``: the value's device tensors by IPC handle, kept here
        while the object is in the store (a reader opens them while it holds the object;
        once opened, the reader holds the memory itself)."""
        for gone in [k for k in self._exported if not self.is_cached(k)]:
            del self._exported[gone]
        exported: list[Any] = []
        placed = self._put(key, _ipc.publish(value, self.device_seam, False, exported))
        if exported:
            self._exported[key] = exported
        return placed

    def loan(self, nbytes: int) -> memoryview:
        """Writer: ``nbytes`` of writable shared memory in the ring, to fill in place (e.g.
        a model's output written straight into it). A later ``put`` of an object whose
        tensor or array is exactly this memory (see ``loan_tensor``/``loan_array``)
        writes the rest of the object around it: no copy, and seals the loan: later writes
        into it are the writer's own (copy-on-write), never seen by readers of the object.
        The memory stays while the loan lives, also once put (the object is not evicted
        before): drop it after the put. Dropped without a put, it is given back. With no room in the ring, this is
        ordinary memory (counted in ``loan_fallbacks``) and ``put`` copies it."""
        if not self.is_writer:
            raise RuntimeError("Only the writer can loan memory.")
        memory, fell_back = loan_memory(
            self._core.loan,
            nbytes,
            lambda: (
                f"the store's ring holds {self.ring_buffer.data_buffer_size} bytes "
                f"(objects of at most max_object_size={self.max_object_size})"
            ),
        )
        self.loan_fallbacks += fell_back
        return memory

    #: Loans that got ordinary memory because the ring had no room.
    loan_fallbacks = 0

    def loan_tensor(self, shape: Any, dtype: Any = None) -> torch.Tensor:
        """A torch tensor of ``shape`` and ``dtype`` (default float32) in loaned memory,
        to fill in place and ``put`` without a copy (see ``loan``)."""
        return cast("torch.Tensor", loaned_tensor(self.loan, shape, dtype))

    def loan_array(self, shape: Any, dtype: Any = "float32") -> npt.NDArray[Any]:
        """A numpy array of ``shape`` and ``dtype`` in loaned memory, to fill in place
        and ``put`` without a copy (see ``loan``)."""
        return cast("npt.NDArray[Any]", loaned_array(self.loan, shape, dtype))

    def is_cached(self, key: str) -> bool:
        return self._core.is_cached(key)

    def get_cached(self, key: str) -> tuple[int, int]:
        """``(address, monotonic_id)`` of a stored key, handing the object out once more
        (each reader is expected to read it once more before it can be evicted); ends a
        ``touch`` of it. ``KeyError`` for an unknown key."""
        return self._core.get_cached(key)

    def ref(self, key: str) -> ObjectRef:
        """Writer: a picklable reference to the object stored under ``key`` (see
        ``ObjectRef``), for readers' ``get(ref)``, handing the object out once more as
        ``get_cached`` does (every reader is then expected to read it once more before it
        can be evicted: what sending a cached object to the readers again means).
        ``KeyError`` if no object has that key (never put, or evicted)."""
        address, monotonic_id = self.get_cached(key)
        return ObjectRef(address, monotonic_id, tuple(self.get_signature(key)), key)

    def put_ref(self, key: str, value: Any) -> ObjectRef:
        """Writer: ``put(key, value)``, returning the object's ``ObjectRef`` (see ``ref``)."""
        address, monotonic_id = self.put(key, value)
        return ObjectRef(address, monotonic_id, tuple(self.get_signature(key)), key)

    def get_signature(self, key: str) -> list[int]:
        """The signature of ``key``'s current handle (32 ints), for readers to check."""
        return self._core.get_signature(key)

    def release_touches(self) -> None:
        """Stop protecting touched objects that were not handed out again."""
        self._core.release_touches()

    def increment_writer_flag(self, id: int) -> None:
        """Count one more hand-out of the object ``id`` (what ``get_cached`` does)."""
        self._core.increment_writer_flag(id)

    def free_unused(self) -> Sequence[int]:
        """Free the oldest objects that every reader has finished with; their ids."""
        return self._core.free_unused()

    def default_is_free_check(self, id: int, buf: memoryview) -> bool:
        """Whether the object ``id`` (its block data ``buf``, from the ring) may be
        evicted: not touched, and read ``n_readers`` times per hand-out."""
        return self._core.is_free(id, buf)

    def clear(self) -> None:
        """Forget every object (writer): how to empty a full store at once, whatever its
        objects wait for. Ids keep counting; handles issued before keep reading their
        objects until new ones are written over them, then raise ``ValueError`` ("has been
        modified or is invalid"). Objects a zero-copy view holds stay until it is dropped.
        A no-op on a reader."""
        if self.is_writer:
            self._core.clear()

    @property
    def dropped_readers(self) -> list[int]:
        """Writer: reader slots dropped after their readers died (``on_dead_reader="drop"``)."""
        return self._core.dropped_readers() if self.is_writer else []

    @property
    def reader_slot(self) -> Optional[int]:
        """Reader: the reader slot it counts its reads in (``None``: it found none free, as
        when more live readers open the store than ``n_readers``, and reads anonymously:
        its reads never count in place of a reader that holds a slot, and the writer
        cannot tell whether it lives)."""
        return self._core.reader_slot

    def readers(self) -> list[ReaderSlotInfo]:
        """The store's reader slots (the first ``n_readers``): who holds each, whether it
        lives, what it has read. Only the writer can tell a dead reader (``"dead"``)."""
        return [ReaderSlotInfo(*r) for r in self._core.readers()]

    # -- any side --------------------------------------------------------------------

    def get(
        self,
        address: Union[int, ObjectRef],
        monotonic_id: Optional[int] = None,
        signature: Optional[list[int]] = None,
        key: Optional[str] = None,
        copy: bool = False,
        *,
        device: Any = None,
    ) -> Any:
        """The object at ``(address, monotonic_id)``, or the object an ``ObjectRef``
        names (``get(ref)``, ``get(ref, copy=True)``). A reader needs the handle's
        ``signature`` and ``key`` (``ValueError`` "SHM handle signature" otherwise, before
        anything is read), which a reference carries. ``ValueError`` ("has been modified or is invalid") if the
        object was evicted, overwritten or never there.

        With the built-in serdes, tensors and arrays of ``view_threshold`` bytes or more
        come back as zero-copy views of the shared memory (``get`` costs the same for
        any size): private copy-on-write mappings, writable, whose writes reach nobody
        else. The object is not evicted (and ``clear()`` moves nothing) while a view of
        it lives in any process; a process that dies drops its views. ``copy=True``
        returns owned copies instead.

        ``device`` (e.g. ``"cuda:0"``): the object's tensors come back in that device's
        memory, copied from this process's *shared* mapping of the store (registered
        with the device block by block, as copies first read them) while the object is held; the
        object is given back only once each copy's event says it ended (checked at each
        ``device=`` call, by ``release_device_copies()`` and at ``close()``, which waits).
        A mapping the device refuses to register (logged once), or a serde the store does
        not frame itself, takes the host path: the host value, each tensor ``.to(device)``.
        Which device implementation: ``device_seam`` (docs/guide.md, "The device path")."""
        if isinstance(address, ObjectRef):
            if monotonic_id is not None or signature is not None or key is not None:
                raise TypeError("get(ref) takes the reference alone (and copy=, device=)")
            ref = address
            address, monotonic_id, signature, key = ref.address, ref.monotonic_id, list(ref.signature), ref.key
        elif monotonic_id is None:
            raise TypeError("get() needs (address, monotonic_id[, signature, key]) or an ObjectRef")
        if device is None and not copy and self._read_device is not None:
            device = self._read_device()
            if device is not None:  # the serde's device path (shmq.vllm_serde's switch)
                leaves = getattr(self.ser_de, "shmq_device_leaves")  # noqa: B009  # the serde's, beside shmq_read_device
                return self._get_to_device(address, monotonic_id, signature, key, device, leaves)
        elif device is not None:
            return self._get_to_device(address, monotonic_id, signature, key, device)
        load_owned = self._load_owned
        if load_owned is not None and not copy:
            load = functools.partial(self._load_handles, load_owned, None)
            return self._core.get(address, monotonic_id, signature, key, load, True, self.view_threshold)
        load = functools.partial(self._load_handles, self._load, None)
        return self._core.get(address, monotonic_id, signature, key, load, self._split)

    def _load_handles(self, load: Callable[..., Any], device: Any, *args: Any) -> Any:
        """``load(*args)`` (the decode, inside the core's get: the object is held), and for
        an object put with ``ipc=True`` its opened tensors copied on ``device`` (or their
        own) and waited for, still inside the hold: the writer lets a tensor go once its
        object leaves the store, which nothing else keeps it from after ``get``."""
        value = load(*args)
        if not _ipc.has_handles(value):
            return value
        sources = self._ipc_copies
        if sources is None:
            what = f"store {self.ring_buffer.shared_memory.name!r}"
            sources = self._ipc_copies = DeviceSources(what, self.device_seam)
        value = _ipc.resolve(value, device, sources, None, functools.partial(_to_device, device=device))
        sources.wait_ipc()
        return value

    def _get_to_device(
        self,
        address: int,
        monotonic_id: int,
        signature: Any,
        key: Any,
        device: Any,
        leaves: Callable[[Any, Callable[[Any], Any]], Any] = tensor_leaves,
    ) -> Any:
        reader = self._device
        if reader is None:
            memory = self.ring_buffer.shared_memory
            # The getter holds the segment, not the store (no cycle): a store collected
            # without close() still waits for its copies and unregisters (the finalizer).
            reader = self._device = DeviceReader(
                functools.partial(_buffer_of, memory), f"store {memory.name!r}", self.device_seam
            )
            weakref.finalize(self, _close_quietly, reader)
        reader.release_done()
        load_owned = self._load_owned
        if load_owned is None or not reader.usable():
            load_host = functools.partial(self._load_handles, self._load, device)
            value = self._core.get(address, monotonic_id, signature, key, load_host, self._split)
            return leaves(value, functools.partial(_to_device, device=device))
        # Where each viewed part lies in the shared mapping: read in the part table, which
        # ends where the first part (read in place, in the shared mapping) begins.
        shared: dict[int, tuple[int, int]] = {}  # view address -> (shared address, bytes)
        kept: list[Any] = []

        def load(parts: list[Any]) -> Any:
            n = len(parts)
            if n:
                head = address_of(parts[0])
                table_at = head - 8 * n
                if reader.contains(table_at, 8 * n):
                    table = struct.unpack(f"<{2 * n}I", ctypes.string_at(table_at, 8 * n))
                    start = head - table[0]
                    if table[1] == len(parts[0]):
                        for k in range(1, n):
                            off, nbytes = table[2 * k], table[2 * k + 1]
                            part = parts[k]
                            if type(part) is memoryview and nbytes == part.nbytes and nbytes:
                                if reader.contains(start + off, nbytes):
                                    shared[address_of(part)] = (start + off, nbytes)
            kept.append(parts)  # the views: they hold the object until the copies end
            return self._load_handles(load_owned, device, parts)

        value = self._core.get(address, monotonic_id, signature, key, load, True, self.view_threshold)
        hold = (kept, value)

        def to_device(t: Any) -> Any:
            nbytes = t.numel() * t.element_size()
            if nbytes and t.is_contiguous():
                ptr = t.data_ptr()
                for view, (at, size) in shared.items():
                    if view <= ptr and ptr + nbytes <= view + size:
                        copied = reader.copy(at + (ptr - view), nbytes, t.dtype, tuple(t.shape), device, hold)
                        if copied is not None:  # None: the device refused the range
                            return copied
                        break
            return t.to(device)

        return leaves(value, to_device)

    def release_device_copies(self) -> int:
        """Give back the objects whose copies to device memory ended (made by
        ``get(..., device=)``); how many copies are still in flight."""
        in_flight = self._ipc_copies.release_done() if self._ipc_copies is not None else 0
        return in_flight + (self._device.release_done() if self._device is not None else 0)

    def wait_device_copies(self) -> None:
        """Wait until every copy to device memory (``get(..., device=)``) ended, and give
        back the objects they held: the host's way to see their tensors complete (a
        device's own streams are already ordered after the copies)."""
        if self._device is not None:
            self._device.wait_all()
        if self._ipc_copies is not None:
            self._ipc_copies.wait_all()

    def touch(
        self,
        key: str,
        address: int = 0,
        monotonic_id: int = 0,
        signature: Optional[list[int]] = None,
    ) -> None:
        """Writer (without a ``reader_lock``): keep ``key``'s object from eviction until
        ``get_cached(key)`` or ``release_touches()``; unknown keys are ignored. Reader:
        check the handle (signature, then that it still names its object)."""
        self._core.touch(key, address, monotonic_id, signature)

    def verify_signature(
        self,
        key: Optional[str],
        address: int,
        monotonic_id: int,
        signature: Optional[list[int]],
    ) -> None:
        """``ValueError`` ("SHM handle signature") unless ``signature`` signs the handle
        for ``key``; on the writer the handle must also be ``key``'s current entry."""
        self._core.verify_signature(key, address, monotonic_id, signature)

    def _make_signature(self, key: str, address: int, monotonic_id: int) -> bytes:
        """The HMAC-SHA256 of a handle (what ``get_signature`` returns, as bytes)."""
        return bytes(self._core._sign(key, address, monotonic_id))

    def increment_reader_flag(self, data_view: memoryview) -> None:
        """Add one to the 4-byte count in ``data_view`` (as vLLM does, not atomically;
        ``get`` counts atomically by itself)."""
        count = self.ring_buffer.byte2int(data_view)
        data_view[:] = self.ring_buffer.int2byte(count + 1)

    def copy_to_buffer(
        self,
        data: Any,
        data_bytes: int,
        metadata: bytes,
        md_bytes: int,
        data_view: memoryview,
    ) -> None:
        """vLLM's helper: write ``[flag][metadata][data...]`` into ``data_view``."""
        data_view[self.flag_bytes : self.flag_bytes + md_bytes] = metadata
        if isinstance(data, (bytes, bytearray, memoryview)):
            data_view[len(data_view) - data_bytes :] = data
        elif isinstance(data, list):
            at = self.flag_bytes + md_bytes
            for item in data:
                n = memoryview(item).nbytes
                data_view[at : at + n] = item
                at += n
        else:
            raise ValueError(f"Unsupported data type for serialization: {type(data)}")

    def handle(self) -> ObjectStorageHandle:
        return ObjectStorageHandle(
            self.max_object_size, self.n_readers, self.ring_buffer.handle(), self.serde_class, self._reader_lock
        )

    def __reduce__(self) -> NoReturn:
        # Pickling would copy the writer's index or a reader's mapping, which cannot be
        # copied: another process needs the handle instead.
        raise TypeError(
            "an ObjectStorage cannot be sent to another process: pass store.handle() and call "
            "ObjectStorage.create_from_handle(handle) in the child"
        )

    @staticmethod
    def create_from_handle(handle: ObjectStorageHandle) -> "ObjectStorage":
        """Open the store of ``handle`` as a reader."""
        ring = RingBuffer(*handle.ring_buffer_handle)
        return ObjectStorage(handle.max_object_size, handle.n_readers, ring, handle.serde_class, handle.reader_lock)

    def _claim_name(self) -> None:
        """Record this writer's handle under its ring's name (see ``open``) and hold it (a
        lock on the record) until the store is closed or dropped."""
        from . import _names

        name = self.ring_buffer.shared_memory.name
        serde = f"{self.serde_class.__module__}:{self.serde_class.__qualname__}"
        details = {
            "max_object_size": self.max_object_size,
            "n_readers": self.n_readers,
            "ring_buffer_handle": list(self.ring_buffer.handle()),
            "serde_class": serde,
        }
        held = _names.claim("store", name, details)
        self._name_release = weakref.finalize(self, held.release)

    @staticmethod
    def open(name: str, serde_class: Optional[type[ObjectSerde]] = None) -> "ObjectStorage":
        """Open the store named ``name`` on this machine as a reader, without its handle:
        the store whose writer was made on
        ``RingBuffer(data_buffer_size, name=name, create=True)`` (vLLM's way of naming its multimodal store), as
        ``create_from_handle`` does with the handle the writer recorded under that name.
        ``serde_class``: the writer's by default (imported by its module and name; pass it
        when the writer's is defined in its ``__main__``). Any segment name is a store name
        (1 to 200 bytes). Names are scoped to the user: a store of another user is not
        found, and a segment of that name that belongs to another user is a
        ``PermissionError`` naming it; ``FileNotFoundError`` naming it when there is no such
        store (never made, closed, or its writer died: told by a lock the writer holds on
        its record, never by its pid, so a writer in another container sharing ``/dev/shm``
        is found). Where the names are kept: as for ``MessageQueue.open``."""
        import importlib
        import os

        from . import _names

        try:
            record = _names.lookup("store", name)
        except FileNotFoundError:
            path = f"{_core.SHM_DIR}/{name}" if "/" not in name else None
            try:
                owner = os.stat(path).st_uid if path is not None else None
            except OSError:
                owner = None
            if owner is not None and owner != os.getuid():
                raise PermissionError(
                    f"shared memory segment {name!r} belongs to another user (uid {owner}; this is uid "
                    f"{os.getuid()}): stores are opened by name only by their own user"
                ) from None
            raise
        if serde_class is None:
            module, _, qualname = record["serde_class"].partition(":")
            try:
                found: Any = importlib.import_module(module)
                for part in qualname.split("."):
                    found = getattr(found, part)
            except (ImportError, AttributeError) as e:
                raise ValueError(
                    f"store {name!r} was made with serde_class {record['serde_class']}, which this process "
                    "cannot import: pass serde_class= to ObjectStorage.open"
                ) from e
            serde_class = cast("type[ObjectSerde]", found)
        size, ring_name = record["ring_buffer_handle"]
        handle = ObjectStorageHandle(record["max_object_size"], record["n_readers"], (size, ring_name), serde_class)
        return ObjectStorage.create_from_handle(handle)

    def close(self) -> None:
        """Close the ring buffer (the writer removes the segment); a reader gives its
        reader slot back first. Idempotent. With copies to device memory in flight
        (``get(..., device=)``), waits for them first, then unregisters the mapping."""
        device = getattr(self, "_device", None)
        if device is not None:
            self._device = None
            device.close()
        copies = getattr(self, "_ipc_copies", None)
        if copies is not None:
            self._ipc_copies = None
            copies.close()
        self._exported = {}
        leave = getattr(self, "_leave", None)
        if leave is not None:
            leave()
        release = getattr(self, "_name_release", None)
        if release is not None:
            release()
        self._core = _Closed("the object storage")
        self.ring_buffer.close()

    def reader_count(self, address: int, monotonic_id: int) -> int:
        """How many reads the object at ``(address, monotonic_id)`` has had."""
        return self._core.reader_count(address, monotonic_id)

    @property
    def _touched(self) -> set[int]:
        """Ids the writer protects with ``touch`` (vLLM's private set)."""
        return set(self._core.touched()) if self.is_writer else set()

    def __repr__(self) -> str:
        role = "writer" if self.is_writer else "reader"
        return f"<ObjectStorage {role} {self.ring_buffer.shared_memory.name!r} n_readers={self.n_readers}>"

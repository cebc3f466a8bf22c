"""What the object-store tests (``test_object_storage.py``, ``test_serde.py``) run in
other processes, and the tools to run it.

Children are started with the multiprocessing "spawn" context, which pickles a child's
target by reference, so every child entry point lives at module level here. A child
reports through a ``multiprocessing`` queue: one ``(tag, ...)`` tuple per report, or
``("error", pid, traceback)`` if it raised, so that a failure inside a child shows
up in the test with the child's traceback instead of as a bare exit code.

Readers open the store from a *pickled* handle (``pickle.dumps(store.handle())`` or
``pickle.dumps(ring.handle())``), as a real engine process would.

Every blocking call has a timeout (``STEP``): a broken store fails the test instead of
hanging it. The child-process manager is the queue tests' (``harness``). This module
does not import torch: a child imports it only when it deserializes a tensor.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import struct
import sys
from typing import Any

import numpy as np

from shmq import MsgpackSerde, ObjectSerde, ObjectStorage, RingBuffer

from .harness import SHM_DIR, STEP

STALE = "has been modified or is invalid"

# The cases of ``absurd_scenario``, by name (for test ids).
ABSURD_CASES = [
    "wrong_id_plus_1",
    "wrong_id_other_object",
    "evicted_object",
    "freed_block_id_2**32-1",
    "live_block_id_2**32-1",
    "id_2**31",
    "id_2**31-1",
    "id_2**32",
    "id_2**63",
    "id_2**64-1",
    "address_plus_1_not_aligned",
    "address_plus_4_not_aligned",
    "address_plus_8_not_aligned",
    "address_plus_32_not_aligned",
    "address_middle_of_object_64",
    "address_middle_of_object_256",
    "address_middle_of_object_id0",
    "address_past_the_end_id0",
    "address_ring_size_minus_8",
    "address_2**63",
    "address_2**64-1",
    "address_2**64-64",
    "negative_address",
    "negative_address_minus_ring",
    "negative_id",
    "address_2**64",
    "address_2**100",
    "id_2**64",
    "id_2**100",
]
# Those a reader cannot even sign (an address outside u64, an id outside u32): refused
# for their signature, before anything is read; the others for what is at the address.
UNSIGNABLE_CASES = {
    "id_2**32",
    "id_2**63",
    "id_2**64-1",
    "id_2**64",
    "id_2**100",
    "negative_address",
    "negative_address_minus_ring",
    "negative_id",
    "address_2**64",
    "address_2**100",
}


# ---------------------------------------------------------------------------------
# Exact comparison


def store_frame(view: memoryview, data_offset: int) -> tuple[int, int, int, list[tuple[int, int]]]:
    """Read the frame of a stored object from its block data ``view`` (at ring offset
    ``data_offset``): ``[pad to 8][count: u32][tag: u32][n | s << 24: u32]`` then, if ``s``
    (reader slots, in a store of two or more readers) is not 0, ``[pad: u32][s x (count:
    u32, tag: u32)]``, then ``[n x (offset, len)]`` (``crates/core/src/storage/``). Returns
    ``(count, tag, pad, [(offset, len), ...])``: the count word's count (the reads of
    readers without a slot) and tag."""
    pad = -data_offset % 8

    def word(at: int) -> int:
        return int.from_bytes(view[at : at + 4], "little")

    frame = word(pad + 8)
    n, slots = frame & 0xFFFFFF, frame >> 24
    table = pad + 12 if slots == 0 else pad + 16 + 8 * slots
    entries = [(word(table + 8 * i), word(table + 4 + 8 * i)) for i in range(n)]
    return word(pad), word(pad + 4), pad, entries


def tensor_bytes(t: Any) -> bytes:
    """The bytes of every element of ``t`` in C order, read straight from its storage
    through its strides: works for every dtype (even those torch cannot copy) and for
    any layout (transposed, sliced, expanded, offset)."""
    import torch

    es = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
    base = raw[t.storage_offset() * es :]
    shape = tuple(t.shape) + (es,)
    if 0 in shape:
        return b""
    view = np.lib.stride_tricks.as_strided(base, shape=shape, strides=tuple(s * es for s in t.stride()) + (1,))
    return np.ascontiguousarray(view).tobytes()


def _canon_tensor(t: Any) -> tuple:
    info = (type(t).__name__, str(t.dtype), tuple(t.shape), t.device.type)
    if t.is_quantized:
        import torch

        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            params = (float(t.q_scale()), int(t.q_zero_point()))
        else:
            params = (
                tensor_bytes(t.q_per_channel_scales()),
                tensor_bytes(t.q_per_channel_zero_points()),
                t.q_per_channel_axis(),
            )
        return ("qtensor", info, str(t.qscheme()), params, tensor_bytes(t.int_repr()))
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return ("tensor", info, tensor_bytes(t))


def _canon_array(a: np.ndarray) -> tuple:
    info = (type(a).__name__, a.dtype.str, repr(a.dtype.descr), a.shape)
    if a.dtype.hasobject:
        return ("ndarray-object", info, [canon(v) for v in a.ravel(order="C").tolist()])
    return ("ndarray", info, a.tobytes(order="C"))


def canon(x: Any) -> Any:
    """A picklable, exactly comparable description of ``x``: types are kept (a tuple is
    not a list, a bool is not an int), floats compare by their bits (NaN-safe, -0.0 is
    not 0.0), tensors and arrays by dtype, shape and the bytes of their elements."""
    torch = sys.modules.get("torch")
    kind = type(x)
    if torch is not None and isinstance(x, torch.Tensor):
        return _canon_tensor(x)
    if isinstance(x, np.ndarray):
        return _canon_array(x)
    if isinstance(x, np.generic):
        return ("np.generic", kind.__name__, x.dtype.str, x.tobytes())
    if kind in (list, tuple):
        return (kind.__name__, [canon(v) for v in x])
    if kind is dict:
        return ("dict", [(canon(k), canon(v)) for k, v in x.items()])
    if kind in (set, frozenset):
        return (kind.__name__, sorted((canon(v) for v in x), key=repr))
    if kind is float:
        return ("float", struct.pack("<d", x))
    if kind is complex:
        return ("complex", struct.pack("<dd", x.real, x.imag))
    if kind in (int, bool, str, bytes, type(None)):
        return (kind.__name__, x)
    if kind is bytearray:
        return ("bytearray", bytes(x))
    if hasattr(x, "__dict__"):
        return ("object", kind.__module__, kind.__qualname__, canon(dict(vars(x))))
    return ("repr", kind.__qualname__, repr(x))


# ---------------------------------------------------------------------------------
# Custom types (module level, so that a child can unpickle them)


class Thing:
    """A plain user class: not known to any serde, so it is pickled."""

    def __init__(self, name: str, payload: Any):
        self.name = name
        self.payload = payload

    def __eq__(self, other: Any) -> bool:
        return type(other) is Thing and (self.name, self.payload) == (other.name, other.payload)


class Point:
    """A user type registered with ``MsgpackSerde.register`` (never pickled)."""

    def __init__(self, x: int, y: int):
        self.x = x
        self.y = y

    def __reduce__(self):
        raise TypeError("Point must not be pickled: it is registered with MsgpackSerde")

    def __eq__(self, other: Any) -> bool:
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)


POINT_CODE = 77
POINT_ENCODED: list[int] = []  # one entry per encode call (this process)


def _encode_point(p: Point) -> bytes:
    POINT_ENCODED.append(1)
    return struct.pack("<qq", p.x, p.y)


def _decode_point(b: bytes) -> Point:
    return Point(*struct.unpack("<qq", b))


def register_point() -> None:
    MsgpackSerde.register(Point, POINT_CODE, _encode_point, _decode_point)


# ---------------------------------------------------------------------------------
# Child entry points


def _describe(e: BaseException) -> tuple[str, str]:
    return (type(e).__name__, str(e))


# Readers sign the handles they are given themselves (any process that opens the store
# can: the secret is in the segment), so that tests about what lies at an address reach
# that check; the signature checks have tests of their own. A handle that cannot be
# signed (an int out of range) goes without one and is refused for that.
SIGNING_KEY = "test-key"
SIGNATURE_REFUSED = "SHM handle signature"


def signed_get(store: ObjectStorage, address: Any, mid: Any) -> Any:
    """``store.get`` of a handle this reader signs itself (see above)."""
    if store.is_writer:
        return store.get(address, mid)
    try:
        signature: Any = list(store._make_signature(SIGNING_KEY, address, mid))
    except (OverflowError, TypeError, ValueError):
        signature = None
    return store.get(address, mid, signature, SIGNING_KEY)


def store_reader(out: Any, handle_pickle: bytes, cmds: Any) -> None:
    """A reader of the store of ``handle_pickle``. Commands on ``cmds``:
    ``("get", tag, address, id)`` → ``("got", tag, value)`` or ``("raised", tag, type, msg)``;
    ``("count", tag, address, id)`` → ``("count", tag, reader_count)``;
    ``("put", tag)`` → the outcome of a put attempt (readers may not put);
    ``("close", tag)`` → ``("closed", tag)`` once it has closed the store (it stays alive);
    ``("exit keeping it",)``: ends with the store still referenced (a module global), so
    that only the process's normal exit lets it go;
    ``("stop",)``. The ``ready`` report carries the reader slot it took."""
    # A handle carrying a multiprocessing lock travels as a Process argument instead.
    handle = pickle.loads(handle_pickle) if isinstance(handle_pickle, bytes) else handle_pickle
    store = ObjectStorage.create_from_handle(handle)
    out.put(("ready", os.getpid(), store.is_writer, store.reader_slot))
    while True:
        cmd = cmds.get(timeout=STEP)
        op = cmd[0]
        if op == "stop":
            break
        if op == "exit keeping it":
            _KEPT.append(store)
            out.put(("exiting", os.getpid()))
            return
        if op == "close":
            store.close()
            out.put(("closed", cmd[1]))
            continue
        try:
            if op == "get":
                out.put(("got", cmd[1], signed_get(store, cmd[2], cmd[3])))
            elif op == "count":
                out.put(("count", cmd[1], store.reader_count(cmd[2], cmd[3])))
            elif op == "put":
                out.put(("got", cmd[1], store.put("from-a-reader", 1)))
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # reported, not fatal: the test decides
            out.put(("raised", cmd[1], *_describe(e)))
    del store
    gc.collect()
    out.put(("stopped", os.getpid()))


# What a child keeps until it exits (see ``store_reader``'s "exit keeping it").
_KEPT: list[Any] = []


def ring_reader(out: Any, handle_pickle: bytes, cmds: Any) -> None:
    """A reader of the RingBuffer of ``handle_pickle`` (``RingBuffer(*handle)``).
    Commands: ``("read", address)`` → ``("read", address, bytes, (id, size))``;
    ``("attrs",)``; ``("try", op)`` with op in allocate/free/clear → the exception;
    ``("stop",)``."""
    ring = RingBuffer(*pickle.loads(handle_pickle))
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=STEP)
        op = cmd[0]
        if op == "stop":
            break
        if op == "read":
            with ring.access_buf(cmd[1]) as (view, header):
                out.put(("read", cmd[1], bytes(view), tuple(header), type(view).__name__))
        elif op == "attrs":
            sm = ring.shared_memory
            out.put(
                (
                    "attrs",
                    {
                        "is_writer": ring.is_writer,
                        "data_buffer_size": ring.data_buffer_size,
                        "handle": tuple(ring.handle()),
                        "name": sm.name,
                        "size": sm.size,
                        "buf_len": len(sm.buf),
                    },
                )
            )
        elif op == "try":
            calls = {
                "allocate": lambda: ring.allocate_buf(16),
                "free": lambda: ring.free_buf(lambda i, v: True),
                "clear": ring.clear,
            }
            try:
                calls[cmd[1]]()
                out.put(("try", cmd[1], None, None))
            except Exception as e:
                out.put(("try", cmd[1], *_describe(e)))
        else:
            raise ValueError(f"unknown command {cmd!r}")
    ring = None  # drop the mapping (before the exit report)
    gc.collect()
    out.put(("stopped", os.getpid()))


def _probe(out: Any, store: ObjectStorage, ring: RingBuffer, cases: list[tuple[str, Any, Any]], side: str) -> None:
    for name, address, mid in cases:
        # Announce the case first: if it crashes the process, the test knows which.
        out.put(("start", side, name))
        try:
            value = signed_get(store, address, mid)
            result: tuple = ("returned", repr(value)[:200])
        except BaseException as e:
            result = ("raised", *_describe(e))
        try:
            with ring.access_buf(address) as (view, header):
                access: tuple = ("returned", tuple(header), len(view))
        except BaseException as e:
            access = ("raised", *_describe(e))
        try:
            count: tuple = ("returned", store.reader_count(address, mid))
        except BaseException as e:
            count = ("raised", *_describe(e))
        out.put(("case", side, name, result, access, count))


def absurd_reader(out: Any, handle_pickle: bytes, cases: list[tuple[str, Any, Any]]) -> None:
    """Opens the store as a reader and tries every ``(name, address, id)`` case."""
    store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
    _probe(out, store, store.ring_buffer, cases, "reader")
    del store
    gc.collect()
    out.put(("done", "reader"))


def absurd_writer(out: Any) -> None:
    """Builds its own store (as the writer, with a reader_lock so that its gets count),
    then tries every case ``absurd_scenario`` gives on it."""
    import threading

    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring, reader_lock=threading.Lock())
    cases = absurd_scenario(store)
    _probe(out, store, ring, cases, "writer")
    del store, ring
    gc.collect()
    out.put(("done", "writer"))


def absurd_scenario(store: ObjectStorage) -> list[tuple[str, Any, Any]]:
    """On an empty store of a 4096-byte ring: puts, clears, puts again, and returns the
    absurd handles to try (every one must be refused with the stale-object ValueError).
    The same scenario is built by the parent for the reader side."""
    rng = np.random.default_rng(1234)
    old_a, old_id = store.put("old", bytes(rng.integers(0, 256, 300, dtype=np.uint8)))
    store.clear()  # "old" is now a freed block
    a, mid = store.put("a", bytes(rng.integers(0, 256, 600, dtype=np.uint8)))
    b, bid = store.put("b", b"bbbb")
    cap = store.ring_buffer.data_buffer_size
    end = store.ring_buffer.data_buffer_end
    cases: list[tuple[str, Any, Any]] = [
        ("wrong_id_plus_1", a, mid + 1),
        ("wrong_id_other_object", a, bid),
        ("evicted_object", old_a, old_id),
        ("freed_block_id_2**32-1", old_a, 2**32 - 1),
        ("live_block_id_2**32-1", a, 2**32 - 1),
        ("id_2**31", a, 2**31),
        ("id_2**31-1", a, 2**31 - 1),
        ("id_2**32", a, 2**32),
        ("id_2**63", a, 2**63),
        ("id_2**64-1", a, 2**64 - 1),
        ("address_plus_1_not_aligned", a + 1, mid),
        ("address_plus_4_not_aligned", a + 4, mid),
        ("address_plus_8_not_aligned", a + 8, mid),
        ("address_plus_32_not_aligned", a + 32, mid),
        ("address_middle_of_object_64", a + 64, mid),
        ("address_middle_of_object_256", a + 256, mid),
        ("address_middle_of_object_id0", a + 128, 0),
        ("address_past_the_end_id0", end + 64 if end + 64 < cap else end, 0),
        ("address_ring_size_minus_8", cap - 8, 0),
        ("address_2**63", 2**63, mid),
        ("address_2**64-1", 2**64 - 1, mid),
        ("address_2**64-64", 2**64 - 64, 0),
        ("negative_address", -1, mid),
        ("negative_address_minus_ring", a - cap, mid),
        ("negative_id", a, -1),
        ("address_2**64", 2**64, mid),
        ("address_2**100", 2**100, mid),
        ("id_2**64", a, 2**64),
        ("id_2**100", a, 2**100),
    ]
    return cases


def abandoned_writer(out: Any, values: dict[str, Any]) -> None:
    """Creates a store, puts ``values``, reports the pickled handle and the handles, then
    exits without running any destructor. Without a janitor (``SHMQ_NO_JANITOR=1``), so
    the segment stays in /dev/shm (with one, the janitor would remove it)."""
    os.environ["SHMQ_NO_JANITOR"] = "1"
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(8192, 1, ring)
    handles = {k: store.put(k, v) for k, v in values.items()}
    out.put(("stored", pickle.dumps(store.handle()), handles, ring.shared_memory.name))
    out.close()
    out.join_thread()
    os._exit(0)


def killed_reader(out: Any, handle_pickle: bytes, address: int, mid: int) -> None:
    """Reads one object, reports, then kills itself with SIGKILL (no cleanup at all)."""
    store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
    out.put(("got", signed_get(store, address, mid)))
    out.close()
    out.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def view_lifetime(out: Any) -> None:
    """Keeps zero-copy views (``shared_memory.buf`` and an ``access_buf`` view kept past
    its ``with``) after the writer is dropped, and uses them."""
    ring = RingBuffer(4096, create=True)
    name = ring.shared_memory.name
    address, _ = ring.allocate_buf(32)
    with ring.access_buf(address) as (view, _header):
        view[:] = bytes(range(32))
        kept = view
    buf = ring.shared_memory.buf
    offset = address % ring.data_buffer_size
    del ring
    gc.collect()
    try:
        kept_bytes: Any = bytes(kept)
    except ValueError as e:  # a released view is fine; reading freed memory is not
        kept_bytes = ("raised", str(e))
    data = bytes(buf[offset + 8 : offset + 8 + 32])
    exists_with_view = os.path.exists(os.path.join(SHM_DIR, name))
    buf.release()
    del buf, kept
    gc.collect()
    out.put(("views", data, kept_bytes, exists_with_view, os.path.exists(os.path.join(SHM_DIR, name))))


def serde_service(out: Any, cmds: Any) -> None:
    """A long-lived reader for the serde tests. ``("read", handle_pickle, [(key,
    address, id)], point)`` opens the store, gets every item and answers
    ``("read", {key: ("ok", canon(value)) | ("raised", type, msg)})``; ``point`` registers
    ``Point`` first."""
    # What the imports made lives as long as this process: the collection after each
    # read need not walk it (a full one takes 0.1 s here, with torch imported).
    gc.freeze()
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=600)
        if cmd[0] == "stop":
            break
        _, handle_pickle, items, point = cmd
        if point:
            register_point()
        store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
        results: dict[str, Any] = {}
        for key, address, mid in items:
            try:
                results[key] = ("ok", canon(signed_get(store, address, mid)))
            except Exception as e:
                results[key] = ("raised", *_describe(e))
        del store
        gc.collect()
        out.put(("read", results))
    out.put(("stopped", os.getpid()))


# ---------------------------------------------------------------------------------
# Custom serdes (module level, so that a reader process can use them)


class _RawSerde(ObjectSerde):
    """Stores bytes as they are."""

    def serialize(self, value: Any) -> tuple[Any, int, bytes, int]:
        data = bytes(value)
        return data, len(data), b"", 0


class KeepSelf(_RawSerde):
    """Returns the memoryview it was given: keeps the store's memory."""

    def deserialize(self, data_view: memoryview) -> Any:
        return data_view


class KeepSlice(_RawSerde):
    """Returns a slice of the view: a new memoryview on the same memory."""

    def deserialize(self, data_view: memoryview) -> Any:
        return data_view[1:]


class KeepNumpy(_RawSerde):
    """Returns a numpy array over the memory (np.frombuffer copies nothing)."""

    def deserialize(self, data_view: memoryview) -> Any:
        return np.frombuffer(data_view, dtype=np.uint8)


class KeepInTuple(_RawSerde):
    """Returns the view inside a container."""

    def deserialize(self, data_view: memoryview) -> Any:
        return ("kept", data_view)


KEEPERS = [KeepSelf, KeepSlice, KeepNumpy, KeepInTuple]


class PartsSerde(ObjectSerde):
    """A user serde that writes its data in several parts after a metadata block, and
    copies what it reads: ``[b"M" + n][part lengths][parts]``."""

    def serialize(self, value: Any) -> tuple[Any, int, bytes, int]:
        parts = [s.encode() for s in value]
        metadata = struct.pack(f"<I{len(parts)}I", len(parts), *[len(p) for p in parts])
        return parts, sum(len(p) for p in parts), metadata, len(metadata)

    def deserialize(self, data_view: memoryview) -> Any:
        (n,) = struct.unpack_from("<I", data_view, 0)
        lengths = struct.unpack_from(f"<{n}I", data_view, 4)
        at, out = 4 + 4 * n, []
        for length in lengths:
            out.append(bytes(data_view[at : at + length]).decode())
            at += length
        return out

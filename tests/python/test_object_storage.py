"""The object store (the engines' ``SingleWriterShmObjectStorage`` API): ``RingBuffer``
(the FIFO allocator over a segment),
``ObjectStorage`` / ``ObjectStorageHandle`` and the engines' aliases.

Readers run in separate processes (multiprocessing "spawn"), opened from a pickled
handle, and are driven through queues by the test; values are compared in the test.
Absurd handles are tried in child processes, so that a crash shows up as an exit code.
"""

from __future__ import annotations

import gc
import os
import pickle
import secrets
import signal
from collections.abc import Mapping

import numpy as np
import pytest

import shmq
from shmq import (
    MsgpackSerde,
    ObjectStorage,
    ObjectStorageHandle,
    PickleSerde,
    RingBuffer,
    ShmObjectStorageHandle,
    SingleWriterShmObjectStorage,
    SingleWriterShmRingBuffer,
)

from _processes import CTX, SHM_DIR, Children, shm_segments
from _processes.store_children import (
    ABSURD_CASES,
    SIGNATURE_REFUSED,
    UNSIGNABLE_CASES,
    STALE,
    PartsSerde,
    abandoned_writer,
    absurd_reader,
    absurd_scenario,
    absurd_writer,
    canon,
    killed_reader,
    ring_reader,
    signed_get,
    store_reader,
    view_lifetime,
)

pytestmark = pytest.mark.timeout(90)

NOT_ENOUGH_SPACE = "Not enough space in the data buffer"


# ---------------------------------------------------------------------------------
# Fixtures and drivers


class Reader:
    """A ``store_reader`` child driven by the test."""

    def __init__(self, children: Children, handle_arg):
        self.children = children
        self.out = children.queue()
        self.cmds = children.queue()
        self.proc = children.start(store_reader, self.out, handle_arg, self.cmds)
        msg = children.expect(self.out, "ready")
        self.is_writer = msg[2]

    def ask(self, *cmd):
        self.cmds.put(cmd)
        return self.children.receive(self.out)

    def get(self, handle):
        """The value read by the child at ``handle``; fails the test if it raised."""
        msg = self.ask("get", "g", *handle)
        assert msg[0] == "got", f"the reader could not get {handle}: {msg}"
        return msg[2]

    def get_error(self, handle) -> tuple[str, str]:
        """``(exception type, message)`` of a get that must fail."""
        msg = self.ask("get", "g", *handle)
        assert msg[0] == "raised", f"get{tuple(handle)} should have failed, but returned {msg[2]!r:.200}"
        return msg[2], msg[3]

    def stop(self):
        self.cmds.put(("stop",))
        self.children.expect(self.out, "stopped")
        self.proc.join(10)
        assert self.proc.exitcode == 0


def start_readers(children: Children, store: ObjectStorage, n: int) -> list[Reader]:
    blob = pickle.dumps(store.handle())
    return [Reader(children, blob) for _ in range(n)]


def fill(store: ObjectStorage, nbytes: int = 900, prefix: str = "k") -> tuple[dict, dict]:
    """Put same-size objects until the ring is full; their values and handles by key."""
    values, handles = {}, {}
    for n in range(1000):
        key, value = f"{prefix}{n}", bytes([n % 256]) * nbytes
        try:
            handles[key] = store.put(key, value)
        except MemoryError:
            break
        values[key] = value
    assert 3 <= len(values) < 1000, len(values)
    return values, handles


# ---------------------------------------------------------------------------------
# Exports and aliases


def test_exports_and_aliases():
    assert SingleWriterShmObjectStorage is ObjectStorage
    assert ShmObjectStorageHandle is ObjectStorageHandle
    assert SingleWriterShmRingBuffer is RingBuffer
    for name in (
        "ObjectStorage",
        "ObjectStorageHandle",
        "RingBuffer",
        "ObjectSerde",
        "MsgpackSerde",
        "PickleSerde",
        "SingleWriterShmObjectStorage",
        "ShmObjectStorageHandle",
        "SingleWriterShmRingBuffer",
    ):
        assert hasattr(shmq, name), name
        assert name in shmq.__all__, name


# ---------------------------------------------------------------------------------
# RingBuffer


def test_ring_ids_count_from_zero_and_addresses_grow():
    ring = RingBuffer(4096, create=True)
    assert ring.is_writer
    assert ring.data_buffer_size == 4096
    assert ring.metadata == {}
    assert (ring.monotonic_id_start, ring.monotonic_id_end) == (0, 0)
    sizes = [10, 100, 1, 200, 63, 64, 65, 7, 56]
    got = []
    for s in sizes:
        out = ring.allocate_buf(s)
        assert len(out) == 2
        address, mid = out
        assert isinstance(address, int) and isinstance(mid, int)
        got.append((address, mid))
    assert [mid for _, mid in got] == list(range(len(sizes)))
    assert got[0][0] == 0
    for (a, _), s in zip(got, sizes, strict=True):
        # every block [id][size][data] lies inside the ring at offset address % size
        assert a % 4096 + 8 + s <= 4096
    for (a0, _), s0, (a1, _) in zip(got, sizes, got[1:], strict=False):
        assert a1 >= a0 + 8 + s0, "blocks overlap or addresses went back"
    assert ring.metadata == {mid: a for a, mid in got}
    assert (ring.monotonic_id_start, ring.monotonic_id_end) == (0, len(sizes))
    assert ring.data_buffer_start == got[0][0]
    assert ring.data_buffer_end >= got[-1][0] + 8 + sizes[-1]
    assert ring.data_buffer_end - ring.data_buffer_start <= ring.data_buffer_size


def test_ring_block_layout_and_reader_process_sees_the_data(children):
    ring = RingBuffer(8192, create=True)
    sizes = [1, 17, 300, 64, 1000]
    blocks = []
    for n, s in enumerate(sizes):
        address, mid = ring.allocate_buf(s)
        payload = bytes((n * 31 + k) % 256 for k in range(s))
        with ring.access_buf(address) as (view, header):
            assert isinstance(view, memoryview)
            assert len(view) == s
            assert tuple(header) == (mid, s + 8), "size counts the 8 header bytes"
            view[:] = payload
        blocks.append((address, mid, s, payload))
    # [4-byte id][4-byte size][data] at address % data_buffer_size of shared_memory.buf
    buf = ring.shared_memory.buf
    for address, mid, s, payload in blocks:
        off = address % ring.data_buffer_size
        assert int.from_bytes(buf[off : off + 4], "little") == mid
        assert int.from_bytes(buf[off + 4 : off + 8], "little") == s + 8
        assert bytes(buf[off + 8 : off + 8 + s]) == payload
    buf.release()

    out, cmds = children.queue(), children.queue()
    children.start(ring_reader, out, pickle.dumps(ring.handle()), cmds)
    children.expect(out, "ready")
    for address, mid, s, payload in blocks:
        cmds.put(("read", address))
        _, addr, data, header, view_type = children.expect(out, "read")
        assert addr == address
        assert view_type == "memoryview"
        assert header == (mid, s + 8)
        assert data == payload
    cmds.put(("attrs",))
    _, attrs = children.expect(out, "attrs")
    assert attrs["is_writer"] is False
    assert attrs["data_buffer_size"] == 8192
    assert attrs["handle"] == ring.handle()
    assert attrs["name"] == ring.shared_memory.name
    assert attrs["size"] >= 8192 and attrs["buf_len"] >= 8192
    cmds.put(("stop",))
    children.expect(out, "stopped")


def test_ring_readers_cannot_allocate_free_or_clear(children):
    ring = RingBuffer(4096, create=True)
    ring.allocate_buf(8)
    out, cmds = children.queue(), children.queue()
    children.start(ring_reader, out, pickle.dumps(ring.handle()), cmds)
    children.expect(out, "ready")
    for op in ("allocate", "free", "clear"):
        cmds.put(("try", op))
        _, got_op, exc_type, message = children.expect(out, "try")
        assert got_op == op
        assert exc_type == "RuntimeError", f"a reader's {op}: {exc_type}: {message}"
        assert "writer" in message.lower(), message
    cmds.put(("stop",))
    children.expect(out, "stopped")
    # the same in the writer's process, through a reader opened by name
    reader = RingBuffer(*ring.handle())
    assert not reader.is_writer
    with pytest.raises(RuntimeError, match="(?i)writer"):
        reader.allocate_buf(8)
    with pytest.raises(RuntimeError, match="(?i)writer"):
        reader.free_buf(lambda i, v: True)
    with pytest.raises(RuntimeError, match="(?i)writer"):
        reader.clear()
    assert ring.metadata == {0: 0}, "the refused calls changed the writer's ring"


@pytest.mark.parametrize("size", [0, -1, -8, -(2**40)])
def test_ring_allocate_size_must_be_positive(size):
    ring = RingBuffer(4096, create=True)
    with pytest.raises(ValueError):
        ring.allocate_buf(size)
    assert ring.metadata == {}
    assert ring.allocate_buf(1) == (0, 0), "a refused size used an id or space"


def test_ring_not_enough_space():
    ring = RingBuffer(1000, create=True)
    with pytest.raises(MemoryError) as e:
        ring.allocate_buf(1000)  # 1008 bytes with the header: never fits
    assert str(e.value).startswith(NOT_ENOUGH_SPACE), str(e.value)
    a0, i0 = ring.allocate_buf(600)  # 608 bytes
    state = (ring.metadata, ring.data_buffer_start, ring.data_buffer_end, ring.monotonic_id_end)
    with pytest.raises(MemoryError) as e:
        ring.allocate_buf(500)  # would make the live span 608 + 508 > 1000
    assert str(e.value).startswith(NOT_ENOUGH_SPACE), str(e.value)
    assert (ring.metadata, ring.data_buffer_start, ring.data_buffer_end, ring.monotonic_id_end) == state
    assert list(ring.free_buf(lambda i, v: True)) == [i0]
    # Nothing live: as in vLLM 0.33, the line restarts at 0.
    assert (ring.data_buffer_start, ring.data_buffer_end) == (0, 0)
    a1, i1 = ring.allocate_buf(500)
    assert (a1, i1) == (0, i0 + 1)
    # A block that does not fit before the end of the ring starts the next lap.
    a2, i2 = ring.allocate_buf(100)  # 508..616
    assert a2 == 508
    assert list(ring.free_buf(lambda i, v: True, 1)) == [i1]
    a3, i3 = ring.allocate_buf(500)  # 508 bytes do not fit at 616: next lap, 1000..1508
    assert (a3, i3) == (1000, i2 + 1)
    with ring.access_buf(a3) as (view, header):
        view[:] = b"\x5a" * 500
        assert tuple(header) == (i3, 508)
    buf = ring.shared_memory.buf
    assert int.from_bytes(buf[0:4], "little") == i3
    assert bytes(buf[8:508]) == b"\x5a" * 500
    buf.release()
    # Once the oldest live block is a lap ahead, both ends move back by a lap.
    assert list(ring.free_buf(lambda i, v: True, 1)) == [i2]
    assert (ring.data_buffer_start, ring.data_buffer_end) == (0, 508)
    assert ring.metadata == {i3: 1000}


def test_ring_packs_blocks_tightly_as_vllm():
    """vLLM 0.33's test: a 200-byte ring holds allocations of 100 and 80 bytes."""
    ring = RingBuffer(200, create=True)
    assert ring.allocate_buf(100) == (0, 0)
    assert ring.allocate_buf(80) == (108, 1)
    assert ring.data_buffer_end == 196
    with pytest.raises(MemoryError, match=NOT_ENOUGH_SPACE):
        ring.allocate_buf(1)


def test_ring_free_buf_oldest_first_until_in_use_or_nbytes():
    ring = RingBuffer(4096, create=True)
    handles = [ring.allocate_buf(50) for _ in range(9)]  # 58 bytes each with the header
    for address, mid in handles:
        with ring.access_buf(address) as (view, _):
            view[:] = bytes([mid]) * 50
    asked = []

    def until_2(mid, view):
        asked.append((mid, bytes(view)))
        return mid != 2

    freed = ring.free_buf(until_2)
    assert list(freed) == [0, 1]
    assert len(freed) == 2 and freed[0] == 0 and freed[-1] == 1, "not an indexable sequence"
    assert asked == [(0, b"\x00" * 50), (1, b"\x01" * 50), (2, b"\x02" * 50)], "oldest first, stop at the first in use"
    assert ring.metadata == {mid: a for a, mid in handles[2:]}
    assert ring.monotonic_id_start == 2
    assert ring.data_buffer_start == handles[2][0]

    assert list(ring.free_buf(lambda i, v: True, 1)) == [2], "nbytes=1: stop after one block"
    assert list(ring.free_buf(lambda i, v: True, 3 * 58)) == [3, 4, 5], "stop once nbytes are freed"
    assert ring.monotonic_id_start == 6
    assert list(ring.free_buf(lambda i, v: False)) == []
    assert list(ring.free_buf(lambda i, v: True)) == [6, 7, 8], "default nbytes: the whole ring"
    empty = ring.free_buf(lambda i, v: True)
    assert len(empty) == 0 and list(empty) == []
    assert ring.metadata == {}
    assert ring.monotonic_id_start == ring.monotonic_id_end == 9
    assert ring.data_buffer_start == ring.data_buffer_end == 0
    # the freed space is reused from the start (vLLM 0.33); ids keep counting
    address, mid = ring.allocate_buf(3000)
    assert (address, mid) == (0, 9)


def test_ring_clear_forgets_everything_and_ids_keep_counting(children):
    """vLLM 0.33: clear() forgets every block, ids keep counting, addresses restart at 0;
    the memory is left as it was until new blocks are written over it."""
    ring = RingBuffer(4096, create=True)
    old = [ring.allocate_buf(n) for n in (10, 20, 30)]
    for address, _mid in old:
        with ring.access_buf(address) as (view, _):
            view[:] = bytes([0xAB]) * len(view)
    ring.clear()
    assert ring.metadata == {}
    assert ring.monotonic_id_start == ring.monotonic_id_end == 3
    assert ring.data_buffer_start == ring.data_buffer_end == 0
    assert list(ring.free_buf(lambda i, v: True)) == []
    address, mid = ring.allocate_buf(10)
    assert (address, mid) == (0, 3), "ids keep counting, addresses restart at 0"
    assert ring.metadata == {3: 0}
    # The new block took the first old one's place; the others are untouched.
    with ring.access_buf(0) as (_, header):
        assert tuple(header) == (3, 18)
    out, cmds = children.queue(), children.queue()
    children.start(ring_reader, out, pickle.dumps(ring.handle()), cmds)
    children.expect(out, "ready")
    for a, i in old[1:]:
        cmds.put(("read", a))
        msg = children.expect(out, "read")
        assert msg[3][0] == i and set(msg[2]) == {0xAB}
    cmds.put(("stop",))
    children.receive(out)


def test_ring_handle_and_shared_memory():
    ring = RingBuffer(5000, create=True)
    sm = ring.shared_memory
    handle = ring.handle()
    assert tuple(handle) == (5000, sm.name)
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert sm.name in shm_segments()
    assert sm.size >= 5000
    buf = sm.buf
    assert isinstance(buf, memoryview) and len(buf) >= 5000 and not buf.readonly
    buf.release()
    reader = RingBuffer(*handle)
    assert not reader.is_writer
    assert reader.data_buffer_size == 5000
    assert reader.shared_memory.name == sm.name
    address, mid = ring.allocate_buf(4)
    with ring.access_buf(address) as (view, _):
        view[:] = b"abcd"
    with reader.access_buf(address) as (view, header):
        assert bytes(view) == b"abcd" and tuple(header) == (mid, 12)


def test_ring_named_segment_is_created_and_removed():
    name = f"shmq_store_{os.getpid()}_{secrets.token_hex(4)}"
    ring = RingBuffer(4096, name=name, create=True)
    assert ring.shared_memory.name == name
    assert ring.handle() == (4096, name)
    assert os.path.exists(os.path.join(SHM_DIR, name))
    reader = RingBuffer(4096, name)
    assert not reader.is_writer
    del reader, ring
    gc.collect()
    assert not os.path.exists(os.path.join(SHM_DIR, name)), "the writer did not remove its segment"


@pytest.mark.parametrize("size", [1000, 777, 4097])
def test_ring_many_laps_never_overlap_live_blocks(size, children):
    rng = np.random.default_rng(size)
    ring = RingBuffer(size, create=True)
    live: dict[int, tuple[int, bytes]] = {}  # id -> (address, payload)
    next_id = 0
    laps = 0
    last_offset = -1
    for step in range(400):
        n = int(rng.integers(1, size // 3))
        while True:
            try:
                address, mid = ring.allocate_buf(n)
                break
            except MemoryError as e:
                assert str(e).startswith(NOT_ENOUGH_SPACE)
                oldest = min(live)
                assert list(ring.free_buf(lambda i, v: True, 1)) == [oldest]
                del live[oldest]
        assert mid == next_id
        next_id += 1
        offset = address % size
        laps += offset < last_offset
        last_offset = offset
        assert 0 <= address < 2 * size, "vLLM's addresses stay below two laps"
        assert offset + 8 + n <= size
        payload = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        with ring.access_buf(address) as (view, header):
            assert tuple(header) == (mid, n + 8)
            view[:] = payload
        live[mid] = (address, payload)
        assert ring.data_buffer_end - ring.data_buffer_start <= size
        assert ring.metadata == {i: a for i, (a, _) in live.items()}
        for i, (a, p) in live.items():  # no live block was overwritten
            with ring.access_buf(a) as (view, header):
                assert header[0] == i and bytes(view) == p, f"block {i} corrupted at step {step}"
    assert laps >= 3, "the test should go round the ring several times"
    out, cmds = children.queue(), children.queue()
    children.start(ring_reader, out, pickle.dumps(ring.handle()), cmds)
    children.expect(out, "ready")
    for i, (a, p) in live.items():
        cmds.put(("read", a))
        msg = children.expect(out, "read")
        assert msg[3] == (i, len(p) + 8) and msg[2] == p
    cmds.put(("stop",))
    children.expect(out, "stopped")


def test_ring_access_view_is_released_after_the_with_block():
    ring = RingBuffer(4096, create=True)
    address, _ = ring.allocate_buf(16)
    with ring.access_buf(address) as (view, _):
        view[:] = b"x" * 16
    try:
        assert bytes(view) == b"x" * 16
    except ValueError:
        pass  # released: fine


def test_zero_copy_views_outlive_the_writer(children):
    """STYLE 10: a view kept after ``del`` + ``gc.collect()`` of its ring still reads the
    data (or is released), never freed memory; the segment goes once the views do."""
    out = children.queue()
    children.start(view_lifetime, out)
    _, data, kept, _exists_with_view, exists_after = children.expect(out, "views")
    assert data == bytes(range(32))
    assert kept == bytes(range(32)) or kept[0] == "raised"
    assert not exists_after
    assert children.exit_codes() == {p.pid: 0 for p in children.procs}


# ---------------------------------------------------------------------------------
# ObjectStorage: put/get across processes


VALUES = {
    "int": 12345,
    "neg": -(2**40),
    "float": 3.25,
    "str": "hello, 世界",
    "bytes": b"\x00\x01binary\xff",
    "none": None,
    "bool": True,
    "list": [1, 2.5, "three", None, [4, [5]]],
    "tuple": (1, ("nested", b"t")),
    "dict": {"a": 1, "b": [1, 2, {"c": "d"}], "e": (1.5, None)},
    "array": np.arange(24, dtype=np.float32).reshape(4, 6),
    "array_T": np.arange(12, dtype=np.int64).reshape(3, 4).T,
    "big_bytes": bytes(range(256)) * 200,
    "empty": {},
}


@pytest.mark.parametrize("serde", [MsgpackSerde, PickleSerde])
def test_put_get_across_processes_two_readers(serde, children):
    ring = RingBuffer(1 << 20, create=True)
    store = ObjectStorage(1 << 16, 2, ring, serde_class=serde)
    handles = {k: store.put(k, v) for k, v in VALUES.items()}
    for _k, (address, mid) in handles.items():
        assert isinstance(address, int) and isinstance(mid, int)
    assert [mid for _, mid in handles.values()] == list(range(len(VALUES)))
    readers = start_readers(children, store, 2)
    assert [r.is_writer for r in readers] == [False, False]
    # the handles travel to the readers through a multiprocessing queue
    for n, r in enumerate(readers):
        order = list(handles) if n == 0 else list(reversed(handles))
        for k in order:
            got = r.get(handles[k])
            assert canon(got) == canon(VALUES[k]), k
    for k, h in handles.items():
        assert store.reader_count(*h) == 2, k
    for r in readers:
        r.stop()


def test_duplicate_key_is_refused():
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring)
    h = store.put("k", "first")
    before = (dict(store.key_index), ring.metadata, ring.monotonic_id_end)
    with pytest.raises(ValueError, match="already exists in the storage"):
        store.put("k", "second")
    assert (dict(store.key_index), ring.metadata, ring.monotonic_id_end) == before
    assert store.get(*h) == "first"


def test_object_larger_than_max_object_size_is_refused():
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(1024, 1, ring)
    with pytest.raises(ValueError, match="exceeds max object size"):
        store.put("big", b"x" * 2000)
    assert not store.is_cached("big")
    assert ring.metadata == {} and ring.monotonic_id_end == 0
    h = store.put("small", b"x" * 100)
    assert store.get(*h) == b"x" * 100


def test_max_object_size_counts_the_serialized_object():
    """As in vLLM: the 4-byte reader count plus the serialized bytes (not the store's own
    framing or alignment padding)."""
    value = b"y" * 500
    serialized = sum(memoryview(p).nbytes for p in PickleSerde()._store_parts(value))
    ring = RingBuffer(1 << 16, create=True)
    fits = ObjectStorage(serialized + 4, 1, ring, serde_class=PickleSerde)
    assert fits.get(*fits.put("k", value)) == value
    ring2 = RingBuffer(1 << 16, create=True)
    too_small = ObjectStorage(serialized + 3, 1, ring2, serde_class=PickleSerde)
    with pytest.raises(ValueError, match="exceeds max object size"):
        too_small.put("k", value)
    # A custom serde: its data and metadata, as vLLM counts them.
    data, nbytes, metadata, md_nbytes = PartsSerde().serialize(["ab", "cde"])
    ring3 = RingBuffer(1 << 16, create=True)
    exact = ObjectStorage(4 + nbytes + md_nbytes, 1, ring3, serde_class=PartsSerde)
    assert exact.get(*exact.put("k", ["ab", "cde"])) == ["ab", "cde"]
    with pytest.raises(ValueError, match="exceeds max object size"):
        ObjectStorage(3 + nbytes + md_nbytes, 1, ring3, serde_class=PartsSerde).put("k2", ["ab", "cde"])


def test_object_larger_than_the_ring_is_a_memory_error():
    ring = RingBuffer(1024, create=True)
    store = ObjectStorage(1 << 20, 1, ring)
    with pytest.raises(MemoryError):
        store.put("huge", b"z" * 4000)
    assert not store.is_cached("huge")
    h = store.put("ok", b"z" * 100)
    assert store.get(*h) == b"z" * 100


# ---------------------------------------------------------------------------------
# Eviction


def test_eviction_only_of_objects_every_reader_has_read_fifo(children):
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 2, ring)
    values, handles = fill(store)
    n = len(values)
    new = b"\xff" * 900
    r0, r1 = start_readers(children, store, 2)

    # Full, and nobody has read anything: no room.
    with pytest.raises(MemoryError):
        store.put("new1", new)
    assert set(store.key_index) == set(handles)

    # k0 read by one reader of two: still in use.
    assert r0.get(handles["k0"]) == values["k0"]
    assert store.reader_count(*handles["k0"]) == 1
    with pytest.raises(MemoryError):
        store.put("new1", new)
    assert store.is_cached("k0")

    # Read by both: put evicts it (and only it) to make room.
    assert r1.get(handles["k0"]) == values["k0"]
    assert store.reader_count(*handles["k0"]) == 2
    h_new1 = store.put("new1", new)
    assert not store.is_cached("k0") and "k0" not in store.key_index
    assert set(store.key_index) == {f"k{i}" for i in range(1, n)} | {"new1"}
    exc_type, message = r0.get_error(handles["k0"])
    assert exc_type == "ValueError" and STALE in message, (exc_type, message)

    # FIFO: k2 fully read but k1 not; k1 blocks the eviction of k2.
    assert r0.get(handles["k2"]) == values["k2"]
    assert r1.get(handles["k2"]) == values["k2"]
    with pytest.raises(MemoryError):
        store.put("new2", new)
    assert store.is_cached("k1") and store.is_cached("k2")
    assert r1.get(handles["k2"]) == values["k2"], "k2 must still be readable"

    # Now k1 is read by both: the oldest fully-read objects k1, k2 go.
    assert r0.get(handles["k1"]) == values["k1"]
    assert r1.get(handles["k1"]) == values["k1"]
    store.put("new2", new)
    assert not store.is_cached("k1") and not store.is_cached("k2")
    assert set(store.key_index) == {f"k{i}" for i in range(3, n)} | {"new1", "new2"}
    for k in ("k1", "k2"):
        exc_type, message = r1.get_error(handles[k])
        assert exc_type == "ValueError" and STALE in message
    for k in [f"k{i}" for i in range(3, n)]:
        assert r0.get(handles[k]) == values[k]
    assert r1.get(h_new1) == new
    for r in (r0, r1):
        r.stop()


def test_get_cached_needs_one_more_read_per_reader(children):
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 2, ring)
    values, handles = fill(store)
    assert store.is_cached("k0")
    assert tuple(store.get_cached("k0")) == tuple(handles["k0"])
    r0, r1 = start_readers(children, store, 2)
    new = b"\xee" * 900
    for n, reader in enumerate([r0, r1, r0]):
        assert reader.get(handles["k0"]) == values["k0"]
        assert store.reader_count(*handles["k0"]) == n + 1
        with pytest.raises(MemoryError):
            store.put("new", new)  # handed out twice: 4 reads are needed
        assert store.is_cached("k0")
    assert r1.get(handles["k0"]) == values["k0"]
    assert store.reader_count(*handles["k0"]) == 4
    store.put("new", new)
    assert not store.is_cached("k0")
    for r in (r0, r1):
        r.stop()


@pytest.mark.parametrize("with_lock", [False, True], ids=["no_reader_lock", "reader_lock"])
def test_get_in_the_writer_counts_only_with_reader_lock(with_lock):
    lock = CTX.Lock() if with_lock else None
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring, reader_lock=lock)
    values, handles = fill(store)
    assert store.get(*handles["k0"]) == values["k0"]
    assert store.reader_count(*handles["k0"]) == (1 if with_lock else 0)
    if with_lock:
        store.put("new", b"n" * 900)
        assert not store.is_cached("k0")
    else:
        with pytest.raises(MemoryError):
            store.put("new", b"n" * 900)
        assert store.is_cached("k0")


def test_handle_with_reader_lock_reaches_a_child(children):
    """The engines pass the handle (with a multiprocessing lock in it) as a Process
    argument; the child opens the store from it."""
    lock = CTX.Lock()
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring, reader_lock=lock)
    h = store.put("k", {"v": 1})
    reader = Reader(children, store.handle())
    assert reader.get(h) == {"v": 1}
    assert store.reader_count(*h) == 1
    reader.stop()


def test_is_cached_and_free_unused(children):
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(4096, 1, ring)
    ha = store.put("a", "A")
    hb = store.put("b", "B")
    assert store.is_cached("a") and store.is_cached("b") and not store.is_cached("c")
    assert list(store.free_unused() or []) == []
    assert store.is_cached("a") and store.is_cached("b")
    (reader,) = start_readers(children, store, 1)
    assert reader.get(hb) == "B"
    store.free_unused()  # "a" is older and unread: nothing may go
    assert store.is_cached("a") and store.is_cached("b")
    assert reader.get(ha) == "A"
    store.free_unused()
    assert not store.is_cached("a") and not store.is_cached("b")
    assert store.key_index == {}
    for h in (ha, hb):
        exc_type, message = reader.get_error(h)
        assert exc_type == "ValueError" and STALE in message
    # an evicted key may be stored again, under a new id
    ha2 = store.put("a", "A2")
    assert ha2[1] > hb[1]
    assert reader.get(ha2) == "A2"
    reader.stop()


def test_clear_keeps_old_handles_readable_until_the_memory_is_reused(children):
    """vLLM 0.33: requests still draining after a clear() read their objects until new
    objects are written over them; then the handle is refused, never another object."""
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(4096, 1, ring)
    old = {k: store.put(k, k * 300) for k in ("a", "b", "c")}
    (reader,) = start_readers(children, store, 1)
    assert reader.get(old["a"]) == "a" * 300
    store.clear()
    assert store.key_index == {} and store.id_index == {}
    assert not any(store.is_cached(k) for k in old)
    for k, h in old.items():
        assert reader.get(h) == k * 300
        assert store.get(*h) == k * 300
    # "A" overwrites the start of "a" only.
    new = {"A": store.put("A", "A")}
    assert new["A"][0] == 0, "addresses restart at 0"
    assert min(mid for _, mid in new.values()) > max(mid for _, mid in old.values()), "ids must keep counting"
    exc_type, message = reader.get_error(old["a"])
    assert exc_type == "ValueError" and STALE in message
    with pytest.raises(ValueError, match=STALE):
        store.get(*old["a"])
    assert reader.get(old["c"]) == "c" * 300
    # Enough new objects to cover every old one.
    new.update({k: store.put(k, k * 300) for k in ("B", "C", "D", "E")})
    for h in old.values():
        assert reader.get_error(h)[0] == "ValueError"
    for k, h in new.items():
        assert reader.get(h) == (k if k == "A" else k * 300)
    # A second clear forgets what the first one kept readable.
    store.clear()
    assert reader.get(new["E"]) == "E" * 300
    reader.stop()


def test_writer_attributes():
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(4096, 3, ring)
    assert store.is_writer is True
    assert store.max_object_size == 4096
    assert store.n_readers == 3
    assert store.ring_buffer is ring
    assert store.key_index == {} and store.id_index == {}
    ha = store.put("a", 1)
    hb = store.put("b", 2)
    assert {k: tuple(v) for k, v in store.key_index.items()} == {"a": tuple(ha), "b": tuple(hb)}
    assert store.id_index == {ha[1]: "a", hb[1]: "b"}
    assert isinstance(store.writer_flag, Mapping)
    assert store.writer_flag == {ha[1]: 1, hb[1]: 1}
    assert set(store.writer_flag) <= {ha[1], hb[1]}
    reader = ObjectStorage.create_from_handle(store.handle())
    assert reader.is_writer is False
    assert reader.n_readers == 3 and reader.max_object_size == 4096


def test_writer_flag_of_an_id_whose_key_was_put_again_is_a_key_error():
    # writer_flag[id] looks the id's key up, then the key's entry: if the key is put again
    # in between (another thread), the entry is a newer object's, not this id's count.
    from shmq.object_storage import _WriterFlag

    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(4096, 1, ring)
    _, old_id = store.put("k", 1)
    store.get_cached("k")  # the old object: handed out twice

    class PutAgainBetween:
        def __init__(self, core):
            self.core = core

        def key_of(self, monotonic_id):
            key = self.core.key_of(monotonic_id)
            store.clear()
            store.put("k", 2)  # handed out once, under a new id
            return key

        def __getattr__(self, name):
            return getattr(self.core, name)

    class Racing:  # a store whose core puts the key again between the two lookups
        _core = PutAgainBetween(store._core)

    racing = Racing()
    with pytest.raises(KeyError):
        _WriterFlag(racing)[old_id]  # type: ignore[arg-type]
    ring.close()


def test_handle_is_picklable_and_opens_a_reader(children):
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(4096, 2, ring, serde_class=PickleSerde)
    handle = store.handle()
    assert isinstance(handle, ObjectStorageHandle)
    assert handle.max_object_size == 4096
    assert handle.n_readers == 2
    assert tuple(handle.ring_buffer_handle) == tuple(ring.handle())
    assert handle.serde_class is PickleSerde
    assert handle.reader_lock is None
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert ObjectStorageHandle(4096, 2, ring.handle(), PickleSerde, None) == handle
    assert ObjectStorageHandle(4096, 2, ring.handle(), PickleSerde) == handle
    h = store.put("k", {"x": (1, 2)})
    reader = ObjectStorage.create_from_handle(pickle.loads(pickle.dumps(handle)))
    assert reader.is_writer is False
    assert reader.get(*h, store.get_signature("k"), "k") == {"x": (1, 2)}
    with pytest.raises(RuntimeError, match="(?i)writer"):
        reader.put("x", 1)
    (child,) = start_readers(children, store, 1)
    assert child.get(h) == {"x": (1, 2)}
    msg = child.ask("put", "p")
    assert msg[0] == "raised" and msg[2] == "RuntimeError", msg
    child.stop()


# ---------------------------------------------------------------------------------
# Absurd handles: refused with the stale-object ValueError, never a crash


@pytest.fixture(scope="module")
def absurd_results():
    """Tries every absurd handle, in a reader process (on a store of this process) and
    in a writer process (on its own store, with a reader_lock so its gets count)."""
    children = Children()
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring)
    try:
        cases = absurd_scenario(store)
        assert [c[0] for c in cases] == ABSURD_CASES
        out = children.queue()
        children.start(absurd_reader, out, pickle.dumps(store.handle()), cases)
        children.start(absurd_writer, out)
        results: dict = {}
        started: dict = {}
        done: set = set()
        while len(done) < 2:
            try:
                msg = children.receive(out)
            except AssertionError as e:  # a child died or hung: record what we have
                results["_failure"] = str(e)
                break
            if msg[0] == "start":
                started[msg[1]] = msg[2]
            elif msg[0] == "case":
                results[(msg[1], msg[2])] = msg[3:]
                started.pop(msg[1], None)
            elif msg[0] == "done":
                done.add(msg[1])
        codes = children.exit_codes()
        results["_exit_codes"] = codes
        results["_crashed_in"] = started
        return results
    finally:
        children.close()
        del store, ring
        gc.collect()


def test_absurd_handles_do_not_crash(absurd_results):
    assert "_failure" not in absurd_results, absurd_results.get("_failure")
    assert absurd_results["_crashed_in"] == {}, f"a child died in case {absurd_results['_crashed_in']}"
    codes = absurd_results["_exit_codes"]
    assert all(c == 0 for c in codes.values()), f"exit codes: {codes}"
    for side in ("reader", "writer"):
        for case in ABSURD_CASES:
            assert (side, case) in absurd_results, (side, case)


@pytest.mark.parametrize("side", ["reader", "writer"])
@pytest.mark.parametrize("case", ABSURD_CASES)
def test_absurd_handle_is_refused_with_value_error(absurd_results, side, case):
    if (side, case) not in absurd_results:
        pytest.fail(f"no result for {side}/{case}: the child died before it (see test_absurd_handles_do_not_crash)")
    get_result, _access, _count = absurd_results[(side, case)]
    assert get_result[0] == "raised", f"get() returned {get_result[1]}"
    exc_type, message = get_result[1], get_result[2]
    # A reader refuses a handle that cannot even be signed (an int out of range) for its
    # signature; every other one for what is, or is not, at the address.
    expected = SIGNATURE_REFUSED if side == "reader" and case in UNSIGNABLE_CASES else STALE
    assert exc_type == "ValueError" and expected in message, f"{exc_type}: {message}"


# ---------------------------------------------------------------------------------
# Crash tests (STYLE 11): peers that die without running their destructors


def test_killed_reader_then_replacement_reader(children):
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(4096, 1, ring)
    h0 = store.put("k0", ["zero"])
    h1 = store.put("k1", ["one"])
    blob = pickle.dumps(store.handle())
    out = children.queue()
    p = children.start(killed_reader, out, blob, *h0)
    assert children.expect(out, "got")[1] == ["zero"]
    p.join(15)
    assert p.exitcode == -signal.SIGKILL
    # its read was counted before it died; the writer and a new reader carry on
    assert store.reader_count(*h0) == 1
    store.free_unused()
    assert not store.is_cached("k0") and store.is_cached("k1")
    h2 = store.put("k2", ["two"])
    reader = Reader(children, blob)
    assert reader.get(h1) == ["one"]
    assert reader.get(h2) == ["two"]
    assert reader.get_error(h0)[0] == "ValueError"
    reader.stop()


def test_abandoned_writer_leaves_a_readable_segment(children):
    values = {"a": [1, 2, 3], "b": {"x": b"bytes"}, "c": np.arange(10, dtype=np.int16)}
    out = children.queue()
    p = children.start(abandoned_writer, out, values)
    _, blob, handles, name = children.expect(out, "stored")
    p.join(15)
    assert p.exitcode == 0
    try:
        assert os.path.exists(os.path.join(SHM_DIR, name)), "the abandoned segment should still be there"
        reader = ObjectStorage.create_from_handle(pickle.loads(blob))
        for k, h in handles.items():
            assert canon(signed_get(reader, *h)) == canon(values[k])
        del reader
        gc.collect()
    finally:
        # nobody is left to remove it: the test does
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def test_a_dropped_store_frees_its_segment_at_once_not_at_a_garbage_collection():
    # The store's vLLM-shaped indexes (key_index, id_index, writer_flag) refer back to it
    # weakly: the last reference dropped, the ring's segment goes (as vLLM's own store's
    # does), not only once a collection finds a cycle.
    gc.collect()
    gc.disable()
    try:
        ring = RingBuffer(1 << 16, create=True)
        store = ObjectStorage(4096, 1, ring)
        address, monotonic_id = store.put("k", np.arange(8))
        assert store.key_index["k"] == (address, monotonic_id) and store.id_index[monotonic_id] == "k"
        name = ring.shared_memory.name
        assert os.path.exists(os.path.join(SHM_DIR, name))
        key_index = store.key_index
        del store, ring
        assert not os.path.exists(os.path.join(SHM_DIR, name)), "the segment waits for a garbage collection"
        with pytest.raises(ValueError, match="closed"):
            key_index["k"]  # an index kept past its store says so
    finally:
        gc.enable()

"""vLLM 0.33's current API of the classes shmq replaces (issue 9): signed store handles,
vLLM's reference counting, tight packing, ``close()``, the attributes and arguments vLLM
0.33 added, its environment variables and process-group helpers.

Readers run in spawned processes wherever memory is shared; the plugin that puts shmq
under vLLM itself is tested in ``test_vllm_plugin.py``.
"""

from __future__ import annotations

import gc
import os
import pickle
import stat
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from shmq import Handle, MessageQueue, ObjectStorage, PickleSerde, RingBuffer, ShmRingBuffer, _core

from _processes import STEP, free_port
from _processes.store_children import STALE, store_frame
from _processes.vllm_children import (
    env_probe,
    external_writer_member,
    ring_memory_writer,
    signed_reader,
    single_reader_member,
    stateless_tensor_member,
    vllm_style_reader,
    vllm_warning_interval_reader,
)

pytestmark = pytest.mark.timeout(120)

SIGNATURE = "SHM handle signature"
# vLLM 0.33's sentences, less the full stop: shmq's messages start with them and go on to
# name the key and what was wrong (test_errors.py checks the rest).
MISSING = "Missing SHM handle signature for cache key"
INVALID = "Invalid SHM handle signature for cache key"


class Reader:
    """A ``signed_reader`` child driven by the test."""

    def __init__(self, children, handle):
        self.children = children
        self.out, self.cmds = children.queue(), children.queue()
        self.proc = children.start(signed_reader, self.out, handle, self.cmds)
        children.expect(self.out, "ready")

    def ask(self, *cmd):
        self.cmds.put(cmd)
        return self.children.receive(self.out)

    def ok(self, *cmd):
        msg = self.ask(*cmd)
        assert msg[0] == "ok", msg
        return msg[2]

    def refused(self, *cmd) -> str:
        msg = self.ask(*cmd)
        assert msg[0] == "raised" and msg[2] == "ValueError", msg
        return msg[3]

    def stop(self):
        self.cmds.put(("stop",))
        self.children.expect(self.out, "stopped")


def _writer(n_readers=1, size=1 << 16, max_object=1 << 12, **kw):
    return ObjectStorage(max_object, n_readers, RingBuffer(size, create=True), **kw)


# ---------------------------------------------------------------------------------
# Signed handles


def test_reader_get_and_touch_need_the_writers_signature(children):
    store = _writer()
    address, mid = store.put("key", {"v": 1})
    signature = store.get_signature("key")
    assert isinstance(signature, list) and len(signature) == 32
    assert all(type(b) is int and 0 <= b <= 255 for b in signature)
    assert store.get_signature("key") == signature, "deterministic"
    reader = Reader(children, store.handle())
    assert reader.ok("touch", "t", "key", address, mid, signature) is None
    assert reader.ok("get", "g", address, mid, signature, "key") == {"v": 1}
    assert reader.ok("count", "c", address, mid) == 1
    flipped = [signature[0] ^ 1, *signature[1:]]
    bad = {
        "none": None,
        "flipped": flipped,
        "nested": [signature],
        "short": signature[:-1],
        "long": signature + [0],
        "out_of_range": [256] * 32,
        "negative": [-1] * 32,
        "bools": [bool(b & 1) for b in signature],
        "tuple": tuple(signature),
        "bytes": bytes(signature),
        "floats": [float(b) for b in signature],
    }
    for name, sig in bad.items():
        message = reader.refused("get", name, address, mid, sig, "key")
        assert SIGNATURE in message, (name, message)
        assert message.startswith(MISSING if sig is None else INVALID), (name, message)
        message = reader.refused("touch", name, "key", address, mid, sig)
        assert SIGNATURE in message, (name, message)
    # Bound to the key, the address and the id; a missing key is a missing signature.
    assert reader.refused("get", "k", address, mid, signature, "other").startswith(INVALID)
    assert reader.refused("get", "a", address + 1, mid, signature, "key").startswith(INVALID)
    assert reader.refused("get", "i", address, mid + 1, signature, "key").startswith(INVALID)
    assert reader.refused("get", "n", address, mid, signature, None).startswith(MISSING)
    assert reader.refused("get", "t", address, mid, signature, 7).startswith(INVALID)
    # Refused before anything is read: no read was counted.
    assert reader.ok("count", "c", address, mid) == 1
    # Another store's signature does not open this one.
    other = _writer()
    other.put("key", {"v": 1})
    assert reader.refused("get", "o", address, mid, other.get_signature("key"), "key").startswith(INVALID)
    reader.stop()
    other.close()
    store.close()


def test_a_signed_handle_of_reused_memory_is_refused_as_modified(children):
    """The signature says the writer issued the handle, not that the object is still
    there: a reused chunk is "modified or is invalid", for get and touch alike."""
    store = _writer(size=4096, max_object=2048)
    address, mid = store.put("a", b"a" * 1500)
    signature = store.get_signature("a")
    reader = Reader(children, store.handle())
    assert reader.ok("get", "g", address, mid, signature, "a") == b"a" * 1500
    store.put("b", b"b" * 1500)
    store.put("c", b"c" * 1500)  # the ring is full: "a" (read by its one reader) goes
    assert not store.is_cached("a")
    for cmd in (("get", "g", address, mid, signature, "a"), ("touch", "t", "a", address, mid, signature)):
        message = reader.refused(*cmd)
        assert STALE in message, message
    reader.stop()
    store.close()


def test_writer_verify_signature_needs_the_current_entry():
    store = _writer()
    address, mid = store.put("key", "value")
    signature = store.get_signature("key")
    store.verify_signature("key", address, mid, signature)
    for args in (
        ("other", address, mid, signature),
        ("key", address + 1, mid, signature),
        (None, address, mid, signature),
        ("key", address, mid, [signature[0] ^ 1, *signature[1:]]),
    ):
        with pytest.raises(ValueError, match=SIGNATURE):
            store.verify_signature(*args)
    with pytest.raises(ValueError, match="Missing SHM handle signature"):
        store.verify_signature("key", address, mid, None)
    store.clear()
    with pytest.raises(ValueError, match=SIGNATURE):
        store.verify_signature("key", address, mid, signature)
    with pytest.raises(KeyError):
        store.get_signature("key")
    # A reader only checks the signature.
    reader = ObjectStorage.create_from_handle(store.handle())
    reader.verify_signature("key", address, mid, signature)
    reader.close()
    store.close()


def test_the_secret_lives_in_the_owner_only_segment(children):
    store = _writer()
    name = store.ring_buffer.shared_memory.name
    assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
    secret = store.ring_buffer.get_auth_secret()
    assert isinstance(secret, bytes) and len(secret) == 32 == RingBuffer.AUTH_SECRET_BYTES
    reader = Reader(children, store.handle())
    assert reader.ok("secret", "s") == secret
    reader.stop()
    other = _writer()
    assert other.ring_buffer.get_auth_secret() != secret
    other.close()
    store.close()


# ---------------------------------------------------------------------------------
# vLLM's reference counting, with four reader processes (tensor-parallel workers)


class Group:
    """A writer and four reader processes; a reference is one request's handle."""

    def __init__(self, children):
        self.writer = _writer(n_readers=4)
        self.readers = [Reader(children, self.writer.handle()) for _ in range(4)]

    def reference(self, key):
        if self.writer.is_cached(key):
            address, mid = self.writer.get_cached(key)
        else:
            address, mid = self.writer.put(key, "value")
        return address, mid, self.writer.get_signature(key), key

    def touch(self, reader, ref):
        address, mid, signature, key = ref
        assert reader.ok("touch", "t", key, address, mid, signature) is None

    def get(self, reader, ref):
        assert reader.ok("get", "g", *ref) == "value"

    def evictable(self, key):
        self.writer.free_unused()
        return not self.writer.is_cached(key)

    def close(self):
        for r in self.readers:
            r.stop()
        self.writer.close()


def test_item_referenced_again_before_every_reader_fetched_it_is_evictable_after(children):
    g = Group(children)
    first = g.reference("image")
    g.writer.touch("image")
    second = g.reference("image")
    g.writer.release_touches()
    assert g.writer.writer_flag[first[1]] == 2
    for r in g.readers:
        g.touch(r, first)
    for r in g.readers[:-1]:
        g.get(r, first)
        g.touch(r, second)
        g.get(r, second)
    assert not g.evictable("image"), "the last reader has fetched neither reference"
    g.get(g.readers[-1], first)
    assert not g.evictable("image"), "one reference is still to be fetched"
    g.touch(g.readers[-1], second)
    g.get(g.readers[-1], second)
    assert g.evictable("image"), "never pinned forever"
    g.close()


def test_new_item_twice_in_one_request_stays_until_the_last_fetch(children):
    g = Group(children)
    g.writer.touch("image")  # not stored yet: ignored
    refs = [g.reference("image"), g.reference("image")]
    g.writer.release_touches()
    for r in g.readers[:-1]:
        for ref in refs:
            g.touch(r, ref)
        for ref in refs:
            g.get(r, ref)
    for ref in refs:
        g.touch(g.readers[-1], ref)
    assert not g.evictable("image")
    for ref in refs:
        g.get(g.readers[-1], ref)
    assert g.evictable("image")
    g.close()


def test_touch_protects_until_get_cached_or_release(children):
    g = Group(children)
    ref = g.reference("image")
    for r in g.readers:
        g.get(r, ref)
    g.writer.touch("image")
    assert g.writer._touched == {ref[1]}
    assert not g.evictable("image")
    # get_cached ends the touch, but hands the item out again: 4 more reads needed.
    ref2 = g.reference("image")
    assert g.writer._touched == set()
    assert not g.evictable("image")
    for r in g.readers:
        g.get(r, ref2)
    g.writer.touch("image")
    assert not g.evictable("image")
    g.writer.release_touches()
    assert g.evictable("image")
    g.close()


def test_eviction_helpers_of_vllm():
    store = _writer(n_readers=1, size=4096, max_object=2048)
    address, mid = store.put("k", b"x" * 100)
    ring = store.ring_buffer
    with ring.access_buf(address) as (view, _):
        assert store.default_is_free_check(mid, view) is False
        store.touch("k")
        store.increment_writer_flag(mid)
        assert store.writer_flag[mid] == 2
    signature = store.get_signature("k")
    reader = ObjectStorage.create_from_handle(store.handle())
    for _ in range(2):
        reader.get(address, mid, signature, "k")
    with ring.access_buf(address) as (view, _):
        assert store.default_is_free_check(mid, view) is False, "touched"
        store.release_touches()
        assert store.default_is_free_check(mid, view) is True
    assert list(ring.free_buf(store.default_is_free_check)) == [mid]
    with pytest.raises(ValueError):
        store.default_is_free_check(mid, memoryview(bytearray(8)))
    with pytest.raises(KeyError):
        store.increment_writer_flag(12345)
    reader.close()
    store.close()


# ---------------------------------------------------------------------------------
# Layout, clear and close


def test_five_puts_clear_and_the_next_put_is_0_5():
    store = _writer()
    for i in range(5):
        store.put(f"item_{i}", f"value_{i}")
    store.clear()
    assert len(store.key_index) == 0 and len(store.id_index) == 0 and len(store.ring_buffer.metadata) == 0
    assert store.put("new_item", "new_value") == (0, 5)
    store.close()


def test_tensor_data_is_64_byte_aligned_in_shared_memory():
    store = _writer(size=1 << 20, max_object=1 << 18)
    ring = store.ring_buffer
    for skew in range(1, 9):
        ring.allocate_buf(skew * 7)  # move the next chunk to odd offsets
        value = {"a": torch.arange(skew * 3, dtype=torch.float32), "b": np.ones((skew, 5), np.int8), "c": "text"}
        address, mid = store.put(f"k{skew}", value)
        data_offset = address % ring.data_buffer_size + 8
        with ring.access_buf(address) as (view, _):
            _, _, _, entries = store_frame(view, data_offset)
            assert len(entries) == 3  # the msgpack tree and two raw buffers
            for off, _ in entries[1:]:
                assert (data_offset + off) % 64 == 0
        got = store.get(address, mid)
        assert torch.equal(got["a"], value["a"]) and np.array_equal(got["b"], value["b"]) and got["c"] == "text"
        store.free_unused()
    store.close()


def test_close_removes_the_segment_once_and_readers_keep_theirs(children):
    store = _writer()
    name = store.ring_buffer.shared_memory.name
    address, mid = store.put("k", "v")
    signature = store.get_signature("k")
    reader = ObjectStorage.create_from_handle(store.handle())
    reader.clear()  # a no-op on a reader, as in vLLM
    reader.close()
    reader.close()
    assert os.path.exists(f"/dev/shm/{name}"), "a reader's close must not remove the segment"
    assert store.get(address, mid) == "v"
    child = Reader(children, store.handle())
    assert child.ok("clear", "c") is None
    assert child.ok("get", "g", address, mid, signature, "k") == "v"
    child.stop()
    store.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    store.close()  # idempotent
    store.ring_buffer.close()
    with pytest.raises(ValueError, match="closed"):
        store.put("x", 1)
    with pytest.raises(ValueError, match="closed"):
        store.get(address, mid)
    assert store.ring_buffer.shared_memory.buf is None


def test_ring_buffer_attributes_of_vllm():
    ring = RingBuffer(1000, create=True)
    assert (ring.ID_NBYTES, ring.SIZE_NBYTES, ring.MD_SIZE, ring.ID_MAX) == (4, 4, 8, 2**31)
    assert ring.int2byte(-1) == b"\xff\xff\xff\xff" and ring.byte2int(b"\xff\xff\xff\xff") == -1
    ring.allocate_buf(10)
    assert isinstance(ring.metadata, Mapping) and dict(ring.metadata) == {0: 0} and ring.metadata[0] == 0
    with pytest.raises(KeyError):
        ring.metadata[1]
    sm = ring.shared_memory
    assert sm.size == 1000 and len(sm.buf) == 1000 and sm.name == ring.handle()[1]
    ring.close()
    ring.close()


def test_key_index_is_a_live_mapping():
    store = _writer()
    a = store.put("a", 1)
    b = store.put("b", 2)
    ki = store.key_index
    assert isinstance(ki, Mapping) and len(ki) == 2 and ki["a"] == a and "b" in ki
    assert {"a", "b", "c"} - ki.keys() == {"c"}  # what vLLM's sender cache does
    assert store.id_index[b[1]] == "b" and dict(store.writer_flag) == {a[1]: 1, b[1]: 1}
    store.put("c", 3)
    assert len(ki) == 3, "not a copy"
    store.close()


def test_a_custom_serde_gets_metadata_and_data_back_to_back():
    """vLLM's own MsgpackSerde reads its metadata from the start of the view and its data
    from the end: the view must be exactly ``[metadata][data...]``."""
    seen = []

    class EndReader(PickleSerde):
        def serialize(self, value):
            data = pickle.dumps(value)
            metadata = pickle.dumps(len(data))
            return [data[:3], data[3:]], len(data), metadata, len(metadata)

        def deserialize(self, data_view):
            nbytes = pickle.loads(data_view)
            seen.append(len(data_view))
            return pickle.loads(bytes(data_view[-nbytes:]))

    store = _writer(serde_class=EndReader)
    store.ring_buffer.allocate_buf(5)
    assert store.get(*store.put("k", {"x": [1, 2]})) == {"x": [1, 2]}
    assert seen == [len(pickle.dumps(len(pickle.dumps({"x": [1, 2]})))) + len(pickle.dumps({"x": [1, 2]}))]
    store.close()


# ---------------------------------------------------------------------------------
# The broadcast queue: vLLM 0.33's arguments and attributes


def test_ring_shared_memory_shows_the_segment_another_process_wrote(children):
    """``ShmRingBuffer.shared_memory`` (vLLM's ``SharedMemory``) is the whole segment, the
    same class as the store's: what another process writes into a chunk is in ``buf``,
    and what this one writes into ``buf`` is in the chunk."""
    ring = ShmRingBuffer(1, 4096, 2)
    sm = ring.shared_memory
    assert type(sm) is type(RingBuffer(4096, create=True).shared_memory)
    assert sm.name == ring.name and sm.size == os.stat(os.path.join(_core.SHM_DIR, ring.name)).st_size
    assert sm.size >= ring.total_bytes_of_buffer
    buf = sm.buf  # mapped before the child writes: a copy would not see it
    assert buf is not None and len(buf) == sm.size
    pattern = os.urandom(32)
    out = children.queue()
    children.start(ring_memory_writer, out, ring.handle(), pattern)
    tag, size, buf_len, found = out.get(timeout=STEP)
    assert (tag, size, buf_len) == ("written", sm.size, sm.size)
    at = bytes(buf).find(pattern)
    assert at == found and at >= 0, "the child's write is where its own view saw it"
    mine = os.urandom(32)
    buf[at : at + 32] = mine
    with ring.get_data(1) as data:
        assert bytes(data[:32]) == mine
    sm.close()
    assert sm.buf is None and sm.size == len(buf)
    assert bytes(buf[at : at + 32]) == mine, "a view made before close keeps the mapping"
    buf.release()
    # The size stays known after close, read before or not.
    other = ShmRingBuffer(1, 4096, 2)
    other.shared_memory.close()
    assert other.shared_memory.size == os.stat(os.path.join(_core.SHM_DIR, other.name)).st_size
    # A ring whose segment is not on this machine (a handle from another node): the
    # object can be made, its memory cannot be reached.
    away = ShmRingBuffer(1, 4096, 2, name="shmq_no_such_ring_here")
    with pytest.raises(FileNotFoundError, match="does not exist on this machine"):
        _ = away.shared_memory.size
    with pytest.raises(FileNotFoundError, match="does not exist on this machine"):
        _ = away.shared_memory.buf


def test_a_dropped_ring_or_store_is_gone_without_the_garbage_collector():
    """``shared_memory`` does not keep its ring alive: dropping the creator removes the
    segment at once, with no collection (a reference cycle would keep it until one)."""
    gc.collect()
    gc.disable()
    try:
        for make in (lambda: ShmRingBuffer(1, 4096, 2), lambda: RingBuffer(4096, create=True)):
            ring = make()
            path = os.path.join(_core.SHM_DIR, ring.shared_memory.name)
            ring.shared_memory.buf.release()
            assert ring.shared_memory.size > 0 and os.path.exists(path)
            del ring
            assert not os.path.exists(path), path
    finally:
        gc.enable()


def test_message_queue_takes_vllm_arguments_and_attributes(children):
    # All of vLLM 0.33's constructor arguments, positionally.
    mq = MessageQueue(1, 1, [0], 1 << 16, 3, "127.0.0.1", True)
    assert mq.enable_shm_tensor_arena is True and mq.tensor_arena is None
    handle = mq.export_handle()
    assert isinstance(handle, Handle) and handle.local_notify_addr is None and handle.tensor_arena_handle is None
    buf = mq.buffer
    assert buf.metadata_size == 2
    assert buf.total_bytes_of_buffer == ((1 << 16) + 2) * 3
    assert (buf.data_offset, buf.metadata_offset) == (0, (1 << 16) * 3)
    assert buf.shared_memory.name == buf.handle()[3] and buf.shared_memory.size >= buf.total_bytes_of_buffer
    out = children.queue()
    children.start(vllm_style_reader, out, handle, 0)
    mq.wait_until_ready(timeout=STEP)
    for m in ("one", "two", "three"):
        mq.enqueue(m, timeout=STEP)
    with mq.acquire_write(STEP) as chunk:
        chunk[:5] = b"raw!!"
    _, got, attrs = children.expect(out, "read")
    children.join()
    assert got == ["one", "two", "three", b"raw!!"]
    assert attrs == {
        "metadata_size": 2,
        "data_offset": 0,
        "metadata_offset": (1 << 16) * 3,
        "total_bytes_of_buffer": ((1 << 16) + 2) * 3,
        "shared_memory_name": buf.handle()[3],
        "handle_name": buf.handle()[3],
        "tensor_arena": None,
        "enable_shm_tensor_arena": False,
    }


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"VLLM_HOST_IP": "127.0.0.2"}, "127.0.0.2"),
        ({"VLLM_HOST_IP": "127.0.0.2", "SHMQ_HOST_IP": "127.0.0.3"}, "127.0.0.3"),
    ],
)
def test_vllm_host_ip_is_the_fallback(children, env, expected):
    out = children.queue()
    children.start(env_probe, out, env)
    assert children.expect(out, "ip")[1] == expected
    children.join()


def test_vllm_ringbuffer_warning_interval_is_the_fallback(children):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    out = children.queue()
    env = {"VLLM_RINGBUFFER_WARNING_INTERVAL": "0.2"}
    children.start(vllm_warning_interval_reader, out, mq.export_handle(), 0, env)
    mq.wait_until_ready(timeout=STEP)
    warnings = children.expect(out, "log")[1]
    children.join()
    assert len(warnings) >= 2, f"expected a warning every 0.2 s during a 1 s wait, got {warnings}"


# ---------------------------------------------------------------------------------
# Process groups: vLLM 0.33's helpers


def _run_members(children, target, n, *args):
    out, release = children.queue(), children.event()
    port = free_port()
    for rank in range(n):
        children.start(target, out, port, rank, n, *args, release)
    msgs = [children.receive(out, timeout=4 * STEP) for _ in range(n)]
    release.set()
    children.join()
    return msgs


def test_single_reader_queues_gather_every_handle_to_the_reader(children):
    msgs = _run_members(children, single_reader_member, 3, 1, None)
    reports = {m[1]["rank"]: m[1] for m in msgs}
    assert reports[1]["n_handles"] == 3 and reports[0]["n_handles"] == reports[2]["n_handles"] == 0
    assert all(r["n_local_reader"] == 1 for r in reports.values()), "all on one machine"
    assert reports[1]["got"] == [("from", 0), ("from", 1), ("from", 2)]


def test_single_reader_queues_follow_the_locality_the_caller_states(children):
    """Issue 43: where the caller says which ranks share the reader's machine (vLLM's
    rule, by device count), shmq follows it rather than its /dev/shm probe: ranks 0 and 2
    are said to be elsewhere, so their queues are remote-only although they share this
    machine, and the reader opens them as vLLM's executor does (rank -1)."""
    msgs = _run_members(children, single_reader_member, 3, 1, [False, True, False])
    reports = {m[1]["rank"]: m[1] for m in msgs}
    assert [reports[r]["n_local_reader"] for r in range(3)] == [0, 1, 0]
    assert reports[1]["got"] == [("from", 0), ("from", 1), ("from", 2)]


def test_a_negative_rank_opens_a_remote_reader_or_is_refused_naming_it():
    """vLLM's executor opens another node's response queue as ``create_from_handle(h, -1)``."""
    remote = MessageQueue(n_reader=1, n_local_reader=0, max_chunk_bytes=1024, max_chunks=2, connect_ip="127.0.0.1")
    reader = MessageQueue.create_from_handle(remote.export_handle(), -1)
    assert reader._is_remote_reader and not reader._is_local_reader
    local = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    refused = r"rank -1 is not a local reader \(\[0\]\) and the queue has no remote readers"
    with pytest.raises(ValueError, match=refused):
        MessageQueue.create_from_handle(local.export_handle(), -1)


def test_external_writer_handle_makes_every_rank_a_reader(children):
    mq = MessageQueue(n_reader=3, n_local_reader=3, max_chunk_bytes=1 << 16, max_chunks=2)
    out, release = children.queue(), children.event()
    port = free_port()
    for rank in range(3):
        children.start(external_writer_member, out, port, rank, 3, mq.export_handle(), release)
    mq.wait_until_ready(timeout=STEP)
    for m in ("a", "b", "c"):
        mq.enqueue(m, timeout=STEP)
    msgs = [children.receive(out, timeout=4 * STEP) for _ in range(3)]
    release.set()
    children.join()
    assert sorted(m[1] for m in msgs) == [0, 1, 2]
    for m in msgs:
        assert m[2] is True and m[3] == ["a", "b", "c"]


def test_stateless_group_tensor_helpers_and_listen_socket(children):
    msgs = _run_members(children, stateless_tensor_member, 3)
    seen = {m[1]: m[2] for m in msgs}
    for rank in range(3):
        assert seen[rank]["broadcast"] == [0, 10, 20, 30]
        assert seen[rank]["sum"] == [6.0, -3.0]
        assert seen[rank]["max"] == [3.0, 0.0]
        assert seen[rank]["product"] == [6.0, 0.0]
    assert seen[2]["recv"] == ([7.0, 7.0, 7.0], True)


def test_dequeue_cancel_still_takes_an_event():
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    import threading

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RuntimeError, match="cancelled"):
        reader.dequeue(5, cancel)
    with pytest.raises(TimeoutError):
        reader.dequeue(0.05, True)
    del reader, mq
    gc.collect()

"""ShmRingBuffer and Handle: geometry, views, pickling across processes, segment lifetime
(the engines' ``ShmRingBuffer`` and ``Handle``)."""

from __future__ import annotations

import dataclasses
import gc
import pickle

import pytest

from shmq import Handle, MessageQueue, ShmRingBuffer

from _processes import (
    segment_exists,
    STEP,
    handle_roundtrip_reader,
    missing_ring_user,
    ring_buffer_peer,
    shm_segments,
)


def test_handle_is_the_geometry_and_name():
    buf = ShmRingBuffer(3, 4096, 5)
    assert buf.is_creator
    assert buf.name.startswith("shmq_")
    assert buf.name in shm_segments()
    assert buf.handle() == (3, 4096, 5, buf.name)
    assert isinstance(buf.handle(), tuple)


def test_views_have_the_chunk_sizes_and_start_zeroed():
    buf = ShmRingBuffer(3, 1000, 4)
    for i in range(4):
        with buf.get_data(i) as data:
            assert isinstance(data, memoryview)
            assert len(data) == 1000
            assert not data.readonly
            assert bytes(data) == bytes(1000)
        with buf.get_metadata(i) as meta:
            # [written, read_0, read_1, read_2]
            assert len(meta) == 1 + 3
            assert bytes(meta) == bytes(4)


def test_chunks_do_not_overlap():
    buf = ShmRingBuffer(2, 100, 3)
    for i in range(3):
        with buf.get_data(i) as data:
            data[:] = bytes([i + 1]) * 100
        with buf.get_metadata(i) as meta:
            meta[:] = bytes([i + 1]) * 3
    for i in range(3):
        with buf.get_data(i) as data:
            assert bytes(data) == bytes([i + 1]) * 100
        with buf.get_metadata(i) as meta:
            assert bytes(meta) == bytes([i + 1]) * 3


def test_views_are_released_when_the_block_ends():
    buf = ShmRingBuffer(1, 64, 2)
    with buf.get_data(0) as data:
        pass
    with pytest.raises(ValueError):
        data[0]
    with buf.get_metadata(0) as meta:
        pass
    with pytest.raises(ValueError):
        meta[0]


@pytest.mark.parametrize("index", [2, 3, 10**6, -1])
def test_out_of_range_chunk_index_is_a_value_error(index):
    buf = ShmRingBuffer(1, 64, 2)
    with pytest.raises(ValueError):
        with buf.get_data(index):
            pass
    with pytest.raises(ValueError):
        with buf.get_metadata(index):
            pass


def test_pickles_as_its_handle_and_reopens_the_segment():
    buf = ShmRingBuffer(2, 256, 3)
    assert buf.__reduce__() == (ShmRingBuffer, buf.handle())
    other = pickle.loads(pickle.dumps(buf))
    assert not other.is_creator
    assert other.handle() == buf.handle()
    with buf.get_data(2) as data:
        data[:5] = b"hello"
    with other.get_data(2) as data:
        assert bytes(data[:5]) == b"hello"
    # Dropping an opener leaves the segment to its creator.
    del other
    gc.collect()
    assert segment_exists(buf.name)


def test_opening_with_another_geometry_is_refused():
    buf = ShmRingBuffer(2, 256, 3)
    with pytest.raises(ValueError):
        ShmRingBuffer(2, 512, 3, name=buf.name)
    with pytest.raises(ValueError):
        ShmRingBuffer(3, 256, 3, name=buf.name)


def test_creator_unlinks_the_segment_when_dropped():
    buf = ShmRingBuffer(1, 64, 2)
    name = buf.name
    assert segment_exists(name)
    del buf
    gc.collect()
    assert not segment_exists(name)


def test_a_view_keeps_the_mapping_alive_after_its_buffer_is_dropped():
    buf = ShmRingBuffer(1, 64, 2)
    name = buf.name
    with buf.get_data(1) as data:
        data[:4] = b"live"
        kept = data[:4]  # a slice outlives the block's view
    del buf, data
    gc.collect()
    assert bytes(kept) == b"live"  # still mapped: no crash, same bytes
    kept[0:1] = b"L"
    assert bytes(kept) == b"Live"
    del kept
    gc.collect()
    assert not segment_exists(name)


def test_child_process_sees_and_writes_the_segment(children):
    buf = ShmRingBuffer(2, 4096, 3)
    pattern = bytes(range(256)) * 3
    with buf.get_data(1) as data:
        data[: len(pattern)] = pattern
    with buf.get_metadata(1) as meta:
        meta[:] = b"\x01\x00\x01"
    out = children.queue()
    children.start(ring_buffer_peer, out, pickle.dumps(buf), pattern, b"written by the child")
    seen = children.expect(out, "seen")[1]
    children.join()
    assert seen == {
        "handle": buf.handle(),
        "is_creator": False,
        "data": pattern,
        "data_len": 4096,
        "metadata": b"\x01\x00\x01",
    }
    with buf.get_data(2) as data:
        assert bytes(data[:20]) == b"written by the child"
    with buf.get_metadata(2) as meta:
        assert bytes(meta) == b"\x01\x01\x01"
    # The child's exit (it only opened the segment) did not remove it.
    assert segment_exists(buf.name)


def test_unpickling_a_missing_segment_works_and_use_fails_clearly():
    buf = ShmRingBuffer(2, 128, 2)
    data = pickle.dumps(buf)
    handle = buf.handle()
    del buf
    gc.collect()
    assert not segment_exists(handle[3])
    ghost = pickle.loads(data)  # must not raise: the handle may come from another node
    assert ghost.handle() == handle
    assert pickle.loads(pickle.dumps(ghost)).handle() == handle  # can be passed on
    for use in (ghost.get_data, ghost.get_metadata):
        with pytest.raises(FileNotFoundError, match="does not exist on this machine"):
            with use(0):
                pass


def test_unpickling_a_missing_segment_in_a_child(children):
    buf = ShmRingBuffer(1, 128, 2)
    data = pickle.dumps(buf)
    handle = buf.handle()
    del buf
    gc.collect()
    out = children.queue()
    children.start(missing_ring_user, out, data)
    outcome = children.expect(out, "missing")[1]
    children.join()
    assert outcome["handle"] == handle
    for what in ("get_data", "get_metadata"):
        kind, message = outcome[what]
        assert kind == "FileNotFoundError"
        assert "does not exist on this machine" in message
        assert handle[3] in message


def test_handle_is_a_dataclass_with_the_engine_fields():
    # vLLM 0.33's fields, in its order (positional construction works as in vLLM), then
    # shmq's own, with defaults.
    names = [f.name for f in dataclasses.fields(Handle)]
    assert names == [
        "local_reader_ranks",
        "buffer_handle",
        "local_subscribe_addr",
        "local_notify_addr",
        "remote_subscribe_addr",
        "remote_addr_ipv6",
        "tensor_arena_handle",
        "arena_name",
        "remote_secret",
    ]
    h = Handle()
    assert h.local_reader_ranks == []
    assert h.buffer_handle is None
    assert h.local_subscribe_addr is None
    assert h.local_notify_addr is None
    assert h.remote_subscribe_addr is None
    assert h.remote_addr_ipv6 is False
    assert h.tensor_arena_handle is None


def test_handle_round_trips_through_a_child_and_its_reader_works(children):
    mq = MessageQueue(n_reader=2, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, connect_ip="127.0.0.1")
    handle = mq.export_handle()
    assert isinstance(handle, Handle)
    assert handle.local_reader_ranks == [0]
    assert handle.buffer_handle == mq.buffer.handle()
    assert handle.buffer_handle[:3] == (1, 1024, 2)
    assert handle.local_subscribe_addr and handle.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    assert handle.remote_addr_ipv6 is False
    assert pickle.loads(pickle.dumps(handle)) == handle

    messages = ["small", b"x" * 5000, {"k": [1, 2, 3]}]  # the bytes overflow a chunk
    outs = {}
    for rank in (0, 1):  # rank 0 reads through shared memory, rank 1 remotely
        outs[rank] = children.queue()
        children.start(handle_roundtrip_reader, outs[rank], pickle.dumps(handle), rank, len(messages))
    for rank in (0, 1):
        returned = pickle.loads(children.expect(outs[rank], "handle")[1])
        assert returned == handle
    mq.wait_until_ready(timeout=STEP)
    for m in messages:
        mq.enqueue(m, timeout=STEP)
    for rank in (0, 1):
        assert children.expect(outs[rank], "got")[1] == messages
    children.join()

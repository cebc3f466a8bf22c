"""Errors that say what to do (issue 17): each mistake a new user made gets a builtin
exception naming what was wrong and how to do it instead, with vLLM 0.33's wording
first where vLLM's callers and tests match it.

Readers, writers and store readers run in spawned processes wherever shared memory
crosses processes. The one child entry point of this file's own lives here at module
level (spawned children import this module by name; the others come from
``_processes`` and ``_processes.vllm_children``).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
from typing import Any

import pytest

from shmq import MessageQueue, ObjectStorage, PeerDiedError, RingBuffer, ShmRingBuffer

from _processes import SHM_DIR, STEP, doomed_writer, killed_reader
from _processes.vllm_children import signed_reader

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------
# 1. Sizes and counts: a ValueError naming the argument, not pyo3's OverflowError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_chunk_bytes": -5}, "max_chunk_bytes must be a positive number of bytes, got -5"),
        ({"max_chunk_bytes": 0}, "max_chunk_bytes must be a positive number of bytes, got 0"),
        ({"max_chunks": -1}, "max_chunks must be a positive number of chunks, got -1"),
        ({"n_reader": -2, "n_local_reader": 0}, "n_reader must be a positive number of readers, got -2"),
        ({"n_reader": 0, "n_local_reader": 0}, "n_reader must be a positive number of readers, got 0"),
        ({"n_local_reader": -1}, "n_local_reader must be a non-negative number of readers, got -1"),
        ({"arena_bytes": -1}, r"arena_bytes must be a non-negative number of bytes \(0: no arena\), got -1"),
        ({"arena_threshold": -3}, "arena_threshold must be a non-negative number of bytes, got -3"),
        ({"remote_hwm": -1}, "remote_hwm must be a positive number of messages, got -1"),
        ({"remote_hwm": 2**31}, "remote_hwm must be at most 2147483647 messages, got 2147483648"),
        ({"max_chunk_bytes": 2**64}, "max_chunk_bytes must be at most"),
        ({"local_reader_ranks": [-1]}, r"local_reader_ranks must hold ranks \(non-negative ints\), got \[-1\]"),
        (
            {"n_reader": 1, "n_local_reader": 2},
            r"n_local_reader \(2\) cannot exceed n_reader \(1\): n_reader counts all readers, local and remote",
        ),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "",
)
def test_bad_sizes_and_counts_are_value_errors_naming_the_argument(kwargs, message):
    args: dict[str, Any] = {"n_reader": 2, "n_local_reader": 2, "max_chunk_bytes": 1024, "max_chunks": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{message}"):
        MessageQueue(**args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_chunk_bytes": 1.5}, r"max_chunk_bytes must be an int, got float \(1.5\)"),
        ({"max_chunks": "10"}, r"max_chunks must be an int, got str \('10'\)"),
        ({"n_reader": True}, r"n_reader must be an int, got bool \(True\)"),
        ({"arena_bytes": 1e6}, r"arena_bytes must be an int, got float \(1000000.0\)"),
    ],
    ids=["float", "str", "bool", "float-arena"],
)
def test_sizes_and_counts_of_the_wrong_type_are_type_errors_naming_the_argument(kwargs, message):
    args: dict[str, Any] = {"n_reader": 1, "n_local_reader": 1, "max_chunk_bytes": 1024, "max_chunks": 2}
    args.update(kwargs)
    with pytest.raises(TypeError, match=f"^{message}$"):
        MessageQueue(**args)


def test_ints_of_other_types_are_accepted():
    np = pytest.importorskip("numpy")
    mq = MessageQueue(np.int64(1), np.int32(1), max_chunk_bytes=np.int64(1024), max_chunks=np.uint8(2), arena_bytes=0)
    assert (mq.buffer.n_reader, mq.buffer.max_chunk_bytes, mq.buffer.max_chunks) == (1, 1024, 2)
    assert type(mq.buffer.max_chunk_bytes) is int


def test_shm_ring_buffer_sizes_are_checked_the_same_way():
    with pytest.raises(ValueError, match="^max_chunk_bytes must be a positive number of bytes, got -5$"):
        ShmRingBuffer(1, -5, 2)
    with pytest.raises(ValueError, match="^n_reader must be a positive number of readers, got 0$"):
        ShmRingBuffer(0, 1024, 2)


class _OneRankGroup:
    """A stateless process group of one process (what ``_Ops`` needs of one)."""

    rank, world_size = 0, 1

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        return obj

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return [obj]


def test_a_group_of_one_still_makes_a_queue_without_readers():
    # As vLLM 0.33 does: only a queue made by hand with n_reader=0 is refused.
    mq = MessageQueue.create_from_process_group(_OneRankGroup(), 1024, 2)
    assert mq.export_handle().local_reader_ranks == [] and mq.buffer is None
    mq.enqueue("to nobody", timeout=1)
    mq.wait_until_ready(timeout=1)
    with pytest.raises(ValueError, match="^max_chunks must be a positive number of chunks, got 0$"):
        MessageQueue.create_from_process_group(_OneRankGroup(), 1024, 0)


# ---------------------------------------------------------------------------------
# 2. Queues and stores do not pickle: send their handles


QUEUE_NOT_SENT = (
    "a MessageQueue cannot be sent to another process: pass queue.export_handle() "
    "and call MessageQueue.create_from_handle(handle, rank) in the child"
)
STORE_NOT_SENT = (
    "an ObjectStorage cannot be sent to another process: pass store.handle() and call "
    "ObjectStorage.create_from_handle(handle) in the child"
)


def never_runs(out: Any, thing: Any) -> None:  # pragma: no cover - refused at start()
    out.put(("ran",))


def test_a_message_queue_sent_to_a_spawned_process_says_to_send_its_handle(children):
    writer = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2, arena_bytes=0)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    for mq in (writer, reader):
        with pytest.raises(TypeError) as e:
            children.start(never_runs, children.queue(), mq)
        assert str(e.value) == QUEUE_NOT_SENT
        with pytest.raises(TypeError) as e:
            pickle.dumps(mq)
        assert str(e.value) == QUEUE_NOT_SENT
    assert children.procs == [], "no process was started"
    # The handle itself travels.
    assert pickle.loads(pickle.dumps(writer.export_handle())) == writer.export_handle()


def test_an_object_storage_sent_to_a_spawned_process_says_to_send_its_handle(children):
    store = ObjectStorage(1024, 1, RingBuffer(4096, create=True))
    with pytest.raises(TypeError) as e:
        children.start(never_runs, children.queue(), store)
    assert str(e.value) == STORE_NOT_SENT
    reader = ObjectStorage.create_from_handle(pickle.loads(pickle.dumps(store.handle())))
    with pytest.raises(TypeError) as e:
        pickle.dumps(reader)
    assert str(e.value) == STORE_NOT_SENT
    assert children.procs == []
    reader.close()
    store.close()


# ---------------------------------------------------------------------------------
# 3. wait_until_ready is idempotent on both sides


def ready_twice_reader(out: Any, handle: Any, rank: int) -> None:
    """Join as ``rank``, call wait_until_ready twice (the second with a 1 s timeout it
    must not need), report how long the second took, then read one message."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    started = time.monotonic()
    mq.wait_until_ready(timeout=1.0)
    again = time.monotonic() - started
    out.put(("done", rank, again, mq.dequeue(timeout=STEP)))


def test_a_second_wait_until_ready_returns_at_once_on_every_side(children):
    # Rank 0 reads through shared memory, rank 1 over TCP.
    mq = MessageQueue(2, 1, max_chunk_bytes=1024, max_chunks=2, connect_ip="127.0.0.1", arena_bytes=0)
    outs = {rank: children.queue() for rank in (0, 1)}
    for rank, out in outs.items():
        children.start(ready_twice_reader, out, mq.export_handle(), rank)
    mq.wait_until_ready(timeout=STEP)
    started = time.monotonic()
    mq.wait_until_ready(timeout=1.0)
    assert time.monotonic() - started < 0.5
    mq.enqueue("after", timeout=STEP)
    for rank, out in outs.items():
        _, r, again, got = children.expect(out, "done")
        assert (r, got) == (rank, "after")
        assert again < 0.5, f"rank {rank}'s second wait_until_ready took {again:.3f} s"
    children.join()


# ---------------------------------------------------------------------------------
# 4. A peer's death names the queue


def test_a_dead_reader_error_names_its_queue(children):
    """Two queues, one reader each; the reader of the second is killed: the writer's
    PeerDiedError names the second queue's ring (and the reader, as before)."""
    queues = [MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2, arena_bytes=0) for _ in range(2)]
    outs = [children.queue() for _ in queues]
    procs = [children.start(killed_reader, out, mq.export_handle(), 0) for mq, out in zip(queues, outs, strict=True)]
    for mq, out in zip(queues, outs, strict=True):
        mq.wait_until_ready(timeout=STEP)
        children.expect(out, "ready")
    victim, alive = procs[1], procs[0]
    victim.kill()
    victim.join(STEP)
    children.procs.remove(victim)
    mq = queues[1]
    with pytest.raises(PeerDiedError) as e:
        for i in range(3):  # two fill the ring; the third waits for the dead reader
            mq.enqueue(i, timeout=STEP)
    message = str(e.value)
    assert message.startswith(f"reader 0 (pid {victim.pid}) died before reading chunk 0 of queue '{mq.buffer.name}'")
    assert "on_dead_reader=\"drop\"" in message, message
    assert queues[0].buffer.name not in message
    alive.kill()
    alive.join(STEP)
    children.procs.remove(alive)


def test_a_dead_writer_error_names_its_queue(children):
    out = children.queue()
    writer = children.start(doomed_writer, out, 1)
    handle = children.expect(out, "handle")[1]
    name = handle.buffer_handle[3]
    try:
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready(timeout=STEP)
        assert reader.dequeue(timeout=STEP) == 0
        children.expect(out, "sent")
        writer.kill()
        writer.join(STEP)
        children.procs.remove(writer)
        with pytest.raises(PeerDiedError) as e:
            reader.dequeue(timeout=STEP)
        assert str(e.value) == f"the writer (pid {writer.pid}) died; no more messages will come on queue '{name}'"
        del reader
    finally:
        # The killed writer could not remove its segments.
        for segment in (name, handle.arena_name):
            if segment:
                try:
                    os.unlink(os.path.join(SHM_DIR, segment))
                except FileNotFoundError:
                    pass
                shutil.rmtree(os.path.join(SHM_DIR, segment + ".sock"), ignore_errors=True)


# ---------------------------------------------------------------------------------
# 5. An object larger than the store's ring


def test_an_object_larger_than_the_ring_is_refused_as_never_fitting():
    # Accepted, as in vLLM 0.33: its multimodal cache builds the store from two settings
    # (mm_shm_cache_max_object_size_mb, default 128 MiB, and mm_processor_cache_gb) and
    # serves an item that cannot be stored uncached on MemoryError; refusing here would
    # stop vLLM from starting with a cache under 128 MiB.
    store = ObjectStorage(1 << 20, 1, RingBuffer(4096, create=True))
    with pytest.raises(MemoryError) as e:
        store.put("big", b"x" * 10_000)
    message = str(e.value)
    assert message.startswith("Not enough space in the data buffer: a chunk of ")
    assert "can never fit in this ring of 4096 bytes, however much is freed" in message, message
    assert "free_buf" not in message, message
    assert not store.is_cached("big")
    # The same from the ring itself.
    never = "^Not enough space in the data buffer: a chunk of 5008 bytes .* can never fit"
    with pytest.raises(MemoryError, match=never):
        store.ring_buffer.allocate_buf(5000)
    # An object that fits the ring but not now (its one reader has read nothing): the
    # error says what holds the room (no free_buf(), which ObjectStorage does not have).
    store.put("a", b"a" * 1500)
    store.put("b", b"b" * 1500)
    with pytest.raises(MemoryError, match=r"^Not enough space in the data buffer \((?s:(?!free_buf).)*$"):
        store.put("c", b"c" * 1500)
    store.close()


# ---------------------------------------------------------------------------------
# 6. A refused signature says which key and what was wrong


class _StoreReader:
    """A ``signed_reader`` child, driven by the test."""

    def __init__(self, children, handle):
        self.children = children
        self.out, self.cmds = children.queue(), children.queue()
        children.start(signed_reader, self.out, handle, self.cmds)
        children.expect(self.out, "ready")

    def refused(self, *cmd: Any) -> str:
        self.cmds.put(cmd)
        msg = self.children.receive(self.out)
        assert msg[0] == "raised" and msg[2] == "ValueError", msg
        return msg[3]

    def stop(self) -> None:
        self.cmds.put(("stop",))
        self.children.expect(self.out, "stopped")


INVALID = "Invalid SHM handle signature for cache key"
MISSING = "Missing SHM handle signature for cache key"


def test_a_refused_signature_names_the_key_and_what_was_wrong(children):
    store = ObjectStorage(4096, 1, RingBuffer(1 << 16, create=True))
    address, mid = store.put("img-3", {"v": 1})
    signature = store.get_signature("img-3")
    other_store = ObjectStorage(4096, 1, RingBuffer(1 << 16, create=True))
    other_store.put("img-3", {"v": 1})
    reader = _StoreReader(children, store.handle())
    mismatch = (
        "the signature does not match this key, address {} and id {} "
        "(was it made for another key or object, or by another store?)"
    )
    as_list = "the signature must be a list of 32 ints"
    expected = [
        (("img-4", address, mid, signature), f"{INVALID} 'img-4': " + mismatch.format(address, mid)),
        (("img-3", address + 1, mid, signature), f"{INVALID} 'img-3': " + mismatch.format(address + 1, mid)),
        (
            ("img-3", address, mid, other_store.get_signature("img-3")),
            f"{INVALID} 'img-3': " + mismatch.format(address, mid),
        ),
        (
            ("img-3", address, mid, bytes(signature)),
            f"{INVALID} 'img-3': {as_list} (what get_signature returns), got bytes",
        ),
        (("img-3", address, mid, signature[:-1]), f"{INVALID} 'img-3': {as_list}, got a list of 31"),
        (
            ("img-3", address, mid, [*signature[:5], 256, *signature[6:]]),
            f"{INVALID} 'img-3': {as_list} in 0..255, item 5 is 256",
        ),
        (
            ("img-3", address, mid, [float(b) for b in signature]),
            f"{INVALID} 'img-3': {as_list} in 0..255, item 0 is {float(signature[0])}",
        ),
        ((7, address, mid, signature), f"{INVALID} 7: the key must be a str, got int"),
        (
            ("img-3", -1, mid, signature),
            f"{INVALID} 'img-3': the handle (address -1, id {mid}) cannot have been signed: the address must be "
            "an int in 0..2**64 and the id an int in 0..2**32",
        ),
        (
            ("img-3", address, mid, None),
            f"{MISSING} 'img-3': no signature was given; pass the one the writer's get_signature(key) returns",
        ),
        (
            (None, address, mid, signature),
            f"{MISSING}: no key was given; a reader's get and touch need the key the signature was made for",
        ),
    ]
    for (key, a, i, sig), message in expected:
        got = reader.refused("get", "t", a, i, sig, key)
        assert got == message, (key, a, i, got)
        assert got.startswith(INVALID if sig is not None and key is not None else MISSING)
    # touch says the same.
    assert reader.refused("touch", "t", "img-4", address, mid, signature) == (
        f"{INVALID} 'img-4': " + mismatch.format(address, mid)
    )
    reader.stop()
    # The writer's check names the key too.
    with pytest.raises(ValueError, match=f"^{re.escape(INVALID)} 'nope': no object is stored under this key$"):
        store.verify_signature("nope", address, mid, signature)
    with pytest.raises(ValueError, match=rf"^{re.escape(INVALID)} 'img-3': the handle \(address 1, id 0\) is not"):
        store.verify_signature("img-3", 1, 0, signature)
    with pytest.raises(ValueError, match=f"^{re.escape(INVALID)}: no key was given$"):
        store.verify_signature(None, address, mid, signature)
    with pytest.raises(ValueError, match=f"^{re.escape(INVALID)} 7: no object is stored under this key$"):
        store.verify_signature(7, address, mid, signature)
    other_store.close()
    store.close()

"""shmq in Docker's default 64 MiB ``/dev/shm`` (issue 18 item 2).

Each test runs a program of its own (this file, run as a script) in a private mount
namespace whose ``/dev/shm`` is a fresh 64 MiB tmpfs (``unshare --mount``, as a default
container has): the writer there, and its 2 reader processes (spawned: they share the
namespace). Rings and stores are sized far beyond 64 MiB (shmq's defaults, and vLLM
0.33's: 10 chunks of 24 MiB, a 4 GiB store); they commit memory as it is used, so they
start and carry 10,000 small messages and some 4 MiB tensors. Filling ``/dev/shm``
makes queue messages take the overflow socket (all still arrive, in order) and the
store's ``put`` raise ``MemoryError``, with one warning saying how to raise
``/dev/shm`` — never a ``SIGBUS``, which would show here as the program's exit status.

Skipped, with the reason, where mount namespaces cannot be made (no ``unshare``, or
not permitted).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time

import pytest

from _processes.private_shm import capture_shm_warnings, run_in_private_shm, shm_total

SHM_SIZE = "64m"
STEP = 60.0  # bound on any one blocking call in the program
N_SMALL = 10_000
N_TENSORS = 8
TENSOR_BYTES = 4 << 20
WARNING = "is too small"

# (kwargs of MessageQueue beyond (2, 2)): shmq's defaults, and vLLM 0.33's sizes.
QUEUE_SIZES = {
    "defaults": {},
    "vllm": {"max_chunk_bytes": 24 << 20, "max_chunks": 10},
}
# (data_buffer_size, max_object_size): a 1 GiB store, and vLLM 0.33's multimodal cache
# (mm_processor_cache_gb=4, mm_shm_cache_max_object_size_mb=128).
STORE_SIZES = {
    "1gib": (1 << 30, 64 << 20),
    "vllm": (4 << 30, 128 << 20),
}


def _in_small_shm(*args: str, timeout: float = 240) -> dict:
    """Run this file as a program with ``args`` in a private 64 MiB /dev/shm; its last
    stdout line (JSON), once it exited 0."""
    return run_in_private_shm(__file__, list(args), SHM_SIZE, timeout)


def _check_readers(got: dict, expected: list) -> None:
    for rank in ("0", "1"):
        r = got["readers"][rank]
        assert r["error"] is None, r["error"]
        assert r["received"] == expected, f"reader {rank}: {r['received'][:5]}... != expected"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sizes", list(QUEUE_SIZES))
def test_queue_carries_small_and_4mib_messages_in_64mib(sizes):
    got = _in_small_shm("queue", sizes)
    _check_readers(got, got["sent"])
    assert got["shm_total"] == 64 << 20
    assert got["ring_bytes"] > got["shm_total"] or sizes == "defaults"
    # Nothing had to fall back: there was room for all of it (the tensors in the arena,
    # which reserves what a part needs where its 64 MiB step does not fit).
    assert got["warnings"] == 0, got
    assert got["overflow_count"] == 0, got
    assert got["arena_fallbacks"] == 0, got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sizes", list(QUEUE_SIZES))
def test_queue_falls_back_to_the_overflow_socket_when_dev_shm_is_full(sizes):
    got = _in_small_shm("queue_full", sizes)
    _check_readers(got, got["sent"])
    assert got["overflow_count"] > 0, got
    assert got["warnings"] == 1, got["warning_texts"]
    text = got["warning_texts"][0]
    for needle in ("/dev/shm", "--shm-size", "--ipc=host", "medium: Memory"):
        assert needle in text, text
    # Room again (the filler gone): messages go through the ring again.
    assert got["overflow_after_room"] == got["overflow_count"], got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sizes", list(STORE_SIZES))
def test_store_carries_small_objects_and_4mib_tensors_in_64mib(sizes):
    got = _in_small_shm("store", sizes)
    _check_readers(got, got["sent"])
    assert got["warnings"] == 0, got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sizes", list(STORE_SIZES))
def test_store_put_raises_memory_error_when_dev_shm_is_full(sizes):
    got = _in_small_shm("store_full", sizes)
    _check_readers(got, got["sent"])
    assert got["memory_errors"] > 0, got
    assert "shm-size" in got["memory_error_text"], got["memory_error_text"]
    assert got["warnings"] == 1, got["warning_texts"]
    assert got["put_after_room"], got


@pytest.mark.timeout(300)
def test_shared_memory_buf_too_large_for_dev_shm_raises_memory_error():
    """``shared_memory.buf`` shows a whole ring (vLLM's 240 MiB queue, a 1 GiB store):
    committing it in 64 MiB is a ``MemoryError``, not a ``SIGBUS`` at the first touch,
    and the queue and the store go on working (the failed reservation took nothing)."""
    got = _in_small_shm("buf", "vllm")
    for what in ("queue", "store"):
        assert got[what]["error"] == "MemoryError", got
        assert "/dev/shm" in got[what]["text"], got
    assert got["shm_used_after"] < 16 << 20, got
    _check_readers(got, got["sent"])


# ------------------------------------------------------------------------------------
# The program: runs inside the private /dev/shm.


def _fill_dev_shm(leave: int) -> str:
    """Take all of /dev/shm but `leave` bytes in a file of our own; its path."""
    path = "/dev/shm/small_shm_filler"
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - leave, 4096))
    return path


def _message(i: int):
    """Message i: small, except every N_SMALL // N_TENSORS-th, a 4 MiB tensor."""
    if i % (N_SMALL // N_TENSORS) == N_SMALL // N_TENSORS - 1:
        import torch

        return ("tensor", i, torch.full((TENSOR_BYTES // 4,), float(i), dtype=torch.float32))
    return ("small", i, "x" * (i % 200))


def _summary(obj) -> list:
    kind, i, payload = obj
    if kind == "tensor":
        return [kind, i, int(payload.numel()), float(payload[0]), float(payload[-1])]
    return [kind, i, len(payload)]


def _queue_reader(handle_pickle: bytes, rank: int, n: int, out) -> None:
    from shmq import MessageQueue

    received, error = [], None
    try:
        mq = MessageQueue.create_from_handle(pickle.loads(handle_pickle), rank)
        mq.wait_until_ready(timeout=STEP)
        for _ in range(n):
            received.append(_summary(mq.dequeue(timeout=STEP)))
    except Exception as e:  # reported, not lost
        error = repr(e)
    out.put((rank, received, error))


def _start_readers(target, args_for_rank) -> tuple:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for_rank(r), out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    return procs, out


def _collect(procs, out) -> dict:
    readers = {}
    for _ in procs:
        rank, received, error = out.get(timeout=4 * STEP)
        readers[str(rank)] = {"received": received, "error": error}
    for p in procs:
        p.join(STEP)
    return readers


def run_queue(sizes: str, fill: bool) -> dict:
    warnings = capture_shm_warnings(WARNING)
    from shmq import MessageQueue

    kwargs = QUEUE_SIZES[sizes]
    mq = MessageQueue(2, 2, **kwargs)
    ring = mq.buffer
    ring_bytes = ring.max_chunk_bytes * ring.max_chunks
    n = N_SMALL + 10 if fill else N_SMALL
    procs, out = _start_readers(_queue_reader, lambda r: (pickle.dumps(mq.export_handle()), r, n))
    mq.wait_until_ready(timeout=STEP)
    sent, filler, overflow_at_fill_end = [], None, None
    for i in range(n):
        if fill and i == 5:
            # Taken before chunks 5.. reserved anything, and before any tensor.
            filler = _fill_dev_shm(leave=8 << 10)
        if fill and i == N_SMALL:
            overflow_at_fill_end = ring.ring.overflow_count
            os.unlink(filler)
        msg = _message(i)
        mq.enqueue(msg, timeout=STEP)
        sent.append(_summary(msg))
    readers = _collect(procs, out)
    return {
        "sent": sent,
        "readers": readers,
        "ring_bytes": ring_bytes,
        "shm_total": shm_total(),
        "overflow_count": overflow_at_fill_end if fill else ring.ring.overflow_count,
        "overflow_after_room": ring.ring.overflow_count,
        "arena_fallbacks": mq.arena_fallbacks,
        "warnings": len(warnings.texts),
        "warning_texts": warnings.texts,
    }


def _store_reader(handle_pickle: bytes, rank: int, inbox, out) -> None:
    from shmq import ObjectStorage

    received, error = [], None
    try:
        store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
        while True:
            item = inbox.get(timeout=STEP)
            if item is None:
                break
            key, address, monotonic_id, signature = item
            obj = store.get(address, monotonic_id, signature, key)
            received.append(_summary(obj))
            del obj
    except Exception as e:  # reported, not lost
        error = repr(e)
    out.put((rank, received, error))


def run_store(sizes: str, fill: bool) -> dict:
    import multiprocessing as mp

    warnings = capture_shm_warnings(WARNING)
    from shmq import ObjectStorage, PickleSerde, RingBuffer

    data_buffer_size, max_object_size = STORE_SIZES[sizes]
    ring = RingBuffer(data_buffer_size, create=True)
    store = ObjectStorage(max_object_size, 2, ring, PickleSerde)
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(2)]
    procs, out = _start_readers(_store_reader, lambda r: (pickle.dumps(store.handle()), r, inboxes[r]))
    sent, memory_errors, memory_error_text, put_after_room = [], 0, "", False
    filler = None
    for i in range(N_SMALL):
        if fill and i == 1:
            # Taken before any tensor: none of them can find room.
            filler = _fill_dev_shm(leave=16 << 10)
        msg = _message(i)
        key = f"k{i}"
        try:
            address, monotonic_id = store.put(key, msg)
        except MemoryError as e:
            memory_errors += 1
            memory_error_text = str(e)
            continue
        sent.append(_summary(msg))
        for q in inboxes:
            q.put((key, address, monotonic_id, store.get_signature(key)))
    for q in inboxes:
        q.put(None)
    readers = _collect(procs, out)
    if fill:
        os.unlink(filler)
        try:
            store.put("after", _message(N_TENSORS * (N_SMALL // N_TENSORS) - 1))
            put_after_room = True
        except MemoryError:
            put_after_room = False
    return {
        "sent": sent,
        "readers": readers,
        "memory_errors": memory_errors,
        "memory_error_text": memory_error_text,
        "put_after_room": put_after_room,
        "warnings": len(warnings.texts),
        "warning_texts": warnings.texts,
    }


def run_buf() -> dict:
    """Touch ``shared_memory.buf`` of a queue and a store larger than /dev/shm, then use
    both: a 4 MiB tensor through the queue to 2 reader processes and through the store."""
    from shmq import MessageQueue, ObjectStorage, PickleSerde, RingBuffer

    mq = MessageQueue(2, 2, **QUEUE_SIZES["vllm"])
    ring = RingBuffer(STORE_SIZES["1gib"][0], create=True)
    store = ObjectStorage(STORE_SIZES["1gib"][1], 1, ring, PickleSerde)
    result: dict = {}
    for what, memory in (("queue", mq.buffer.shared_memory), ("store", ring.shared_memory)):
        try:
            view = memory.buf
            view[len(view) - 1] = 1  # would be a SIGBUS, ending this program, without room
            result[what] = {"error": None, "text": ""}
        except MemoryError as e:
            result[what] = {"error": "MemoryError", "text": str(e)}
    st = os.statvfs("/dev/shm")
    result["shm_used_after"] = (st.f_blocks - st.f_bfree) * st.f_frsize
    n = N_SMALL // N_TENSORS  # message n - 1 is a tensor
    procs, out = _start_readers(_queue_reader, lambda r: (pickle.dumps(mq.export_handle()), r, n))
    mq.wait_until_ready(timeout=STEP)
    sent = []
    for i in range(n):
        msg = _message(i)
        mq.enqueue(msg, timeout=STEP)
        sent.append(_summary(msg))
    result["readers"] = _collect(procs, out)
    result["sent"] = sent
    tensor = _message(n - 1)
    address, monotonic_id = store.put("t", tensor)
    got = store.get(address, monotonic_id, store.get_signature("t"), "t")
    assert _summary(got) == _summary(tensor), (_summary(got), _summary(tensor))
    return result


if __name__ == "__main__":
    what, sizes = sys.argv[1], sys.argv[2]
    started = time.monotonic()
    if what == "buf":
        result = run_buf()
    elif what.startswith("queue"):
        result = run_queue(sizes, fill=what.endswith("_full"))
    else:
        result = run_store(sizes, fill=what.endswith("_full"))
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result))

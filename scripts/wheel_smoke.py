"""Smoke test of an installed shmq (the wheel, in a venv without Rust): run by
scripts/newcomer.sh, from a directory outside the source tree.

1. Queue: a writer ``MessageQueue(1, 1)`` and a spawned reader process; a few objects,
   one larger than a chunk (it goes over the local ZeroMQ socket, so libzmq inside the
   wheel is exercised too), come back equal and in order.
2. Store: the writer ``put``s an array and a dict; a spawned reader opens the store
   from its handle and ``get``s both with their signed handles (address, id,
   signature, key); a wrong signature is refused with ``ValueError``.

Exits 0 when all holds; prints what it checked.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from textwrap import shorten
from typing import Any

import numpy as np

import shmq
from shmq import MessageQueue, ObjectStorage, RingBuffer

CHUNK = 64 << 10
OBJECTS: list[Any] = [
    {"step": 0, "req_ids": list(range(16))},
    "text",
    (1, 2.5, None, b"\x00\xff"),
    b"x" * (4 * CHUNK),  # larger than a chunk: the overflow path (ZeroMQ ipc)
    {"step": 1, "done": True},
]
ARRAY = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
META = {"kind": "image", "shape": [256, 256], "ok": True}


def queue_reader(handle: Any, out: Any) -> None:
    queue = MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    out.put([queue.dequeue(timeout=60) for _ in OBJECTS])


def store_reader(handle: Any, refs: list[tuple[int, int, list[int], str]], out: Any) -> None:
    store = ObjectStorage.create_from_handle(handle)
    array = store.get(*refs[0])
    meta = store.get(*refs[1])
    address, monotonic_id, signature, key = refs[0]
    forged = [(signature[0] + 1) % 256, *signature[1:]]
    try:
        store.get(address, monotonic_id, forged, key)
        refused = "a forged signature was accepted"
    except ValueError as e:
        refused = f"ValueError: {e}"
    out.put((bool(np.array_equal(array, ARRAY)), meta, refused))


def check_queue(ctx: Any) -> None:
    queue = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=CHUNK, max_chunks=4)
    out = ctx.Queue()
    reader = ctx.Process(target=queue_reader, args=(queue.export_handle(), out))
    reader.start()
    queue.wait_until_ready()
    for obj in OBJECTS:
        queue.enqueue(obj, timeout=60)
    received = out.get(timeout=60)
    reader.join(timeout=60)
    assert reader.exitcode == 0, f"queue reader exited with {reader.exitcode}"
    assert received == OBJECTS, f"queue round trip: sent {OBJECTS!r:.200}, read {received!r:.200}"
    print(f"queue: {len(OBJECTS)} objects through a spawned reader, equal and in order (one over the socket)")


def check_store(ctx: Any) -> None:
    store = ObjectStorage(max_object_size=4 << 20, n_readers=1, ring_buffer=RingBuffer(16 << 20, create=True))
    refs = []
    for key, value in (("array", ARRAY), ("meta", META)):
        address, monotonic_id = store.put(key, value)
        refs.append((address, monotonic_id, store.get_signature(key), key))
    out = ctx.Queue()
    reader = ctx.Process(target=store_reader, args=(store.handle(), refs, out))
    reader.start()
    array_ok, meta, refused = out.get(timeout=60)
    reader.join(timeout=60)
    assert reader.exitcode == 0, f"store reader exited with {reader.exitcode}"
    assert array_ok, "store: the array read in the other process differs"
    assert meta == META, f"store: read {meta!r}, put {META!r}"
    assert refused.startswith("ValueError"), refused
    print(
        "store: array and dict read by a spawned reader with signed handles; "
        f"forged signature -> {shorten(refused, 100)}"
    )
    store.close()


if __name__ == "__main__":
    print(f"shmq from {shmq.__file__}")
    ctx = mp.get_context("spawn")
    check_queue(ctx)
    check_store(ctx)
    sys.exit(0)

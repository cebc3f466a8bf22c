"""Child entry points of the metrics tests (``test_metrics.py``)."""

from __future__ import annotations

import logging
import os
import queue
import time
from typing import Any

import numpy as np

from shmq import Handle, MessageQueue

from .harness import STEP

__all__ = ["busy_reader", "counting_reader", "named_store_and_cache", "stalling_writer", "store_getter"]


class _Forward(logging.Handler):
    """Sends every shmq warning to the test as it happens: ``("warning", message)``."""

    def __init__(self, out: Any) -> None:
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("shmq"):
            self.out.put(("warning", record.getMessage()))


def stalling_writer(out: Any, cmds: Any, env: dict[str, str]) -> None:
    """A writer (2 local readers, 4 chunks, dead readers dropped) that enqueues without
    pause and forwards its shmq warnings; ``"stop"`` on ``cmds`` ends the stream (None
    to the readers) and reports the queue's metrics."""
    os.environ.update(env)  # before the first wait: the interval is read once
    logging.getLogger().addHandler(_Forward(out))
    mq = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=4, on_dead_reader="drop")
    out.put(("handle", mq.export_handle()))
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    i = 0
    while True:
        try:
            if cmds.get_nowait() == "stop":
                break
        except queue.Empty:
            pass
        try:
            mq.enqueue(i, timeout=3.0)
            i += 1
        except TimeoutError:
            pass  # a stopped reader: the warnings say who
    mq.enqueue(None, timeout=STEP)
    from shmq import metrics

    out.put(("metrics", metrics.collect([mq.export_handle().buffer_handle[3]])[0]))


def busy_reader(out: Any, handle: Handle, rank: int) -> None:
    """Read until None, spending 50 ms on each message (busy elsewhere, not in the
    queue, nearly all the time)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("reader", rank, os.getpid()))
    while mq.dequeue(timeout=STEP) is not None:
        time.sleep(0.05)  # not synchronisation: busy elsewhere (the behaviour under test)
    out.put(("done", rank))


def counting_reader(out: Any, handle: Handle, rank: int) -> None:
    """Read until None; report how many messages and array bytes arrived."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    n, array_bytes = 0, 0
    while True:
        obj = mq.dequeue(timeout=STEP)
        n += 1
        if obj is None:
            break
        if isinstance(obj, np.ndarray):
            obj.sum()  # consumed as a user would: every byte read
            array_bytes += obj.nbytes
    out.put(("done", rank, n, array_bytes))


def store_getter(out: Any, handle_pickle: bytes, handles: list[tuple[int, int, list[int], str]]) -> None:
    """Open the store and get each of ``handles`` (address, id, signature, key)."""
    import pickle

    from shmq import ObjectStorage

    store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
    got = [store.get(a, i, sig, key) for a, i, sig, key in handles]
    out.put(("got", got))


def named_store_and_cache(out: Any, store_name: str, cache_name: str, end: Any) -> None:
    """Make a store named ``store_name`` (vLLM's way: ``RingBuffer(name=..., create=True)``)
    with one object and an encoder cache named ``cache_name`` with one entry, report
    ``("made", store segment, cache segment)`` and keep both until ``end``."""
    from shmq import ObjectStorage, RingBuffer
    from shmq.encoder_cache import EncoderCacheProducer

    store = ObjectStorage(1 << 16, 1, RingBuffer(1 << 20, name=store_name, create=True))
    store.put("image-1", b"pixels")
    cache = EncoderCacheProducer(cache_name, capacity=1 << 20)
    cache.save("image-1", np.zeros(16, dtype=np.float32))
    cache.flush()
    out.put(("made", store.ring_buffer.handle()[1], cache.segment_name))
    assert end.wait(STEP), "never told to end"
    cache.close()
    store.close()

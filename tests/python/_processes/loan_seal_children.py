"""Children of ``test_loan_seal_hostile.py``: writers that run out of mappings
(``vm.max_map_count``) before they send loans."""

from __future__ import annotations

import ctypes
import gc
import pickle
from typing import Any

import numpy as np

from _processes import STEP, mapping_count
from shmq import MessageQueue, ObjectStorage, RingBuffer, _core

_PAGE = 4096


class _MappingHog:
    """Takes this process's mappings up to ``vm.max_map_count``, then gives back
    ``headroom`` pairs (each mprotect of a lone page splits one mapping into three): too
    few for a loan's seal (a mapping moved aside and the loan's range split out), enough
    for the rest of a send (malloc is told to grow its heap for large blocks)."""

    def __init__(self, headroom: int = 0):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc = libc
        # malloc grows its heap (no new mapping) rather than mapping large blocks.
        libc.mallopt(-3, 256 << 20)  # M_MMAP_THRESHOLD
        limit = int(open("/proc/sys/vm/max_map_count").read())
        self.pages = 2 * (limit + 16)
        self.base = libc.mmap(None, self.pages * _PAGE, 3, 0x22, -1, 0)  # RW, private anon
        assert self.base not in (None, ctypes.c_void_p(-1).value)
        self.split: list[int] = []
        for k in range(1, self.pages, 2):
            at = self.base + k * _PAGE
            if libc.mprotect(at, _PAGE, 1) != 0:  # PROT_READ: a mapping of its own
                break
            self.split.append(at)
        for at in self.split[len(self.split) - headroom :]:
            libc.mprotect(at, _PAGE, 3)  # merged back: two mappings free
        self.at_limit = mapping_count()

    def release(self) -> None:
        self.libc.munmap(self.base, self.pages * _PAGE)


def hogged_queue_writer(out: Any, n: int) -> None:
    """A queue writer with one local reader (the test): once the reader is ready, takes
    its mappings to the limit, then loans ``n`` arrays, fills each with ``i``, sends
    ``(i, array)`` and fills it with ``1000 + i`` (keeping every loan alive)."""
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=8, arena_bytes=32 << 20)
    out.put(("handle", mq.export_handle()))
    mq.wait_until_ready(timeout=STEP)
    # Makes the arena (copied into it: no loan sealed next to the ones below, whose
    # private mappings would merge with its own and cost no new mapping).
    mq.enqueue((-1, np.full(256 * 1024, -1.0, dtype=np.float32)), timeout=STEP)
    hog = _MappingHog()
    kept = []
    for i in range(n):
        a = mq.loan_array((_core.LOAN_SEAL_MIN // 4,))  # sealed: smaller loans are copied
        a[:] = i
        mq.enqueue((i, a), timeout=STEP)
        a[:] = 1000 + i
        kept.append(a)
    maps = mapping_count()
    hog.release()
    mq.enqueue(None, timeout=STEP)
    out.put(("sent", hog.at_limit, maps, mq.loan_fallbacks))
    del kept
    gc.collect()
    out.put(("done",))
    del mq


def hogged_store_writer(out: Any, cmds: Any, n: int) -> None:
    """A store writer: takes its mappings to the limit, then loans ``n`` arrays, fills
    each with ``i``, puts it and fills it with ``1000 + i`` (keeping every loan alive);
    reports the handles, and waits for ``"stop"`` before it lets them go."""
    store = ObjectStorage(2 << 20, 1, RingBuffer(2 * (n + 1) * ((1 << 20) + (128 << 10)), create=True))
    out.put(("handle", pickle.dumps(store.handle())))
    hog = _MappingHog()
    kept, handles = [], []
    for i in range(n):
        a = store.loan_array((256 * 1024,))
        a[:] = i
        handles.append(store.put(f"k{i}", {"a": a}))
        a[:] = 1000 + i
        kept.append(a)
    maps = mapping_count()
    hog.release()
    out.put(("put", handles, hog.at_limit, maps, store.loan_fallbacks))
    assert cmds.get(timeout=STEP) == "stop"
    del kept
    gc.collect()
    store.close()


def two_part_reader(out: Any, handle: Any) -> None:
    """Read ``(i, a, b)`` messages until None; report every one whose arrays are not all
    ``i``, and how many came in all."""
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)
    n, wrong = 0, []
    while (msg := mq.dequeue(timeout=STEP)) is not None:
        i, a, b = msg
        got = (float(a.min()), float(a.max()), float(b.min()), float(b.max()))
        if got != (i, i, i, i):
            wrong.append((i, got))
        n += 1
        del msg, a, b
    out.put(("read", n, wrong))

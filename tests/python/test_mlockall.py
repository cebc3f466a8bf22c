"""Readers whose memory is locked with ``mlockall`` (issue 32, item 6).

A reader locked before it joins (``MCL_CURRENT | MCL_FUTURE``) used to fault in every
page of the queue's sparse segments as it mapped them, filling ``/dev/shm`` (a 240 MiB
ring in a 512 MiB tmpfs, where the writer had reserved a few MiB): now the join is
refused with an ``OSError`` that names ``mlockall`` and ``MCL_ONFAULT``, and a reader
locked with ``MCL_ONFAULT`` joins and reads everything. A reader locked after its view
window exists used to read some messages as zeros (the lock copied the window's pages
in privately, as they were then): now every message arrives whole.

Each test runs a program of its own (this file, run as a script) in a private 512 MiB
tmpfs ``/dev/shm``; its reader is a spawned process. The lock is ``mlockall`` through
ctypes, with ``RLIMIT_MEMLOCK`` raised to its hard limit; a lock that fails fails the
test (no skip).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

import pytest

from _processes.private_shm import run_in_private_shm

pytestmark = pytest.mark.timeout(300)

MCL_CURRENT, MCL_FUTURE, MCL_ONFAULT = 1, 2, 4
MiB = 1 << 20
N = 2999


def _program(mode: str) -> dict:
    return run_in_private_shm(__file__, [mode], "512m", timeout=240)


def test_a_reader_locked_before_it_joins_is_refused_and_dev_shm_stays_free():
    got = _program("before")
    assert got["error"] is not None, got
    assert got["error"].startswith("OSError"), got
    for needle in ("mlockall", "MCL_ONFAULT", "/dev/shm"):
        assert needle in got["error"], got
    # The refused join took nothing: /dev/shm holds what the writer reserved.
    assert got["shm_used"] < 64 * MiB, got


def test_a_reader_locked_on_fault_before_it_joins_reads_every_message():
    got = _program("onfault")
    assert got["error"] is None, got
    assert (got["received"], got["wrong"]) == (N, []), got
    assert got["shm_used"] < 128 * MiB, got


def test_a_reader_locked_after_its_window_exists_reads_no_zeros():
    got = _program("after")
    assert got["error"] is None, got
    assert (got["received"], got["wrong"]) == (N, []), got


# ------------------------------------------------------------------------------------
# The program: runs inside the private /dev/shm.


def _lock(flags: int) -> None:
    """mlockall(flags), with RLIMIT_MEMLOCK raised to its hard limit; raises if refused."""
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlockall(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mlockall({flags}) failed: {os.strerror(err)} (RLIMIT_MEMLOCK hard {hard})")


def _shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _reader(handle, mode: str, out) -> None:
    from shmq import MessageQueue

    received, wrong, error = 0, [], None
    try:
        if mode == "before":
            _lock(MCL_CURRENT | MCL_FUTURE)
        elif mode == "onfault":
            _lock(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)
        mq = MessageQueue.create_from_handle(handle, 0)
        mq.wait_until_ready(timeout=60)
        while (msg := mq.dequeue(timeout=60)) is not None:
            i, a = msg
            if received == 0 and mode == "after":
                _lock(MCL_CURRENT | MCL_FUTURE)  # the window exists: the first message made it
            if not (float(a.min()) == float(a.max()) == i + 1):
                wrong.append(i)
            received += 1
            del msg, a
    except Exception as e:  # reported, not lost
        error = f"{type(e).__name__}: {e}"
    out.put({"received": received, "wrong": wrong[:20], "error": error, "shm_used": _shm_used()})


def run(mode: str) -> dict:
    import multiprocessing as mp

    import numpy as np

    from shmq import MessageQueue

    ctx = mp.get_context("spawn")
    # vLLM's ring (10 chunks of 24 MiB) and a 64 MiB arena that every part goes through.
    mq = MessageQueue(1, 1, max_chunk_bytes=24 * MiB, max_chunks=10, arena_bytes=64 * MiB, arena_threshold=16384)
    out = ctx.Queue()
    p = ctx.Process(target=_reader, args=(mq.export_handle(), mode, out), daemon=True)
    p.start()
    writer_error = None
    try:
        mq.wait_until_ready(timeout=10 if mode == "before" else 30)
        for i in range(N):
            mq.enqueue((i, np.full(16384 * (1 + i % 7), i + 1, dtype=np.float32)), timeout=60)
        mq.enqueue(None, timeout=60)
    except Exception as e:  # the refused reader never subscribes
        writer_error = repr(e)
    got = out.get(timeout=120)
    p.join(60)
    got["writer_error"] = writer_error
    return got


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))

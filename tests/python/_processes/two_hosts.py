"""Processes of the two-host test (test_two_hosts.py), run as
``python _processes/two_hosts.py ROLE WORKDIR`` inside network namespaces. Each prints one JSON
line with what it saw and exits 0 only if everything checked out.

Roles: ``writer`` (host A), ``local`` (host A, reads through shared memory),
``remote`` (host B, with its own /dev/shm: it must not see host A's segments),
``group RANK``: one rank of a 3-process StatelessProcessGroup (store on host A) that
makes its queue with ``MessageQueue.create_from_process_group``, rank 0 writing, and
``writer_then_hold`` / ``remote_until_gone``: a remote reader whose link to the writer
goes down; ``writer_blocked`` / ``remote_holding``: a writer blocked on the credit of a
remote reader whose link goes down (test_remote_link_cut.py).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import sys
import time

import numpy as np

from _processes.harness import LogRecords, WaitTimeout, wait_for
from shmq import MessageQueue, StatelessProcessGroup, _core

HOST_A = "10.213.7.1"
N_OBJECTS = 400
MAX_CHUNK = 64 * 1024
TIMEOUT = 60.0


def objects(seed: int = 7):
    """A deterministic stream: small dicts and numpy arrays, some larger than a chunk."""
    rng = random.Random(seed)
    for i in range(N_OBJECTS):
        if i % 5 == 0:
            n = rng.choice([10, 1000, 3 * MAX_CHUNK // 8])  # the last is over a chunk
            yield {"i": i, "array": np.arange(n, dtype=np.float64) * i}
        else:
            yield {"i": i, "text": "x" * rng.randrange(200), "ids": list(range(i % 17))}


def same(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


def handle_path(workdir: str) -> str:
    return os.path.join(workdir, "handle.pickle")


def read_handle(workdir: str):
    wait_for(lambda: os.path.exists(handle_path(workdir)), TIMEOUT, "the writer's handle", interval=0.05)
    with open(handle_path(workdir), "rb") as f:
        return pickle.load(f)


def writer(workdir: str) -> dict:
    mq = MessageQueue(
        n_reader=2, n_local_reader=1, local_reader_ranks=[1], max_chunk_bytes=MAX_CHUNK, max_chunks=4, connect_ip=HOST_A
    )
    tmp = handle_path(workdir) + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(mq.export_handle(), f)
    os.rename(tmp, handle_path(workdir))
    mq.wait_until_ready(TIMEOUT)
    for obj in objects():
        mq.enqueue(obj, timeout=TIMEOUT)
    mq.enqueue(None, timeout=TIMEOUT)
    # The process (and its ZeroMQ context) goes only once both readers have the end mark:
    # each says so with a file.
    done = [os.path.join(workdir, f"done.{rank}") for rank in (1, 2)]
    wait_for(lambda: all(map(os.path.exists, done)), TIMEOUT, "both readers to take the end mark", interval=0.01)
    return {"sent": N_OBJECTS, "remote_addr": mq.export_handle().remote_subscribe_addr}


def reader(workdir: str, rank: int) -> dict:
    handle = read_handle(workdir)
    # Same-machine check: only host A can open the writer's segment.
    try:
        _core.Ring.open(handle.buffer_handle[3])
        sees_segment = True
    except FileNotFoundError:
        sees_segment = False
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(TIMEOUT)
    count = mismatches = 0
    for expected in objects():
        got = mq.dequeue(timeout=TIMEOUT)
        count += 1
        mismatches += not same(got, expected)
    end = mq.dequeue(timeout=TIMEOUT)
    with open(os.path.join(workdir, f"done.{rank}"), "w") as f:
        f.write("done")
    return {
        "count": count,
        "mismatches": mismatches,
        "end_mark": end is None,
        "sees_segment": sees_segment,
        "local": mq._is_local_reader,
    }


def writer_then_hold(workdir: str) -> dict:
    """A writer for one remote reader (rank 0) that sends 10 numbers, then holds the queue
    open (neither sends nor shuts down) until it is killed."""
    mq = MessageQueue(n_reader=1, n_local_reader=0, connect_ip=HOST_A)
    tmp = handle_path(workdir) + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(mq.export_handle(), f)
    os.rename(tmp, handle_path(workdir))
    mq.wait_until_ready(TIMEOUT)
    for i in range(10):
        mq.enqueue(i, timeout=TIMEOUT)
    time.sleep(TIMEOUT)  # not synchronisation: holds the queue open until killed
    return {"held": True}


def remote_until_gone(workdir: str) -> dict:
    """Rank 0 of ``writer_then_hold``'s queue: read the 10 numbers, say so (a file
    ``got``), then wait for more and report the error that ends the wait, with the
    wall-clock time it came (both hosts share the clock)."""
    mq = MessageQueue.create_from_handle(read_handle(workdir), 0)
    mq.wait_until_ready(TIMEOUT)
    got = [mq.dequeue(timeout=TIMEOUT) for _ in range(10)]
    with open(os.path.join(workdir, "got"), "w") as f:
        f.write("got")
    try:
        mq.dequeue(timeout=TIMEOUT)
        error = None
    except Exception as e:  # reported: the test checks which
        error = [type(e).__name__, str(e)]
    return {"got": got, "error": error, "at": time.time()}


# The remote reader's window in writer_blocked: messages sent to it and not yet taken.
BLOCKED_HWM = 4
# How long writer_blocked's enqueue that waits for the reader's credit may wait.
BLOCKED_TIMEOUT = 30.0


def _mark(workdir: str, name: str) -> None:
    with open(os.path.join(workdir, name), "w") as f:
        f.write(name)


def _await_mark(workdir: str, name: str, timeout: float = TIMEOUT) -> None:
    path = os.path.join(workdir, name)
    wait_for(lambda: os.path.exists(path), timeout, f"the file {name!r}", interval=0.02)


def writer_blocked(workdir: str) -> dict:
    """A writer for one remote reader (rank 0) that may have ``BLOCKED_HWM`` messages in
    flight to it: sends that many (the reader takes none yet), says so (a file ``full``),
    then enqueues one more, which waits for the reader's credit (at most
    ``BLOCKED_TIMEOUT``); reports how and when (wall clock) that enqueue ended, then
    sends 3 more (the seconds each took, or the error that ended them), shuts the queue
    down and waits for the reader's ``done``.
    The shmq warnings logged are reported too."""
    warnings = LogRecords()
    logging.getLogger("shmq").addHandler(warnings)
    logging.getLogger("shmq").setLevel(logging.WARNING)
    mq = MessageQueue(n_reader=1, n_local_reader=0, connect_ip=HOST_A, remote_hwm=BLOCKED_HWM)
    tmp = handle_path(workdir) + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(mq.export_handle(), f)
    os.rename(tmp, handle_path(workdir))
    mq.wait_until_ready(TIMEOUT)
    for i in range(BLOCKED_HWM):
        mq.enqueue(i, timeout=TIMEOUT)
    _mark(workdir, "full")
    try:
        mq.enqueue(BLOCKED_HWM, timeout=BLOCKED_TIMEOUT)
        blocked_error = None
    except Exception as e:  # reported: the test checks which
        blocked_error = [type(e).__name__, str(e)]
    blocked_ended = time.time()
    after: list = []
    for i in range(BLOCKED_HWM + 1, BLOCKED_HWM + 4):
        t0 = time.monotonic()
        try:
            mq.enqueue(i, timeout=5.0)
        except Exception as e:  # reported: the test checks
            after.append([type(e).__name__, str(e)])
            break
        after.append(time.monotonic() - t0)
    mq.shutdown()
    try:
        _await_mark(workdir, "done")  # the process (its ZeroMQ context) stays until the reader is done
    except WaitTimeout:
        pass  # the report goes out all the same: the test checks the reader's own
    return {
        "blocked_error": blocked_error,
        "blocked_ended": blocked_ended,
        "after": after,
        "warnings": [message for _, _, message in warnings.records],
    }


def remote_holding(workdir: str) -> dict:
    """Rank 0 of ``writer_blocked``'s queue: get ready, then take nothing (busy elsewhere:
    not in a call of the queue) until the file ``read`` appears; then dequeue until an
    error ends it, and report the numbers taken and that error; says ``done`` (a file)."""
    mq = MessageQueue.create_from_handle(read_handle(workdir), 0)
    mq.wait_until_ready(TIMEOUT)
    _await_mark(workdir, "read", 2 * TIMEOUT)  # told to read
    got = []
    try:
        while True:
            got.append(mq.dequeue(timeout=TIMEOUT))
    except Exception as e:  # reported: the test checks which
        error = [type(e).__name__, str(e)]
    _mark(workdir, "done")
    return {"got": got, "error": error}


STORE_PORT = 29517  # inside the test's own network namespaces: nothing else uses it


def group_member(rank: int) -> dict:
    pg = StatelessProcessGroup.create(HOST_A, STORE_PORT, rank, 3, store_timeout=int(TIMEOUT))
    mq = MessageQueue.create_from_process_group(pg, MAX_CHUNK, 4, writer_rank=0)
    result: dict = {"rank": rank, "local": bool(mq._is_local_reader), "writer": mq._writer is not None}
    if rank == 0:
        for obj in objects():
            mq.enqueue(obj, timeout=TIMEOUT)
        mq.enqueue(None, timeout=TIMEOUT)
        result["local_reader_ranks"] = list(mq.export_handle().local_reader_ranks)
    else:
        count = mismatches = 0
        for expected in objects():
            count += 1
            mismatches += not same(mq.dequeue(timeout=TIMEOUT), expected)
        result.update(count=count, mismatches=mismatches, end_mark=mq.dequeue(timeout=TIMEOUT) is None)
    pg.barrier(timeout=TIMEOUT)  # rank 0 hosts the store: nobody leaves before all are done
    return result


if __name__ == "__main__":
    role, workdir = sys.argv[1], sys.argv[2]
    if role == "group":
        result = group_member(int(sys.argv[3]))
    elif role == "writer_then_hold":
        result = writer_then_hold(workdir)
    elif role == "remote_until_gone":
        result = remote_until_gone(workdir)
    elif role == "writer_blocked":
        result = writer_blocked(workdir)
    elif role == "remote_holding":
        result = remote_holding(workdir)
    else:
        result = writer(workdir) if role == "writer" else reader(workdir, 1 if role == "local" else 2)
    print(json.dumps(result), flush=True)

"""Child processes of test_relay.py (and, run as a script, the processes of its
two-host test): a writer whose remote reader is a relay, and the relay's local readers.

As a script: ``python _processes/relay_children.py ROLE WORKDIR [RANK]`` with ROLE ``writer``
(host A: a queue with one remote reader, the relay; sends ``N_OBJECTS`` objects and
holds the queue until killed) or ``reader`` (host B: a local reader of the relay's
queue, whose handle the relay wrote to ``WORKDIR/relay.handle``); each prints one JSON
line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np

from _processes.harness import STEP, LogRecords, wait_for
from shmq import Handle, MessageQueue

MAX_CHUNK = 64 * 1024
N_OBJECTS = 60


def obj(i: int) -> Any:
    """The test stream: small dicts, and every fourth a dict with an array larger than
    a chunk (a pickled object with an out-of-band buffer: a message of parts)."""
    if i % 4 == 3:
        return {"i": i, "array": np.arange(3 * MAX_CHUNK // 8, dtype=np.float64) * i}
    return {"i": i, "text": "x" * (i % 50)}


def check(i: int, got: Any) -> bool:
    want = obj(i)
    if "array" in want:
        return got.keys() == want.keys() and got["i"] == i and np.array_equal(got["array"], want["array"])
    return bool(got == want)


def writer(out: Any, ip: str, cmds: Any) -> None:
    """A writer with one remote reader (rank 0: the relay). Reports its handle's text,
    then takes commands: ``("send", a, b)`` sends objects ``a..b`` (reporting ``sent``
    with the seconds it took and the shmq warnings logged meanwhile), ``"shutdown"``
    shuts the queue down and leaves at once, ``None`` returns. The test may kill it."""
    warnings = LogRecords()
    logging.getLogger("shmq").addHandler(warnings)
    logging.getLogger("shmq").setLevel(logging.WARNING)
    mq = MessageQueue(1, 0, max_chunk_bytes=MAX_CHUNK, max_chunks=4, connect_ip=ip)
    out.put(("handle", str(mq.export_handle()), os.getpid()))
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    while True:
        cmd = cmds.get(timeout=STEP * 4)
        if cmd is None:
            return
        if cmd == "shutdown":
            mq.shutdown()
            os._exit(0)
        _, a, b = cmd
        t0 = time.monotonic()
        for i in range(a, b):
            mq.enqueue(obj(i), timeout=STEP)
        out.put(("sent", time.monotonic() - t0, [message for _, _, message in warnings.records]))


def reader(out: Any, handle_text: str, rank: int, progress: Any = None) -> None:
    """A local reader of the relay's queue: read until an error, then report
    ``("done", rank, numbers read, all as sent, error type, error text, when)`` (``when``:
    ``time.monotonic()``, which every process on the machine shares). ``progress``: a
    shared array where it keeps how many messages it has read (at index ``rank``)."""
    mq = MessageQueue.create_from_handle(Handle.from_str(handle_text), rank)
    out.put(("joined", rank))
    mq.wait_until_ready(timeout=STEP)
    got: list[int] = []
    good = True
    while True:
        try:
            m = mq.dequeue(timeout=STEP * 2)
        except Exception as e:  # reported: the test checks which
            out.put(("done", rank, got, good, type(e).__name__, str(e), time.monotonic()))
            return
        good = good and check(len(got), m)
        got.append(m["i"])
        if progress is not None:
            progress[rank] = len(got)


def _handle_file(workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    wait_for(lambda: os.path.exists(path), STEP * 2, f"the file {path}", interval=0.05)
    with open(path) as f:
        return f.read().strip()


def _script_writer(workdir: str) -> dict:
    mq = MessageQueue(1, 0, max_chunk_bytes=MAX_CHUNK, max_chunks=4, connect_ip="10.213.7.1")
    path = os.path.join(workdir, "writer.handle")
    with open(path + ".tmp", "w") as f:
        f.write(str(mq.export_handle()))
    os.rename(path + ".tmp", path)
    mq.wait_until_ready(timeout=STEP * 2)
    for i in range(N_OBJECTS):
        mq.enqueue(obj(i), timeout=STEP)
    with open(os.path.join(workdir, "sent"), "w") as f:
        f.write("sent")
    time.sleep(STEP * 4)  # held until the test kills it
    return {"held": True}


def _script_reader(workdir: str, rank: int) -> dict:
    mq = MessageQueue.create_from_handle(Handle.from_str(_handle_file(workdir, "relay.handle")), rank)
    mq.wait_until_ready(timeout=STEP * 2)
    got: list[int] = []
    good = True
    try:
        while True:
            m = mq.dequeue(timeout=STEP * 2)
            good = good and check(len(got), m)
            got.append(m["i"])
            if len(got) == N_OBJECTS:  # the test waits for this file
                with open(os.path.join(workdir, f"r{rank}.got"), "w") as f:
                    f.write("got")
    except Exception as e:  # reported: the test checks which
        error = [type(e).__name__, str(e)]
    return {"rank": rank, "got": got, "good": good, "error": error, "at": time.monotonic()}


if __name__ == "__main__":
    role, workdir = sys.argv[1], sys.argv[2]
    result = _script_writer(workdir) if role == "writer" else _script_reader(workdir, int(sys.argv[3]))
    print(json.dumps(result), flush=True)

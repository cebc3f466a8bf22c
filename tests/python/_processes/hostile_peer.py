"""Peers for test_hostile.py that must run as separate programs (in another pid
namespace through ``unshare``, or as a process that forks): run as
``python _processes/hostile_peer.py ROLE ARG``, with the handle as base64 pickle.

Each prints one JSON line with what it saw and exits 0, or prints a traceback and exits
1. Every blocking call has a timeout.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import time

from _processes.harness import STEP, blocked_in_queue, wait_for


def _handle(arg: str):
    return pickle.loads(base64.b64decode(arg))


def slow_reader(arg: str) -> dict:
    """Open reader 0, read nothing until the writer has filled the ring and been blocked
    on it (checking on us, every 0.5 s) for 2 s, then read every message until None."""
    from shmq import MessageQueue

    handle = _handle(arg)
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)
    ring = handle.buffer_handle[3]
    wait_for(lambda: blocked_in_queue(ring, for_at_least=2.0), STEP, "the writer to block on the full ring for 2 s")
    got = []
    while (obj := mq.dequeue(timeout=STEP)) is not None:
        got.append(obj)
    return {"got": got, "pid": os.getpid()}


def cleanup() -> dict:
    """What `python -m shmq cleanup` (dry run) and `inspect` say from here."""
    import shmq.admin

    return {
        "would_remove": [s.name for s in shmq.admin.cleanup(dry_run=True)],
        "states": {s.name: s.creator_state for s in shmq.admin.list_segments()},
    }


def fork_then_exit(arg: str) -> dict:
    """Make a writer and a reader, fork; the child tries the queue, then leaves with
    sys.exit (running Python's finalizers); the parent must live on and still work."""
    from shmq import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    mq.enqueue("before")
    pid = os.fork()
    if pid == 0:
        try:
            mq.enqueue("from the child")
            outcome = "sent"
        except RuntimeError as e:
            outcome = str(e)
        with open(arg, "w") as f:
            f.write(outcome)
        sys.exit(0)
    t0 = time.monotonic()
    _, status = os.waitpid(pid, 0)
    waited = time.monotonic() - t0
    with open(arg) as f:
        child_said = f.read()
    mq.enqueue("after")
    got = [reader.dequeue(timeout=STEP), reader.dequeue(timeout=STEP)]
    return {"child_status": status, "child_took": waited, "child_said": child_said, "got": got}


def main() -> None:
    role, *args = sys.argv[1:]
    fn = {
        "slow_reader": slow_reader,
        "cleanup": cleanup,
        "fork_then_exit": fork_then_exit,
    }[role]
    try:
        print(json.dumps(fn(*args)), flush=True)
    except Exception:  # not SystemExit: a forked child leaves through it
        import traceback

        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()

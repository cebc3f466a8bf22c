"""Child processes and worker targets for test_async_completeness.py and
test_rust_parent.py (issue 59 items 3 and 6). Every wait is bounded (``STEP``)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from shmq import MessageQueue, QueueShutDownError
from shmq.workers import report_ready

from _processes.harness import STEP


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + STEP
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never made"
        time.sleep(0.01)


def results_worker(rank: int, steps_handle: Any) -> None:
    """A worker of a scheduler: reads the steps queue, writes its own results queue
    (its handle is its ready info). The step ``{"fail": rank}`` makes that worker exit
    with code 3 (its results queue ends normally, at its interpreter's exit); the others
    wait for the steps queue's end."""
    steps = MessageQueue.create_from_handle(steps_handle, rank)
    results = MessageQueue(1, 1)
    report_ready(results.export_handle())
    steps.wait_until_ready(timeout=STEP)
    results.wait_until_ready(timeout=STEP)
    step = steps.dequeue(timeout=STEP)
    if step["fail"] == rank:
        sys.exit(3)
    try:
        steps.dequeue(timeout=STEP)
    except QueueShutDownError:
        pass


def gated_worker(rank: int, gate: str, codes: list[int]) -> None:
    """Report ready (``rank * 10``) once the file ``gate/ready`` exists, then exit with
    ``codes[rank]`` once ``gate/exit`` does."""
    _wait_for_file(Path(gate) / "ready")
    report_ready(rank * 10)
    _wait_for_file(Path(gate) / "exit")
    sys.exit(codes[rank])


def raw_ready_worker(rank: int, raw: bytes) -> None:
    """Report ready with ``raw`` as raw bytes, then wait to be stopped."""
    report_ready(raw=raw)
    time.sleep(STEP)  # not synchronisation: alive until the parent closes the group


def filling_writer(out: Any, name: str, go: Any, n: int) -> None:
    """The writer of queue ``name`` (one local reader, a ring of 2 chunks): report
    ready, wait for the reader, then for ``go``; send ``n`` messages (more than the ring
    holds: they all go only if the reader reads them or has left) and report ``("sent",
    n)`` or ``("error", text)``."""
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name=name)
    out.put(("ready", os.getpid()))
    mq.wait_until_ready(timeout=STEP)
    assert go.wait(STEP), "never told to send"
    try:
        for i in range(n):
            mq.enqueue(i, timeout=STEP)
    except Exception as e:
        out.put(("error", f"{type(e).__name__}: {e}"))
        return
    out.put(("sent", n))
    mq.shutdown()


def reader_on_go(out: Any, handle: Any, go: Any) -> None:
    """Join as local reader 0, report ready, wait for the writer; once ``go`` is set read
    every message until ``None`` and report them."""
    mq = MessageQueue.create_from_handle(handle, 0)
    out.put(("ready", os.getpid()))
    mq.wait_until_ready(timeout=STEP)
    assert go.wait(STEP), "never told to read"
    got = []
    while (obj := mq.dequeue(timeout=STEP)) is not None:
        got.append(obj)
    out.put(("got", got))

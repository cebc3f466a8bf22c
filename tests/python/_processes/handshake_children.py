"""Child entry point of the handshake-order tests: a worker that reads a scheduler's steps
and writes its results back, calling ``wait_until_ready`` on its two queues in the order
it is given."""

from __future__ import annotations

import os
from typing import Any

from shmq import MessageQueue

from .harness import STEP


def step_worker(
    out: Any, steps_handle: Any, rank: int, results_name: str, order: str, n: int, remote: bool = False
) -> None:
    """Open the steps queue's reader of rank ``rank`` and make the writer of
    ``results_name`` (one reader: local, or with ``remote`` over TCP on 127.0.0.1), report
    ``("made", rank)``, then make both ready in ``order`` (``"reader-first"``: steps then
    results, as ``examples/serving.py``; ``"writer-first"``: results then steps) within
    ``STEP`` seconds each; answer ``n`` steps ``i`` with ``(rank, i * i)``."""
    steps = MessageQueue.create_from_handle(steps_handle, rank)
    if remote:
        results = MessageQueue(1, 0, name=results_name, connect_ip="127.0.0.1")
    else:
        results = MessageQueue(1, 1, name=results_name)
    out.put(("made", rank))
    first, second = (steps, results) if order == "reader-first" else (results, steps)
    first.wait_until_ready(timeout=STEP)
    second.wait_until_ready(timeout=STEP)
    out.put(("ready", rank, os.getpid()))
    for _ in range(n):
        i = steps.dequeue(timeout=STEP)
        results.enqueue((rank, i * i), timeout=STEP)
    results.shutdown()


def reader_until_told(out: Any, handle: Any, rank: int, end: Any) -> None:
    """Make the reader of rank ``rank``, make it ready (it waits for nothing), report
    ``("made", pid)`` and keep it until ``end``."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("made", os.getpid()))
    assert end.wait(STEP), "never told to end"


def ref_reader(out: Any, store_handle: Any, refs: Any) -> None:
    """Open the store from its handle and get each ``ObjectRef`` that arrives on
    ``refs`` (pickled through a multiprocessing queue) until ``None``; report each
    object, or the error's type and message."""
    from shmq import ObjectStorage

    store = ObjectStorage.create_from_handle(store_handle)
    out.put(("opened",))
    while (ref := refs.get(timeout=STEP)) is not None:
        try:
            out.put(("got", store.get(ref, copy=True)))
        except Exception as e:
            out.put(("refused", type(e).__name__, str(e)))
    store.close()

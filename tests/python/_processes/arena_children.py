"""Child entry points of the arena lifecycle tests (each takes the report queue first)."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from shmq import Handle, MessageQueue

from .harness import STEP


def small_then_large_reader(out: Any, handle: Handle, rank: int, n_small: int, go: Any) -> None:
    """Read ``n_small`` small messages and report them; then read one message
    ``{"t": tensor}`` (the queue's first large part), report whether every element is
    ``7.0`` and keep the tensor until ``go``; then drop it, report, and read ``"bye"``."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    small = [mq.dequeue(timeout=STEP) for _ in range(n_small)]
    out.put(("small", small))
    msg = mq.dequeue(timeout=STEP)
    t = msg["t"]
    import torch  # here, not at the top: every test's children import this package

    out.put(("large", t.numel(), bool(torch.all(t == 7.0))))
    if not go.wait(STEP):
        raise TimeoutError("no go")
    del msg, t
    gc.collect()
    out.put(("dropped",))
    bye = mq.dequeue(timeout=STEP)
    assert bye == "bye", bye


def hoarding_reader(out: Any, handle: Handle, rank: int, n: int) -> None:
    """Read ``n`` messages ``{"t": tensor}``, keep every tensor, report, then wait to be
    killed (SIGKILL: its holds are never dropped by itself)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    kept = [mq.dequeue(timeout=STEP)["t"] for _ in range(n)]
    out.put(("holding", len(kept), os.getpid()))
    time.sleep(3 * STEP)  # not synchronisation: holds its tensors until killed


def tensor_counting_reader(out: Any, handle: Handle, rank: int, n: int) -> None:
    """Read ``n`` messages ``{"i": i, "t": tensor filled with i}``, dropping each at once;
    report whether each was intact and in order."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    ok = []
    for i in range(n):
        msg = mq.dequeue(timeout=STEP)
        ok.append(msg["i"] == i and bool((msg["t"] == float(i)).all()))
        del msg
    out.put(("read", ok))

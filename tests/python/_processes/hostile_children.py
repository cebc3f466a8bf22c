"""Child entry points of test_hostile.py."""

from __future__ import annotations

import os
import time
from typing import Any

from shmq import Handle, MessageQueue

from .harness import STEP


def remote_writer_then_sleep(out: Any) -> None:
    """A writer with one remote reader: reports its handle, sends one message once the
    reader is in, then waits to be killed."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    out.put(("handle", mq.export_handle()))
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue("from the real writer")
    time.sleep(3 * STEP)  # not synchronisation: alive until killed


def hold_rank(out: Any, handle: Handle, rank: int) -> None:
    """Open reader ``rank`` and hold it until killed."""
    mq = MessageQueue.create_from_handle(handle, rank)
    out.put(("holding", os.getpid()))
    time.sleep(3 * STEP)  # not synchronisation: holds the rank until killed
    del mq


def raw_chunk_keeper(out: Any, handle: Handle) -> None:
    """Read a raw chunk with acquire_read, keep an array made from it past the block,
    read the next chunk (the writer refilled the same one), and report what the kept
    array shows before and after."""
    import numpy as np

    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)
    with mq.acquire_read(timeout=STEP) as buf:
        kept = np.frombuffer(buf, dtype=np.uint8)[:8]
        before = kept.tolist()
    with mq.acquire_read(timeout=STEP) as buf:
        second = bytes(buf[:8])
    out.put(("kept", before, kept.tolist(), list(second)))

"""Child entry points of the open-by-name, asyncio and many-to-one tests (each takes the
report queue first): writers of named queues and stores that report, send when told,
and end as told (a normal end, or killed)."""

from __future__ import annotations

import os
import signal
from typing import Any

from shmq import MessageQueue, ObjectStorage, RingBuffer
from shmq import _names  # noqa: F401  (loaded before a child drops to a user who cannot read this tree)

from .harness import STEP


def _end(how: str, mq: MessageQueue) -> None:
    """End as ``how`` says: ``"shutdown"`` (the queue's end, then the process's normal
    end), ``"exit"`` (the process's normal end alone: the writer is dropped at exit),
    ``"kill"`` (SIGKILL: a death)."""
    if how == "shutdown":
        mq.shutdown()
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def named_writer(out: Any, name: str, go: Any, messages: list[Any], end: Any, how: str) -> None:
    """Make the writer of queue ``name`` (one local reader), report ``("ready", pid)``,
    wait for its reader, then for ``go``; send ``messages``; wait for ``end`` (when one is
    given) and end as ``how`` says (see ``_end``)."""
    mq = MessageQueue(1, 1, name=name)
    out.put(("ready", os.getpid()))
    mq.wait_until_ready(timeout=STEP)
    if go is not None:
        assert go.wait(STEP), "never told to send"
    for m in messages:
        mq.enqueue(m, timeout=STEP)
    if end is not None:
        assert end.wait(STEP), "never told to end"
    out.put(("sent", os.getpid()))
    _end(how, mq)


def named_store(out: Any, name: str, end: Any) -> None:
    """Make a store on ``RingBuffer(create=True, name=name)`` with one object, report
    ``("ready", (address, id), signature)``, and keep it until ``end``."""
    ring = RingBuffer(1 << 20, name=name, create=True)
    store = ObjectStorage(max_object_size=1 << 16, n_readers=1, ring_buffer=ring)
    address = store.put("image-1", {"pixels": list(range(8))})
    out.put(("ready", address, store.get_signature("image-1")))
    assert end.wait(STEP), "never told to end"
    store.close()
    out.put(("closed",))


def open_as_another_user(out: Any, uid: int, queue_name: str, store_name: str) -> None:
    """As user ``uid`` (a root child drops to it): what opening this user's queue and
    store by name raises, as ``(type name, message)`` pairs."""
    os.setgid(uid)
    os.setuid(uid)
    found = []
    for call in (lambda: MessageQueue.open(queue_name, 0), lambda: ObjectStorage.open(store_name)):
        try:
            call()
            found.append(("opened", ""))
        except Exception as e:
            found.append((type(e).__name__, str(e)))
    out.put(("tried", found))

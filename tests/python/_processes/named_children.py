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


def named_remote_writer(out: Any, name: str, go: Any, messages: list[Any], end: Any, how: str) -> None:
    """As ``named_writer``, for one remote reader (rank 0, TCP on 127.0.0.1): reports
    ``("ready", pid, handle)``."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name=name)
    out.put(("ready", os.getpid(), mq.export_handle()))
    mq.wait_until_ready(timeout=STEP)
    assert go.wait(STEP), "never told to send"
    for m in messages:
        mq.enqueue(m, timeout=STEP)
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


def as_user(out: Any, uid: int, target: Any, *args: Any) -> None:
    """Run ``target(out, *args)`` as user ``uid`` (a root child drops to it, with no
    janitor: that user may not run this interpreter)."""
    os.environ["SHMQ_NO_JANITOR"] = "1"
    os.setgid(uid)
    os.setuid(uid)
    target(out, *args)


def named_reader(out: Any, name: str, n: int) -> None:
    """Open reader 0 of the queue named ``name``, read ``n`` messages, report them as
    ``("read", messages)``."""
    mq = MessageQueue.open(name, 0)
    mq.wait_until_ready(timeout=STEP)
    out.put(("read", [mq.dequeue(timeout=STEP) for _ in range(n)]))


def squat_names(out: Any, victim_uid: int, how: str) -> None:
    """As a stranger: take the entries of ``/dev/shm`` where user ``victim_uid``'s
    directory of names would go, as ``how`` says (``"directory"``: a directory anyone may
    write into; ``"symlink"``: a symlink to ``/tmp``; ``"several"``: directories at the
    first three places), and report ``("squatted",)``."""
    base = f"/dev/shm/.shmq-names-{victim_uid}"
    if how == "symlink":
        os.symlink("/tmp", base)
    else:
        for path in [base, f"{base}.1", f"{base}.2"] if how == "several" else [base]:
            os.mkdir(path)
            os.chmod(path, 0o777)
    out.put(("squatted",))


def claim_racer(out: Any, base: str, rounds: int, barrier: Any) -> None:
    """For each of ``rounds`` rounds: wait at ``barrier`` with the other racers, then try
    to take the name ``f"{base} {round}"``; report ``("tried", round, pid, got it)``. The
    names taken are held until the process ends (the test removes their records)."""
    held = []
    for r in range(rounds):
        barrier.wait(STEP)
        try:
            held.append(_names.claim("queue", f"{base} {r}", {"handle": "-"}))
            got = True
        except FileExistsError:
            got = False
        out.put(("tried", r, os.getpid(), got))


def named_writer_that_forks(out: Any, name: str, go: Any) -> None:
    """Make the writer of queue ``name``, fork a child that only sleeps (it holds copies
    of every descriptor of the writer's, as a forked worker would), report ``("ready",
    pid, child pid)``, and on ``go`` die by SIGKILL, leaving the child running."""
    import time

    mq = MessageQueue(1, 1, name=name)
    child = os.fork()
    if child == 0:
        time.sleep(STEP)
        os._exit(0)
    out.put(("ready", os.getpid(), child))
    assert go.wait(STEP), "never told to die"
    _end("kill", mq)


# ---------------------------------------------------------------------------------
# Waits that cancel (test_asyncio.py, issue 54 items 6 and 7)


def remote_numbers_writer(out: Any, go: Any, n: int, end: Any) -> None:
    """A writer for one remote reader (rank 0, TCP on 127.0.0.1): report its handle, wait
    for the reader, then for ``go``; send ``0 .. n-1``; wait for ``end`` and shut down."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    out.put(("handle", mq.export_handle(), os.getpid()))
    mq.wait_until_ready(timeout=STEP)
    assert go.wait(STEP), "never told to send"
    for i in range(n):
        mq.enqueue(i, timeout=STEP)
    out.put(("sent", os.getpid()))
    assert end.wait(STEP), "never told to end"
    mq.shutdown()


def cancelling_async_reader(out: Any, handle: Any, go: Any) -> None:
    """Join as remote reader 0; in one event loop, give up two ``dequeue_async`` waits
    (one cancelled, one ended by ``asyncio.wait_for``), then let the writer send (``go``,
    set by a coroutine only once the loop runs) and read three messages with
    ``dequeue_async(timeout=...)``; report them (``"timeout"`` for a wait that timed out)
    once ``asyncio.run`` has returned."""
    import asyncio

    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)

    async def main() -> list[Any]:
        waiting = asyncio.ensure_future(mq.dequeue_async())
        # Not synchronisation: the wait is under way in its thread by then (the issue's
        # case) or not yet; either way the cancelled wait must not take a message.
        await asyncio.sleep(0.2)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        try:
            await asyncio.wait_for(mq.dequeue_async(), 0.2)
        except TimeoutError:
            pass
        ticks = 0

        async def ticker() -> None:
            # The writer sends only once this has run: a loop blocked by a wait would
            # never see a message.
            nonlocal ticks
            while ticks < 20:
                ticks += 1
                await asyncio.sleep(0)
            go.set()

        tick = asyncio.ensure_future(ticker())
        got: list[Any] = []
        for _ in range(3):
            try:
                got.append(await mq.dequeue_async(timeout=10))
            except TimeoutError:
                got.append("timeout")
        await tick
        return got

    out.put(("got", asyncio.run(main())))


def many_writers(out: Any, n: int, cmds: Any) -> None:
    """The writers of ``n`` small local queues (one reader each): report their handles,
    wait for each one's reader in turn; then each command ``(i, message)`` sends
    ``message`` on queue ``i``; ``None`` shuts them all down and ends."""
    writers = [MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2) for _ in range(n)]
    out.put(("handles", [w.export_handle() for w in writers]))
    for w in writers:
        w.wait_until_ready(timeout=STEP)
    while True:
        cmd = cmds.get(timeout=STEP * 2)
        if cmd is None:
            break
        i, message = cmd
        writers[i].enqueue(message, timeout=STEP)
        out.put(("sent", i))
    for w in writers:
        w.shutdown()

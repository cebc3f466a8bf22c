"""Many writers to one reader: ``Gather`` reads several single-writer queues (workers'
results back to a scheduler) with one wait for all of them.

Each worker writes its own ``MessageQueue`` (one writer, one local reader: the
scheduler), so a worker's messages keep their order and a worker's death is told apart
from the others'. The scheduler holds the reading ends in one ``Gather`` and takes the
next message from whichever has one: one sleep on every queue's doorbell
(``futex_waitv``), no thread per queue, no polling. The cost on the reader's side is that
of one queue: one wait, one wake per message; each worker's queue costs its ring in
``/dev/shm``.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Mapping, Optional, Union

from . import _aio, _core
from .message_queue import MessageQueue, PeerDiedError, QueueShutDownError

__all__ = ["Gather"]

# How often a busy Gather looks at its writers' liveness (a wait does on its own), as a
# queue's own wait does.
_LIVENESS_INTERVAL = 0.5


class Gather:
    """Messages from several writers, each on its own queue, read as one stream.

    ``queues``: local readers (``MessageQueue.create_from_handle(handle, rank)`` or
    ``MessageQueue.open(name, rank)``), as a mapping name → queue, or a sequence (named
    by each queue's ``name``, else its position). At most 127.

    ``recv()`` returns ``(name, obj)``: the next message of any writer, each writer's in
    the order it sent them, writers served in turns when several have messages.

    - A writer that ends its queue normally (``shutdown()``, the writer dropped, its
      process exiting normally) is not an error: its last messages are returned, then it
      is left out (listed in ``ended``). Once every writer has ended, ``recv`` raises
      ``QueueShutDownError``; iterating over the ``Gather`` stops there.
    - A writer that dies (killed, ``os._exit``, a crash) is reported, after every message
      it sent: ``recv`` raises ``PeerDiedError`` naming it (its ``writer`` attribute is the
      name); it is then left out (listed in ``died``) and the next ``recv`` goes on with the
      others. Found within about half a second, also while the others keep sending.

    ``recv_async()`` is the same for ``asyncio`` (through the event loop's one waiter, see
    ``MessageQueue.dequeue_async``).

    ``shutdown()`` (safe from another thread) wakes a ``recv`` / ``recv_async`` blocked in
    this process with ``RuntimeError("cancelled")``, the error of a reader's
    ``MessageQueue.shutdown()``, and every later call raises it too: so a ``Gather`` goes
    to ``WorkerProcesses.monitor(steps, gather)`` beside the queues the parent writes, and
    a worker's failure wakes the parent's wait for results. ``close()`` shuts it down and
    lets go of its readers: each leaves its queue (its writer goes on without it, as
    after a reader's normal end). A ``with`` block closes it on leaving.
    """

    #: Set by ``shutdown()`` (and ``close()``): ``recv`` raises ``RuntimeError("cancelled")``.
    shutting_down = False

    def __init__(self, queues: Union[Mapping[str, MessageQueue], Iterable[MessageQueue]]):
        if isinstance(queues, Mapping):
            items = [(name, q) for name, q in queues.items()]
        else:
            items = [(q.name if q.name is not None else str(i), q) for i, q in enumerate(queues)]
        if not items:
            raise ValueError("a Gather needs at least one queue")
        if len(items) > 127:
            raise ValueError(f"a Gather reads at most 127 queues, got {len(items)}")
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"a Gather's queues need distinct names, got {names!r}")
        for name, q in items:
            if not isinstance(q, MessageQueue) or not q._is_local_reader:
                raise ValueError(
                    f"queue {name!r} is not a local reader: a Gather reads queues on this machine "
                    "(MessageQueue.create_from_handle or MessageQueue.open, with a local rank)"
                )
        self._queues: dict[str, MessageQueue] = dict(items)
        #: Names of the writers still sending, in turn order.
        self.live: list[str] = list(names)
        #: Names of the writers that ended their queue normally.
        self.ended: list[str] = []
        #: Names of the writers that died.
        self.died: list[str] = []
        self._turn = 0
        self._wake = _core.WakeWord()
        self._next_liveness = time.monotonic() + _LIVENESS_INTERVAL

    @classmethod
    def open(cls, names: Iterable[str], rank: int = 0) -> "Gather":
        """A ``Gather`` of the queues named ``names`` on this machine, each opened as
        ``MessageQueue.open(name, rank)`` (see there for the errors)."""
        return cls({name: MessageQueue.open(name, rank) for name in names})

    def __getitem__(self, name: str) -> MessageQueue:
        """The queue of writer ``name``."""
        return self._queues[name]

    def shutdown(self) -> None:
        """Wake the calls blocked in this process (``recv``, ``recv_async``, iterating)
        with ``RuntimeError("cancelled")``, as a reader's ``MessageQueue.shutdown()`` does;
        later calls raise it too. Safe to call from another thread (a
        ``WorkerMonitor``'s), and more than once. The writers are not told: each queue
        is only cancelled on this side."""
        self.shutting_down = True
        for q in list(self._queues.values()):
            q.shutdown()  # ends a blocked dequeue; its ready target reads as ready
        self._wake.wake()  # ends recv's wait_any even if no target changed

    def close(self) -> None:
        """``shutdown()``, then let go of the readers: each leaves its queue (its writer
        goes on without it, not a death). Idempotent."""
        self.shutdown()
        for q in list(self._queues.values()):
            q._leave()

    def __enter__(self) -> "Gather":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.shutting_down:
            raise RuntimeError("cancelled")

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Each queue's ``wait_until_ready(timeout)`` (its writer must call its own)."""
        for q in self._queues.values():
            q.wait_until_ready(timeout)

    def _target(self, name: str) -> Any:
        reader = self._queues[name]._reader_for("recv")
        return _core.ready_target(reader)

    def _take(self) -> Optional[tuple[str, Any, bool]]:
        """One round over the live writers, from the one after the last served:
        ``(name, obj, True)`` for a message taken, ``(name, None, False)`` for a writer whose next
        message is larger than a chunk and still on its way (take it with a blocking
        dequeue), ``None`` when none has anything. Writers found ended are left out."""
        k = 0
        while k < len(self.live):
            i = (self._turn + k) % len(self.live)
            name = self.live[i]
            if not self._target(name).ready():
                k += 1
                continue
            try:
                obj = self._queues[name].dequeue(0)
            except TimeoutError:
                return name, None, False
            except QueueShutDownError:
                self.live.pop(i)
                self.ended.append(name)
                continue
            self._turn = i + 1
            return name, obj, True
        return None

    def _look_at_writers(self) -> None:
        """Twice a second at most, while messages keep coming (a wait looks at them
        itself): raise for a writer proved dead with nothing left to read, so that a
        busy stream from the others does not hide a death."""
        now = time.monotonic()
        if now < self._next_liveness:
            return
        self._next_liveness = now + _LIVENESS_INTERVAL
        names = list(self.live)
        targets = [self._target(n) for n in names]
        self._check(names, targets, list(range(len(names))))

    def _dead(self, name: str, error: PeerDiedError) -> PeerDiedError:
        """Leave out writer ``name``, which died; the error that says so."""
        self.live.remove(name)
        self.died.append(name)
        e = PeerDiedError(f"writer {name!r} of this Gather died: {error}")
        e.writer = name  # type: ignore[attr-defined]
        e.__cause__ = error
        return e

    def _check(self, names: list[str], targets: list[Any], ready: list[int]) -> None:
        """After a wait: raise for the first writer proved dead with nothing left to read."""
        for i in ready:
            if not targets[i].ready():
                try:
                    targets[i].check_writer()
                except PeerDiedError as e:
                    raise self._dead(names[i], e) from e

    def _all_ended(self) -> QueueShutDownError:
        return QueueShutDownError(
            f"every writer of this Gather has ended its queue (ended: {self.ended!r}, died: {self.died!r})"
        )

    def recv(self, timeout: Optional[float] = None) -> tuple[str, Any]:
        """``(name, obj)``: the next message of any writer (see the class docs).
        ``TimeoutError`` after ``timeout`` seconds without one."""
        seconds = _core.timeout_seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            self._check_open()
            if not self.live:
                raise self._all_ended()
            self._look_at_writers()
            got = self._take()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if got is not None:
                name, obj, taken = got
                return (name, obj) if taken else (name, self._queues[name].dequeue(remaining))
            if not self.live:
                continue
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"Gather.recv: no message from {self.live!r} within {timeout} s")
            names = list(self.live)
            seen = self._wake.current()
            self._check_open()  # a shutdown() before that read woke nobody: seen here
            targets = [self._target(n) for n in names]
            self._check(names, targets, _core.wait_any(targets, self._wake, seen, remaining))

    async def recv_async(self, timeout: Optional[float] = None) -> tuple[str, Any]:
        """``await gather.recv_async()``: ``recv`` without blocking the event loop."""
        import asyncio

        loop = asyncio.get_running_loop()
        seconds = _core.timeout_seconds(timeout)
        deadline = None if seconds is None else loop.time() + seconds
        while True:
            self._check_open()
            if not self.live:
                raise self._all_ended()
            self._look_at_writers()
            got = self._take()
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            if got is not None:
                name, obj, taken = got
                if taken:
                    return name, obj
                # An overflow mark whose message is still on its way: dequeue_async waits
                # for it without blocking the loop, and a cancelled wait leaves it there.
                return name, await self._queues[name].dequeue_async(remaining)
            if not self.live:
                continue
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"Gather.recv_async: no message from {self.live!r} within {timeout} s")
            names = list(self.live)
            targets = [self._target(n) for n in names]
            self._check(names, targets, await _aio.wait_ready(targets, remaining))

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """``(name, obj)`` until every writer has ended its queue (a death raises)."""
        while True:
            try:
                yield self.recv()
            except QueueShutDownError:
                if self.live:
                    raise
                return

    def __repr__(self) -> str:
        return f"<Gather live={self.live!r} ended={self.ended!r} died={self.died!r}>"

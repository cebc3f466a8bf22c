"""asyncio for local readers: ``MessageQueue.dequeue_async`` and ``Gather.recv_async``.

Waiter threads per event loop, not a thread per queue: a thread that sleeps in one
``futex_waitv`` on the doorbells of the queues coroutines of that loop await
(``_core.wait_any``, GIL released) and wakes the loop with ``call_soon_threadsafe`` for
those with a message (or whose writer shut the queue down or died). One ``futex_waitv``
takes at most 128 words (the kernel's ``FUTEX_WAITV_MAX``), the thread's wake word
included: so one thread watches up to 127 waits, and each further 127 awaited at once
get a thread of their own (a *shard*), so that every wait is watched whatever their
number. Nothing polls: the sleep ends when a writer publishes, when a coroutine starts or
stops waiting (the shard's wake word), and at most once a second to see whether its loop
was closed.

A shard's thread starts with its first wait and exits when no coroutine waits in it any
more (or its loop is closed): it never outlives its loop, and nothing of it stays in the
process (no signal handler, no atexit work). A daemon thread, so that it can never hold
up the interpreter's exit either.

A remote reader's messages come over ZeroMQ, not through a doorbell: its
``dequeue_async`` waits in the loop's default executor (a thread for the duration of the
wait); so does a local reader's for the rare message larger than a chunk whose bytes are
still on their way over the queue's socket when the waiter wakes, and one that another
thread is using in a blocking call. That wait (``wait_message``) only waits until the
message can be taken, and leaves it with the reader; the loop's thread takes it. A
coroutine cancelled meanwhile sets its wait's ``_core.CancelFlag``: the thread's wait
ends within milliseconds, having taken nothing, so the next wait gets the message and
the executor (``asyncio.run``'s shutdown of it included) is not held up.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from typing import Any, Optional

from . import _core

# How long a waiter thread sleeps at most before it looks whether its loop was closed (a
# loop closed with coroutines still waiting, which asyncio.run never leaves: it cancels
# them).
_LOOP_CHECK = 1.0

# The most waits one thread sleeps on (the kernel's futex_waitv limit, less the thread's
# wake word: _core's wait_any takes no more); more at once get more threads.
_MAX_TARGETS = 127


class _Shard:
    """Up to ``_MAX_TARGETS`` waits of one loop, and the thread that sleeps on them."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[Any, asyncio.Future[None]]] = {}
        self.wake = _core.WakeWord()
        self.thread: Optional[threading.Thread] = None


class _LoopWaiter:
    """The waiter of one event loop (see the module docs): its shards."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        # Guards every shard's entries and thread, and the list of shards.
        self._lock = threading.Lock()
        self._shards: list[_Shard] = []
        self._shard_of: dict[int, _Shard] = {}
        self._next_token = 0

    def register(self, target: Any) -> tuple[int, asyncio.Future[None]]:
        """Wait for ``target`` (a ``_core.ReadyTarget``): the future is done (on the
        loop's thread) once it is ready or its writer is proved dead."""
        future: asyncio.Future[None] = self._loop.create_future()
        with self._lock:
            token = self._next_token
            self._next_token += 1
            shard = next((s for s in self._shards if len(s.entries) < _MAX_TARGETS), None)
            if shard is None:
                shard = _Shard()
                self._shards.append(shard)
            shard.entries[token] = (target, future)
            self._shard_of[token] = shard
            if shard.thread is None:
                shard.thread = threading.Thread(
                    target=self._run, args=(shard,), name="shmq-asyncio-waiter", daemon=True
                )
                shard.thread.start()
        shard.wake.wake()
        return token, future

    def unregister(self, token: int) -> None:
        with self._lock:
            shard = self._shard_of.pop(token, None)
            gone = shard is not None and shard.entries.pop(token, None) is not None
        if gone and shard is not None:
            shard.wake.wake()

    def _stop(self, shard: _Shard) -> None:
        """``shard``'s thread ends (under the lock): a shard left empty is forgotten."""
        shard.thread = None
        if not shard.entries and shard in self._shards:
            self._shards.remove(shard)

    def _run(self, shard: _Shard) -> None:
        while True:
            # Read before the entries: a registration after this read changes the word,
            # and the wait below returns at once (see shmq_protocol::multiwait).
            seen = shard.wake.current()
            with self._lock:
                if not shard.entries or self._loop.is_closed():
                    self._stop(shard)
                    return
                items = list(shard.entries.items())
            try:
                ready = _core.wait_any([target for _, (target, _) in items], shard.wake, seen, _LOOP_CHECK)
            except BaseException as e:  # OSError: this kernel has no futex_waitv
                self._fail(shard, e)
                return
            if not ready:
                continue
            with self._lock:
                futures = []
                for i in ready:
                    token = items[i][0]
                    entry = shard.entries.pop(token, None)
                    if entry is not None:
                        self._shard_of.pop(token, None)
                        futures.append(entry[1])
            try:
                self._loop.call_soon_threadsafe(_resolve, futures)
            except RuntimeError:  # the loop was closed
                with self._lock:
                    self._stop(shard)
                return

    def _fail(self, shard: _Shard, error: BaseException) -> None:
        """Hand ``error`` to every coroutine waiting in ``shard`` and stop its thread."""
        with self._lock:
            futures = [f for _, f in shard.entries.values()]
            for token in shard.entries:
                self._shard_of.pop(token, None)
            shard.entries.clear()
            self._stop(shard)
        try:
            self._loop.call_soon_threadsafe(_fail_all, futures, error)
        except RuntimeError:  # the loop was closed
            pass


def _resolve(futures: list[asyncio.Future[None]]) -> None:
    for f in futures:
        if not f.done():
            f.set_result(None)


def _fail_all(futures: list[asyncio.Future[None]], error: BaseException) -> None:
    for f in futures:
        if not f.done():
            f.set_exception(error)


_waiters: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaiter]" = weakref.WeakKeyDictionary()
_waiters_lock = threading.Lock()


def _waiter_of(loop: asyncio.AbstractEventLoop) -> _LoopWaiter:
    with _waiters_lock:
        waiter = _waiters.get(loop)
        if waiter is None:
            waiter = _waiters[loop] = _LoopWaiter(loop)
        return waiter


async def wait_ready(targets: list[Any], timeout: Optional[float]) -> list[int]:
    """Wait (in the running loop, without blocking it) until one of ``targets`` is ready
    or its writer is proved dead; the indices of those done (empty: ``timeout`` seconds
    passed). One registration with the loop's waiter per target."""
    loop = asyncio.get_running_loop()
    waiter = _waiter_of(loop)
    registered = [waiter.register(t) for t in targets]
    try:
        done, _ = await asyncio.wait([f for _, f in registered], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for f in done:
            f.result()  # the waiter's error, if it failed
        return [i for i, (_, f) in enumerate(registered) if f in done]
    finally:
        for token, f in registered:
            waiter.unregister(token)
            f.cancel()


async def wait_message(reader: Any, timeout: Optional[float]) -> None:
    """``reader.wait_message(timeout)`` (a ``_core.Reader``) in the running loop's default
    executor: until its next message can be taken at once, which it does not take (see
    the module docs). Cancelling the coroutine ends that wait within milliseconds (its
    ``CancelFlag``); a message it received meanwhile stays with the reader."""
    flag = _core.CancelFlag()
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, functools.partial(reader.wait_message, timeout, flag))
    except BaseException:
        # Cancelled (asyncio.wait_for's timeout included), or its thread's error: the
        # thread's wait ends, if it has not already.
        flag.set()
        raise

"""asyncio for local readers: ``MessageQueue.dequeue_async`` and ``Gather.recv_async``.

One *waiter* per event loop, not a thread per queue: a thread that sleeps in one
``futex_waitv`` on the doorbells of every queue a coroutine of that loop awaits
(``_core.wait_any``, GIL released) and wakes the loop with ``call_soon_threadsafe`` for
those with a message (or whose writer shut the queue down or died). Nothing polls: the
sleep ends when a writer publishes, when a coroutine starts or stops waiting (the
waiter's wake word), and at most once a second to see whether its loop was closed.

The waiter starts with the first wait and exits when no coroutine waits any more (or
its loop is closed): it never outlives its loop, and nothing of it stays in the process
(no signal handler, no atexit work). A daemon thread, so that it can never hold up the
interpreter's exit either.

A remote reader's messages come over ZeroMQ, not through a doorbell: its
``dequeue_async`` runs ``dequeue`` in the loop's default executor (a thread for the
duration of the call); so does a local reader's for the rare message larger than a chunk
whose bytes are still on their way over the queue's socket when the waiter wakes.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from typing import Any, Callable, Optional

from . import _core

# How long the waiter sleeps at most before it looks whether its loop was closed (a loop
# closed with coroutines still waiting, which asyncio.run never leaves: it cancels them).
_LOOP_CHECK = 1.0

# The most queues one waiter sleeps on (the kernel's futex_waitv limit, less its wake
# word); more waits at once are served in turns.
_MAX_TARGETS = 127


class _LoopWaiter:
    """The waiter of one event loop (see the module docs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[Any, asyncio.Future[None]]] = {}
        self._next_token = 0
        self._wake = _core.WakeWord()
        self._thread: Optional[threading.Thread] = None

    def register(self, target: Any) -> tuple[int, asyncio.Future[None]]:
        """Wait for ``target`` (a ``_core.ReadyTarget``): the future is done (on the
        loop's thread) once it is ready or its writer is proved dead."""
        future: asyncio.Future[None] = self._loop.create_future()
        with self._lock:
            token = self._next_token
            self._next_token += 1
            self._entries[token] = (target, future)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shmq-asyncio-waiter", daemon=True)
                self._thread.start()
        self._wake.wake()
        return token, future

    def unregister(self, token: int) -> None:
        with self._lock:
            gone = self._entries.pop(token, None) is not None
        if gone:
            self._wake.wake()

    def _run(self) -> None:
        while True:
            # Read before the entries: a registration after this read changes the word,
            # and the wait below returns at once (see shmq_protocol::multiwait).
            seen = self._wake.current()
            with self._lock:
                if not self._entries or self._loop.is_closed():
                    self._thread = None
                    return
                items = list(self._entries.items())[:_MAX_TARGETS]
            try:
                ready = _core.wait_any([target for _, (target, _) in items], self._wake, seen, _LOOP_CHECK)
            except BaseException as e:  # OSError: this kernel has no futex_waitv
                self._fail(e)
                return
            if not ready:
                continue
            with self._lock:
                futures = [self._entries.pop(items[i][0], (None, None))[1] for i in ready]
            try:
                self._loop.call_soon_threadsafe(_resolve, [f for f in futures if f is not None])
            except RuntimeError:  # the loop was closed
                with self._lock:
                    self._thread = None
                return

    def _fail(self, error: BaseException) -> None:
        """Hand ``error`` to every waiting coroutine and stop."""
        with self._lock:
            futures = [f for _, f in self._entries.values()]
            self._entries.clear()
            self._thread = None
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


async def in_executor(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` in the running loop's default executor."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(call, *args))

"""The public face: :class:`WorkerProcesses` and its :class:`WorkerMonitor`."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import multiprocessing
import multiprocessing.process
import signal
import threading
import time
import weakref
from types import TracebackType
from typing import Any, Callable, Iterable, Optional, Sequence

from .. import _core
from .errors import WorkerDiedError, WorkersNotReadyError
from .protocol import DEFAULT_GRACE, WorkerTicket
from .supervisor import Launcher, Supervisor, WorkerInfo, open_supervisors

__all__ = ["WorkerMonitor", "WorkerProcesses"]

logger = logging.getLogger("shmq.workers")

# How long a monitor waits for the supervisor to record an exit it already sees (the
# supervisor takes milliseconds; this only bounds a stalled one).
_RECORD_WITHIN = 2.0
# How often join(), waiting past a failure it already reported, looks for normal exits.
_JOIN_STEP = 0.05


# The longest slice of a wait that an async method's thread makes before it looks
# whether its coroutine was cancelled.
_ASYNC_SLICE = 1.0


async def _wait_off_loop(
    wait: Callable[[Optional[float]], tuple[str, Any]], timeout: Optional[float]
) -> tuple[str, Any]:
    """``wait(timeout)`` (a core wait returning ``(outcome, value)``, ``"timeout"`` when
    its time passed) in a daemon thread, without blocking the running loop: the thread
    waits in slices of at most ``_ASYNC_SLICE`` seconds until the wait ends otherwise,
    ``timeout`` passes, or the coroutine is cancelled (the thread then stops after its
    slice; it is not the loop's executor, so ``asyncio.run`` never waits for it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[tuple[str, Any]] = loop.create_future()
    cancelled = threading.Event()
    seconds = _core.timeout_seconds(timeout)
    deadline = None if seconds is None else time.monotonic() + seconds

    def deliver(set_it: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            set_it(value)

    def run() -> None:
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                step = _ASYNC_SLICE if left is None else min(_ASYNC_SLICE, left)
                result = wait(step)
                if result[0] != "timeout" or (left is not None and left <= _ASYNC_SLICE) or cancelled.is_set():
                    break
        except BaseException as e:
            try:
                loop.call_soon_threadsafe(deliver, future.set_exception, e)
            except RuntimeError:  # the loop was closed
                pass
            return
        try:
            loop.call_soon_threadsafe(deliver, future.set_result, result)
        except RuntimeError:  # the loop was closed
            pass

    threading.Thread(target=run, name="shmq-workers-async-wait", daemon=True).start()
    try:
        return await future
    finally:
        cancelled.set()


def _exits_within(group: Any, timeout: Optional[float]) -> tuple[str, bool]:
    """``group.wait_exits(timeout)`` as ``_wait_off_loop`` takes a wait."""
    return "timeout", group.wait_exits(0.0 if timeout is None else timeout)


def _failures_after(group: Any, seen: int, timeout: Optional[float]) -> tuple[str, int]:
    """``group.wait_failures(seen, timeout)`` as ``_wait_off_loop`` takes a wait."""
    return "timeout", group.wait_failures(seen, timeout)


class WorkerMonitor:
    """Raises in the parent when a worker fails (from :meth:`WorkerProcesses.monitor`).

    When a worker exits before :meth:`WorkerProcesses.close` with a non-zero exit code or a
    signal (or before it was ready, or a remote worker's connection drops), the monitor at
    once sets :attr:`cancel`, calls ``shutdown()`` on the queues it was given (a reader's
    blocked ``dequeue`` in this process raises ``RuntimeError("cancelled")``; a writer's
    ``shutdown()`` ends its queue: its blocked ``enqueue`` raises ``QueueShutDownError``),
    and leaving the ``with`` block raises the :class:`WorkerDiedError`, chained from
    whatever the block raised. A worker that exits with code 0 after it was ready has
    finished, not failed.

    **What the surviving workers see.** A sibling's failure ends the group's work: every
    queue given here that this process writes is shut down, so each surviving worker
    reading it gets the messages sent before and then ``QueueShutDownError`` from
    ``dequeue`` (not a hang, not a death). Before that, the parent has told every worker
    which one failed: in a worker, :func:`shmq.workers.sibling_failure` returns that
    worker's :class:`WorkerDiedError` (None after a plain shutdown), so a worker loop
    catches ``QueueShutDownError``, says why, and returns, ending cleanly (exit code 0)
    rather than with a traceback (see the README's worker loop). Workers still running
    when the parent leaves its ``with WorkerProcesses`` block are stopped by
    :meth:`WorkerProcesses.close` (SIGTERM, a ``SystemExit`` in the worker).

    Code that waits on anything else can pass :attr:`cancel` where a ``threading.Event``
    is taken (``dequeue(cancel=...)``) or call :meth:`check`. The error raised (by
    leaving the block or by :meth:`check`) counts as reported: :meth:`WorkerProcesses.join`
    does not raise it again."""

    def __init__(self, supervisor: Supervisor, queues: Iterable[Any]):
        self._supervisor = supervisor
        self._queues = list(queues)
        self.cancel = threading.Event()
        """Set when a worker fails."""
        self.error: Optional[WorkerDiedError] = None
        """The first failure seen, or None."""

    def _fire(self, error: WorkerDiedError, queues: Optional[list[Any]] = None) -> None:
        if self.error is not None:
            return
        self.error = error
        self.cancel.set()
        for q in self._queues if queues is None else queues:
            try:
                q.shutdown()
            except Exception:  # pragma: no cover - a queue that cannot shut down
                logger.exception("shutting down %r after %s failed", q, error.name)

    def check(self) -> None:
        """Raise the :class:`WorkerDiedError` if a worker has failed."""
        if self.error is not None:
            self._supervisor.report(self.error)
            raise self.error

    def __enter__(self) -> "WorkerMonitor":
        with self._supervisor.lock:
            self._supervisor.monitors.append(self)
        errors = self._supervisor.tell_siblings()
        if errors:
            self._fire(errors[0])
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if (
            isinstance(exc, Exception)
            and self.error is None
            and (isinstance(exc, (_core.PeerDiedError, _core.QueueShutDownError)) or self._supervisor.exit_unrecorded())
        ):
            # The block failed because a worker died, but the supervisor has not recorded
            # that yet: give it a moment, so that the error names the worker. shmq's own
            # errors can come first: PeerDiedError (a dying process gives up its role locks
            # before it turns into a zombie), and QueueShutDownError (a worker that ends
            # through the interpreter's exit, sys.exit say, has its queues' writers end
            # them before the process is gone; one that raises sends a death notice
            # before that).
            self.cancel.wait(_RECORD_WITHIN)
        with self._supervisor.lock:
            if self in self._supervisor.monitors:
                self._supervisor.monitors.remove(self)
            # Let the queues go: the error raised below keeps this monitor alive (through
            # its traceback), and a queue kept alive keeps its segment.
            queues, self._queues = self._queues, []
        # Recorded, but perhaps not yet handed to this monitor (the relay thread does
        # that just after the core records it; the workers are told first).
        errors = self._supervisor.tell_siblings()
        recorded = errors[0] if errors else None
        if self.error is None and recorded is not None:
            self._fire(recorded, queues)
        del queues  # this frame lives on in the traceback of what is raised below
        if self.error is not None and not isinstance(exc, WorkerDiedError):
            if exc is not None and not isinstance(exc, Exception):
                return  # KeyboardInterrupt, SystemExit: let them through
            self._supervisor.report(self.error)
            raise self.error from exc


class WorkerProcesses:
    """``n_workers`` local worker processes running ``target(rank, *args, **kwargs)``,
    plus ``n_remote`` workers on other machines that join over TCP; supervised from a
    background thread, and shut down by :meth:`close` (also on leaving a ``with`` block,
    at interpreter exit, and when the object is garbage-collected).

    Local workers have ranks ``0 .. n_workers-1`` and names ``Worker_0``...; remote ones
    the ranks after those. Arguments:

    - ``context``: a ``multiprocessing`` start method name or context (``"spawn"``).
    - ``death_signal``: the signal a worker gets when the parent dies, even by SIGKILL
      (see :func:`die_with_parent`), or None to let workers outlive it. The default,
      SIGKILL, is preceded by a clean-up in the worker: it kills its descendants and
      removes the segments it created first (see ``shmq.workers.child``).
    - ``new_process_group``: each worker leads its own process group (its descendants are
      signalled with it; a terminal's Ctrl-C reaches the parent only).
    - ``capture_stderr`` / ``forward_stderr``: keep the last ``stderr_tail_lines`` lines
      each worker writes to stderr (for error messages), and copy them to the parent's
      stderr (file descriptor 2: what replaces ``sys.stderr`` in Python does not see
      them) prefixed ``(Worker_1 pid=...)``.
    - ``remote_host`` / ``remote_port``: where remote workers connect (default: this
      host's address, ``SHMQ_HOST_IP``; any free port); see :attr:`ticket`. Before a
      connection proved the token it has 10 s for its whole handshake and frames of at
      most 4 KiB; of 32 such connections at once, the oldest of the host with the most
      gives way to a new one.
    - ``grace``: the default of :meth:`close` (also at exit and on garbage collection).
    """

    def __init__(
        self,
        target: Callable[..., Any],
        n_workers: int,
        args: Sequence[Any] = (),
        kwargs: Optional[dict[str, Any]] = None,
        *,
        context: Any = "spawn",
        name_prefix: str = "Worker",
        n_remote: int = 0,
        remote_host: Optional[str] = None,
        remote_port: int = 0,
        death_signal: Optional[int] = signal.SIGKILL,
        new_process_group: bool = True,
        capture_stderr: bool = True,
        forward_stderr: bool = True,
        stderr_tail_lines: int = 20,
        grace: float = DEFAULT_GRACE,
    ):
        if n_workers < 0 or n_remote < 0 or n_workers + n_remote == 0:
            raise ValueError(f"need at least one worker (n_workers={n_workers}, n_remote={n_remote})")
        if getattr(multiprocessing.process.current_process(), "_inheriting", False):
            # multiprocessing's own check would fail later, deep in Process.start(), with a
            # message whose advice (freeze_support) is beside the point; this is the line
            # the parent's WorkerDiedError shows from the worker's stderr.
            raise RuntimeError(
                "WorkerProcesses(...) ran while this process was starting as a spawned worker: "
                "the spawn start method re-imports the main module in every worker, so a script "
                'must start its workers under `if __name__ == "__main__":`'
            )
        ctx = multiprocessing.get_context(context) if isinstance(context, (str, type(None))) else context
        self.grace = grace
        self._supervisor = Supervisor(
            n_workers, n_remote, name_prefix, stderr_tail_lines, forward_stderr, new_process_group, grace
        )
        open_supervisors.add(self._supervisor)
        self._finalizer = weakref.finalize(self, self._supervisor.close, grace)
        self._finalizer.atexit = False  # _close_all_at_exit does it, in the right order
        try:
            if n_remote:
                self._supervisor.listen(remote_host or _core.default_connect_ip(), remote_port)
            for rank in range(n_workers):
                Launcher.call(
                    functools.partial(
                        self._supervisor.start_local,
                        ctx, rank, f"{name_prefix}_{rank}", target, tuple(args), dict(kwargs or {}),
                        death_signal, capture_stderr, new_process_group,
                    )
                )  # fmt: skip
        except BaseException:
            self.close(grace=min(grace, 1.0))
            raise

    # -- readiness -------------------------------------------------------------------

    def wait_until_ready(self, timeout: Optional[float] = None, *, close_on_failure: bool = True) -> list[Any]:
        """Wait until every worker has called :func:`report_ready`; returns what they
        passed it, a list indexed by rank (``infos[rank]``: worker ``rank``'s ``info``
        object; None for a worker that passed none), the order of :attr:`names` and
        :attr:`pids`.

        Raises :class:`WorkerDiedError` as soon as a worker exits first (any exit code),
        and :class:`WorkersNotReadyError` naming those not ready when ``timeout``
        seconds pass. Either way (and on Ctrl-C) the group is closed first, unless
        ``close_on_failure`` is false. A ``WorkerDiedError`` raised here counts as
        reported: :meth:`join` does not raise it again."""
        supervisor = self._supervisor
        try:
            if supervisor.closed:
                raise RuntimeError("the worker processes have been closed")
            # In the core, with the GIL released; a RuntimeError once the group closes.
            outcome, rank = supervisor.group.wait_ready(timeout)
            return _ready_outcome(supervisor, outcome, rank, timeout)
        except BaseException:
            if close_on_failure:
                self.close()
            raise

    async def wait_until_ready_async(
        self, timeout: Optional[float] = None, *, close_on_failure: bool = True
    ) -> list[Any]:
        """``await workers.wait_until_ready_async()``: :meth:`wait_until_ready` without
        blocking the event loop (the same result, errors and closing on failure). The
        core's wait runs in a daemon thread of its own, a second at a time, the loop's
        executor left free; cancelling the task ends that thread within a second and
        neither closes the group nor reports anything."""
        supervisor = self._supervisor
        try:
            if supervisor.closed:
                raise RuntimeError("the worker processes have been closed")
            outcome, rank = await _wait_off_loop(supervisor.group.wait_ready, timeout)
            return _ready_outcome(supervisor, outcome, rank, timeout)
        except asyncio.CancelledError:
            raise  # the caller gave up waiting: nothing failed
        except BaseException:
            if close_on_failure:
                self.close()
            raise

    # -- supervision -----------------------------------------------------------------

    @property
    def ticket(self) -> Optional[WorkerTicket]:
        """What remote workers pass to :func:`connect_to_parent` (None without
        ``n_remote``)."""
        return self._supervisor.ticket

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The local workers' ``multiprocessing`` process objects, by rank."""
        return [p for p in self._supervisor.processes if p is not None]

    @property
    def pids(self) -> list[Optional[int]]:
        """Every worker's pid by rank (None: a remote worker not connected yet)."""
        return [w.pid for w in self.info()]

    @property
    def names(self) -> list[str]:
        """Every worker's name by rank."""
        return [w.name for w in self.info()]

    def info(self) -> list[WorkerInfo]:
        """A snapshot of every worker, by rank."""
        return self._supervisor.snapshots()

    def sentinels(self) -> list[int]:
        """The local workers' process sentinels (for ``multiprocessing.connection.wait``);
        each becomes ready when its worker exits."""
        supervisor = self._supervisor
        return [p.sentinel for r, p in enumerate(supervisor.processes) if p is not None and r not in supervisor.reaped]

    def finished(self) -> dict[str, Optional[int]]:
        """The workers that have exited so far: name → exit code (negative: killed by that
        signal; None: a remote worker that left without saying), in the order they
        exited. Does not wait (:meth:`join` does) and raises nothing."""
        order = self._supervisor.group.exit_order()
        info = self.info()  # after the order: every rank in it has its exit recorded here
        return {info[r].name: info[r].exitcode for r in order}

    def join_first(self, timeout: Optional[float] = None) -> Optional[WorkerInfo]:
        """Wait until a worker exits (or one already has); that worker, or None when
        ``timeout`` passes first."""
        rank = self._supervisor.group.wait_any(timeout)
        return None if rank is None else self.info()[rank]

    def join(self, timeout: Optional[float] = None) -> dict[str, Optional[int]]:
        """Wait until every worker has exited (after they were told to stop: a ``None``
        batch, say); returns their exit codes, a dict keyed by worker name
        (``codes[workers.names[rank]]``), in rank order: ``list(codes.values())[rank]``
        is worker ``rank``'s. An exit code is negative for the signal that killed the
        worker, None for a remote worker that left without saying.

        Raises :class:`WorkerDiedError` as soon as a worker fails (non-zero exit code or a
        signal) unless that failure was raised to the caller already (by
        :meth:`wait_until_ready`, a monitor, or an earlier ``join``): after a failure
        reported that way, ``join`` waits for the other workers and returns every exit
        code, the failed worker's included. Raises ``TimeoutError`` naming those still
        running when ``timeout`` seconds pass. Does not stop anyone: :meth:`close`
        does."""
        supervisor = self._supervisor
        # The core's wait (which also checks the timeout) ends at the first failure.
        outcome, _ = supervisor.group.wait_all_exited(timeout)
        if outcome == "failed":
            unreported = supervisor.unreported()
            if unreported is not None:
                supervisor.report(unreported)
                raise unreported
            outcome = self._join_past_failures(timeout)
        if outcome == "timeout":
            running = [w.rank for w in self.info() if not w.exited]
            raise TimeoutError(
                f"{len(running)} worker(s) still running after {timeout} s: "
                + ", ".join(str(supervisor.group.describe(r)) for r in running)
            )
        return {w.name: w.exitcode for w in self.info()}

    async def join_async(self, timeout: Optional[float] = None) -> dict[str, Optional[int]]:
        """``await workers.join_async()``: :meth:`join` without blocking the event loop (the
        same result and errors). The waits run in a daemon thread of their own, a second
        at a time; cancelling the task ends that thread within a second and reports no
        failure (a later ``join`` still raises it)."""
        supervisor = self._supervisor
        loop = asyncio.get_running_loop()
        try:
            seconds = None if timeout is None else float(timeout)
        except OverflowError:
            seconds = None
        deadline = None if seconds is None or seconds == math.inf else loop.time() + seconds
        outcome, _ = await _wait_off_loop(supervisor.group.wait_all_exited, timeout)
        if outcome == "failed":
            # Past the failures already reported: as _join_past_failures, each wait in
            # the thread.
            while True:
                unreported = supervisor.unreported()
                if unreported is not None:
                    supervisor.report(unreported)
                    raise unreported
                if all(w.exited for w in self.info()):
                    outcome = "done"
                    break
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    outcome = "timeout"
                    break
                seen = len(supervisor.errors())
                step = _JOIN_STEP if left is None else min(_JOIN_STEP, left)
                if supervisor.group.closing:
                    await _wait_off_loop(functools.partial(_exits_within, supervisor.group), step)
                else:
                    # Wakes at a new failure; normal exits are seen at the next step.
                    await _wait_off_loop(functools.partial(_failures_after, supervisor.group, seen), step)
        if outcome == "timeout":
            running = [w.rank for w in self.info() if not w.exited]
            raise TimeoutError(
                f"{len(running)} worker(s) still running after {timeout} s: "
                + ", ".join(str(supervisor.group.describe(r)) for r in running)
            )
        return {w.name: w.exitcode for w in self.info()}

    def _join_past_failures(self, timeout: Optional[float]) -> str:
        """``join``'s wait once the failures so far have all been reported: until every
        worker has exited ("done"), or ``timeout`` passes ("timeout"); a new failure
        raises."""
        supervisor = self._supervisor
        try:
            deadline = None if timeout is None else time.monotonic() + float(timeout)
        except OverflowError:  # longer than any float: no deadline (the core checked it)
            deadline = None
        while True:
            seen = len(supervisor.errors())
            unreported = supervisor.unreported()
            if unreported is not None:
                supervisor.report(unreported)
                raise unreported
            if all(w.exited for w in self.info()):
                return "done"
            left = None if deadline is None or deadline == math.inf else deadline - time.monotonic()
            if left is not None and left <= 0:
                return "timeout"
            step = _JOIN_STEP if left is None else min(_JOIN_STEP, left)
            if supervisor.group.closing:
                supervisor.group.wait_exits(step)
            else:
                # Wakes at a new failure; normal exits are seen at the next step.
                supervisor.group.wait_failures(seen, step)

    def monitor(self, *queues: Any) -> WorkerMonitor:
        """A context manager that raises :class:`WorkerDiedError` when a worker fails
        while it is open, waking the parent's blocked calls on ``queues`` (anything with a
        ``shutdown()`` method, e.g. ``MessageQueue``) so it never hangs on a dead
        worker. A failure shuts ``queues`` down: the surviving workers reading a queue this
        process writes get ``QueueShutDownError`` after the messages sent before, and
        :func:`shmq.workers.sibling_failure` tells them which worker failed. See
        :class:`WorkerMonitor`."""
        return WorkerMonitor(self._supervisor, queues)

    @property
    def failures(self) -> list[WorkerDiedError]:
        """Every worker failure seen so far (before :meth:`close`)."""
        return self._supervisor.errors()

    # -- shutdown --------------------------------------------------------------------

    def close(self, grace: Optional[float] = None) -> None:
        """Shut every worker down: SIGTERM to each worker's process group (remote workers
        are asked to stop), one shared deadline ``grace`` seconds away, then SIGKILL of
        what remains, including each worker's descendants captured before the SIGTERM
        and again before the SIGKILL; reap; remove the shared-memory segments the dead
        workers and their descendants created. Workers adopt their orphaned descendants
        (double-forked daemons) and kill what they still have when they exit (also what
        a SIGTERM handler forked), so nothing a worker started outlives ``close()``.
        Idempotent; a second Ctrl-C during the grace period skips to SIGKILL."""
        self._supervisor.close(self.grace if grace is None else grace)
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._supervisor.closed

    def __enter__(self) -> "WorkerProcesses":
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        states = []
        for w in self.info():
            state = "exited" if w.exited else "ready" if w.ready else "starting"
            states.append(f"{w.name}:{state}")
        return f"<WorkerProcesses {' '.join(states)}{' closed' if self.closed else ''}>"


def _ready_outcome(supervisor: Any, outcome: str, rank: Optional[int], timeout: Optional[float]) -> list[Any]:
    """What ``wait_until_ready`` (and its async form) returns or raises once the core's
    wait ended with ``outcome``: the infos, the failed worker's ``WorkerDiedError``
    (reported), or ``WorkersNotReadyError`` after ``timeout``."""
    if outcome == "done":
        return supervisor.infos()
    if outcome == "failed" and rank is not None:
        error = supervisor.error_of(rank)
        supervisor.report(error)
        raise error
    assert timeout is not None  # without one, the wait ends only as above
    message, names = supervisor.group.not_ready(timeout)
    raise WorkersNotReadyError(message, names)

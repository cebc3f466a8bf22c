"""The parent side's machinery: the core's supervision, and what only Python can do.

The watching is the core's (``_core.WorkerGroup``, ``crates/workers/src/``): one native
thread waits on every worker's pidfd, ready pipe and stderr pipe, records readiness and
exits (never reaping), forwards stderr to the parent's fd 2 prefixed ``(Worker_1
pid=...)`` and keeps each worker's last lines, and shuts the group down. What stays here
is Python's: starting interpreters with ``multiprocessing`` (pickling the target),
unpickling ready reports, handing failures to the open monitors (whose queues are Python
objects), and a fork server's children (whose exit codes only ``multiprocessing`` reads).
Remote workers are the core's alone (``WorkerGroup.admit_remote``, ``shmq::workers::link``):
its threads accept them (with handshake slots), admit them, serve their links, tell them of
a sibling's failure and stop them. The group reaps its workers itself, last, and takes them
out of ``multiprocessing``'s list of children; why: docs/design.md ("Worker processes").
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util  # registers multiprocessing's atexit hook before ours (see _close_all_at_exit)
import os
import pickle
import queue as queue_module
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from .. import _core
from .child import WorkerSpec, bootstrap
from .errors import WorkerDiedError, failure_notice
from .protocol import DEFAULT_GRACE, WorkerTicket
from .spawn import SpawnProcessWithStderr, can_capture_from_start

__all__ = ["WorkerInfo"]

logger = logging.getLogger("shmq.workers")


class FailureListener(Protocol):
    """What the supervisor hands a failure to: an open ``WorkerMonitor`` (``processes``)."""

    def _fire(self, error: WorkerDiedError, queues: Optional[list[Any]] = None) -> None: ...


# A notice of a sibling's failure goes to a local worker in one write of at most
# PIPE_BUF bytes (atomic, and it never waits: the pipe is empty, and its end non-blocking).
_NOTICE_LIMIT = 4000


@dataclass(frozen=True)
class WorkerInfo:
    """A snapshot of one worker. ``exitcode``: None while it runs (and for a remote worker
    that left without saying); negative for the signal that killed it."""

    name: str
    rank: int
    pid: Optional[int]
    host: str
    ready: bool
    exited: bool
    exitcode: Optional[int]


def _error(death: tuple) -> WorkerDiedError:
    """A ``WorkerDiedError`` from the core's death tuple."""
    name, rank, pid, exitcode, tail, host, before_ready, how, captured, from_start = death
    return WorkerDiedError(
        name,
        rank,
        pid,
        exitcode,
        tail,
        host=host,
        before_ready=before_ready,
        how=how,
        stderr_captured=captured,
        stderr_from_start=from_start,
    )


class Supervisor:
    """Everything a :class:`WorkerProcesses` owns, without a reference back to it (so the
    façade can be garbage-collected and its finalizer close this)."""

    def __init__(
        self,
        n_local: int,
        n_remote: int,
        name_prefix: str,
        tail_lines: int,
        forward_stderr: bool,
        new_process_group: bool,
        grace: float = DEFAULT_GRACE,
    ):
        self.owner_pid = os.getpid()
        self.grace = grace  # at interpreter exit
        self.group = _core.WorkerGroup(
            n_local, n_remote, name_prefix, tail_lines, forward_stderr, new_process_group, grace
        )
        self.n_local = n_local
        self.lock = threading.Lock()
        self.processes: list[Optional[multiprocessing.process.BaseProcess]] = [None] * n_local
        self.reaped: set[int] = set()
        self.monitors: list[FailureListener] = []
        self._errors: list[WorkerDiedError] = []  # the core's failures, each made once
        # Ranks whose failure was raised to the caller (``report``): join() does not
        # raise it again.
        self.reported: set[int] = set()
        # The write ends of the local workers' notice pipes, by rank (see tell_siblings).
        self.notices: dict[int, multiprocessing.connection.Connection] = {}
        self.told = False
        self._infos: dict[int, Any] = {}  # unpickled ready reports, by rank
        self.close_lock = threading.Lock()
        self.closed = False
        self.exit_relays: list[threading.Thread] = []
        self.ticket: Optional[WorkerTicket] = None  # remote workers join with it
        # Failures reach the monitors from this thread (their queues are Python objects).
        self.relay = threading.Thread(target=self._relay_failures, name="shmq-workers-failures", daemon=True)
        self.relay.start()

    # -- what the core recorded, as Python objects -------------------------------------

    def errors(self) -> list[WorkerDiedError]:
        """Every failure so far, in order (the same objects at every call)."""
        with self.lock:
            deaths = self.group.failures()
            self._errors.extend(_error(d) for d in deaths[len(self._errors) :])
            return list(self._errors)

    def report(self, error: WorkerDiedError) -> None:
        """Note ``error`` as raised to the caller (so that ``join`` does not raise it
        again)."""
        with self.lock:
            self.reported.add(error.rank)

    def unreported(self) -> Optional[WorkerDiedError]:
        """The first failure not raised to the caller yet, or None."""
        errors = self.errors()
        with self.lock:
            return next((e for e in errors if e.rank not in self.reported), None)

    def tell_siblings(self) -> list[WorkerDiedError]:
        """Every failure so far (``errors``); the first time there is one, every other
        worker is told of it first (``child.sibling_failure``): before a monitor shuts
        the group's queues down, so that a worker whose queue ends can tell why."""
        errors = self.errors()
        if not errors:
            return errors
        payload = failure_notice(errors[0], _NOTICE_LIMIT)
        # A Connection's frame (its recv_bytes reads it): the length, then the bytes.
        frame = len(payload).to_bytes(4, "big") + payload
        with self.lock:
            if self.told:
                return errors
            self.told = True
            failed = errors[0].rank
            # Under the lock, which close() takes to close these pipes: never a write
            # into a descriptor number reused since. Non-blocking writes into empty pipes.
            for rank, conn in self.notices.items():
                if rank != failed:
                    try:
                        os.write(conn.fileno(), frame)
                    except OSError:  # that worker is gone (EPIPE)
                        pass
        # The remote workers, on their links (the core's, which it admitted).
        self.group.tell_siblings()
        return errors

    def error_of(self, rank: int) -> WorkerDiedError:
        """The failure of ``rank`` (or, one that finished early, its exit as an error)."""
        for e in self.errors():
            if e.rank == rank:
                return e
        return _error(self.group.death_or_exit(rank))

    def infos(self) -> list[Any]:
        """Every worker's ready report's ``info``, by rank (all have reported)."""
        with self.lock:
            for rank, payload in enumerate(self.group.ready_payloads()):
                if rank not in self._infos and payload is not None:
                    self._infos[rank] = pickle.loads(payload)  # from a worker we started or admitted
            return [self._infos.get(rank) for rank in range(len(self.group.status()))]

    def snapshots(self) -> list[WorkerInfo]:
        return [WorkerInfo(*s) for s in self.group.status()]

    def exit_unrecorded(self) -> bool:
        """Whether a local worker is dead or dying but the core has not recorded its exit
        yet."""
        return self.group.exit_unrecorded()

    def _relay_failures(self) -> None:
        seen = 0
        while True:
            n = self.group.wait_failures(seen)
            if n > seen:
                seen = n
                errors = self.tell_siblings()
                with self.lock:
                    monitors = list(self.monitors)
                # Outside the lock: a monitor calls the queues' shutdown().
                for m in monitors:
                    m._fire(errors[0])
            if self.group.closing:
                return

    # -- local workers ---------------------------------------------------------------

    def start_local(
        self,
        ctx: Any,
        rank: int,
        name: str,
        target: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        death_signal: Optional[int],
        capture_stderr: bool,
        new_process_group: bool,
    ) -> None:
        """Start local worker ``rank`` and hand it to the core. Call it from a thread that
        lives as long as the process (``Launcher.call``): PR_SET_PDEATHSIG follows the
        forking thread."""
        ready_r, ready_w = ctx.Pipe(duplex=False)
        notice_r, notice_w = ctx.Pipe(duplex=False)  # the parent tells of a sibling's failure
        err_r, err_w = ctx.Pipe(duplex=False) if capture_stderr else (None, None)
        # Spawned children get the pipe as their stderr before they run any Python (their
        # start-up, the re-import of the main module, can fail too); others from the
        # bootstrap, which redirects fd 2 once it runs.
        from_start = err_w is not None and can_capture_from_start(ctx)
        spec = WorkerSpec(
            target,
            rank,
            args,
            kwargs,
            os.getpid(),
            ready_w,
            None if from_start else err_w,
            death_signal,
            new_process_group,
            notice_r,
        )
        if from_start:
            assert err_w is not None  # from_start says so
            process: Any = SpawnProcessWithStderr(
                target=bootstrap, args=(spec,), name=name, daemon=False, stderr_fd=err_w.fileno()
            )
        else:
            process = ctx.Process(target=bootstrap, args=(spec,), name=name, daemon=False)
        try:
            process.start()
        except BaseException:
            notice_w.close()
            raise
        finally:
            # The child has its copies (or never started): the parent's write ends must go,
            # or the parent would never see EOF.
            ready_w.close()
            notice_r.close()
            if err_w is not None:
                err_w.close()
        os.set_blocking(notice_w.fileno(), False)
        self.notices[rank] = notice_w
        # This group reaps its workers itself, after killing their process groups; nobody
        # else may reap them first (multiprocessing does, for every child it knows, at
        # each Process.start() and at exit: a reaped pid can be reused, and killpg would
        # then hit a stranger).
        getattr(multiprocessing.process, "_children", set()).discard(process)
        self.processes[rank] = process
        # A fork server's child is not ours: only multiprocessing learns its exit code
        # (from the fork server), and a thread hands it to the core.
        own_child = getattr(ctx, "get_start_method", lambda: "spawn")() != "forkserver"
        try:
            self.group.adopt(
                rank,
                process.pid,
                own_child,
                ready_r.fileno(),
                None if err_r is None else err_r.fileno(),
                from_start,
            )
        finally:
            ready_r.close()  # the core holds its own copies
            if err_r is not None:
                err_r.close()
        if not own_child:
            relay = threading.Thread(
                target=self._relay_exit, args=(rank, process), name="shmq-workers-exit", daemon=True
            )
            relay.start()
            self.exit_relays.append(relay)

    def _relay_exit(self, rank: int, process: multiprocessing.process.BaseProcess) -> None:
        process.join()
        self.group.report_exit(rank, process.exitcode, [], None)

    # -- remote workers --------------------------------------------------------------

    def listen(self, host: str, port: int) -> WorkerTicket:
        """Admit the remote workers from now on, on ``host``:``port``: the core's threads
        accept, admit and serve them (``WorkerGroup.admit_remote``)."""
        ticket = WorkerTicket.parse(self.group.admit_remote(host, port))
        self.ticket = dataclasses.replace(ticket, host=host)  # as the caller named it
        return self.ticket

    # -- shutting down ---------------------------------------------------------------

    def close(self, grace: float) -> None:
        if os.getpid() != self.owner_pid:
            return  # a forked copy of the parent: these are not its workers
        with self.close_lock:
            if self.closed:
                return
            try:
                self._close(grace)
            finally:
                self.closed = True

    def _close(self, grace: float) -> None:
        interrupted: Optional[BaseException] = None
        try:
            self.group.close_begin()
            self.group.stop_remote(grace)  # over their links
            self.group.wait_exits(grace)
        except KeyboardInterrupt as e:  # a second Ctrl-C: skip the grace period
            interrupted = e
        # SIGKILL of what remains, whole trees; the core's thread stopped; segments gone;
        # remote workers no longer admitted, their links ended.
        self.group.close_finish()
        self._reap()
        with self.lock:
            for conn in self.notices.values():
                conn.close()
            self.notices = {}
        if interrupted is not None:
            raise interrupted

    def _reap(self) -> None:
        for relay in self.exit_relays:
            relay.join(timeout=1.0)
        for rank, p in enumerate(self.processes):
            if p is None:
                continue
            p.join(timeout=1.0)
            if p.exitcode is None:  # pragma: no cover - unkillable (D state)
                logger.error("%s did not exit after SIGKILL", self.group.describe(rank))
                continue
            self.reaped.add(rank)
            try:
                p.close()  # releases the sentinel
            except ValueError:
                pass


# Every supervisor still open, closed at interpreter exit. Registered after multiprocessing's
# own exit hook (imported above), so it runs first: multiprocessing's hook joins child
# processes without a timeout and would hang on a worker that ignores SIGTERM.
open_supervisors: "weakref.WeakSet[Supervisor]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for supervisor in list(open_supervisors):
        try:
            supervisor.close(supervisor.grace)
        except BaseException:  # noqa: B036 - nothing may stop the others' shutdown
            logger.exception("closing worker processes at exit")


class Launcher:
    """A daemon thread that forks workers when the caller is not the main thread: a
    worker's PR_SET_PDEATHSIG fires when the thread that forked it exits, so that thread
    must live as long as the process."""

    _lock = threading.Lock()
    _jobs: Optional[queue_module.SimpleQueue] = None

    @classmethod
    def call(cls, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is threading.main_thread():
            return fn()
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue_module.SimpleQueue()
                threading.Thread(target=cls._run, args=(cls._jobs,), name="shmq-workers-launcher", daemon=True).start()
            jobs = cls._jobs
        done: Future = Future()
        jobs.put((fn, done))
        return done.result()

    @staticmethod
    def _run(jobs: queue_module.SimpleQueue) -> None:
        while True:
            fn, done = jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: B036 - handed to the caller
                done.set_exception(e)

    @classmethod
    def _forget_after_fork(cls) -> None:
        cls._jobs = None  # the thread does not exist in a forked child
        cls._lock = threading.Lock()


os.register_at_fork(after_in_child=Launcher._forget_after_fork)

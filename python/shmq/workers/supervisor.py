"""The parent side's machinery: the core's supervision, and what only Python can do.

The watching is the core's (``_core.WorkerGroup``, ``crates/workers/src/``, the same code a
Rust serving stack uses): one native thread waits on every worker's pidfd, ready pipe
and stderr pipe, records readiness and exits (never reaping: see below), forwards stderr
to the parent's fd 2 prefixed ``(Worker_1 pid=...)`` and keeps each worker's last lines,
and shuts the group down (signals, the grace period, whole process trees, removing the
dead workers' segments). What stays here is Python's: starting interpreters with
``multiprocessing`` (pickling the target), unpickling ready reports, handing failures to
the open monitors (whose queues are Python objects), a fork server's children (whose exit
codes only ``multiprocessing`` reads), and remote workers' TCP handshake.

Why exits are read without reaping: a worker's pid is also its process group's id. While
the worker is our unreaped child (a zombie at worst), the kernel cannot hand that id to
another process, so ``killpg`` reaches only the worker's own descendants. The group
therefore reaps its workers itself, last, and takes them out of ``multiprocessing``'s
list of children so that nobody reaps them earlier.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.process
import multiprocessing.util  # registers multiprocessing's atexit hook before ours (see _close_all_at_exit)
import os
import pickle
import queue as queue_module
import socket
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from .. import _core
from .child import WorkerSpec, bootstrap
from .errors import WorkerDiedError
from .protocol import (
    DEFAULT_GRACE,
    HANDSHAKE_TIMEOUT,
    PROTOCOL_VERSION,
    SealedLink,
    WorkerTicket,
    hello_is_genuine,
    is_secret_text,
    new_nonce,
    recv_frame,
    send_frame,
    welcome_mac,
)
from .spawn import SpawnProcessWithStderr, can_capture_from_start

__all__ = ["WorkerInfo"]

logger = logging.getLogger("shmq.workers")


class FailureListener(Protocol):
    """What the supervisor hands a failure to: an open ``WorkerMonitor`` (``processes``)."""

    def _fire(self, error: WorkerDiedError, queues: Optional[list[Any]] = None) -> None: ...


_MAX_HANDSHAKES = 32  # remote handshakes in progress at once


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
        self._infos: dict[int, Any] = {}  # unpickled ready reports, by rank
        self.close_lock = threading.Lock()
        self.closed = False
        self.exit_relays: list[threading.Thread] = []
        # Remote workers.
        self.listener: Optional[socket.socket] = None
        self.handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        self.token = ""
        self.ticket: Optional[WorkerTicket] = None
        self.links: dict[int, SealedLink] = {}
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
                errors = self.errors()
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
        finally:
            # The child has its copies (or never started): the parent's write ends must go,
            # or the parent would never see EOF.
            ready_w.close()
            if err_w is not None:
                err_w.close()
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
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = self.listener = socket.create_server((host, port), family=family, backlog=64)
        self.token = _core.new_secret_text()
        self.ticket = WorkerTicket(host, listener.getsockname()[1], self.token)
        threading.Thread(target=self._accept, args=(listener,), name="shmq-workers-listen", daemon=True).start()
        return self.ticket

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return  # closed (close() shuts it down, which wakes this)
            # A handshake can stall (a stranger connects and says nothing): never in this
            # thread, and only so many at once (a flood of connections gets closed).
            if not self.handshakes.acquire(blocking=False):
                logger.warning("too many worker handshakes in progress: closed a connection from %s", peer)
                conn.close()
                continue
            threading.Thread(
                target=self._handshake, args=(conn, peer), name="shmq-workers-handshake", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket, peer: Any) -> None:
        try:
            rank = self._handshake_with(conn, peer)
        finally:
            self.handshakes.release()
        if rank is not None:
            self._serve_remote(rank, self.links[rank])

    def _handshake_with(self, conn: socket.socket, peer: Any) -> Optional[int]:
        """The admitted worker's rank (its link registered), or None."""
        conn.settimeout(HANDSHAKE_TIMEOUT)
        try:
            nonce = new_nonce()
            send_frame(conn, b"C", json.dumps({"nonce": nonce, "version": PROTOCOL_VERSION}).encode())
            kind, payload = recv_frame(conn)
            hello = json.loads(payload) if kind == b"H" else {}
            if not isinstance(hello, dict):
                hello = {}
            error = self._admit(hello, nonce)
            if error:
                logger.warning("refused a worker from %s claiming rank %s: %s", peer, hello.get("rank"), error)
                send_frame(conn, b"A", json.dumps({"ok": False, "error": error}).encode())
                conn.close()
                return None
            rank = int(hello["rank"])  # checked by _admit
            answer = {"ok": True, "mac": welcome_mac(self.token, hello["nonce"], nonce, rank)}
            send_frame(conn, b"A", json.dumps(answer).encode())
            link = SealedLink(conn, self.token, nonce, hello["nonce"], parent=True)
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            logger.warning("worker handshake with %s failed: %s", peer, e)
            conn.close()
            return None
        with self.lock:
            if not self.group.remote_connected(rank, str(hello.get("host") or peer[0])):
                conn.close()  # the group is closing
                return None
            self.links[rank] = link
        return rank

    def _admit(self, hello: dict, nonce: str) -> str:
        """Why this hello is refused, or "" to admit it (its rank is then reserved)."""
        rank, pid, claimed = hello.get("rank"), hello.get("pid"), hello.get("mac")
        theirs, host = hello.get("nonce"), hello.get("host")
        if not isinstance(rank, int) or not isinstance(pid, int) or not isinstance(claimed, str):
            return "malformed hello"
        if not isinstance(theirs, str) or not is_secret_text(theirs):
            return "malformed hello (no nonce: a worker of an older shmq?)"
        if not isinstance(host, str):
            return "malformed hello"
        if not hello_is_genuine(self.token, nonce, rank, pid, host, theirs, claimed):
            return "wrong token"
        if not (0 <= rank < 2**32 and 0 <= pid < 2**32):
            return "malformed hello"
        return self.group.claim_remote(rank, pid) or ""

    def _serve_remote(self, rank: int, link: SealedLink) -> None:
        """Read an admitted remote worker's frames until it leaves or its link drops (or
        fails: a frame that is not the worker's ends it)."""
        link.sock.settimeout(None)  # it may say nothing for as long as it runs
        while True:
            try:
                kind, payload = link.recv()
            except (OSError, EOFError, ValueError) as e:
                how = "lost its connection to the parent" + ("" if isinstance(e, EOFError) else f" ({e})")
                if isinstance(e, ValueError):
                    # The stream is not the worker's any more: end it, so the worker's
                    # own side sees it go (and stops, when it dies with its parent).
                    try:
                        link.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self.group.report_exit(rank, None, [], how)
                return
            if kind == b"R":
                self.group.remote_ready(rank, payload)
            elif kind == b"X":
                msg = json.loads(payload)
                lines = [str(line) for line in msg.get("stderr", [])]
                self.group.report_exit(rank, int(msg.get("exitcode", 1)), lines, None)
                return

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
        links: list[SealedLink] = []
        try:
            self.group.close_begin()
            with self.lock:
                links = list(self.links.values())
            for link in links:
                try:
                    link.send(b"S", json.dumps({"grace": grace}).encode())
                except OSError:
                    pass
            self.group.wait_exits(grace)
        except KeyboardInterrupt as e:  # a second Ctrl-C: skip the grace period
            interrupted = e
        # SIGKILL of what remains, whole trees; the core's thread stopped; segments gone.
        self.group.close_finish()
        self._reap()
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
            except OSError:
                pass
            self.listener.close()
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already shut down (a link that failed), or the peer is gone
            link.sock.close()
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

"""The parent side's machinery: the core's supervision, and what only Python can do.

The watching is the core's (``_core.WorkerGroup``, ``crates/workers/src/``): one native
thread waits on every worker's pidfd, ready pipe and stderr pipe, records readiness and
exits (never reaping), forwards stderr to the parent's fd 2 prefixed ``(Worker_1
pid=...)`` and keeps each worker's last lines, and shuts the group down. What stays here
is Python's: starting interpreters with ``multiprocessing`` (pickling the target),
unpickling ready reports, handing failures to the open monitors (whose queues are Python
objects), a fork server's children (whose exit codes only ``multiprocessing`` reads), and
remote workers' sockets (the handshake's messages and the frames' seals are the core's:
``shmq::workers::link``, through ``protocol``). The group reaps its workers itself, last, and takes them
out of ``multiprocessing``'s list of children; why: docs/design.md ("Worker processes").
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util  # registers multiprocessing's atexit hook before ours (see _close_all_at_exit)
import os
import pickle
import queue as queue_module
import socket
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from .. import _core
from .child import WorkerSpec, bootstrap
from .errors import WorkerDiedError, failure_notice
from .protocol import (
    DEFAULT_GRACE,
    HANDSHAKE_TIMEOUT,
    MAX_HELLO_FRAME,
    SealedLink,
    WorkerTicket,
    challenge_payload,
    check_hello,
    new_nonce,
    peer_text,
    recv_frame,
    refusal_payload,
    send_frame,
    send_frame_by,
    welcome_payload,
)
from .spawn import SpawnProcessWithStderr, can_capture_from_start

__all__ = ["WorkerInfo"]

logger = logging.getLogger("shmq.workers")


class FailureListener(Protocol):
    """What the supervisor hands a failure to: an open ``WorkerMonitor`` (``processes``)."""

    def _fire(self, error: WorkerDiedError, queues: Optional[list[Any]] = None) -> None: ...


# A notice of a sibling's failure goes to a local worker in one write of at most
# PIPE_BUF bytes (atomic, and it never waits: the pipe is empty, and its end non-blocking).
_NOTICE_LIMIT = 4000
_MAX_HANDSHAKES = 32  # remote connections not admitted yet, at once (see _start_handshake)
_ACCEPT_PAUSE = 0.05  # seconds between accepts while they fail (out of descriptors), doubling
_ACCEPT_PAUSE_MAX = 1.0
# accept(2): the listener itself is gone (closed, shut down): the accept thread ends.
_LISTENER_GONE = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK, errno.EFAULT})
# accept(2): the connection failed before it was taken (Linux passes on its network errors).
_PEER_FAILED = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.ENETDOWN,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.ENONET,
        errno.EHOSTUNREACH,
        errno.EOPNOTSUPP,
        errno.ENETUNREACH,
        errno.EPERM,
    }
)


class _Handshake:
    """A connection the parent accepted and has not admitted: the host it came from, its
    deadline, and whether it still waits for its hello (only such a one gives way to a
    newer connection)."""

    __slots__ = ("host", "deadline", "waiting")

    def __init__(self, host: str, deadline: float):
        self.host = host
        self.deadline = deadline
        self.waiting = True


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


_NOT_A_WORKERS_KIND = (b"C", b"H", b"A", b"S", b"F")
"""Sealed frames' kinds that are never a remote worker's to send (the handshake's, the
parent's own): one ends its link."""


def _leaving(payload: bytes) -> Optional[tuple[int, list[str]]]:
    """A leaving frame's (exit code, stderr lines), or None for one that is not
    (Rust's ``RemoteWorker::recv``: no exit code is 1, one outside an i32 is malformed)."""
    try:
        msg = json.loads(payload)
    except ValueError:  # not JSON, or not UTF-8
        return None
    if not isinstance(msg, dict):
        return None
    exitcode = msg.get("exitcode", 1)
    if isinstance(exitcode, bool) or not isinstance(exitcode, int) or not -(2**31) <= exitcode < 2**31:
        return None
    stderr = msg.get("stderr", [])
    lines = [line if isinstance(line, str) else json.dumps(line) for line in stderr] if isinstance(stderr, list) else []
    return exitcode, lines


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
        # Remote workers.
        self.listener: Optional[socket.socket] = None
        self.accepting = True  # False from close() on: the accept thread's errors are its end
        self.pending_lock = threading.Lock()
        self.pending: dict[socket.socket, _Handshake] = {}  # unauthenticated, oldest first
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
            links = [link for rank, link in self.links.items() if rank != failed]
        for link in links:
            try:
                link.send(b"F", payload)
            except OSError:
                pass  # its link is gone: it is told of its own end
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
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = self.listener = socket.create_server((host, port), family=family, backlog=64)
        self.token = _core.new_secret_text()
        self.ticket = WorkerTicket(host, listener.getsockname()[1], self.token)
        threading.Thread(target=self._accept, args=(listener,), name="shmq-workers-listen", daemon=True).start()
        return self.ticket

    def _accept(self, listener: socket.socket) -> None:
        """Accept connections until close(). No error of ``accept`` ends this but the
        listener's own end: out of descriptors (``EMFILE``, ``ENFILE``) or memory, the
        error is logged once and accepting goes on after a pause (the connection waits in
        the backlog meanwhile); a connection that failed before it was accepted
        (``ECONNABORTED`` and the network errors ``accept(2)`` passes on) is skipped."""
        failing: Optional[str] = None  # the error of the streak in progress, logged once
        pause = _ACCEPT_PAUSE
        while True:
            try:
                conn, peer = listener.accept()
            except OSError as e:
                if not self.accepting or e.errno in _LISTENER_GONE:
                    if self.accepting:
                        logger.error("the port for remote workers stopped accepting: %s", e)
                    return  # closed (close() shuts it down, which wakes this)
                if e.errno in _PEER_FAILED:
                    continue  # that connection's own failure: the next one
                if failing is None:
                    failing = os.strerror(e.errno) if e.errno else str(e)
                    logger.warning(
                        "the port for remote workers cannot accept now (%s): retrying every %.0f s at most",
                        failing,
                        _ACCEPT_PAUSE_MAX,
                    )
                time.sleep(pause)
                pause = min(2 * pause, _ACCEPT_PAUSE_MAX)
                continue
            if failing is not None:
                logger.warning("the port for remote workers accepts again (after: %s)", failing)
                failing, pause = None, _ACCEPT_PAUSE
            try:
                self._start_handshake(conn, peer)
            except Exception as e:  # e.g. RuntimeError: can't start new thread
                logger.warning("could not start the handshake with %s: %s", peer, e)
                self._forget_handshake(conn)
                conn.close()

    def _start_handshake(self, conn: socket.socket, peer: Any) -> None:
        """Take a slot for this connection's handshake and start it in a thread of its own
        (a handshake can stall: never in the accept thread). With every slot taken, the
        oldest connection still waiting for its hello, of the host with most of them,
        gives way (strangers cannot starve a worker: to push its handshake out, a host
        must open more connections than there are slots in the round trip of its hello)."""
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        pending = _Handshake(host, time.monotonic() + HANDSHAKE_TIMEOUT)
        with self.pending_lock:
            if len(self.pending) >= _MAX_HANDSHAKES:
                victim = self._handshake_to_drop()
                if victim is None:  # every slot past its hello: being admitted now
                    logger.warning("too many worker handshakes in progress: closed a connection from %s", peer)
                    conn.close()
                    return
                old_conn, old = victim
                del self.pending[old_conn]
                logger.warning(
                    "%d worker handshakes in progress: dropped the oldest waiting one of %s, for a connection from %s",
                    _MAX_HANDSHAKES,
                    old.host,
                    peer,
                )
                # Wakes its thread's read (an end of file), which then closes it. In the
                # lock: the thread closes the connection only after it left ``pending``.
                try:
                    old_conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.pending[conn] = pending
        threading.Thread(target=self._handshake, args=(conn, peer), name="shmq-workers-handshake", daemon=True).start()

    def _handshake_to_drop(self) -> Optional[tuple[socket.socket, "_Handshake"]]:
        """Of the handshakes waiting for their hello, the oldest of the host with the most
        (call it holding ``pending_lock``); None if none waits."""
        waiting = [(conn, h) for conn, h in self.pending.items() if h.waiting]  # oldest first
        if not waiting:
            return None
        per_host: dict[str, int] = {}
        for _, h in waiting:
            per_host[h.host] = per_host.get(h.host, 0) + 1
        most = max(per_host.values())
        return next((conn, h) for conn, h in waiting if per_host[h.host] == most)

    def _forget_handshake(self, conn: socket.socket) -> None:
        with self.pending_lock:
            self.pending.pop(conn, None)

    def _handshake(self, conn: socket.socket, peer: Any) -> None:
        try:
            rank = self._handshake_with(conn, peer)
        except Exception as e:  # never a traceback for what a stranger sent
            logger.error("worker handshake with %s failed: %s: %s", peer, type(e).__name__, e)
            rank = None
        finally:
            self._forget_handshake(conn)
        if rank is None:
            conn.close()
        else:
            self._serve_remote(rank, self.links[rank])

    def _handshake_with(self, conn: socket.socket, peer: Any) -> Optional[int]:
        """The admitted worker's rank (its link registered), or None (the caller closes
        the connection). One deadline for the whole handshake; before the worker proved
        the token, a frame may be ``MAX_HELLO_FRAME`` bytes at most."""
        with self.pending_lock:
            entry = self.pending.get(conn)
        if entry is None:
            return None  # dropped for a newer connection before it started
        deadline = entry.deadline
        try:
            nonce = new_nonce()
            send_frame_by(conn, deadline, b"C", challenge_payload(nonce))
            kind, payload = recv_frame(conn, MAX_HELLO_FRAME, deadline, peer=peer_text(peer), handshake=True)
            with self.pending_lock:
                if self.pending.get(conn) is not entry:
                    return None  # dropped for a newer connection (logged there)
                entry.waiting = False  # being admitted: never dropped from here on
            hello, error = self._admit(kind, payload, nonce)
            if hello is None:
                logger.warning("refused a worker from %s: %s", peer, error)
                send_frame_by(conn, deadline, b"A", refusal_payload(error))
                return None
            rank, _pid, host, theirs = hello
            if error:
                logger.warning("refused a worker from %s claiming rank %d: %s", peer, rank, error)
                send_frame_by(conn, deadline, b"A", refusal_payload(error))
                return None
            # The worker proved the token and has its rank now: its welcome is not cut
            # short by the deadline (a fresh timeout of its own).
            conn.settimeout(HANDSHAKE_TIMEOUT)
            send_frame(conn, b"A", welcome_payload(self.token, theirs, nonce, rank))
            link = SealedLink(conn, self.token, nonce, theirs, parent=True, peer=peer_text(peer))
        except TimeoutError:  # a read or write at the deadline, or one after it
            logger.warning("worker handshake with %s failed: not done within %.0f s", peer, HANDSHAKE_TIMEOUT)
            return None
        except (OSError, EOFError, ValueError) as e:
            # ConnectionError (an OSError): a hello over MAX_HELLO_FRAME; ValueError: a
            # length of 0.
            with self.pending_lock:
                dropped = self.pending.get(conn) is not entry
            if not dropped:  # (a dropped one's end was logged when it was dropped)
                logger.warning("worker handshake with %s failed: %s", peer, e)
            return None
        with self.lock:
            if not self.group.remote_connected(rank, host or str(peer[0])):
                return None  # the group is closing
            self.links[rank] = link
        return rank

    def _admit(self, kind: bytes, payload: bytes, nonce: str) -> tuple[Optional[tuple[int, int, str, str]], str]:
        """The hello (rank, pid, host, the worker's nonce) if it proves the token, or None;
        and why it is refused, or "" to admit it (its rank is then reserved). The hello's
        checks are the core's (``protocol.check_hello``)."""
        try:
            hello = check_hello(self.token, nonce, kind, payload)
        except ValueError as e:  # malformed, or a wrong token
            return None, str(e)
        return hello, self.group.claim_remote(hello[0], hello[1]) or ""

    def _serve_remote(self, rank: int, link: SealedLink) -> None:
        """Read an admitted remote worker's frames until it leaves or its link drops (or
        fails: a frame that is not the worker's ends it)."""
        link.sock.settimeout(None)  # it may say nothing for as long as it runs
        # A worker machine that vanished without a word (no FIN, no RST) ends the recv
        # below once TCP keepalive's probes go unanswered, instead of never (Rust's
        # link turns it on at both ends too).
        try:
            link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except OSError:
            pass
        payload: Any = None
        while True:
            payload = None  # the last frame's payload goes before the next is read: one at a time
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
            elif kind == b"X" or kind in _NOT_A_WORKERS_KIND:
                left = _leaving(payload) if kind == b"X" else None
                if left is None:
                    # Sealed, but a malformed leaving frame or a kind never the worker's
                    # to send (a handshake's, the parent's own), as Rust's
                    # RemoteWorker::recv: the link is over, and the worker reported gone
                    # (the thread must not die with the rank still taken).
                    try:
                        link.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    why = "a malformed leaving frame" if kind == b"X" else f"unexpected frame kind {kind.decode()!r}"
                    self.group.report_exit(rank, None, [], f"lost its connection to the parent ({why})")
                    return
                self.group.report_exit(rank, left[0], left[1], None)
                return
            # Any other kind: a newer worker's, skipped.

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
            self.accepting = False
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

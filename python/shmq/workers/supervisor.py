"""The parent side's machinery: one supervisor thread per group of workers.

The supervisor thread waits (one selector) on every worker's pidfd, ready pipe and stderr
pipe, on the TCP listener and the sockets of remote workers. It records readiness and
exits under one lock (a condition variable the public calls wait on), forwards stderr
and keeps each worker's last lines, and on a failure hands a ``WorkerDiedError`` to the
open monitors. Shutting down (signals, the grace period, killing process trees, reaping,
removing segments) lives here too; ``processes.py`` is the public face.

Why exits are read without reaping: a worker's pid is also its process group's id. While
the worker is our unreaped child (a zombie at worst), the kernel cannot hand that id to
another process, so ``killpg`` reaches only the worker's own descendants. The group
therefore reaps its workers itself, last, and takes them out of ``multiprocessing``'s
list of children so that nobody reaps them earlier.
"""

from __future__ import annotations

import atexit
import collections
import hmac
import json
import logging
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util  # registers multiprocessing's atexit hook before ours (see _close_all_at_exit)
import os
import shutil
import pickle
import queue as queue_module
import secrets
import selectors
import signal
import socket
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import psutil

from .. import _core
from .child import WorkerSpec, bootstrap
from .errors import WorkerDiedError
from .protocol import DEFAULT_GRACE, HANDSHAKE_TIMEOUT, WorkerTicket, mac, recv_frame, send_frame
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


class WorkerState:
    """The supervisor's record of one worker (guarded by ``Supervisor.lock``)."""

    def __init__(self, rank: int, name: str, tail_lines: int):
        self.rank = rank
        self.name = name
        self.process: Optional[multiprocessing.process.BaseProcess] = None
        self.pid: Optional[int] = None
        # Our own child (spawn, fork), or a fork server's (forkserver): only our own
        # children can be waited for without reaping, which makes signalling their
        # process group safe after they exit.
        self.is_child = True
        self.host = ""
        self.remote = False
        self.ready = False
        self.info: Any = None
        self.exited = False
        self.exitcode: Optional[int] = None
        self.lost = ""  # remote: how the connection ended
        self.reaped = False
        self.error: Optional[WorkerDiedError] = None
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.partial = b""
        self.stderr_captured = False
        # Captured from the child's first line of Python (spawn), not from its bootstrap on.
        self.stderr_from_start = False
        self.ready_conn: Optional[multiprocessing.connection.Connection] = None
        self.stderr_fd: Optional[int] = None
        self.exit_fd: Optional[int] = None  # pidfd, or the process sentinel without pidfds
        self.exit_fd_owned = False
        self.sock: Optional[socket.socket] = None

    @property
    def started(self) -> multiprocessing.process.BaseProcess:
        """The process of a started local worker."""
        assert self.process is not None, f"{self.name} is not a started local worker"
        return self.process

    @property
    def started_pid(self) -> int:
        """The pid of a started local worker (or of a connected remote one)."""
        assert self.pid is not None, f"{self.name} has no pid yet"
        return self.pid

    def snapshot(self) -> WorkerInfo:
        return WorkerInfo(self.name, self.rank, self.pid, self.host, self.ready, self.exited, self.exitcode)

    def describe(self) -> str:
        if self.remote:
            return f"{self.name} (rank {self.rank}, remote, {'pid ' + str(self.pid) if self.pid else 'not connected'})"
        return f"{self.name} (rank {self.rank}, pid {self.pid})"


def _exit_status(pid: int) -> tuple[bool, Optional[int]]:
    """Whether child ``pid`` has exited, and its exit code (negative: signal), *without*
    reaping it: while it is an unreaped zombie its pid, and so its process group id, cannot
    be reused, so signalling the group stays safe. ``(True, None)``: already reaped."""
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True, None
    if result is None:
        return False, None
    if result.si_code == os.CLD_EXITED:
        return True, result.si_status
    return True, -result.si_status


def _dying(pid: int) -> bool:
    """Whether process ``pid`` is gone or exiting: its main thread is a zombie, as shmq's own
    liveness checks see it. A multi-threaded process shows that before it can be waited
    for (until its other threads have exited too)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")


def _unreaped(pid: int) -> bool:
    """Whether ``pid`` is our child and not reaped yet (running, or a zombie)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _signal_group_or_process(pid: int, sig: int, own_group: bool) -> None:
    """``sig`` to the process group led by worker ``pid`` (its descendants too), or to the
    worker alone. Only call it while ``pid`` is our unreaped child."""
    try:
        if own_group:
            try:
                os.killpg(pid, sig)
                return
            except ProcessLookupError:
                pass  # it has not called setpgid yet: signal it alone
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _remove_segments_of(pids: set[int]) -> list[str]:
    """Remove the shmq segments created by processes in ``pids`` that are dead."""
    removed: list[str] = []
    try:
        rows = _core.list_segments()
    except OSError:
        return removed
    for name, _size, _kind, creator_pid, creator_state in rows:
        if creator_pid in pids and creator_state == "dead":
            try:
                os.unlink(os.path.join(_core.SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("could not remove %s: %s", name, e)
            # A ring's local socket lives in a directory beside it.
            shutil.rmtree(os.path.join(_core.SHM_DIR, name + ".sock"), ignore_errors=True)
    return removed


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
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.workers = [WorkerState(r, f"{name_prefix}_{r}", tail_lines) for r in range(n_local + n_remote)]
        for w in self.workers[n_local:]:
            w.remote = True
        self.forward_stderr = forward_stderr
        self.new_process_group = new_process_group
        self.exit_order: list[WorkerState] = []
        self.monitors: list[FailureListener] = []
        self.failures: list[WorkerDiedError] = []
        self.closing = False
        self.closed = False
        self.close_lock = threading.Lock()
        self.captured_pids: set[int] = set()
        # Remote workers.
        self.listener: Optional[socket.socket] = None
        self.handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        self.token = ""
        self.ticket: Optional[WorkerTicket] = None
        # The supervisor thread and its selector; other threads hand it work through
        # `pending` and the wake pipe (a selector is not thread-safe).
        self.selector = selectors.DefaultSelector()
        self.pending: queue_module.SimpleQueue[Callable[[], object]] = queue_module.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.stopping = False
        self.thread = threading.Thread(target=self._supervise, name="shmq-workers-supervisor", daemon=True)
        self.thread.start()

    # -- talking to the supervisor thread ------------------------------------------

    def call_in_supervisor(self, fn: Callable[[], object]) -> None:
        self.pending.put(fn)
        self.wake()

    def wake(self) -> None:
        with self.lock:  # never write to a closed (and perhaps reused) fd number
            if self.wake_w < 0:
                return
            try:
                os.write(self.wake_w, b"x")
            except OSError:
                pass  # already awake: the pipe is full

    def _supervise(self) -> None:
        while not self.stopping:
            try:
                events = self.selector.select()
            except OSError as e:  # pragma: no cover - a closed fd slipped through
                logger.error("worker supervisor: select failed: %s", e)
                time.sleep(0.05)
                continue
            for key, _ in events:
                kind, w = key.data
                try:
                    self._handle(kind, w, key)
                except Exception:  # pragma: no cover - a bug; keep supervising the others
                    logger.exception("worker supervisor: handling %s of %s", kind, getattr(w, "name", None))
                    self._unregister(key.fileobj)

    def _handle(self, kind: str, w: Optional[WorkerState], key: selectors.SelectorKey) -> None:
        if kind == "wake":
            try:
                while os.read(self.wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            while True:
                try:
                    fn = self.pending.get_nowait()
                except queue_module.Empty:
                    break
                fn()
        elif kind == "listen":
            self._accept()
        else:
            assert w is not None  # every other fd belongs to a worker
            if kind == "stderr":
                self._read_stderr(w)
            elif kind == "ready":
                self._read_ready(w)
            elif kind == "exit":
                self._on_exit(w)
            elif kind == "remote":
                self._read_remote(w)

    def _unregister(self, fileobj: Any) -> None:
        try:
            self.selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    # -- local workers ---------------------------------------------------------------

    def start_local(
        self,
        ctx: Any,
        w: WorkerState,
        target: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        death_signal: Optional[int],
        capture_stderr: bool,
    ) -> None:
        """Start local worker ``w``. Call it from a thread that lives as long as the
        process (``Launcher.call``): PR_SET_PDEATHSIG follows the forking thread."""
        ready_r, ready_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False) if capture_stderr else (None, None)
        # Spawned children get the pipe as their stderr before they run any Python (their
        # start-up, the re-import of the main module, can fail too); others from the
        # bootstrap, which redirects fd 2 once it runs.
        from_start = err_w is not None and can_capture_from_start(ctx)
        spec = WorkerSpec(
            target,
            w.rank,
            args,
            kwargs,
            os.getpid(),
            ready_w,
            None if from_start else err_w,
            death_signal,
            self.new_process_group,
        )
        if from_start:
            assert err_w is not None  # from_start says so
            process: Any = SpawnProcessWithStderr(
                target=bootstrap, args=(spec,), name=w.name, daemon=False, stderr_fd=err_w.fileno()
            )
        else:
            process = ctx.Process(target=bootstrap, args=(spec,), name=w.name, daemon=False)
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
        w.process, w.pid = process, process.pid
        w.is_child = getattr(ctx, "get_start_method", lambda: "spawn")() != "forkserver"
        w.ready_conn = ready_r
        if err_r is not None:
            w.stderr_captured = True
            w.stderr_from_start = from_start
            w.stderr_fd = os.dup(err_r.fileno())
            err_r.close()
            os.set_blocking(w.stderr_fd, False)
        # A pidfd is readable as soon as the worker exits, whoever holds copies of the
        # sentinel pipe (a worker's forked children do). A fork server's child: its
        # sentinel, readable once the fork server has sent the exit code.
        w.exit_fd, w.exit_fd_owned = process.sentinel, False
        if w.is_child and hasattr(os, "pidfd_open"):
            try:
                w.exit_fd, w.exit_fd_owned = os.pidfd_open(process.pid), True
            except OSError:
                pass
        self.call_in_supervisor(lambda: self._watch_local(w))

    def _watch_local(self, w: WorkerState) -> None:
        """Supervisor thread: start watching a just-started local worker."""
        if w.stderr_fd is not None:
            self.selector.register(w.stderr_fd, selectors.EVENT_READ, ("stderr", w))
        if w.ready_conn is not None:
            self.selector.register(w.ready_conn, selectors.EVENT_READ, ("ready", w))
        if w.exit_fd is not None:
            self.selector.register(w.exit_fd, selectors.EVENT_READ, ("exit", w))

    def _read_stderr(self, w: WorkerState, final: bool = False) -> None:
        """Forward what ``w`` wrote to stderr; keep its last lines. ``final``: read all that
        is in the pipe now (the worker has exited) and flush a last partial line."""
        while w.stderr_fd is not None:
            try:
                data = os.read(w.stderr_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:  # EOF: every copy of the write end is closed
                self._unregister(w.stderr_fd)
                os.close(w.stderr_fd)
                w.stderr_fd = None
                final = True
                break
            *lines, w.partial = (w.partial + data).split(b"\n")
            self._keep_lines(w, lines)
            if not final:
                break
        if final and w.partial:
            self._keep_lines(w, [w.partial])
            w.partial = b""

    def _keep_lines(self, w: WorkerState, lines: list[bytes]) -> None:
        text = [line.decode("utf-8", "replace").rstrip("\r") for line in lines]
        with self.lock:
            w.tail.extend(text)
        if self.forward_stderr and text:
            prefix = f"({w.name} pid={w.pid}) "
            try:
                sys.stderr.write("".join(prefix + line + "\n" for line in text))
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):
                pass  # the parent's stderr is closed: keep the tail only

    def _read_ready(self, w: WorkerState) -> None:
        conn = w.ready_conn
        assert conn is not None
        try:
            tag, info = conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError, ValueError):
            tag, info = None, None  # closed without a word: its exit tells the rest
        self._unregister(conn)
        conn.close()
        w.ready_conn = None
        if tag == "ready":
            with self.changed:
                w.ready, w.info = True, info
                self.changed.notify_all()

    @staticmethod
    def _exit_status(w: WorkerState) -> tuple[bool, Optional[int]]:
        if w.is_child:
            exited, code = _exit_status(w.started_pid)
            if exited and code is None:
                code = w.started.exitcode  # someone reaped it through multiprocessing
            return exited, code
        code = w.started.exitcode  # a fork server's child: it reaps, and reports the code
        return code is not None, code

    @staticmethod
    def may_signal(w: WorkerState) -> bool:
        """Whether signalling ``w``'s pid (or group) can only reach ``w``'s processes."""
        if w.pid is None or w.remote or w.reaped:
            return False
        if w.is_child:
            return _unreaped(w.pid)
        return w.started.exitcode is None

    def poll_exit(self, w: WorkerState) -> bool:
        """Record ``w``'s exit if it has exited (never reaps). True if it has. Only for
        close(): otherwise the supervisor records exits, with the failure and its stderr."""
        with self.lock:
            if w.exited:
                return True
            if w.remote or w.pid is None:
                return False
            exited, code = self._exit_status(w)
            if exited:
                self._set_exited(w, code)
            return exited

    def exit_unrecorded(self) -> bool:
        """Whether a local worker is dead or dying but the supervisor has not recorded its
        exit yet."""
        with self.lock:
            pids = [w.pid for w in self.workers if not w.remote and w.pid is not None and not w.exited]
        return any(_dying(pid) for pid in pids)

    def _set_exited(self, w: WorkerState, code: Optional[int]) -> None:
        with self.changed:
            if not w.exited:
                w.exited, w.exitcode = True, code
                self.exit_order.append(w)
                self.changed.notify_all()

    def _on_exit(self, w: WorkerState) -> None:
        """Supervisor thread: worker ``w``'s pidfd (or sentinel) became readable."""
        self._unregister(w.exit_fd)
        if w.exit_fd_owned and w.exit_fd is not None:
            os.close(w.exit_fd)
        w.exit_fd = None
        self._read_stderr(w, final=True)  # all it wrote is in the pipe by now
        if w.ready_conn is not None and w.ready_conn.poll(0):
            # Its ready report and its exit came in one select, the exit handled first:
            # the report was sent before the exit, so it is taken first.
            self._read_ready(w)
        exited, code = self._exit_status(w)
        if not exited:  # pragma: no cover - a pidfd or sentinel is readable only at exit
            logger.warning("%s: exit signalled but no exit status", w.describe())
        with self.lock:
            closing = self.closing
        if not closing and self.new_process_group and w.is_child and _unreaped(w.started_pid):
            # Its descendants are orphans now: they go down with it. Safe while it is our
            # unreaped zombie (its pid, the group's id, cannot be reused meanwhile).
            _signal_group_or_process(w.started_pid, signal.SIGKILL, own_group=True)
        # The exit and the failure become visible together (one locked step in
        # _record_failure), so that a waiter sees the error with its full stderr tail.
        self._record_failure(w, exit_code=code)

    def _record_failure(self, w: WorkerState, exit_code: Optional[int] = None) -> None:
        with self.changed:
            self._set_exited(w, exit_code if w.exitcode is None else w.exitcode)
            if self.closing or w.error is not None:
                return
            if w.ready and w.exitcode == 0 and not w.lost:
                return  # a worker that finished its work
            w.error = WorkerDiedError(
                w.name,
                w.rank,
                w.pid,
                w.exitcode,
                list(w.tail),
                host=w.host,
                before_ready=not w.ready,
                how=w.lost or None,
                stderr_captured=w.remote or w.stderr_captured,
                stderr_from_start=w.remote or w.stderr_from_start,
            )
            self.failures.append(w.error)
            monitors = list(self.monitors)
            self.changed.notify_all()
        # Outside the lock: a monitor calls the queues' shutdown().
        for m in monitors:
            m._fire(w.error)

    # -- remote workers --------------------------------------------------------------

    def listen(self, host: str, port: int) -> WorkerTicket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = self.listener = socket.create_server((host, port), family=family, backlog=64)
        listener.setblocking(False)
        self.token = secrets.token_hex(32)
        self.ticket = WorkerTicket(host, listener.getsockname()[1], self.token)
        self.call_in_supervisor(lambda: self.selector.register(listener, selectors.EVENT_READ, ("listen", None)))
        return self.ticket

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, peer = self.listener.accept()
        except (BlockingIOError, OSError):
            return
        # A handshake can stall (a stranger connects and says nothing): never in this
        # thread, and only so many at once (a flood of connections gets closed).
        if not self.handshakes.acquire(blocking=False):
            logger.warning("too many worker handshakes in progress: closed a connection from %s", peer)
            conn.close()
            return
        threading.Thread(target=self._handshake, args=(conn, peer), name="shmq-workers-handshake", daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: Any) -> None:
        try:
            self._handshake_with(conn, peer)
        finally:
            self.handshakes.release()

    def _handshake_with(self, conn: socket.socket, peer: Any) -> None:
        conn.setblocking(True)
        conn.settimeout(HANDSHAKE_TIMEOUT)
        try:
            nonce = secrets.token_hex(32)
            send_frame(conn, b"C", json.dumps({"nonce": nonce}).encode())
            kind, payload = recv_frame(conn)
            hello = json.loads(payload) if kind == b"H" else {}
            error = self._admit(hello, nonce)
            if error:
                logger.warning("refused a worker from %s claiming rank %s: %s", peer, hello.get("rank"), error)
                send_frame(conn, b"A", json.dumps({"ok": False, "error": error}).encode())
                conn.close()
                return
            send_frame(conn, b"A", json.dumps({"ok": True}).encode())
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            logger.warning("worker handshake with %s failed: %s", peer, e)
            conn.close()
            return
        conn.settimeout(HANDSHAKE_TIMEOUT)  # frames from an admitted worker arrive whole
        rank, pid = int(hello["rank"]), int(hello["pid"])  # checked by _admit
        w = self.workers[rank]
        host = str(hello.get("host") or peer[0])

        def register() -> None:
            with self.changed:
                if self.closing:
                    conn.close()
                    return
                w.sock, w.pid, w.host = conn, pid, host
                self.changed.notify_all()
            self.selector.register(conn, selectors.EVENT_READ, ("remote", w))

        self.call_in_supervisor(register)

    def _admit(self, hello: dict, nonce: str) -> str:
        """Why this hello is refused, or "" to admit it."""
        rank, pid, claimed = hello.get("rank"), hello.get("pid"), hello.get("mac")
        if not isinstance(rank, int) or not isinstance(pid, int) or not isinstance(claimed, str):
            return "malformed hello"
        if not hmac.compare_digest(claimed, mac(self.token, nonce, rank, pid)):
            return "wrong token"
        with self.lock:
            if self.closing:
                return "the worker group is shutting down"
            if not 0 <= rank < len(self.workers) or not self.workers[rank].remote:
                remote = [w.rank for w in self.workers if w.remote]
                return f"rank {rank} is not a remote rank of this group (remote ranks: {remote})"
            w = self.workers[rank]
            if w.pid is not None or w.exited:
                return f"rank {rank} has already joined"
            # Reserve the rank now, so that two quick joins cannot both pass this check.
            w.pid = pid
        return ""

    def _read_remote(self, w: WorkerState) -> None:
        assert w.sock is not None
        try:
            kind, payload = recv_frame(w.sock)
        except (OSError, EOFError, ValueError) as e:
            self._remote_gone(w, "" if isinstance(e, EOFError) else str(e))
            return
        if kind == b"R":
            info = pickle.loads(payload)  # an authenticated worker
            with self.changed:
                w.ready, w.info = True, info
                self.changed.notify_all()
        elif kind == b"X":
            msg = json.loads(payload)
            with self.lock:
                w.exitcode = int(msg.get("exitcode", 1))
                w.tail.extend(str(line) for line in msg.get("stderr", []))
            self._remote_gone(w, "")

    def _remote_gone(self, w: WorkerState, error: str) -> None:
        if w.sock is not None:
            self._unregister(w.sock)
            w.sock.close()
        with self.changed:
            if w.exited:
                return
            if w.exitcode is None:
                w.lost = "lost its connection to the parent" + (f" ({error})" if error else "")
        self._record_failure(w)

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
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        local = [w for w in self.workers if not w.remote and w.pid is not None]
        for w in local:
            self.poll_exit(w)
        running = [w for w in local if not w.exited]
        # Capture whole trees before anyone is signalled: once a worker exits, its
        # children are reparented and can no longer be found from it.
        trees: list[psutil.Process] = []
        for w in running:
            trees.extend(_descendants(w.started_pid))
        self.captured_pids.update(p.pid for p in trees)
        interrupted: Optional[BaseException] = None
        try:
            for w in running:
                if self.may_signal(w):
                    _signal_group_or_process(w.started_pid, signal.SIGTERM, self.new_process_group)
            for w in self.workers:
                if w.remote and w.sock is not None:
                    try:
                        send_frame(w.sock, b"S", json.dumps({"grace": grace}).encode())
                    except OSError:
                        pass
            deadline = time.monotonic() + grace
            self._wait_exits(deadline)
        except KeyboardInterrupt as e:  # a second Ctrl-C: skip the grace period
            interrupted = e
        # Grace is over: SIGKILL what remains. Each worker's group (safe: unreaped), and
        # the descendants captured above (psutil checks each one's identity), with those
        # that workers still running have made since (in their SIGTERM handler, say).
        for w in local:
            if not self.poll_exit(w):
                late = [p for p in _descendants(w.started_pid) if p not in trees]
                trees.extend(late)
                self.captured_pids.update(p.pid for p in late)
        for w in local:
            if self.may_signal(w):
                _signal_group_or_process(w.started_pid, signal.SIGKILL, self.new_process_group)
        for p in trees:
            try:
                p.kill()
            except psutil.Error:
                pass
        self._wait_exits(time.monotonic() + 5.0)
        self._reap(local)
        self._stop_supervisor()
        # SIGKILL is delivered asynchronously: wait until the descendants are gone (or
        # zombies), so that nothing of the group runs after close() returns.
        _, alive = psutil.wait_procs(trees, timeout=5.0)
        for p in alive:  # pragma: no cover - unkillable (D state)
            logger.error("process %d (a worker's descendant) did not exit after SIGKILL", p.pid)
        removed = _remove_segments_of({w.started_pid for w in local} | self.captured_pids)
        if removed:
            logger.info("removed %d shared-memory segment(s) left by workers: %s", len(removed), removed)
        if interrupted is not None:
            raise interrupted

    def _wait_exits(self, deadline: float) -> None:
        with self.changed:
            while True:
                running = [w for w in self.workers if not w.remote and w.pid is not None and not self.poll_exit(w)]
                running += [w for w in self.workers if w.remote and w.sock is not None and not w.exited]
                left = deadline - time.monotonic()
                if not running or left <= 0:
                    return
                # Woken by the supervisor on each exit; the slice covers a slow supervisor.
                self.changed.wait(min(left, 0.05))

    def _reap(self, local: list[WorkerState]) -> None:
        for w in local:
            p = w.started
            p.join(timeout=1.0)
            if p.exitcode is not None:
                w.reaped = True
                with self.lock:
                    if w.exitcode is None:
                        w.exitcode = p.exitcode
                    if not w.exited:
                        w.exited = True
                        self.exit_order.append(w)
            else:  # pragma: no cover - unkillable (D state)
                logger.error("%s did not exit after SIGKILL", w.describe())

    def _stop_supervisor(self) -> None:
        self.stopping = True
        self.wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5.0)
        # Whatever the workers still had in the pipes, then every fd.
        for w in self.workers:
            if w.stderr_fd is not None:
                self._read_stderr(w, final=True)
                if w.stderr_fd is not None:
                    os.close(w.stderr_fd)
                    w.stderr_fd = None
            if w.ready_conn is not None:
                w.ready_conn.close()
                w.ready_conn = None
            if w.exit_fd is not None and w.exit_fd_owned:
                os.close(w.exit_fd)
            w.exit_fd = None
            if w.sock is not None:
                try:
                    w.sock.close()
                except OSError:
                    pass
            if w.process is not None and w.reaped:
                try:
                    w.process.close()  # releases the sentinel
                except ValueError:
                    pass
        if self.listener is not None:
            self.listener.close()
        self.selector.close()
        with self.changed:
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.wake_r = self.wake_w = -1
            self.changed.notify_all()


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

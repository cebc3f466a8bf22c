"""Worker processes: start them, wait until they are ready, notice when one dies, and
shut them all down, process trees and shared-memory segments included.

The glue around the queues that every serving stack writes by hand (vLLM's
``CoreEngineProcManager``, ``wait_for_engine_startup``, ``shutdown``)::

    def worker(rank, queue_handle, store_handle):
        queue = MessageQueue.create_from_handle(queue_handle, rank)
        store = ObjectStorage.create_from_handle(store_handle)
        report_ready()                      # set-up done
        queue.wait_until_ready()
        while (batch := queue.dequeue()) is not None:
            ...

    with WorkerProcesses(worker, 4, args=(queue.export_handle(), store.handle())) as workers:
        workers.wait_until_ready(timeout=60)   # WorkerDiedError at once if one dies first
        queue.wait_until_ready()
        with workers.monitor(queue):           # a crash wakes the blocked enqueue
            for batch in batches:
                queue.enqueue(batch)
    # leaving the block: SIGTERM, a shared grace period, SIGKILL of whole process trees,
    # and the dead workers' /dev/shm segments removed

What it guarantees:

- **Start.** ``target(rank, *args, **kwargs)`` runs in processes named ``Worker_0``...
  (``spawn`` context by default). If starting one fails, those already started are shut
  down before the error propagates.
- **Ready, with a deadline.** Each worker calls :func:`report_ready` after its own set-up;
  :meth:`WorkerProcesses.wait_until_ready` returns when all have, and raises
  :class:`WorkerDiedError` at once when one dies first (rank, pid, exit code or signal,
  the last lines it wrote to stderr), or :class:`WorkersNotReadyError` naming the
  stragglers when the deadline passes. Workers on other machines join over TCP with the
  same :func:`report_ready` (:func:`connect_to_parent`, authenticated by a random token
  carried in the :class:`WorkerTicket`).
- **Supervision.** A supervisor thread watches every worker (pidfds) and forwards each
  worker's stderr to the parent's stderr, prefixed ``(Worker_1 pid=...)``, keeping the
  last lines for error messages. :meth:`~WorkerProcesses.monitor` wakes the parent's
  blocked ``MessageQueue`` calls when a worker fails, and raises ``WorkerDiedError``.
- **Shutdown.** :meth:`~WorkerProcesses.close`: SIGTERM to every worker's process group,
  one shared grace period, then SIGKILL of what remains, including descendants captured
  before the SIGTERM; reaping; removal of the segments the dead workers (and their
  descendants) created. Idempotent; also runs at interpreter exit, on garbage collection,
  and when Ctrl-C ends a ``with`` block.
- **Orphans.** Each worker gets ``PR_SET_PDEATHSIG`` (SIGKILL by default): it dies with
  the parent even when the parent is SIGKILLed. Each worker leads its own process group,
  so its descendants go down with it, and a Ctrl-C in the terminal reaches only the
  parent, which then shuts the workers down in order.

Caveats, and how they are handled:

- ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the
  process. Workers are therefore always forked from a long-lived thread: the main
  thread, or (when :class:`WorkerProcesses` is made in another thread) a daemon launcher
  thread that lives as long as the process.
- With the ``forkserver`` context the parent of a worker is the fork server, so instead
  of ``PR_SET_PDEATHSIG`` a thread in the worker watches the parent's pidfd.
- A worker killed by the death signal cannot remove its own segments; the next
  ``python -m shmq cleanup`` does. A worker's own children die with it only if they are
  in its process group (the default for anything it starts) or call
  :func:`die_with_parent` themselves.
- Output a worker writes before its bootstrap redirects stderr (interpreter start-up,
  unpickling its arguments) goes straight to the parent's stderr and is not in the tail.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import hashlib
import hmac
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util  # registers multiprocessing's atexit hook before ours (see _close_all_at_exit)
import os
import pickle
import queue as queue_module
import secrets
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import psutil

from . import _core

__all__ = [
    "WorkerDiedError",
    "WorkerInfo",
    "WorkerMonitor",
    "WorkerProcesses",
    "WorkerTicket",
    "WorkersNotReadyError",
    "connect_to_parent",
    "die_with_parent",
    "report_ready",
]

logger = logging.getLogger("shmq.workers")

DEFAULT_GRACE = 5.0
"""Seconds :meth:`WorkerProcesses.close` waits after SIGTERM before it sends SIGKILL."""

# How long a monitor waits for the supervisor to record an exit it already sees (the
# supervisor takes milliseconds; this only bounds a stalled one).
_RECORD_WITHIN = 2.0

_SHM_DIR = "/dev/shm"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# ---------------------------------------------------------------------------------
# Errors


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_exit(exitcode: Optional[int]) -> str:
    """``exitcode`` in words, as ``multiprocessing`` reports it (negative: the signal that
    killed the process): "exited with code 1", "was killed by SIGBUS"."""
    if exitcode is None:
        return "exited (exit code unknown)"
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)}"
    if exitcode > 128 and exitcode - 128 < signal.NSIG:
        # The bootstrap turns SIGTERM into SystemExit(128 + SIGTERM), as shells report it.
        return f"exited with code {exitcode} (128 + {_signal_name(exitcode - 128)}: it was asked to stop)"
    return f"exited with code {exitcode}"


class WorkerDiedError(RuntimeError):
    """A worker process exited when it should not have: before it was ready, or with a
    non-zero exit code or a signal while it ran (a remote worker: it lost its connection).

    Attributes: ``name``, ``rank``, ``pid`` (None for a remote worker that never said),
    ``host`` (``""`` for a local worker), ``exitcode`` (as ``multiprocessing`` reports it:
    negative for a signal; None when unknown), ``signal_name`` (e.g. ``"SIGBUS"``, or
    None), ``stderr_tail`` (the last lines it wrote to stderr), ``before_ready``.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        pid: Optional[int],
        exitcode: Optional[int],
        stderr_tail: Sequence[str] = (),
        *,
        host: str = "",
        before_ready: bool = False,
        how: Optional[str] = None,
    ):
        self.name = name
        self.rank = rank
        self.pid = pid
        self.host = host
        self.exitcode = exitcode
        self.signal_name = _signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        self.stderr_tail = list(stderr_tail)
        self.before_ready = before_ready
        where = f"rank {rank}, pid {pid}" if pid is not None else f"rank {rank}"
        if host:
            where += f" on {host}"
        when = "before it was ready" if before_ready else "while it was running"
        message = f"{name} ({where}) {how or _describe_exit(exitcode)} {when}"
        if self.stderr_tail:
            message += "; the last lines of its stderr:\n" + "\n".join(f"    {line}" for line in self.stderr_tail)
        elif not host:
            message += " (it wrote nothing to stderr after start-up)"
        super().__init__(message)

    def __reduce__(self):
        return (
            _rebuild_worker_died_error,
            (self.name, self.rank, self.pid, self.exitcode, self.stderr_tail, self.host, self.before_ready, str(self)),
        )


def _rebuild_worker_died_error(name, rank, pid, exitcode, tail, host, before_ready, message):  # noqa: ANN001
    err = WorkerDiedError(name, rank, pid, exitcode, tail, host=host, before_ready=before_ready)
    err.args = (message,)
    return err


class WorkersNotReadyError(TimeoutError):
    """:meth:`WorkerProcesses.wait_until_ready` ran past its deadline. ``not_ready``: the
    names of the workers that had not called :func:`report_ready`."""

    def __init__(self, message: str, not_ready: Sequence[str]):
        super().__init__(message)
        self.not_ready = list(not_ready)


# ---------------------------------------------------------------------------------
# Public value types


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


@dataclass(frozen=True)
class WorkerTicket:
    """What a worker on another machine needs to join: the parent's address and a random
    token (the secret that authenticates it; send it over a trusted channel).

    ``str(ticket)`` is ``shmq-workers://HOST:PORT/TOKEN`` (an IPv6 host in brackets);
    :meth:`parse` reads it back, so a ticket can travel as a command-line argument or an
    environment variable."""

    host: str
    port: int
    token: str = field(repr=False)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"shmq-workers://{host}:{self.port}/{self.token}"

    @classmethod
    def parse(cls, text: str) -> "WorkerTicket":
        """The ticket ``str(ticket)`` printed."""
        prefix = "shmq-workers://"
        if not text.startswith(prefix):
            raise ValueError(f"not a worker ticket (expected {prefix}HOST:PORT/TOKEN): {text[:40]!r}")
        address, _, token = text[len(prefix) :].partition("/")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not token:
            raise ValueError(f"not a worker ticket (expected {prefix}HOST:PORT/TOKEN): {text[:40]!r}")
        return cls(host.strip("[]"), int(port), token)


# ---------------------------------------------------------------------------------
# Dying with the parent


def _prctl_set_pdeathsig(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_pid_in_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to this process when process ``pid`` exits (pidfd; a daemon thread)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
        return

    def watch() -> None:
        import select

        select.select([fd], [], [])
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="shmq-parent-watch", daemon=True).start()


def die_with_parent(parent_pid: Optional[int] = None, sig: int = signal.SIGKILL) -> None:
    """Make the kernel send ``sig`` to this process when its parent process exits, even
    when the parent is SIGKILLed (``PR_SET_PDEATHSIG``); if the parent is already gone,
    send it now. Workers do this in their bootstrap; call it in a worker's own children
    to make them die with the worker.

    ``parent_pid``: the process to die with (default: the current parent). When it is not
    this process's parent (a fork server started it), its pidfd is watched from a thread.

    Caveat: the kernel sends the signal when the *thread* that forked this process exits.
    Fork from a thread that lives as long as its process (``WorkerProcesses`` does)."""
    if parent_pid is None:
        parent_pid = os.getppid()
    if os.getppid() == parent_pid and _prctl_set_pdeathsig(sig):
        # The parent may have died between fork and prctl: then this process was
        # reparented and nobody will send the signal.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)
        return
    if hasattr(os, "pidfd_open"):
        _watch_pid_in_thread(parent_pid, sig)
    else:  # pragma: no cover - not Linux
        logger.warning("cannot make process %d die with its parent on this platform", os.getpid())


# ---------------------------------------------------------------------------------
# The worker side: bootstrap, report_ready, connect_to_parent


class _ParentChannel:
    """How a worker tells its parent it is ready."""

    def send_ready(self, info: Any) -> None:
        raise NotImplementedError


class _PipeChannel(_ParentChannel):
    def __init__(self, conn: multiprocessing.connection.Connection):
        self._conn = conn

    def send_ready(self, info: Any) -> None:
        self._conn.send(("ready", info))
        self._conn.close()


_channel: Optional[_ParentChannel] = None
_channel_lock = threading.Lock()
_reported = False


def report_ready(info: Any = None) -> None:
    """Tell the parent this worker has finished its set-up (call it once, in the worker).

    ``info``: any picklable object for the parent, e.g. the handle of a queue this worker
    writes; :meth:`WorkerProcesses.wait_until_ready` returns them by rank. A second call
    does nothing. Raises ``RuntimeError`` outside a worker (a process started by
    :class:`WorkerProcesses` or joined with :func:`connect_to_parent`)."""
    global _reported
    with _channel_lock:
        if _channel is None:
            raise RuntimeError(
                "report_ready() is for worker processes: started by shmq.WorkerProcesses, "
                "or joined with shmq.workers.connect_to_parent()"
            )
        if _reported:
            return
        _channel.send_ready(info)
        _reported = True


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # SystemExit unwinds the worker (finally blocks, atexit: segments are removed by their
    # creators); the code says which signal, as a shell would.
    raise SystemExit(128 + signum)


def _install_sigterm_handler() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


@dataclass
class _WorkerSpec:
    """What the bootstrap needs, pickled into the worker process."""

    target: Callable[..., Any]
    rank: int
    args: tuple
    kwargs: dict
    parent_pid: int
    ready_conn: multiprocessing.connection.Connection
    # Only carries the write end of the stderr pipe into the child (a Connection pickles
    # its fd into any start method's child); the child dup2s it onto fd 2.
    stderr_conn: Optional[multiprocessing.connection.Connection]
    death_signal: Optional[int]
    new_process_group: bool


def _worker_bootstrap(spec: _WorkerSpec) -> None:
    """Entry point of every local worker: die with the parent, own process group, stderr
    into the parent's pipe, SIGTERM as SystemExit, then ``target(rank, ...)``."""
    global _channel
    if spec.death_signal is not None:
        die_with_parent(spec.parent_pid, spec.death_signal)
    if spec.new_process_group:
        try:
            os.setpgid(0, 0)
        except OSError:  # pragma: no cover - already a session or group leader
            pass
    if spec.stderr_conn is not None:
        sys.stderr.flush()
        os.dup2(spec.stderr_conn.fileno(), 2)
        spec.stderr_conn.close()
    try:
        import faulthandler

        faulthandler.enable()  # a SIGSEGV/SIGBUS leaves a Python stack in the stderr tail
    except Exception:  # pragma: no cover
        pass
    _install_sigterm_handler()
    with _channel_lock:
        _channel = _PipeChannel(spec.ready_conn)
    spec.target(spec.rank, *spec.args, **spec.kwargs)


# The remote protocol: frames of [4-byte big-endian length][1-byte kind][payload].
#   parent -> worker   b"C" {"nonce": hex}          challenge
#   worker -> parent   b"H" {"rank", "pid", "host", "mac"}   mac = HMAC-SHA256(token, nonce|rank|pid)
#   parent -> worker   b"A" {"ok": bool, "error": str}
#   worker -> parent   b"R" pickle(info)            ready (only after "A" ok)
#   worker -> parent   b"X" {"exitcode", "stderr"}  leaving
#   parent -> worker   b"S" {"grace": seconds}      stop
# The parent unpickles only frames from an authenticated worker; the worker unpickles
# nothing.
_HANDSHAKE_TIMEOUT = 10.0
_MAX_FRAME = 64 << 20


def _send_frame(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload) + 1) + kind + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    (length,) = struct.unpack("!I", _recv_exact(sock, 4))
    if not 1 <= length <= _MAX_FRAME:
        raise ValueError(f"bad frame length {length}")
    data = _recv_exact(sock, length)
    return data[:1], data[1:]


def _mac(token: str, nonce: str, rank: int, pid: int) -> str:
    return hmac.new(token.encode(), f"{nonce}|{rank}|{pid}".encode(), hashlib.sha256).hexdigest()


class _TcpChannel(_ParentChannel):
    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._send_lock = threading.Lock()

    def send_ready(self, info: Any) -> None:
        with self._send_lock:
            _send_frame(self._sock, b"R", pickle.dumps(info, protocol=pickle.HIGHEST_PROTOCOL))

    def send_exit(self, exitcode: int, stderr: Sequence[str]) -> None:
        with self._send_lock:
            _send_frame(self._sock, b"X", json.dumps({"exitcode": exitcode, "stderr": list(stderr)}).encode())


class ParentLink:
    """A remote worker's connection to its parent (from :func:`connect_to_parent`).

    Use it as a context manager around the worker's work: leaving the block tells the
    parent how the worker ended (exit code 0, or 1 with the traceback's last lines, which
    the parent puts in its ``WorkerDiedError``)."""

    def __init__(self, sock: socket.socket, channel: _TcpChannel, rank: int):
        self._sock = sock
        self._channel = channel
        self.rank = rank
        self._closed = False

    def close(self, exitcode: int = 0, stderr: Sequence[str] = ()) -> None:
        """Tell the parent this worker is leaving with ``exitcode``, and disconnect."""
        if self._closed:
            return
        self._closed = True
        try:
            self._channel.send_exit(exitcode, stderr)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ParentLink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.close(0)
        else:
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
            lines = "".join(traceback.format_exception(exc_type, exc, tb)).splitlines()
            self.close(code, lines[-20:])


def connect_to_parent(
    ticket: WorkerTicket | str,
    rank: int,
    *,
    die_with_parent: bool = True,
    timeout: float = 30.0,
) -> ParentLink:
    """Join a :class:`WorkerProcesses` from another machine (or any process it did not
    start) as worker ``rank``; afterwards :func:`report_ready` reports to that parent.

    The parent accepts the ranks it was told to expect as remote (``n_remote``), each
    once, and only from a process that proves it knows the ticket's token (HMAC over a
    fresh challenge: the token itself never crosses the network). A refusal (wrong token,
    unexpected or taken rank) raises ``PermissionError``.

    ``die_with_parent``: when the parent closes the group (or dies: the connection drops),
    this process gets SIGTERM (a ``SystemExit`` in its main thread) and, if it is still
    there after the grace period, SIGKILL."""
    global _channel
    if isinstance(ticket, str):
        ticket = WorkerTicket.parse(ticket)
    sock = socket.create_connection((ticket.host, ticket.port), timeout=timeout)
    try:
        kind, payload = _recv_frame(sock)
        if kind != b"C":
            raise ConnectionError(f"{ticket.host}:{ticket.port} is not a shmq worker parent")
        nonce = json.loads(payload)["nonce"]
        pid = os.getpid()
        hello = {"rank": rank, "pid": pid, "host": socket.gethostname(), "mac": _mac(ticket.token, nonce, rank, pid)}
        _send_frame(sock, b"H", json.dumps(hello).encode())
        kind, payload = _recv_frame(sock)
        answer = json.loads(payload) if kind == b"A" else {"ok": False, "error": "no answer"}
        if not answer.get("ok"):
            raise PermissionError(
                f"the parent at {ticket.host}:{ticket.port} refused worker rank {rank}: {answer.get('error')}"
            )
    except BaseException:
        sock.close()
        raise
    # Connected: block reads from here on (the watch thread waits for "stop" or EOF).
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    channel = _TcpChannel(sock)
    with _channel_lock:
        _channel = channel
    if die_with_parent:
        _install_sigterm_handler()
        threading.Thread(target=_watch_parent_link, args=(sock,), name="shmq-parent-link", daemon=True).start()
    return ParentLink(sock, channel, rank)


def _watch_parent_link(sock: socket.socket) -> None:
    """Remote worker: stop this process when the parent says so or disappears."""
    grace = DEFAULT_GRACE
    try:
        while True:
            kind, payload = _recv_frame(sock)
            if kind == b"S":
                grace = float(json.loads(payload).get("grace", grace))
                break
    except (OSError, EOFError, ValueError):
        pass  # connection lost: the parent is gone, or we closed the link ourselves
    if sock.fileno() == -1:
        return  # ParentLink.close(): this worker is leaving on its own
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------
# The parent side


class _Worker:
    """The supervisor's record of one worker (guarded by ``_Group.lock``)."""

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
        self.ready_conn: Optional[multiprocessing.connection.Connection] = None
        self.stderr_fd: Optional[int] = None
        self.exit_fd: Optional[int] = None  # pidfd, or the process sentinel without pidfds
        self.exit_fd_owned = False
        self.sock: Optional[socket.socket] = None

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
    removed = []
    try:
        rows = _core.list_segments()
    except OSError:
        return removed
    for name, _size, _kind, creator_pid, creator_alive in rows:
        if creator_pid in pids and not creator_alive:
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("could not remove %s: %s", name, e)
    return removed


class _Group:
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
    ):
        self.owner_pid = os.getpid()
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.workers = [_Worker(r, f"{name_prefix}_{r}", tail_lines) for r in range(n_local + n_remote)]
        for w in self.workers[n_local:]:
            w.remote = True
        self.forward_stderr = forward_stderr
        self.new_process_group = new_process_group
        self.exit_order: list[_Worker] = []
        self.monitors: list[WorkerMonitor] = []
        self.failures: list[WorkerDiedError] = []
        self.closing = False
        self.closed = False
        self.close_lock = threading.Lock()
        self.captured_pids: set[int] = set()
        # Remote workers.
        self.listener: Optional[socket.socket] = None
        self.token = ""
        self.ticket: Optional[WorkerTicket] = None
        # The supervisor thread and its selector; other threads hand it work through
        # `pending` and the wake pipe (a selector is not thread-safe).
        self.selector = selectors.DefaultSelector()
        self.pending: queue_module.SimpleQueue[Callable[[], None]] = queue_module.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        self.stopping = False
        self.thread = threading.Thread(target=self._supervise, name="shmq-workers-supervisor", daemon=True)
        self.thread.start()

    # -- talking to the supervisor thread ------------------------------------------

    def call_in_supervisor(self, fn: Callable[[], None]) -> None:
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

    def _handle(self, kind: str, w: Optional[_Worker], key: selectors.SelectorKey) -> None:
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
        elif kind == "stderr":
            self._read_stderr(w)
        elif kind == "ready":
            self._read_ready(w)
        elif kind == "exit":
            self._on_exit(w)
        elif kind == "listen":
            self._accept()
        elif kind == "remote":
            self._read_remote(w)

    def _unregister(self, fileobj: Any) -> None:
        try:
            self.selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    # -- local workers ---------------------------------------------------------------

    def watch_local(self, w: _Worker) -> None:
        """Supervisor thread: start watching a just-started local worker."""
        if w.stderr_fd is not None:
            self.selector.register(w.stderr_fd, selectors.EVENT_READ, ("stderr", w))
        if w.ready_conn is not None:
            self.selector.register(w.ready_conn, selectors.EVENT_READ, ("ready", w))
        if w.exit_fd is not None:
            self.selector.register(w.exit_fd, selectors.EVENT_READ, ("exit", w))

    def _read_stderr(self, w: _Worker, final: bool = False) -> None:
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

    def _keep_lines(self, w: _Worker, lines: list[bytes]) -> None:
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

    def _read_ready(self, w: _Worker) -> None:
        conn = w.ready_conn
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
    def _exit_status(w: _Worker) -> tuple[bool, Optional[int]]:
        if w.is_child:
            exited, code = _exit_status(w.pid)
            if exited and code is None and w.process is not None:
                code = w.process.exitcode  # someone reaped it through multiprocessing
            return exited, code
        code = w.process.exitcode  # a fork server's child: it reaps, and reports the code
        return code is not None, code

    @staticmethod
    def may_signal(w: _Worker) -> bool:
        """Whether signalling ``w``'s pid (or group) can only reach ``w``'s processes."""
        if w.pid is None or w.remote or w.reaped:
            return False
        if w.is_child:
            return _unreaped(w.pid)
        return w.process.exitcode is None

    def poll_exit(self, w: _Worker) -> bool:
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
            waiting = [w for w in self.workers if not w.remote and w.pid is not None and not w.exited]
        return any(_dying(w.pid) for w in waiting)

    def _set_exited(self, w: _Worker, code: Optional[int]) -> None:
        with self.changed:
            if not w.exited:
                w.exited, w.exitcode = True, code
                self.exit_order.append(w)
                self.changed.notify_all()

    def _on_exit(self, w: _Worker) -> None:
        """Supervisor thread: worker ``w``'s pidfd (or sentinel) became readable."""
        self._unregister(w.exit_fd)
        if w.exit_fd_owned:
            os.close(w.exit_fd)
        w.exit_fd = None
        self._read_stderr(w, final=True)  # all it wrote is in the pipe by now
        exited, code = self._exit_status(w)
        if not exited:  # pragma: no cover - a pidfd or sentinel is readable only at exit
            logger.warning("%s: exit signalled but no exit status", w.describe())
        with self.lock:
            closing = self.closing
        if not closing and self.new_process_group and w.is_child and _unreaped(w.pid):
            # Its descendants are orphans now: they go down with it. Safe while it is our
            # unreaped zombie (its pid, the group's id, cannot be reused meanwhile).
            _signal_group_or_process(w.pid, signal.SIGKILL, own_group=True)
        # The exit and the failure become visible together (one locked step in
        # _record_failure), so that a waiter sees the error with its full stderr tail.
        self._record_failure(w, exit_code=code)

    def _record_failure(self, w: _Worker, exit_code: Optional[int] = None) -> None:
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
        self.listener = socket.create_server((host, port), family=family, backlog=64)
        self.listener.setblocking(False)
        self.token = secrets.token_hex(32)
        self.ticket = WorkerTicket(host, self.listener.getsockname()[1], self.token)
        self.call_in_supervisor(lambda: self.selector.register(self.listener, selectors.EVENT_READ, ("listen", None)))
        return self.ticket

    def _accept(self) -> None:
        try:
            conn, peer = self.listener.accept()
        except (BlockingIOError, OSError):
            return
        # A handshake can stall (a stranger connects and says nothing): never in this thread.
        threading.Thread(
            target=self._handshake, args=(conn, peer), name="shmq-workers-handshake", daemon=True
        ).start()

    def _handshake(self, conn: socket.socket, peer: Any) -> None:
        conn.setblocking(True)
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        try:
            nonce = secrets.token_hex(32)
            _send_frame(conn, b"C", json.dumps({"nonce": nonce}).encode())
            kind, payload = _recv_frame(conn)
            hello = json.loads(payload) if kind == b"H" else {}
            rank, pid = hello.get("rank"), hello.get("pid")
            error = self._admit(hello, nonce)
            if error:
                logger.warning("refused a worker from %s claiming rank %s: %s", peer, rank, error)
                _send_frame(conn, b"A", json.dumps({"ok": False, "error": error}).encode())
                conn.close()
                return
            _send_frame(conn, b"A", json.dumps({"ok": True}).encode())
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            logger.warning("worker handshake with %s failed: %s", peer, e)
            conn.close()
            return
        conn.settimeout(_HANDSHAKE_TIMEOUT)  # frames from an admitted worker arrive whole
        w = self.workers[rank]
        host = str(hello.get("host") or peer[0])

        def register() -> None:
            with self.changed:
                if self.closing:
                    conn.close()
                    return
                w.sock, w.pid, w.host = conn, int(pid), host
                self.changed.notify_all()
            self.selector.register(conn, selectors.EVENT_READ, ("remote", w))

        self.call_in_supervisor(register)

    def _admit(self, hello: dict, nonce: str) -> str:
        """Why this hello is refused, or "" to admit it."""
        rank, pid, mac = hello.get("rank"), hello.get("pid"), hello.get("mac")
        if not isinstance(rank, int) or not isinstance(pid, int) or not isinstance(mac, str):
            return "malformed hello"
        if not hmac.compare_digest(mac, _mac(self.token, nonce, rank, pid)):
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

    def _read_remote(self, w: _Worker) -> None:
        try:
            kind, payload = _recv_frame(w.sock)
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

    def _remote_gone(self, w: _Worker, error: str) -> None:
        self._unregister(w.sock)
        try:
            w.sock.close()
        except OSError:
            pass
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
            trees.extend(_descendants(w.pid))
        self.captured_pids.update(p.pid for p in trees)
        interrupted: Optional[BaseException] = None
        try:
            for w in running:
                if self.may_signal(w):
                    _signal_group_or_process(w.pid, signal.SIGTERM, self.new_process_group)
            for w in self.workers:
                if w.remote and w.sock is not None:
                    try:
                        _send_frame(w.sock, b"S", json.dumps({"grace": grace}).encode())
                    except OSError:
                        pass
            deadline = time.monotonic() + grace
            self._wait_exits(deadline)
        except KeyboardInterrupt as e:  # a second Ctrl-C: skip the grace period
            interrupted = e
        # Grace is over: SIGKILL what remains. Each worker's group (safe: unreaped), and
        # the descendants captured above (psutil checks each one's identity).
        for w in local:
            if self.may_signal(w):
                _signal_group_or_process(w.pid, signal.SIGKILL, self.new_process_group)
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
        removed = _remove_segments_of({w.pid for w in local} | self.captured_pids)
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

    def _reap(self, local: list[_Worker]) -> None:
        for w in local:
            p = w.process
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


# Every group still open, closed at interpreter exit. Registered after multiprocessing's
# own exit hook (imported above), so it runs first: multiprocessing's hook joins child
# processes without a timeout and would hang on a worker that ignores SIGTERM.
_open_groups: "weakref.WeakSet[_Group]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for group in list(_open_groups):
        try:
            group.close(DEFAULT_GRACE)
        except BaseException:  # noqa: B036 - nothing may stop the others' shutdown
            logger.exception("closing worker processes at exit")


class _Launcher:
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


os.register_at_fork(after_in_child=_Launcher._forget_after_fork)


class WorkerMonitor:
    """Raises in the parent when a worker fails (from :meth:`WorkerProcesses.monitor`).

    When a worker exits before :meth:`WorkerProcesses.close` with a non-zero exit code or a
    signal (or before it was ready, or a remote worker's connection drops), the monitor at
    once sets :attr:`cancel`, calls ``shutdown()`` on the queues it was given (their
    blocked ``enqueue``/``dequeue`` calls in this process raise ``RuntimeError("cancelled")``),
    and leaving the ``with`` block raises the :class:`WorkerDiedError`, chained from
    whatever the block raised. A worker that exits with code 0 after it was ready has
    finished, not failed.

    Code that waits on anything else can pass :attr:`cancel` where a ``threading.Event``
    is taken (``dequeue(cancel=...)``) or call :meth:`check`."""

    def __init__(self, group: _Group, queues: Iterable[Any]):
        self._group = group
        self._queues = list(queues)
        self.cancel = threading.Event()
        """Set when a worker fails."""
        self.error: Optional[WorkerDiedError] = None
        """The first failure seen, or None."""

    def _fire(self, error: WorkerDiedError) -> None:
        if self.error is not None:
            return
        self.error = error
        self.cancel.set()
        for q in self._queues:
            try:
                q.shutdown()
            except Exception:  # pragma: no cover - a queue that cannot shut down
                logger.exception("shutting down %r after %s failed", q, error.name)

    def check(self) -> None:
        """Raise the :class:`WorkerDiedError` if a worker has failed."""
        if self.error is not None:
            raise self.error

    def __enter__(self) -> "WorkerMonitor":
        with self._group.lock:
            self._group.monitors.append(self)
            earlier = self._group.failures[0] if self._group.failures else None
        if earlier is not None:
            self._fire(earlier)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if isinstance(exc, Exception) and self.error is None and self._group.exit_unrecorded():
            # The block failed because a worker died (shmq's own PeerDiedError can come
            # first), but the supervisor has not recorded that yet: give it a moment, so
            # that the error names the worker.
            self.cancel.wait(_RECORD_WITHIN)
        with self._group.lock:
            if self in self._group.monitors:
                self._group.monitors.remove(self)
            # Recorded, but perhaps not yet handed to this monitor (that happens just
            # after the supervisor releases the lock).
            recorded = self._group.failures[0] if self._group.failures else None
        if self.error is None and recorded is not None:
            self._fire(recorded)
        if self.error is not None and not isinstance(exc, WorkerDiedError):
            if exc is not None and not isinstance(exc, Exception):
                return  # KeyboardInterrupt, SystemExit: let them through
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
      (default SIGKILL, see :func:`die_with_parent`), or None to let workers outlive it.
    - ``new_process_group``: each worker leads its own process group (its descendants are
      signalled with it; a terminal's Ctrl-C reaches the parent only).
    - ``capture_stderr`` / ``forward_stderr``: keep the last ``stderr_tail_lines`` lines
      each worker writes to stderr (for error messages), and copy them to the parent's
      ``sys.stderr`` prefixed ``(Worker_1 pid=...)``.
    - ``remote_host`` / ``remote_port``: where remote workers connect (default: this
      host's address, ``SHMQ_HOST_IP``; any free port); see :attr:`ticket`.
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
        ctx = multiprocessing.get_context(context) if isinstance(context, (str, type(None))) else context
        self.grace = grace
        self._group = _Group(n_workers, n_remote, name_prefix, stderr_tail_lines, forward_stderr, new_process_group)
        _open_groups.add(self._group)
        self._finalizer = weakref.finalize(self, self._group.close, grace)
        self._finalizer.atexit = False  # _close_all_at_exit does it, in the right order
        try:
            if n_remote:
                self._group.listen(remote_host or _core.default_connect_ip(), remote_port)
            for w in self._group.workers[:n_workers]:
                spec_args = (target, w, tuple(args), dict(kwargs or {}), death_signal, new_process_group)
                _Launcher.call(lambda a=spec_args: self._start_one(ctx, *a, capture_stderr=capture_stderr))
        except BaseException:
            self.close(grace=min(grace, 1.0))
            raise

    def _start_one(
        self,
        ctx: Any,
        target: Callable[..., Any],
        w: _Worker,
        args: tuple,
        kwargs: dict,
        death_signal: Optional[int],
        new_process_group: bool,
        *,
        capture_stderr: bool,
    ) -> None:
        group = self._group
        ready_r, ready_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False) if capture_stderr else (None, None)
        spec = _WorkerSpec(target, w.rank, args, kwargs, os.getpid(), ready_w, err_w, death_signal, new_process_group)
        process = ctx.Process(target=_worker_bootstrap, args=(spec,), name=w.name, daemon=False)
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
            w.stderr_fd = os.dup(err_r.fileno())
            err_r.close()
            os.set_blocking(w.stderr_fd, False)
        try:
            w.exit_fd, w.exit_fd_owned = os.pidfd_open(process.pid), True
        except (AttributeError, OSError):
            w.exit_fd, w.exit_fd_owned = process.sentinel, False
        group.call_in_supervisor(lambda: group.watch_local(w))

    # -- readiness -------------------------------------------------------------------

    def wait_until_ready(self, timeout: Optional[float] = None, *, close_on_failure: bool = True) -> list[Any]:
        """Wait until every worker has called :func:`report_ready`; their ``info``
        objects, by rank.

        Raises :class:`WorkerDiedError` as soon as a worker exits first (any exit code),
        and :class:`WorkersNotReadyError` naming those not ready when ``timeout``
        seconds pass. Either way (and on Ctrl-C) the group is closed first, unless
        ``close_on_failure`` is false."""
        group = self._group
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with group.changed:
                while True:
                    if group.closed or group.closing:
                        raise RuntimeError("the worker processes have been closed")
                    dead = [w for w in group.exit_order if not w.ready or w.error is not None]
                    if dead:
                        w = dead[0]
                        raise w.error or WorkerDiedError(
                            w.name, w.rank, w.pid, w.exitcode, list(w.tail), host=w.host, before_ready=False
                        )
                    waiting = [w for w in group.workers if not w.ready]
                    if not waiting:
                        return [w.info for w in group.workers]
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        names = [w.name for w in waiting]
                        raise WorkersNotReadyError(
                            f"{len(waiting)} of {len(group.workers)} worker(s) not ready after {timeout} s: "
                            + ", ".join(w.describe() for w in waiting),
                            names,
                        )
                    # Woken by the supervisor when a worker reports ready or exits.
                    group.changed.wait(left)
        except BaseException:
            if close_on_failure:
                self.close()
            raise

    # -- supervision -----------------------------------------------------------------

    @property
    def ticket(self) -> Optional[WorkerTicket]:
        """What remote workers pass to :func:`connect_to_parent` (None without
        ``n_remote``)."""
        return self._group.ticket

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The local workers' ``multiprocessing`` process objects, by rank."""
        return [w.process for w in self._group.workers if w.process is not None]

    @property
    def pids(self) -> list[Optional[int]]:
        """Every worker's pid by rank (None: a remote worker not connected yet)."""
        return [w.pid for w in self._group.workers]

    @property
    def names(self) -> list[str]:
        """Every worker's name by rank."""
        return [w.name for w in self._group.workers]

    def info(self) -> list[WorkerInfo]:
        """A snapshot of every worker, by rank."""
        with self._group.lock:
            return [w.snapshot() for w in self._group.workers]

    def sentinels(self) -> list[int]:
        """The local workers' process sentinels (for ``multiprocessing.connection.wait``);
        each becomes ready when its worker exits."""
        return [w.process.sentinel for w in self._group.workers if w.process is not None and not w.reaped]

    def finished(self) -> dict[str, Optional[int]]:
        """The workers that have exited: name → exit code (negative: killed by that signal;
        None: a remote worker that left without saying)."""
        with self._group.lock:
            return {w.name: w.exitcode for w in self._group.exit_order}

    def join_first(self, timeout: Optional[float] = None) -> Optional[WorkerInfo]:
        """Wait until a worker exits (or one already has); that worker, or None when
        ``timeout`` passes first."""
        group = self._group
        deadline = None if timeout is None else time.monotonic() + timeout
        with group.changed:
            while True:
                if group.exit_order:
                    return group.exit_order[0].snapshot()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                group.changed.wait(left)

    def monitor(self, *queues: Any) -> WorkerMonitor:
        """A context manager that raises :class:`WorkerDiedError` when a worker fails
        while it is open, waking the parent's blocked calls on ``queues`` (anything with a
        ``shutdown()`` method, e.g. ``MessageQueue``) so it never hangs on a dead
        worker. See :class:`WorkerMonitor`."""
        return WorkerMonitor(self._group, queues)

    @property
    def failures(self) -> list[WorkerDiedError]:
        """Every worker failure seen so far (before :meth:`close`)."""
        with self._group.lock:
            return list(self._group.failures)

    # -- shutdown --------------------------------------------------------------------

    def close(self, grace: Optional[float] = None) -> None:
        """Shut every worker down: SIGTERM to each worker's process group (remote workers
        are asked to stop), one shared deadline ``grace`` seconds away, then SIGKILL of
        what remains, including each worker's descendants captured before the SIGTERM;
        reap; remove the shared-memory segments the dead workers and their descendants
        created. Idempotent; a second Ctrl-C during the grace period skips to SIGKILL."""
        self._group.close(self.grace if grace is None else grace)
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._group.closed

    def __enter__(self) -> "WorkerProcesses":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        self.close()

    def __repr__(self) -> str:
        states = []
        for w in self.info():
            state = "exited" if w.exited else "ready" if w.ready else "starting"
            states.append(f"{w.name}:{state}")
        return f"<WorkerProcesses {' '.join(states)}{' closed' if self.closed else ''}>"

"""The worker side: what runs in a worker process.

- :func:`bootstrap`, the entry point of every local worker: die with the parent, lead a
  process group, adopt orphaned descendants, send stderr into the parent's pipe, turn
  SIGTERM into ``SystemExit``, then run ``target(rank, ...)``; if it raises, print the
  traceback and send the parent a death notice on the ready pipe before exiting;
- :func:`report_ready`, which a worker calls once its set-up is done;
- :func:`sibling_failure`, which tells a worker that another worker of its group
  failed (why the parent shut the group's queues down);
- :func:`connect_to_parent`, how a worker the parent did not start (on another machine)
  joins over TCP;
- :func:`die_with_parent`, for workers and their own children.

How a worker dies with its parent and takes its descendants with it, and why the death
notice comes before the interpreter's teardown: docs/design.md ("Worker processes").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import fcntl
import logging
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import stat
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Optional, Sequence

from .. import _core
from .errors import WorkerDiedError, failure_from_notice
from .protocol import DEFAULT_GRACE, WorkerTicket

__all__ = ["ParentLink", "connect_to_parent", "die_with_parent", "report_ready", "sibling_failure"]

logger = logging.getLogger("shmq.workers")


def _exit_with_parent(parent_pid: int) -> None:
    """Die of SIGKILL when process ``parent_pid`` exits, even by SIGKILL, but first kill
    this process's descendants and remove the segments it created: a thread of the core
    watches the parent's pidfd and does it without the GIL (see
    ``_core.exit_with_process``). Without pidfds: :func:`die_with_parent` (the kernel's
    SIGKILL, nothing removed)."""
    try:
        _core.exit_with_process(parent_pid)
    except OSError:
        die_with_parent(parent_pid, signal.SIGKILL)


def _become_subreaper() -> None:
    """Adopt this process's orphaned descendants (``PR_SET_CHILD_SUBREAPER``): a daemon
    that double-forks (``setsid``, fork, the middle process exits) stays in the worker's
    process tree, where ``close()`` and the worker's own exit find and kill it, instead of
    being handed to init."""
    try:
        _core.become_subreaper()
    except OSError:  # pragma: no cover - not Linux
        logger.debug("process %d cannot adopt its orphaned descendants", os.getpid())


def die_with_parent(parent_pid: Optional[int] = None, sig: int = signal.SIGKILL) -> None:
    """Make the kernel send ``sig`` to this process when its parent process exits, even
    when the parent is SIGKILLed (``PR_SET_PDEATHSIG``); if the parent is already gone,
    send it now. Workers do this in their bootstrap; call it in a worker's own children
    to make them die with the worker.

    ``parent_pid``: the process to die with (default: the current parent). When it is not
    this process's parent (a fork server started it), its pidfd is watched from a thread.
    The core's ``workers::die_with_process`` does both (the one implementation, shared
    with Rust's ``Workers::spawn``).

    Caveat: the kernel sends the signal when the *thread* that forked this process exits.
    Fork from a thread that lives as long as its process (``WorkerProcesses`` does)."""
    if parent_pid is None:
        parent_pid = os.getppid()
    try:
        _core.die_with_process(parent_pid, int(sig))
    except OSError:  # pragma: no cover - not Linux, or Linux before 5.3
        logger.warning("cannot make process %d die with its parent on this platform", os.getpid())


# ---------------------------------------------------------------------------------
# Reporting ready


class _ParentChannel(ABC):
    """How a worker tells its parent it is ready: a pipe (local workers) or the TCP
    link (remote workers)."""

    @abstractmethod
    def send_ready(self, info: Any) -> None:
        """Send ``info`` to the parent as this worker's ready report."""

    def send_raw_ready(self, raw: bytes) -> None:
        """Send ``raw`` as this worker's ready report: a Python parent gets it as the
        ``bytes`` object (the info it unpickles)."""
        self.send_ready(raw)


# A death notice's frame: its length word has this bit set (a ready report's never has:
# its payload is at most 64 MiB), and its payload is at most _MAX_NOTICE bytes. The
# parent's core reads both frames (``crates/workers/src/watch.rs``).
_NOTICE_FLAG = 1 << 31
_MAX_NOTICE = 64 << 10
# The largest ready payload a parent reads (``MAX_READY_PAYLOAD``): a longer one counts
# as no report.
_MAX_READY = 64 << 20
# How many of a traceback's last lines a death notice carries (the parent keeps its
# ``stderr_tail_lines`` of them).
_NOTICE_LINES = 100


def _notice_payload(exitcode: int, lines: Sequence[str]) -> bytes:
    """The exit code, a newline, and as many of the last ``lines`` as fit."""
    kept = list(lines[-_NOTICE_LINES:])
    while True:
        payload = "\n".join([str(exitcode), *kept]).encode("utf-8", "replace")
        if len(payload) <= _MAX_NOTICE or not kept:
            return payload[:_MAX_NOTICE]
        kept.pop(0)


class _PipeChannel(_ParentChannel):
    def __init__(self, conn: multiprocessing.connection.Connection):
        self._conn = conn

    def send_ready(self, info: Any) -> None:
        # One frame, a 4-byte big-endian length and the pickled info, which the parent's
        # core reads (``crates/workers/src/``). The pipe stays open: a death notice may follow.
        self._conn.send(info)

    def send_death_notice(self, exitcode: int, lines: Sequence[str]) -> None:
        """Tell the parent now that this worker is exiting with ``exitcode`` (its target
        raised; ``lines``: the traceback), before the interpreter's teardown, which can
        take long; then close the pipe."""
        payload = _notice_payload(exitcode, lines)
        frame = memoryview((len(payload) | _NOTICE_FLAG).to_bytes(4, "big") + payload)
        fd = self._conn.fileno()
        while frame:
            frame = frame[os.write(fd, frame) :]
        self._conn.close()


_channel: Optional[_ParentChannel] = None
_channel_lock = threading.Lock()
_reported = False


def report_ready(info: Any = None, *, raw: Optional[bytes] = None) -> None:
    """Tell the parent this worker has finished its set-up (call it once, in the worker).

    ``info``: any picklable object for the parent, e.g. the handle of a queue this worker
    writes; :meth:`WorkerProcesses.wait_until_ready` returns them by rank. ``raw``
    (bytes-like, instead of ``info``): bytes for the parent as they are, not pickled:
    what a Rust parent's ``Workers::ready_payloads()`` returns for this worker (a Python
    parent gets them as a ``bytes`` object, as if passed as ``info``). A second call
    does nothing.

    Works in a process started by :class:`WorkerProcesses`, joined with
    :func:`connect_to_parent`, or started by a Rust parent's ``shmq::workers::Workers::spawn``
    (found by its ready pipe's fd in ``SHMQ_READY_FD``): there the ready frame carries
    ``raw``, the pickled ``info``, or nothing (``report_ready()``, as Rust's own
    ``report_ready()`` sends). Raises ``RuntimeError`` in any other process, and
    ``ValueError`` for both ``info`` and ``raw``."""
    global _reported
    if raw is not None:
        if info is not None:
            raise ValueError("report_ready() takes info or raw, not both")
        raw = bytes(raw)
    with _channel_lock:
        if _reported:
            return
        channel = _channel if _channel is not None else _spawned_by_rust()
        if channel is None:
            raise RuntimeError(
                "report_ready() is for worker processes: started by shmq.WorkerProcesses, "
                "joined with shmq.workers.connect_to_parent(), or started by Rust's "
                f"shmq::workers::Workers::spawn ({_READY_FD_ENV} set to its ready pipe)"
            )
        if raw is not None:
            channel.send_raw_ready(raw)
        else:
            channel.send_ready(info)
        _reported = True


# A worker of Rust's ``Workers::spawn`` finds its ready pipe by these (``READY_FD_ENV``
# and ``RANK_ENV`` in ``crates/workers/src/lib.rs``).
_READY_FD_ENV = "SHMQ_READY_FD"
_RANK_ENV = "SHMQ_WORKER_RANK"


class _RustPipeChannel(_ParentChannel):
    """The ready pipe a Rust parent's ``Workers::spawn`` left open across exec: one frame,
    a 4-byte big-endian length and the payload, as Rust's ``report_ready()`` writes it
    (its parent reads the frame in ``crates/workers/src/watch.rs``); then closed."""

    def __init__(self, fd: int):
        self._fd = fd

    def send_ready(self, info: Any) -> None:
        self.send_raw_ready(b"" if info is None else pickle.dumps(info, protocol=pickle.HIGHEST_PROTOCOL))

    def send_raw_ready(self, raw: bytes) -> None:
        if len(raw) > _MAX_READY:
            raise ValueError(f"a ready payload holds at most {_MAX_READY} bytes, got {len(raw)}")
        frame = memoryview(len(raw).to_bytes(4, "big") + raw)
        try:
            while frame:
                frame = frame[os.write(self._fd, frame) :]
        finally:
            os.close(self._fd)
            # This process's children must not take the variable for a pipe of theirs.
            os.environ.pop(_READY_FD_ENV, None)


def _spawned_by_rust() -> Optional[_ParentChannel]:
    """The ready pipe of a worker started by Rust's ``Workers::spawn``, or None: the fd
    in ``SHMQ_READY_FD`` must be the write end of a pipe (an fd inherited with the
    variable but not the pipe, in a child of such a worker, is not taken for it)."""
    fd = _inherited_pipe_end(_READY_FD_ENV, os.O_WRONLY)
    return None if fd is None else _RustPipeChannel(fd)


def _inherited_pipe_end(env: str, access: int) -> Optional[int]:
    """The fd a Rust parent's ``Workers::spawn`` named in ``env`` for this worker, if it
    is the end of a pipe open for ``access`` (``os.O_WRONLY``, ``os.O_RDONLY``) in a
    worker (``SHMQ_WORKER_RANK`` set); None otherwise (a child of such a worker inherits
    the variable, not the pipe)."""
    value = os.environ.get(env)
    if value is None or _RANK_ENV not in os.environ:
        return None
    try:
        fd = int(value)
        mode = os.fstat(fd).st_mode
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except (ValueError, OSError):
        return None
    if not stat.S_ISFIFO(mode) or flags & os.O_ACCMODE != access:
        return None
    return fd


# ---------------------------------------------------------------------------------
# A sibling's failure, as the parent tells it

# The parent tells every worker of its group's first failure (``Supervisor.tell_siblings``)
# before it shuts the monitored queues down: a local worker on a pipe of its own (read
# here, when asked), a remote one on its link (the watch thread stores it).
_notice_conn: Optional[multiprocessing.connection.Connection] = None
_sibling_failure: Optional[WorkerDiedError] = None
_notice_lock = threading.Lock()


def sibling_failure() -> Optional[WorkerDiedError]:
    """In a worker: the failure of another worker of its group, as the parent told it
    (the first one), or None while the parent has told of none.

    The parent tells every worker as soon as it learns of a failure, *before* a
    :meth:`shmq.WorkerProcesses.monitor` shuts the group's queues down: a worker whose
    ``dequeue`` raises ``QueueShutDownError`` calls this to tell "the parent stopped
    because ``Worker_2`` died" (a :class:`WorkerDiedError` naming it: rank, pid, exit code
    or signal, its last stderr lines) from a plain shutdown (None). A remote worker hears
    of it on its link to the parent, which can arrive a moment after its queue's end.
    A worker of a Rust parent's ``shmq::workers::Workers::spawn`` hears it on the pipe in
    ``SHMQ_NOTICE_FD`` (its parent tells while a ``Workers::monitor`` is open). Outside
    a worker, always None."""
    global _notice_conn, _sibling_failure
    with _notice_lock:
        if _notice_conn is None and _sibling_failure is None:
            _notice_conn = _rust_notice_pipe()
        conn = _notice_conn
        if _sibling_failure is None and conn is not None:
            try:
                if conn.poll(0):
                    _sibling_failure = failure_from_notice(conn.recv_bytes())
            except (OSError, EOFError):  # the parent closed its end (closing, or gone)
                conn.close()
                _notice_conn = None
        return _sibling_failure


# A worker of Rust's ``Workers::spawn`` finds its notice pipe by this (``NOTICE_FD_ENV`` in
# ``crates/workers/src/monitor.rs``): the parent writes the same frame into it.
_NOTICE_FD_ENV = "SHMQ_NOTICE_FD"
_rust_notice_taken = False


def _rust_notice_pipe() -> Optional[multiprocessing.connection.Connection]:
    """The notice pipe a Rust parent's ``Workers::spawn`` left open across exec (its fd in
    ``SHMQ_NOTICE_FD``), once, made non-inheritable and the variable removed, so that
    this worker's children do not take it for theirs; None without one, or where that fd
    is not the read end of a pipe (call it holding ``_notice_lock``)."""
    global _rust_notice_taken
    if _rust_notice_taken:
        return None
    _rust_notice_taken = True
    fd = _inherited_pipe_end(_NOTICE_FD_ENV, os.O_RDONLY)
    if fd is None:
        return None
    os.set_inheritable(fd, False)
    os.environ.pop(_NOTICE_FD_ENV, None)
    return multiprocessing.connection.Connection(fd, writable=False)


def _told_of_failure(payload: bytes) -> None:
    """A remote worker's link brought the parent's notice of a sibling's failure."""
    global _sibling_failure
    with _notice_lock:
        if _sibling_failure is None:
            _sibling_failure = failure_from_notice(payload)


# Set once `_exit_on_sigterm` has run, and while a parent link is stopping this process
# (see `ParentLink._stop_main_thread`).
_sigterm_handled = threading.Event()
_link_stopping = threading.Event()
# How often a remote worker's link sends SIGTERM again while shmq's handler has not run.
_SIGTERM_RESEND = 0.1


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # SystemExit unwinds the worker (finally blocks, atexit: segments are removed by their
    # creators); the code says which signal, as a shell would. While a parent link stops
    # this process, only the first time: its repeats must not interrupt that unwinding.
    if _sigterm_handled.is_set() and _link_stopping.is_set():
        return
    _sigterm_handled.set()
    raise SystemExit(128 + signum)


def _install_sigterm_handler() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


# ---------------------------------------------------------------------------------
# Local workers: the bootstrap


@dataclass
class WorkerSpec:
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
    # The read end of the pipe on which the parent tells of a sibling's failure.
    notice_conn: Optional[multiprocessing.connection.Connection] = None


def bootstrap(spec: WorkerSpec) -> None:
    """Entry point of every local worker: die with the parent (cleanly, see the module
    docs), own process group, adopt orphaned descendants and kill them at exit, stderr
    into the parent's pipe, SIGTERM as SystemExit, then ``target(rank, ...)``."""
    global _channel, _notice_conn
    if spec.death_signal == signal.SIGKILL:
        _exit_with_parent(spec.parent_pid)
    elif spec.death_signal is not None:
        die_with_parent(spec.parent_pid, spec.death_signal)
    _become_subreaper()
    # The worker's descendants do not outlive it: killed at its exit (the end of its
    # target, sys.exit, SIGTERM's SystemExit), by one of multiprocessing's exit
    # finalizers, which every start method runs once the target is done, after the
    # worker's own multiprocessing children are joined.
    multiprocessing.util.Finalize(None, _core.kill_descendants, exitpriority=-100)
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
    with _notice_lock:
        _notice_conn = spec.notice_conn
    worker_pid = os.getpid()
    try:
        spec.target(spec.rank, *spec.args, **spec.kwargs)
    except SystemExit:
        raise
    except BaseException as e:
        # The worker's own frames only (multiprocessing would print its bootstrap's too):
        # the stderr tail in the parent's error is this traceback.
        tb = e.__traceback__
        text = "".join(traceback.format_exception(type(e), e, tb.tb_next if tb is not None else None))
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:  # no stderr (None, closed): the notice still carries it
            pass
        if os.getpid() == worker_pid:  # not a child the target forked, unwinding here
            _send_death_notice(1, text.splitlines())
        sys.exit(1)


def _send_death_notice(exitcode: int, lines: Sequence[str]) -> None:
    """Tell the parent at once that this worker is exiting with ``exitcode``: its
    failure is then reported before the interpreter's teardown (atexit handlers,
    non-daemon threads, the modules' clean-up: long with torch imported, forever when
    one hangs) rather than at the exit. Written after the traceback reached fd 2,
    so the parent finds it in the worker's stderr pipe when the notice arrives."""
    try:
        with _channel_lock:
            if isinstance(_channel, _PipeChannel):
                _channel.send_death_notice(exitcode, lines)
    except Exception:  # the parent still learns from the exit
        pass


# ---------------------------------------------------------------------------------
# Remote workers: joining over TCP


class _TcpChannel(_ParentChannel):
    def __init__(self, link: _core.Link):
        self._link = link

    def send_ready(self, info: Any) -> None:
        self._link.send_ready(pickle.dumps(info, protocol=pickle.HIGHEST_PROTOCOL))

    def send_exit(self, exitcode: int, stderr: Sequence[str]) -> None:
        self._link.send_leaving(exitcode, list(stderr))


class ParentLink:
    """A remote worker's connection to its parent (from :func:`connect_to_parent`).

    Use it as a context manager around the worker's work: leaving the block tells the
    parent how the worker ended (exit code 0, or 1 with the traceback's last lines, which
    the parent puts in its ``WorkerDiedError``)."""

    def __init__(self, link: _core.Link, rank: int, die_with_parent: bool):
        self._link = link
        self._channel = _TcpChannel(link)
        self.rank = rank
        self._leaving = threading.Event()
        if die_with_parent:
            _install_sigterm_handler()
            threading.Thread(target=self._watch, name="shmq-parent-link", daemon=True).start()

    def close(self, exitcode: int = 0, stderr: Sequence[str] = ()) -> None:
        """Tell the parent this worker is leaving with ``exitcode``, and disconnect."""
        if self._leaving.is_set():
            return
        self._leaving.set()
        try:
            self._channel.send_exit(exitcode, stderr)
        except (OSError, EOFError, ValueError):
            pass  # the link is gone: the parent learns of it
        self._link.shutdown()  # wakes the watch thread's recv

    def _watch(self) -> None:
        """Stop this process when the parent says so or disappears, or when its link fails
        (a frame that is not the parent's): not when the worker leaves on its own."""
        grace = DEFAULT_GRACE
        try:
            while True:
                kind, message = self._link.recv()  # the core's ``ParentLink::recv``
                if kind == _core.LinkKind.STOP:
                    grace = message  # the default for a stop without a usable one
                    break
                if kind == _core.LinkKind.SIBLING_FAILED:  # another worker of the group failed
                    _told_of_failure(message)
                del message  # before the next frame is read: one at a time
        except (OSError, EOFError, ValueError):
            # The link dropped or failed (a frame that is not the parent's, or of a kind
            # never the parent's to send): the parent is gone (or this worker is leaving).
            pass
        if self._leaving.is_set():
            return
        self._stop_main_thread(grace)

    def _stop_main_thread(self, grace: float) -> None:
        """SIGTERM to the main thread (shmq's handler: a ``SystemExit`` there), then
        SIGKILL if this worker is still there ``grace`` seconds later.

        CPython runs a signal's handler only when the main thread next executes Python
        code: a SIGTERM that lands just before the main thread enters a blocking call
        (``time.sleep``, say) waits until that call returns by itself, after the grace.
        So while shmq's handler has not run, the signal is sent again every
        ``_SIGTERM_RESEND`` seconds (a repeat interrupts the call, and the handler runs
        once). A handler of the worker's own gets one signal."""
        deadline = time.monotonic() + grace
        ours = signal.getsignal(signal.SIGTERM) is _exit_on_sigterm
        _link_stopping.set()
        _sigterm_handled.clear()
        # The main thread is the process's first thread: it lives as long as the process
        # (finalization included), so its id stays valid for pthread_kill.
        main = threading.main_thread().ident
        assert main is not None  # started: it imported this module
        while True:
            signal.pthread_kill(main, signal.SIGTERM)
            left = deadline - time.monotonic()
            if not ours or left <= 0 or self._leaving.wait(min(_SIGTERM_RESEND, left)) or _sigterm_handled.is_set():
                break
        if not self._leaving.wait(max(0.0, deadline - time.monotonic())):
            os.kill(os.getpid(), signal.SIGKILL)

    def __enter__(self) -> "ParentLink":
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
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
    once, and only from a process that proves it knows the ticket's token (the core's keyed MAC over a
    fresh challenge: the token itself never crosses the network). A refusal (wrong token,
    unexpected or taken rank) raises ``PermissionError``; so does a parent that cannot
    prove the token in turn (over this worker's nonce), or one of another shmq version.
    Every frame after that is sealed (see ``shmq.workers.protocol``).

    ``timeout``: seconds for the whole handshake, connecting included: one deadline,
    however slowly the other end's bytes come (``TimeoutError`` once it passed). A
    handshake frame longer than ``protocol.MAX_HELLO_FRAME`` (4 KiB) is refused at its
    length, before any of it is read, with ``ConnectionError`` naming the address and the
    limit (as is anything else that is no shmq parent). Once admitted, a frame is at most
    ``protocol.MAX_FRAME`` (16 MiB) either way: ``report_ready``'s pickled ``info`` must
    fit in it.

    ``die_with_parent``: when the parent closes the group (or dies: the connection drops;
    or a frame on the link fails its seal), this process gets SIGTERM (a ``SystemExit``
    in its main thread) and, if it is still there after the grace period, SIGKILL."""
    global _channel
    if isinstance(ticket, str):
        ticket = WorkerTicket.parse(ticket)
    try:
        # The core's ``ParentLink::connect``: the handshake, its deadline, the checks.
        sealed = _core.Link.connect(str(ticket), rank, timeout)
    except TimeoutError:
        host = f"[{ticket.host}]" if ":" in ticket.host else ticket.host
        raise TimeoutError(
            f"joining the parent at {host}:{ticket.port} as worker rank {rank}: its handshake did not finish "
            f"within {timeout:g} s"
        ) from None
    link = ParentLink(sealed, rank, die_with_parent)
    with _channel_lock:
        _channel = link._channel
    return link

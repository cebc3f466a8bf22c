"""Running children (the ``spawn`` context, reports through queues, every wait bounded by
``STEP``), waiting for a state (``wait_for``: a condition polled under a deadline; a
queue side blocked in a call; processes gone), and finding the shmq segments they leave
in /dev/shm (``segments_of``, ``wait_until_gone``: the leftover check).

Standard library only (``shmq`` and ``psutil`` are imported where used): programs the
tests run import this module without paying for, or changing by importing, anything
else."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import queue
import re
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Mapping

CTX = mp.get_context("spawn")


class LogRecords(logging.Handler):
    """Keeps every record it is given as ``(logger name, level, message)``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


# Bound on any one blocking call (enqueue, dequeue, ready, a report); generous, because
# it only turns a hang into a failure and the machine may be busy.
STEP = 30.0

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shmq_"
# shmq names its segments shmq_<kind>_<creator pid>_<random> (a ring's local socket
# lives in the directory <ring name>.sock beside it, or <ring name>.<16 hex>.sock where
# that name was taken).
_SEGMENT_NAME = re.compile(r"^shmq_[a-z]+_(\d+)_[0-9a-f]+(\.[0-9a-f]{16})?(\.sock)?$")

# Pids of every child process the tests started (the leftover check needs them: a
# segment's name carries its creator's pid).
CHILD_PIDS: set[int] = set()


# ---------------------------------------------------------------------------------
# /dev/shm


def shm_segments() -> set[str]:
    """Names of shmq segments currently in /dev/shm (from any process)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX)}
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return set()


def segment_exists(name: str) -> bool:
    """Whether ``name`` (a segment, or a ring's socket directory) is in /dev/shm."""
    return os.path.exists(os.path.join(SHM_DIR, name))


def segment_creator_pid(name: str) -> int | None:
    m = _SEGMENT_NAME.match(name)
    return int(m.group(1)) if m else None


def segments_of(pids: Iterable[int]) -> set[str]:
    """shmq segments in /dev/shm created by one of ``pids``."""
    pids = set(pids)
    return {n for n in shm_segments() if segment_creator_pid(n) in pids}


def wait_until_gone(left_now: Callable[[], set[str]], what: str, timeout: float = 3.0) -> None:
    """The leftover check: wait until ``left_now()`` (entries of /dev/shm) is empty,
    failing with the entries still there after ``timeout`` seconds. Creators unlink
    their segment when they are dropped; one held only by a reference cycle goes at a
    collection. Collect only when something is left: a full collection in a process
    that imported torch and vLLM takes 0.1-0.3 s, which every test paid (a quarter of
    the suite's time) while most leave nothing behind."""

    def gone() -> bool:
        if not left_now():
            return True
        gc.collect()
        return not left_now()

    wait_for(gone, timeout, lambda: f"{what} to go from /dev/shm; still there: {sorted(left_now())}", 0.05)


# ---------------------------------------------------------------------------------
# Processes


def still_running(pids: Iterable[int]) -> list[int]:
    """The pids among ``pids`` that still run (a zombie is dead: it only waits to be
    reaped)."""
    import psutil

    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def track(pids: Iterable[int | None]) -> list[int]:
    """Count the segments of processes the tests started other than through ``Children``
    (``WorkerProcesses`` workers, ``subprocess`` programs) in the leftover check; their
    pids."""
    pids = [p for p in pids if p is not None]
    CHILD_PIDS.update(pids)
    return pids


def shmq_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m shmq ARGS`` in a process of its own (neither a writer nor a reader)."""
    return subprocess.run([sys.executable, "-m", "shmq", *args], capture_output=True, text=True, timeout=STEP)


def mapping_count() -> int:
    """How many mappings this process has (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` that is still there (the end of a test's own processes)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _child_main(target: Callable[..., None], out: Any, args: tuple) -> None:
    """Entry point of every child: run ``target(out, *args)``, report an exception."""
    try:
        target(out, *args)
    except BaseException:
        out.put(("error", os.getpid(), traceback.format_exc()))
        out.close()
        out.join_thread()
        sys.exit(1)


class ChildFailed(AssertionError):
    pass


# ---------------------------------------------------------------------------------
# Waiting for a state instead of sleeping


class WaitTimeout(AssertionError):
    """The state ``wait_for`` waited for never came: a test failure that names it."""


def wait_for(
    cond: Callable[[], Any],
    timeout: float = STEP,
    what: str | Callable[[], str] = "the condition",
    interval: float = 0.002,
) -> Any:
    """Poll ``cond()`` every ``interval`` seconds until it returns a true value, and return
    that value; once ``timeout`` seconds have passed, raise ``WaitTimeout`` naming
    ``what`` (a text, or a function that writes it then, to say what was still missing).
    ``cond`` is called at least once, so ``timeout=0`` checks the state now. How a test or
    a child waits for another process or thread to reach a state, instead of sleeping
    for a guessed while or writing its own deadline loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"waited {timeout} s for {what() if callable(what) else what}")
        time.sleep(interval)


def wait_for_file(
    path: str, timeout: float = STEP, what: str | None = None, watch: Mapping[str, Any] | None = None
) -> str:
    """Wait for another process to make the file ``path`` (``what`` it stands for names
    it in the failure); fail at once, with the end of its stderr, if one of the
    processes in ``watch`` (``{name: subprocess.Popen}``) ends before it is there.
    Returns ``path``."""

    def there() -> bool:
        if os.path.exists(path):
            return True
        for name, p in (watch or {}).items():
            assert p.poll() is None, f"{name} ended early:\n{p.communicate()[1][-3000:]}"
        return False

    wait_for(there, timeout, what or f"the file {path}", 0.02)
    return path


def queue_side(ring_name: str, reader: int | None = None) -> dict[str, Any]:
    """The queue metrics of the writer (``reader=None``) or reader ``reader`` of the ring
    segment ``ring_name``, read from its slot in shared memory (``shmq.metrics``)."""
    from shmq import metrics

    m = metrics.collect([ring_name])[0]
    return m["writer"] if reader is None else m["readers"][reader]


def blocked_in_queue(ring_name: str, reader: int | None = None, for_at_least: float = 0.0) -> bool:
    """Whether that side of the queue is blocked in a call now (waiting for room or for a
    message), for ``for_at_least`` seconds already: past the spin and yield phases of a
    wait (a millisecond or so), it is asleep on the segment's futex."""
    waiting = queue_side(ring_name, reader)["waiting_seconds"]
    return waiting is not None and waiting >= for_at_least


class Children:
    """The child processes of one test; ``close()`` joins them and kills stragglers."""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.queues: list[Any] = []

    def queue(self) -> Any:
        q = CTX.Queue()
        self.queues.append(q)
        return q

    def event(self) -> Any:
        return CTX.Event()

    def start(self, target: Callable[..., None], out: Any, *args: Any) -> mp.process.BaseProcess:
        p = CTX.Process(target=_child_main, args=(target, out, args), daemon=True)
        p.start()
        CHILD_PIDS.add(p.pid)
        self.procs.append(p)
        return p

    @staticmethod
    def receive(out: Any, timeout: float = STEP) -> tuple:
        """The next report on ``out``; a child's exception becomes a test failure."""
        try:
            msg = out.get(timeout=timeout)
        except queue.Empty:
            raise ChildFailed(f"no report from the child process(es) within {timeout} s") from None
        if msg[0] == "error":
            raise ChildFailed(f"child process {msg[1]} failed:\n{msg[2]}")
        return msg

    def expect(self, out: Any, tag: str, timeout: float = STEP) -> tuple:
        msg = self.receive(out, timeout)
        assert msg[0] == tag, f"expected a {tag!r} report, got {msg!r:.500}"
        return msg

    def exit_codes(self, timeout: float = STEP) -> dict[int, int | None]:
        """Wait for every child to exit; their exit codes by pid (None: still running)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return {p.pid: p.exitcode for p in self.procs}

    def join(self, timeout: float = STEP) -> None:
        """Wait for every child to exit and check that each exited cleanly."""
        codes = self.exit_codes(timeout)
        assert all(c == 0 for c in codes.values()), f"child exit codes (pid: code): {codes}"

    def close(self) -> None:
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in self.queues:
            q.close()
            q.cancel_join_thread()

"""Worker functions for test_workers.py (module level, so spawned workers can import them).

Each takes its rank first, as ``WorkerProcesses`` calls it. Every wait is bounded
(``STEP``), so a worker the test forgets cannot outlive it for long. A worker waits for
what the test does (an event it sets, a state of a queue) instead of sleeping; the
``time.sleep(STEP)`` calls left keep a worker alive and idle until the test stops it.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from shmq import MessageQueue
from shmq.workers import connect_to_parent, report_ready

from _processes.harness import STEP, blocked_in_queue, wait_for


def _sleeper_command(ignore_sigterm: bool) -> list[str]:
    code = "import signal, time\n"
    if ignore_sigterm:
        # Says so once SIGTERM is ignored (read by _ignoring_sigterm).
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ignoring', flush=True)\n"
    code += f"time.sleep({STEP})\n"  # not synchronisation: alive until killed
    return [sys.executable, "-c", code]


def _ignoring_sigterm(*children: subprocess.Popen) -> None:
    """Wait until each child of ``_sleeper_command(True)`` (stdout piped) has installed
    its SIG_IGN: it says so on its stdout."""
    for child in children:
        assert child.stdout is not None
        line = child.stdout.readline()  # "" (end of file) if the child died first
        assert line.strip() == "ignoring", f"child {child.pid} said {line!r}"


def ready_then_sleep(rank: int, tag: str = "") -> None:
    """Report ready with ``(rank, pid, tag)``, then idle until stopped."""
    report_ready((rank, os.getpid(), tag))
    time.sleep(STEP)  # not synchronisation: idle until stopped


def ready_then_exit(rank: int, code: int, go: Any = None) -> None:
    """Report ready, then exit with ``code`` once the test sets the event ``go`` (after
    every worker was ready: an exit before that would fail the wait for ready). Without
    ``go`` (a group of one, whose ready report comes before its exit): at once."""
    report_ready(rank)
    if go is not None and not go.wait(STEP):
        raise TimeoutError(f"rank {rank}: the test never said go")
    sys.exit(code)


def some_never_ready(rank: int, ready_ranks: tuple[int, ...]) -> None:
    """Only the ranks in ``ready_ranks`` report ready; all idle until stopped."""
    if rank in ready_ranks:
        report_ready()
    time.sleep(STEP)  # not synchronisation: idle until stopped


def one_fails_in_setup(rank: int, failing_rank: int) -> None:
    """Every rank makes a queue (a shared-memory segment); ``failing_rank`` then raises."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    if rank == failing_rank:
        print(f"rank {rank}: loading the model", file=sys.stderr)
        raise ValueError(f"rank {rank}: CUDA out of memory while loading weights")
    report_ready(mq.buffer.name)
    time.sleep(STEP)  # not synchronisation: idle until stopped
    del mq


def raises_then_hangs_at_exit(rank: int, hang: str, ready: bool) -> None:
    """Make the interpreter's teardown hang for ``STEP`` seconds (``hang``: an atexit
    handler that sleeps, or a non-daemon thread), report ready if ``ready``, then raise:
    the worker prints its traceback and stays alive, tearing down, until stopped."""
    if hang == "atexit":
        atexit.register(time.sleep, STEP)  # not synchronisation: the hanging teardown under test
    else:
        # Not synchronisation: the hanging teardown under test.
        threading.Thread(target=time.sleep, args=(STEP,), name="hangs-the-exit").start()
    if ready:
        report_ready(os.getpid())
    print(f"rank {rank}: serving", file=sys.stderr)
    raise RuntimeError(f"rank {rank}: CUDA error (simulated), then a teardown that hangs")


def result_writer(rank: int) -> None:
    """Make a queue this worker writes (one reader: the parent), report its handle, and
    idle until stopped without writing anything: a parent dequeuing from it blocks."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    report_ready(mq.export_handle())
    mq.wait_until_ready(timeout=STEP)
    time.sleep(STEP)  # not synchronisation: idle until stopped
    del mq


def result_writer_that_fails(rank: int) -> None:
    """Like ``result_writer``, but raise once the parent (reader 0) is blocked in a call
    on the queue: the worker exits with code 1 through the interpreter's normal exit
    (which ends its queue too)."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    report_ready(mq.export_handle())
    mq.wait_until_ready(timeout=STEP)
    wait_for(lambda: blocked_in_queue(mq.buffer.name, 0), STEP, f"rank {rank}: the parent to block in dequeue")
    raise RuntimeError(f"rank {rank}: CUDA error (simulated)")


def idle_reader(rank: int, handle: Any) -> None:
    """Join the parent's queue as reader ``rank`` and never read: the parent's enqueue
    blocks once the ring is full."""
    mq = MessageQueue.create_from_handle(handle, rank)
    report_ready()
    mq.wait_until_ready(timeout=STEP)
    time.sleep(STEP)  # not synchronisation: idle until stopped


def stubborn_with_children(rank: int) -> None:
    """Ignore SIGTERM; start two children that ignore it too: one in this worker's process
    group, one in a session of its own (out of reach of a group kill). Report their pids."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    in_group = subprocess.Popen(_sleeper_command(True), stdout=subprocess.PIPE, text=True)
    own_session = subprocess.Popen(_sleeper_command(True), stdout=subprocess.PIPE, text=True, start_new_session=True)
    _ignoring_sigterm(in_group, own_session)
    report_ready((os.getpid(), in_group.pid, own_session.pid))
    time.sleep(STEP)  # not synchronisation: idle until killed


def dies_leaving_a_child(rank: int, go: Any) -> None:
    """Start a child (in this worker's process group), report its pid, then die once the
    test sets the event ``go`` (after its wait for ready returned: a death before that
    would fail the wait)."""
    child = subprocess.Popen(_sleeper_command(False))
    report_ready(child.pid)
    if not go.wait(STEP):
        raise TimeoutError(f"rank {rank}: the test never said go")
    os._exit(3)


def last_words_then_sigbus(rank: int, n_lines: int) -> None:
    """Write ``n_lines`` numbered lines to stderr after reporting ready, then die of
    SIGBUS (faulthandler adds its report)."""
    report_ready()
    for i in range(n_lines):
        print(f"last words {i}", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGBUS)
    time.sleep(STEP)  # not synchronisation: never gets past the signal


def remote_worker_that_misses_the_first_sigterm(out: Any, ticket: str, rank: int) -> None:
    """A remote worker whose main thread enters a blocking call just as its link's
    SIGTERM lands, as a race can make it: the signal is taken (``sigwait``) before
    CPython's handler sees it, then the main thread sleeps. Only another SIGTERM can
    wake it before its grace ends."""
    # Blocked here, so in every thread started from here on too (the link's watch, the
    # queue's feeder): the link's SIGTERM stays pending until sigwait takes it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    out.put(("pid", os.getpid()))
    with connect_to_parent(ticket, rank):
        report_ready({"rank": rank, "pid": os.getpid(), "where": "remote"})
        out.put(("ready",))
        signal.sigwait({signal.SIGTERM})
        out.put(("first SIGTERM taken",))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        time.sleep(STEP)  # not synchronisation: the blocking call the second SIGTERM must end


def remote_worker(out: Any, ticket: str, rank: int, fail: bool, go: Any = None) -> None:
    """A worker the parent did not start (as on another machine): join over TCP, report
    ready (or raise first, when ``fail``), then idle until the parent stops it. With the
    event ``go``: join only once the test sets it (after the ``pid`` report)."""
    out.put(("pid", os.getpid()))
    if go is not None and not go.wait(STEP):
        raise TimeoutError(f"rank {rank}: the test never said go")
    with connect_to_parent(ticket, rank):
        if fail:
            raise RuntimeError(f"remote rank {rank}: no route to the model store")
        report_ready({"rank": rank, "pid": os.getpid(), "where": "remote"})
        out.put(("ready",))
        time.sleep(STEP)  # not synchronisation: idle until stopped


# ---------------------------------------------------------------------------------
# Worker groups (test_worker_groups.py): a sibling's death, join, readers that leave


def exit_when_told(rank: int, codes: tuple[int, ...], events: tuple[Any, ...]) -> None:
    """Report ready, then exit with ``codes[rank]`` once the test sets ``events[rank]``."""
    report_ready(rank)
    if not events[rank].wait(STEP):
        raise TimeoutError(f"rank {rank}: the test never said go")
    sys.exit(codes[rank])


def group_reader(rank: int, handle: Any, failing_rank: int, out: Any) -> None:
    """The README's worker loop, catching the end of the queue: read batches until
    ``None``; ``failing_rank`` raises at batch 2. A worker whose queue is shut down puts
    ``(rank, "shut down", what sibling_failure() says)`` in ``out`` and returns (exit
    code 0); one that read its ``None``, ``(rank, "finished", None)``."""
    from shmq import QueueShutDownError
    from shmq.workers import sibling_failure

    queue = MessageQueue.create_from_handle(handle, rank)
    report_ready()
    queue.wait_until_ready(timeout=STEP)
    try:
        while (batch := queue.dequeue(timeout=STEP)) is not None:
            if rank == failing_rank and batch == 2:
                raise RuntimeError(f"rank {rank}: CUDA error at batch {batch} (simulated)")
    except QueueShutDownError:
        failed = sibling_failure()
        said = None if failed is None else (failed.name, failed.rank, failed.exitcode, failed.pid, str(failed))
        out.put((rank, "shut down", said))
        return
    out.put((rank, "finished", None))


def reads_one_then_returns(rank: int, handle: Any) -> None:
    """Join the parent's queue, read one message, and end normally (the target returns)
    while the parent still sends."""
    mq = MessageQueue.create_from_handle(handle, rank)
    report_ready()
    mq.wait_until_ready(timeout=STEP)
    mq.dequeue(timeout=STEP)


_KEPT: list[Any] = []  # a reader kept past the target's end (a module global)


def _reader_that_ends(handle: Any, how: str, out: Any) -> None:
    """Read one message from ``handle`` as reader 0, then end ``how``: "return" (the
    reader a local of the target), "global" (kept in a module global, so only the
    process's exit lets it go), "sys.exit" (sys.exit(0) with the reader a local),
    "os._exit" (no exit hook at all: a death)."""
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)
    out.send(("read", mq.dequeue(timeout=STEP)))  # a pipe: sent before os._exit too
    if how == "global":
        _KEPT.append(mq)
    elif how == "sys.exit":
        sys.exit(0)
    elif how == "os._exit":
        os._exit(0)


def writer_past_a_reader_that_ends(out: Any, start_method: str, how: str) -> None:
    """A writer (``on_dead_reader="raise"``, 2 chunks) whose one reader, a child started
    with ``start_method``, reads one message and ends ``how`` (see
    ``_reader_that_ends``); the writer then sends 6 more. Puts ``("done", error or None,
    dropped_readers, the reader's exit code, shmq's log records at INFO and above)`` in
    ``out``. In a process of its own, so that its logging is set up from the start."""
    import logging
    import multiprocessing

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    shmq_logger = logging.getLogger("shmq")
    shmq_logger.setLevel(logging.INFO)
    shmq_logger.addHandler(Keep())
    ctx = multiprocessing.get_context(start_method)
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, arena_bytes=0)
    from_reader, to_writer = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_reader_that_ends, args=(mq.export_handle(), how, to_writer))
    reader.start()
    to_writer.close()
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue("first", timeout=STEP)
    assert from_reader.poll(STEP) and from_reader.recv() == ("read", "first")
    reader.join(STEP)
    error = None
    try:
        for i in range(6):
            mq.enqueue(i, timeout=STEP)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    out.put(("done", error, mq.dropped_readers, reader.exitcode, records))


def remote_worker_told_of_a_failure(out: Any, ticket: str, rank: int) -> None:
    """A remote worker (joined over TCP) that waits until its parent tells it of a
    sibling's failure, reports what ``sibling_failure()`` says, and leaves (code 0)."""
    from shmq.workers import sibling_failure

    with connect_to_parent(ticket, rank):
        report_ready(rank)
        # Polled: the link's watch thread stores the notice.
        failed = wait_for(sibling_failure, STEP, f"rank {rank}: news of a sibling's failure", interval=0.01)
        out.put(("told", failed.name, failed.rank, failed.exitcode, failed.pid, str(failed)))


# ---------------------------------------------------------------------------------
# The worker link's bounds (test_worker_link_bounds.py): a worker against a stranger


def _peak_rss() -> int:
    """This process's high-water mark of resident memory (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def joins_and_reports_how(out: Any, ticket: str, rank: int, timeout: float) -> None:
    """Try ``connect_to_parent(ticket, rank, timeout=timeout)`` once and report how it
    went: ("joined" | "failed", the exception's type name or "", its message, the seconds
    it took, how much the peak of this process's resident memory grew)."""
    peak = _peak_rss()
    start = time.monotonic()
    try:
        link = connect_to_parent(ticket, rank, die_with_parent=False, timeout=timeout)
    except Exception as e:
        out.put(("failed", type(e).__name__, str(e), time.monotonic() - start, _peak_rss() - peak))
        return
    link.close(0)
    out.put(("joined", "", "", time.monotonic() - start, _peak_rss() - peak))

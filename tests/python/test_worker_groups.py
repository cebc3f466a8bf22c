"""Worker groups on a user's second day (issue 45, item 2), in real processes:

- a sibling's death under ``monitor(queue)``: the surviving workers' queue is shut down,
  they are told which worker failed (``sibling_failure``) and end cleanly, exit code 0;
- ``join()`` raises a failure once (not one that ``wait_until_ready``, a monitor or an
  earlier ``join`` raised already), and returns the exit codes by name in rank order,
  as ``wait_until_ready`` returns the ready infos by rank;
- a reader whose process ends normally (its reader object dropped, a module global let
  go at exit, ``sys.exit``; every start method) *left* its queue: its writer goes on
  without it and says "left", not "died"; a reader that ends without any exit hook
  (``os._exit``) still died.

Every wait is bounded. Worker pids join the leftover-segment check.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

import _processes
from _processes import worker_targets as targets
from shmq import MessageQueue, QueueShutDownError, WorkerDiedError, WorkerProcesses
from shmq.workers import sibling_failure

STARTUP = 60.0  # spawned interpreters on a busy 2-core machine: only needs to finish
SPAWN = multiprocessing.get_context("spawn")


# ---------------------------------------------------------------------------------
# A sibling's death


def test_a_siblings_death_ends_the_others_cleanly_and_names_it():
    """Worker 1 of 3 fails at batch 2 while the parent streams batches under
    ``monitor(queue)``: the parent gets the WorkerDiedError; workers 0 and 2 get
    QueueShutDownError from ``dequeue``, ``sibling_failure()`` names Worker_1 (its pid,
    its exit code, its traceback's last line), and they end with exit code 0, so the
    only failure is worker 1's; ``join`` then returns every exit code without raising
    that failure again."""
    out = SPAWN.Queue()
    queue = MessageQueue(n_reader=3, n_local_reader=3, max_chunk_bytes=1024, max_chunks=4, arena_bytes=0)
    with WorkerProcesses(targets.group_reader, 3, args=(queue.export_handle(), 1, out)) as workers:
        pids = _processes.track(workers.pids)
        workers.wait_until_ready(timeout=STARTUP)
        queue.wait_until_ready(timeout=STARTUP)
        with pytest.raises(WorkerDiedError) as info:
            with workers.monitor(queue):
                step = 0
                while True:  # until the monitor ends it: only a failure stops this loop
                    queue.enqueue(step, timeout=STARTUP)
                    step += 1
        err = info.value
        assert (err.name, err.rank, err.pid, err.exitcode) == ("Worker_1", 1, pids[1], 1)
        seen = {}
        for _ in range(2):
            rank, how, said = out.get(timeout=STARTUP)
            seen[rank] = (how, said)
        assert sorted(seen) == [0, 2]
        for rank in (0, 2):
            how, said = seen[rank]
            assert how == "shut down", seen
            name, failed_rank, exitcode, pid, message = said
            assert (name, failed_rank, exitcode, pid) == ("Worker_1", 1, 1, pids[1]), said
            assert message == str(err), said
            assert "RuntimeError: rank 1: CUDA error at batch 2 (simulated)" in message
        # The survivors ended cleanly: the only failure is worker 1's, and join (which
        # does not raise it again) has every exit code, by name, in rank order.
        codes = workers.join(timeout=STARTUP)
        assert codes == {"Worker_0": 0, "Worker_1": 1, "Worker_2": 0}
        assert list(codes) == workers.names
        assert workers.failures == [err]
    assert sibling_failure() is None  # not in a worker


def test_a_remote_worker_is_told_of_a_siblings_failure_on_its_link(children):
    event = SPAWN.Event()
    workers = WorkerProcesses(targets.exit_when_told, 1, args=((3,), (event,)), n_remote=1, remote_host="127.0.0.1")
    with workers:
        (local_pid,) = _processes.track(workers.pids)
        out = children.queue()
        children.start(targets.remote_worker_told_of_a_failure, out, str(workers.ticket), 1)
        assert workers.wait_until_ready(timeout=STARTUP) == [0, 1]
        event.set()  # Worker_0 exits with code 3
        _, name, rank, exitcode, pid, message = children.expect(out, "told", timeout=STARTUP)
        assert (name, rank, exitcode, pid) == ("Worker_0", 0, 3, local_pid)
        assert message.startswith(f"Worker_0 (rank 0, pid {local_pid}) exited with code 3")
        with pytest.raises(WorkerDiedError, match="Worker_0"):  # nobody had raised it
            workers.join(timeout=STARTUP)
        assert workers.join(timeout=STARTUP) == {"Worker_0": 3, "Worker_1": 0}


# ---------------------------------------------------------------------------------
# join() and wait_until_ready()


def test_join_does_not_raise_a_failure_the_monitor_raised():
    events = tuple(SPAWN.Event() for _ in range(3))
    with WorkerProcesses(targets.exit_when_told, 3, args=((0, 3, 0), events)) as workers:
        _processes.track(workers.pids)
        assert workers.wait_until_ready(timeout=STARTUP) == [0, 1, 2]  # infos, by rank
        with pytest.raises(WorkerDiedError, match=r"Worker_1 \(rank 1, pid \d+\) exited with code 3") as info:
            with workers.monitor() as monitor:
                events[1].set()
                assert monitor.cancel.wait(STARTUP)
        events[2].set()
        events[0].set()
        codes = workers.join(timeout=STARTUP)  # not the failure again
        assert codes == {"Worker_0": 0, "Worker_1": 3, "Worker_2": 0}
        assert list(codes) == workers.names  # rank order, not the order they exited in
        assert workers.failures == [info.value]
        assert workers.join(timeout=STARTUP) == codes  # and again


def test_join_does_not_raise_a_failure_wait_until_ready_raised():
    with WorkerProcesses(targets.one_fails_in_setup, 2, args=(1,)) as workers:
        _processes.track(workers.pids)
        with pytest.raises(WorkerDiedError, match="before it was ready") as info:
            workers.wait_until_ready(timeout=STARTUP, close_on_failure=False)
        assert info.value.rank == 1
        # Worker 0 idles: join waits for it (a TimeoutError), not the failure again.
        with pytest.raises(TimeoutError, match=r"1 worker\(s\) still running after 0.5 s: Worker_0"):
            workers.join(timeout=0.5)


def test_join_raises_each_failure_once():
    """A failure nobody has raised yet is raised by join, once; a later failure is raised
    by the next join; then join returns the exit codes."""
    events = tuple(SPAWN.Event() for _ in range(3))
    with WorkerProcesses(targets.exit_when_told, 3, args=((0, 3, 4), events)) as workers:
        _processes.track(workers.pids)
        workers.wait_until_ready(timeout=STARTUP)
        events[2].set()
        with pytest.raises(WorkerDiedError, match=r"Worker_2 \(rank 2, pid \d+\) exited with code 4"):
            workers.join(timeout=STARTUP)
        events[1].set()
        with pytest.raises(WorkerDiedError, match=r"Worker_1 \(rank 1, pid \d+\) exited with code 3"):
            workers.join(timeout=STARTUP)
        events[0].set()
        codes = workers.join(timeout=STARTUP)
        assert codes == {"Worker_0": 0, "Worker_1": 3, "Worker_2": 4}
        assert list(codes) == ["Worker_0", "Worker_1", "Worker_2"]
        # finished() keeps the order the workers exited in.
        assert list(workers.finished()) == ["Worker_2", "Worker_1", "Worker_0"]


def test_a_new_failure_after_a_reported_one_wakes_join():
    """join, waiting past a failure it already reported, raises a new one at once."""
    events = tuple(SPAWN.Event() for _ in range(3))
    with WorkerProcesses(targets.exit_when_told, 3, args=((3, 0, 5), events)) as workers:
        _processes.track(workers.pids)
        workers.wait_until_ready(timeout=STARTUP)
        events[0].set()
        with pytest.raises(WorkerDiedError, match="Worker_0"):
            workers.join(timeout=STARTUP)
        started = time.monotonic()
        events[2].set()  # worker 1 never exits: join waits until worker 2 fails
        with pytest.raises(WorkerDiedError, match=r"Worker_2 \(rank 2, pid \d+\) exited with code 5"):
            workers.join(timeout=STARTUP)
        assert time.monotonic() - started < STARTUP / 2
        events[1].set()
        assert workers.join(timeout=STARTUP) == {"Worker_0": 3, "Worker_1": 0, "Worker_2": 5}


# ---------------------------------------------------------------------------------
# A reader that ends normally left its queue; one with no exit at all died


@pytest.mark.parametrize(
    "start_method, how",
    [
        ("spawn", "return"),
        ("spawn", "global"),
        ("spawn", "sys.exit"),
        ("fork", "return"),
        ("fork", "global"),
        ("forkserver", "global"),
    ],
)
def test_a_reader_that_ends_normally_left_and_its_writer_goes_on(start_method, how):
    """The writer (``on_dead_reader="raise"``) needs the chunks its reader never read:
    it goes on without the reader that left, raises nothing, drops nobody as dead, and
    says once, at INFO, that the reader left."""
    error, dropped, exitcode, records = _writer_past_a_reader_that_ends(start_method, how)
    assert error is None, error
    assert dropped == [] and exitcode == 0
    assert not any("died" in r for r in records), records
    left = [r for r in records if " left queue " in r]
    assert len(left) == 1, records
    assert left[0].startswith("INFO shmq: reader 0 (rank 0) left queue 'shmq_ring_"), left
    assert "going on without it" in left[0]


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_reader_that_ends_with_no_exit_hook_died(start_method):
    """``os._exit``: nothing of the process's end runs, so the reader never left: the
    writer reports its death as before."""
    error, dropped, exitcode, records = _writer_past_a_reader_that_ends(start_method, "os._exit")
    assert error is not None and error.startswith("PeerDiedError: reader 0 (pid "), error
    assert "died before reading chunk" in error
    assert not any(" left queue " in r for r in records), records


def _writer_past_a_reader_that_ends(start_method: str, how: str) -> tuple:
    """``targets.writer_past_a_reader_that_ends`` in a process of its own (not daemonic:
    it starts the reader): its report, less the tag."""
    out = SPAWN.Queue()
    writer = SPAWN.Process(target=targets.writer_past_a_reader_that_ends, args=(out, start_method, how))
    writer.start()
    _processes.CHILD_PIDS.add(writer.pid)
    try:
        tag, *report = out.get(timeout=STARTUP)
        assert tag == "done"
        writer.join(STARTUP)
        assert writer.exitcode == 0
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join(STARTUP)
    return tuple(report)


def test_a_worker_that_finishes_early_is_not_a_death_for_its_writer():
    """The issue's case: worker 1 returns after its first batch while the parent goes on
    sending under ``monitor(queue)``. The parent's writer goes on without it (it left):
    no PeerDiedError, no WorkerDiedError; the other worker reads every batch."""
    queue = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1024, max_chunks=2, arena_bytes=0)
    with WorkerProcesses(targets.reads_one_then_returns, 1, args=(queue.export_handle(),)) as workers:
        _processes.track(workers.pids)
        other = MessageQueue.create_from_handle(queue.export_handle(), 1)  # reads in this process
        workers.wait_until_ready(timeout=STARTUP)
        queue.wait_until_ready(timeout=STARTUP)
        other.wait_until_ready(timeout=STARTUP)
        got = []
        with workers.monitor(queue) as monitor:
            queue.enqueue(0, timeout=STARTUP)
            got.append(other.dequeue(timeout=STARTUP))
            assert workers.join(timeout=STARTUP) == {"Worker_0": 0}  # it has gone
            for i in range(1, 6):  # more than the ring holds
                queue.enqueue(i, timeout=STARTUP)
                got.append(other.dequeue(timeout=STARTUP))
        assert monitor.error is None
        assert got == list(range(6))
        assert queue.dropped_readers == []
    del other


def test_a_reader_dropped_in_this_process_leaves_and_the_others_read_on():
    """A reader object dropped (here, before reading anything) leaves: the writer fills
    the ring past it, the other reader gets every message, then the writer's end."""
    queue = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1024, max_chunks=2, arena_bytes=0)
    leaving = MessageQueue.create_from_handle(queue.export_handle(), 0)
    staying = MessageQueue.create_from_handle(queue.export_handle(), 1)
    del leaving  # leaves at once, having read nothing
    got = []
    for i in range(4):  # twice what the ring holds
        queue.enqueue(i, timeout=STARTUP)
        got.append(staying.dequeue(timeout=STARTUP))
    assert got == [0, 1, 2, 3]
    assert queue.dropped_readers == []
    queue.shutdown()
    with pytest.raises(QueueShutDownError):
        staying.dequeue(timeout=STARTUP)

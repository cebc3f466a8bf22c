"""WorkerProcesses: start, ready handshake with a deadline, supervision, shutdown of whole
process trees, workers that die with their parent, remote workers over TCP.

All in real processes. Every wait is bounded; the bounds that the tests assert ("woken
within 1 s", "gone within 1 s") are liveness requirements from the issue, far above what
the mechanisms take (a pidfd wake-up, PR_SET_PDEATHSIG), not performance measurements.
Worker pids are added to the leftover-segment check's pids, so a segment a worker leaves
in /dev/shm fails the test.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import _processes
from _processes import worker_targets as targets
from shmq import MessageQueue, WorkerDiedError, WorkerProcesses
import _link_by_hand as by_hand
from shmq import _core
from shmq.workers import WorkersNotReadyError, WorkerTicket, connect_to_parent, protocol, report_ready

HERE = Path(__file__).resolve().parent
WAKE_WITHIN = 1.0  # the bound for waking a parent blocked on a dead worker
GONE_WITHIN = 1.0  # the bound for workers to die with a SIGKILLed parent
# Generous bounds for things that only need to finish (start-up of spawned interpreters
# on a busy 2-core machine).
STARTUP = 60.0


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie (dead, waiting to be reaped)."""
    return not _processes.still_running([pid])


def _wait_gone(pids, within: float) -> list[int]:
    """The pids still running after ``within`` seconds (0: now); the caller asserts."""
    with contextlib.suppress(_processes.WaitTimeout):
        _processes.wait_for(lambda: not _processes.still_running(pids), within, "the processes to end", 0.01)
    return _processes.still_running(pids)


# ---------------------------------------------------------------------------------
# Start and ready


def test_all_workers_ready_and_closed():
    with WorkerProcesses(targets.ready_then_sleep, 4, args=("hello",), grace=5.0) as workers:
        pids = _processes.track(workers.pids)
        assert workers.names == ["Worker_0", "Worker_1", "Worker_2", "Worker_3"]
        assert [p.name for p in workers.processes] == workers.names
        infos = workers.wait_until_ready(timeout=STARTUP)
        assert infos == [(rank, pid, "hello") for rank, pid in enumerate(pids)]
        assert all(i.ready and not i.exited for i in workers.info())
        assert workers.finished() == {}
        assert workers.join_first(timeout=0.1) is None
    assert workers.closed
    assert _wait_gone(pids, 0) == []
    # SIGTERM became SystemExit(128 + SIGTERM) in each worker: a graceful exit.
    assert workers.finished() == {name: 128 + signal.SIGTERM for name in workers.names}
    assert workers.failures == []


def test_close_is_idempotent_and_runs_on_garbage_collection():
    workers = WorkerProcesses(targets.ready_then_sleep, 2)
    pids = _processes.track(workers.pids)
    workers.wait_until_ready(timeout=STARTUP)
    workers.close()
    workers.close()
    workers.close(grace=0)
    assert _wait_gone(pids, 0) == []
    with pytest.raises(RuntimeError, match="closed"):
        workers.wait_until_ready(timeout=1)

    # Dropped without close(): the finalizer shuts them down.
    workers = WorkerProcesses(targets.ready_then_sleep, 2)
    pids = _processes.track(workers.pids)
    workers.wait_until_ready(timeout=STARTUP)
    del workers
    gc.collect()
    assert _wait_gone(pids, 0) == []


def test_a_worker_raising_during_setup_is_named_and_the_others_are_stopped():
    timeout = STARTUP
    t0 = time.monotonic()
    workers = WorkerProcesses(targets.one_fails_in_setup, 4, args=(2,))
    pids = _processes.track(workers.pids)
    with pytest.raises(WorkerDiedError) as info:
        workers.wait_until_ready(timeout=timeout)
    elapsed = time.monotonic() - t0
    err = info.value
    assert (err.name, err.rank, err.pid, err.exitcode) == ("Worker_2", 2, pids[2], 1)
    assert err.before_ready and err.signal_name is None
    message = str(err)
    assert message.startswith(f"Worker_2 (rank 2, pid {pids[2]}) exited with code 1 before it was ready")
    assert "rank 2: loading the model" in message  # its stderr, before the traceback
    assert "ValueError: rank 2: CUDA out of memory while loading weights" in message
    assert err.stderr_tail[-1] == "ValueError: rank 2: CUDA out of memory while loading weights"
    # At once, not at the deadline.
    assert elapsed < timeout / 2, elapsed
    # wait_until_ready closed the group: every worker is gone, and so are their segments.
    assert workers.closed
    assert _wait_gone(pids, 0) == []
    assert _processes.segments_of(pids) == set()
    assert set(workers.finished()) == set(workers.names)


def test_a_start_failure_stops_the_workers_already_started():
    before = {p.pid for p in psutil.Process().children()}

    class PicklesOnce:
        pickled = 0

        def __reduce__(self):
            PicklesOnce.pickled += 1
            if PicklesOnce.pickled > 1:
                raise pickle.PicklingError("this argument cannot go to a second worker")
            return (int, (0,))

    with pytest.raises(pickle.PicklingError, match="second worker"):
        WorkerProcesses(targets.ready_then_sleep, 3, args=(PicklesOnce(),))
    assert PicklesOnce.pickled == 2  # so Worker_0 was started
    started = [p for p in psutil.Process().children() if p.pid not in before]
    started = [p for p in started if "resource_tracker" not in " ".join(p.cmdline())]
    assert started == []


def test_a_deadline_that_passes_names_the_workers_not_ready():
    workers = WorkerProcesses(targets.some_never_ready, 4, args=((0, 2),))
    pids = _processes.track(workers.pids)
    # Ranks 0 and 2 report ready (however slowly this machine starts them); 1 and 3 never.
    _processes.wait_for(lambda: all(workers.info()[r].ready for r in (0, 2)), STARTUP, "ranks 0 and 2 to be ready")
    t0 = time.monotonic()
    with pytest.raises(WorkersNotReadyError) as info:
        workers.wait_until_ready(timeout=1.5)
    assert time.monotonic() - t0 >= 1.5
    assert isinstance(info.value, TimeoutError)
    assert info.value.not_ready == ["Worker_1", "Worker_3"]
    message = str(info.value)
    assert message.startswith("2 of 4 worker(s) not ready after 1.5 s:")
    assert f"Worker_1 (rank 1, pid {pids[1]})" in message and f"Worker_3 (rank 3, pid {pids[3]})" in message
    assert "Worker_0" not in message and "Worker_2" not in message
    assert workers.closed and _wait_gone(pids, 0) == []


def test_report_ready_outside_a_worker_is_an_error():
    with pytest.raises(RuntimeError, match="report_ready\\(\\) is for worker processes"):
        report_ready()


# A script that starts workers without `if __name__ == "__main__":` (line 7). Every spawned
# worker re-imports it as its main module and fails there, before shmq's bootstrap runs.
_SCRIPT_WITHOUT_MAIN_GUARD = """\
import json
from shmq import WorkerDiedError, WorkerProcesses, report_ready

def worker(rank):
    report_ready()

workers = WorkerProcesses(worker, 2, forward_stderr=False)
try:
    workers.wait_until_ready(timeout={timeout})
except WorkerDiedError as e:
    print(json.dumps({{"message": str(e), "tail": e.stderr_tail, "pids": workers.pids}}))
"""


def test_a_worker_that_fails_while_spawn_starts_it_shows_its_traceback(tmp_path):
    script = tmp_path / "no_main_guard.py"
    script.write_text(_SCRIPT_WITHOUT_MAIN_GUARD.format(timeout=STARTUP))
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=2 * STARTUP
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    _processes.CHILD_PIDS.update(report["pids"])
    message, tail = report["message"], report["tail"]
    assert " exited with code 1 before it was ready; the last lines of its stderr:\n" in message
    # The worker's own traceback: the script's line that started workers again, and why.
    assert f'File "{script}", line 7, in <module>' in message
    assert "workers = WorkerProcesses(worker, 2, forward_stderr=False)" in message
    assert tail[-1].startswith("RuntimeError: WorkerProcesses(...) ran while this process was starting as a spawned")
    assert 'under `if __name__ == "__main__":`' in tail[-1]
    assert "wrote nothing" not in message
    # It went into the parent's pipe, not straight to the terminal (forwarding is off).
    assert "Traceback" not in run.stderr, run.stderr
    assert _wait_gone(report["pids"], 0) == []


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_target_whose_module_fails_to_import_in_the_worker(tmp_path, monkeypatch, context):
    # The module imports in this process and raises in any other: a worker fails while it
    # unpickles its target, before shmq's bootstrap runs.
    name = f"_fails_to_import_in_workers_{context}"
    (tmp_path / f"{name}.py").write_text(
        "import os\n"
        f"if os.getpid() != {os.getpid()}:\n"
        "    raise ImportError('no GPU visible in this worker')\n"
        "def target(rank):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get this sys.path
    try:
        module = __import__(name)
        workers = WorkerProcesses(module.target, 1, context=context, forward_stderr=False)
        pids = _processes.track(workers.pids)
        with pytest.raises(WorkerDiedError) as info:
            workers.wait_until_ready(timeout=STARTUP)
    finally:
        sys.modules.pop(name, None)
    err = info.value
    assert (err.name, err.pid, err.exitcode, err.before_ready) == ("Worker_0", pids[0], 1, True)
    if context == "spawn":
        # Its stderr is the parent's pipe from its first line of Python on.
        assert err.stderr_tail[-1] == "ImportError: no GPU visible in this worker"
        assert f'File "{tmp_path / name}.py", line 3, in <module>' in str(err)
    else:
        # A fork server's child gets the pipe only from the bootstrap on: the error says
        # where the rest went instead of claiming the worker was silent.
        assert err.stderr_tail == []
        assert str(err).endswith(
            "(it wrote nothing to stderr after shmq's bootstrap took it over; what it wrote while"
            " starting, e.g. while re-importing the main module, went to the parent's stderr)"
        )
    assert workers.closed and _wait_gone(pids, 0) == []


def test_workers_started_from_a_short_lived_thread_survive_it():
    # PR_SET_PDEATHSIG fires when the forking *thread* exits: WorkerProcesses forks from
    # a long-lived launcher thread when it is not called on the main thread.
    made = []
    t = threading.Thread(target=lambda: made.append(WorkerProcesses(targets.ready_then_sleep, 2)))
    t.start()
    t.join(STARTUP)
    workers = made[0]
    pids = _processes.track(workers.pids)
    try:
        workers.wait_until_ready(timeout=STARTUP)
        assert workers.join_first(timeout=0.5) is None, "a worker died with the thread that started it"
        assert all(not _gone(p) for p in pids)
    finally:
        workers.close()


# ---------------------------------------------------------------------------------
# Supervision


def test_stderr_tail_and_signal_name_of_a_worker_killed_by_sigbus(capfd):
    with WorkerProcesses(targets.last_words_then_sigbus, 1, args=(30,), stderr_tail_lines=20) as workers:
        pids = _processes.track(workers.pids)
        # It dies right after reporting ready: the wait may see the death already (a
        # failed worker raises there too); the group stays open for what follows.
        with contextlib.suppress(WorkerDiedError):
            workers.wait_until_ready(timeout=STARTUP, close_on_failure=False)
        first = workers.join_first(timeout=STARTUP)
        assert first is not None and first.exitcode == -signal.SIGBUS
        # The failure happened before the monitor was opened: leaving it raises anyway.
        with pytest.raises(WorkerDiedError) as info:
            with workers.monitor() as monitor:
                assert monitor.cancel.is_set()
    err = info.value
    assert (err.name, err.pid, err.signal_name) == ("Worker_0", pids[0], "SIGBUS")
    assert str(err).startswith(f"Worker_0 (rank 0, pid {pids[0]}) was killed by SIGBUS while it was running")
    assert len(err.stderr_tail) == 20
    assert "Fatal Python error: Bus error" in err.stderr_tail  # faulthandler, after the last words
    words = [line for line in err.stderr_tail if line.startswith("last words")]
    assert words and words == [f"last words {i}" for i in range(30 - len(words), 30)]
    # Still forwarded to the parent's stderr, every line, prefixed with the worker.
    forwarded = capfd.readouterr().err
    assert f"(Worker_0 pid={pids[0]}) last words 0\n" in forwarded
    assert f"(Worker_0 pid={pids[0]}) last words 29\n" in forwarded


@pytest.mark.parametrize("blocked_in", ["dequeue", "enqueue"])
def test_a_worker_sigkilled_mid_run_wakes_the_blocked_parent(blocked_in):
    if blocked_in == "dequeue":
        # Each worker writes a queue the parent reads; the parent waits on worker 1's.
        queue = None
        workers = WorkerProcesses(targets.result_writer, 2)
    else:
        # The parent writes a queue the workers read but never do: the ring fills up.
        queue = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1024, max_chunks=2)
        workers = WorkerProcesses(targets.idle_reader, 2, args=(queue.export_handle(),))
    with workers:
        pids = _processes.track(workers.pids)
        handles = workers.wait_until_ready(timeout=STARTUP)
        if blocked_in == "dequeue":
            readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
            for r in readers:
                r.wait_until_ready(timeout=STARTUP)
            blocked_queue = readers[1]
        else:
            queue.wait_until_ready(timeout=STARTUP)
            for i in range(2):
                queue.enqueue(i, timeout=STARTUP)  # fills both chunks
            blocked_queue = queue

        killed_at = []

        def kill_worker_1():
            killed_at.append(time.monotonic())
            os.kill(pids[1], signal.SIGKILL)

        timer = threading.Timer(0.5, kill_worker_1)
        with pytest.raises(WorkerDiedError) as info:
            with workers.monitor(blocked_queue) as monitor:
                timer.start()
                if blocked_in == "dequeue":
                    blocked_queue.dequeue()  # no timeout: only the monitor can end it
                else:
                    blocked_queue.enqueue("one more")
        woken_after = time.monotonic() - killed_at[0]
        timer.join()
        err = info.value
        assert (err.name, err.rank, err.pid, err.exitcode) == ("Worker_1", 1, pids[1], -signal.SIGKILL)
        assert "Worker_1 (rank 1, pid" in str(err) and "was killed by SIGKILL while it was running" in str(err)
        # Chained from what woke the blocked call.
        assert isinstance(err.__cause__, RuntimeError)
        assert monitor.cancel.is_set()
        assert woken_after < WAKE_WITHIN, f"the blocked {blocked_in} was woken {woken_after:.2f} s after the kill"
        if blocked_in == "dequeue":
            # The killed worker could not remove its segment: its janitor does (or, where
            # it has not yet, close() below).
            del readers, blocked_queue
    # close() removed the segment the killed worker left behind.
    assert _processes.segments_of(pids) == set()
    assert _wait_gone(pids, 0) == []
    del queue


def test_a_worker_that_raises_is_named_though_its_queue_ends_first():
    # A worker that fails with an exception exits normally: its queue's writer ends the
    # queue at interpreter exit, so the parent's dequeue raises QueueShutDownError before
    # the supervisor has seen the worker go. The monitor must still name the worker.
    # (The worker raises once this dequeue is blocked.)
    with WorkerProcesses(targets.result_writer_that_fails, 1) as workers:
        (handle,) = workers.wait_until_ready(timeout=STARTUP)
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready(timeout=STARTUP)
        with pytest.raises(WorkerDiedError) as info:
            with workers.monitor(reader):
                reader.dequeue()  # no timeout: ended by the worker's end
        err = info.value
        assert (err.rank, err.exitcode) == (0, 1)
        assert "CUDA error (simulated)" in str(err)
        del reader


@pytest.mark.parametrize(
    "hang, ready, context, capture_stderr",
    [
        ("atexit", False, "spawn", True),
        ("thread", True, "spawn", True),
        ("thread", True, "fork", True),
        ("atexit", True, "spawn", False),
    ],
)
def test_a_worker_that_raises_is_reported_before_its_teardown_ends(hang, ready, context, capture_stderr):
    # The worker's bootstrap sends a death notice once its traceback is printed, before
    # the interpreter tears down (atexit handlers, non-daemon threads: here, one hangs
    # for targets.STEP seconds). The parent's error comes while the worker still runs,
    # with the same message as an exit would have given (the code it exits with, 1).
    with WorkerProcesses(
        targets.raises_then_hangs_at_exit,
        1,
        args=(hang, ready),
        context=context,
        capture_stderr=capture_stderr,
        grace=1.0,
    ) as workers:
        (pid,) = _processes.track(workers.pids)
        with pytest.raises(WorkerDiedError) as info:
            if ready:
                workers.wait_until_ready(timeout=STARTUP, close_on_failure=False)
                workers.join(timeout=targets.STEP / 2)  # the failure, not a TimeoutError
            else:
                workers.wait_until_ready(timeout=targets.STEP / 2, close_on_failure=False)
        assert not _gone(pid), "the failure was reported only when the worker had exited"
        assert not workers.info()[0].exited and workers.finished() == {}
        err = info.value
        assert (err.rank, err.pid, err.exitcode, err.before_ready) == (0, pid, 1, not ready)
        when = "while it was running" if ready else "before it was ready"
        assert str(err).startswith(f"Worker_0 (rank 0, pid {pid}) exited with code 1 {when}")
        last = "RuntimeError: rank 0: CUDA error (simulated), then a teardown that hangs"
        assert err.stderr_tail[-1] == last  # stderr's tail, or (not captured) the notice's
        assert "Traceback (most recent call last):" in err.stderr_tail
        # What else it wrote comes from its stderr pipe only (a forked worker under
        # pytest writes to pytest's sys.stderr, not fd 2: the notice's lines then too).
        if capture_stderr and context == "spawn":
            assert err.stderr_tail[0] == "rank 0: serving"
        elif not capture_stderr:
            assert "rank 0: serving" not in err.stderr_tail
        assert workers.failures == [err]
    # close() stopped the hanging teardown (SIGTERM, or SIGKILL after the grace).
    assert _wait_gone([pid], 0) == []
    assert _processes.segments_of([pid]) == set()


def test_monitor_does_not_fire_for_workers_that_finish():
    go = multiprocessing.get_context("spawn").Event()
    with WorkerProcesses(targets.ready_then_exit, 3, args=(0, go)) as workers:
        _processes.track(workers.pids)
        workers.wait_until_ready(timeout=STARTUP)
        with workers.monitor() as monitor:
            go.set()  # every worker is ready: now they exit
            _processes.wait_for(lambda: len(workers.finished()) == 3, STARTUP, "the three workers to finish")
        assert monitor.error is None and not monitor.cancel.is_set()
        assert workers.join(timeout=STARTUP) == {"Worker_0": 0, "Worker_1": 0, "Worker_2": 0}
        assert workers.finished() == {"Worker_0": 0, "Worker_1": 0, "Worker_2": 0}
        assert workers.join_first().exitcode == 0
        assert workers.failures == []


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_other_start_methods(context):
    with WorkerProcesses(targets.ready_then_sleep, 2, args=(context,), context=context) as workers:
        pids = _processes.track(workers.pids)
        assert workers.wait_until_ready(timeout=STARTUP) == [(0, pids[0], context), (1, pids[1], context)]
        os.kill(pids[1], signal.SIGKILL)
        first = workers.join_first(timeout=STARTUP)
        assert (first.name, first.exitcode) == ("Worker_1", -signal.SIGKILL)
        assert "was killed by SIGKILL" in str(workers.failures[0])
    assert workers.finished() == {"Worker_1": -signal.SIGKILL, "Worker_0": 128 + signal.SIGTERM}
    assert _wait_gone(pids, 0) == []


def test_join_waits_for_every_worker_and_raises_on_a_failure():
    go = multiprocessing.get_context("spawn").Event()
    with WorkerProcesses(targets.ready_then_exit, 2, args=(5, go)) as workers:
        pids = _processes.track(workers.pids)
        workers.wait_until_ready(timeout=STARTUP)
        go.set()  # every worker is ready: now they exit
        with pytest.raises(
            WorkerDiedError, match=r"Worker_\d \(rank \d, pid \d+\) exited with code 5 while it was running"
        ):
            workers.join(timeout=STARTUP)
    with WorkerProcesses(targets.ready_then_sleep, 2) as workers:
        pids = _processes.track(workers.pids)
        workers.wait_until_ready(timeout=STARTUP)
        with pytest.raises(
            TimeoutError, match=f"2 worker\\(s\\) still running after 0.5 s: Worker_0 \\(rank 0, pid {pids[0]}\\)"
        ):
            workers.join(timeout=0.5)


def test_sentinels_and_join_first():
    with WorkerProcesses(targets.ready_then_sleep, 3) as workers:
        pids = _processes.track(workers.pids)
        workers.wait_until_ready(timeout=STARTUP)
        sentinels = workers.sentinels()
        assert len(sentinels) == 3
        assert multiprocessing.connection.wait(sentinels, timeout=0.1) == []
        os.kill(pids[2], signal.SIGKILL)
        assert multiprocessing.connection.wait(sentinels, timeout=STARTUP) == [sentinels[2]]
        first = workers.join_first(timeout=STARTUP)
        assert (first.name, first.rank, first.pid, first.exitcode) == ("Worker_2", 2, pids[2], -signal.SIGKILL)
        assert workers.finished() == {"Worker_2": -signal.SIGKILL}
        assert [e.name for e in workers.failures] == ["Worker_2"]


# ---------------------------------------------------------------------------------
# Shutdown


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period_with_its_children():
    grace = 1.5
    workers = WorkerProcesses(targets.stubborn_with_children, 1, grace=grace)
    _processes.track(workers.pids)
    ((worker, in_group, own_session),) = workers.wait_until_ready(timeout=STARTUP)
    assert all(not _gone(p) for p in (worker, in_group, own_session))
    t0 = time.monotonic()
    workers.close()
    took = time.monotonic() - t0
    assert took >= grace, "SIGKILL came before the grace period was over"
    # The worker and both children (the one outside its process group was found in its
    # process tree before the SIGTERM) are gone.
    assert _wait_gone([worker, in_group, own_session], 0) == []
    assert workers.finished() == {"Worker_0": -signal.SIGKILL}


def test_the_children_of_a_worker_that_dies_die_with_it():
    go = multiprocessing.get_context("spawn").Event()
    with WorkerProcesses(targets.dies_leaving_a_child, 1, args=(go,)) as workers:
        _processes.track(workers.pids)
        (child,) = workers.wait_until_ready(timeout=STARTUP)
        go.set()  # ready: now it dies
        first = workers.join_first(timeout=STARTUP)
        assert first.exitcode == 3
        # Killed with its worker's process group when the worker's exit was noticed.
        assert _wait_gone([child], GONE_WITHIN) == [], "the dead worker's child was orphaned"
        assert "exited with code 3 while it was running" in str(workers.failures[0])


def _start_parent(n_workers: int, context: str = "spawn", mode: str = "wait") -> tuple[subprocess.Popen, list[int]]:
    parent = subprocess.Popen(
        [sys.executable, str(HERE / "_processes" / "worker_parent.py"), str(n_workers), context, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),  # it imports _processes
    )
    line = parent.stdout.readline()
    if not line:
        parent.kill()
        raise AssertionError(f"the parent process failed:\n{parent.communicate(timeout=STARTUP)[1]}")
    report = json.loads(line)
    assert report["parent"] == parent.pid
    return parent, report["workers"]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_die_with_a_sigkilled_parent(context):
    # spawn: PR_SET_PDEATHSIG. forkserver: a worker's parent is the fork server, so a
    # thread in the worker watches the real parent's pidfd instead.
    parent, pids = _start_parent(3, context)
    try:
        assert all(not _gone(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=STARTUP)
        left = _wait_gone(pids, GONE_WITHIN)
        assert left == [], f"workers {left} outlived their SIGKILLed parent by {GONE_WITHIN} s"
    finally:
        parent.kill()
        parent.communicate(timeout=STARTUP)
        for p in pids:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)


_DIES_WITH_PARENT = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "middle":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]])
    child.wait()  # until this process is SIGKILLed
else:
    from shmq.workers import die_with_parent
    die_with_parent(sig=signal.SIGTERM)  # the kernel's PR_SET_PDEATHSIG: a direct parent
    print(os.getpid(), flush=True)
    signal.pause()
"""


def test_die_with_parent_makes_a_workers_own_child_die_with_it():
    # die_with_parent() in a process whose parent is SIGKILLed: it gets the signal asked
    # for (SIGTERM), from the core's die_with_process (the one die-with-parent of shmq).
    middle = subprocess.Popen(
        [sys.executable, "-c", _DIES_WITH_PARENT, "middle", _DIES_WITH_PARENT], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(middle.stdout.readline())  # the child says its pid once it is set up
        child_process = psutil.Process(child)
        assert child_process.ppid() == middle.pid
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait(timeout=STARTUP)
        assert _wait_gone([child], GONE_WITHIN) == [], f"child {child} outlived its SIGKILLed parent"
    finally:
        middle.kill()
        middle.communicate(timeout=STARTUP)


def test_ctrl_c_in_the_parent_shuts_the_workers_down():
    parent, pids = _start_parent(2)
    try:
        # A terminal's Ctrl-C reaches the foreground process group; the workers lead
        # groups of their own, so only the parent gets it, and shuts them down.
        os.kill(parent.pid, signal.SIGINT)
        _, stderr = parent.communicate(timeout=STARTUP)
        assert parent.returncode != 0 and "KeyboardInterrupt" in stderr, stderr
        assert _wait_gone(pids, 0) == []
    finally:
        parent.kill()
        for p in pids:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)


def test_workers_are_closed_at_interpreter_exit():
    # The parent exits without close(), and its workers do not die with it
    # (death_signal=None): only the interpreter-exit hook can have stopped them.
    parent, pids = _start_parent(2, mode="exit")
    try:
        _, stderr = parent.communicate(timeout=STARTUP)
        assert parent.returncode == 0, stderr
        # Reaped by the parent's close(), so not even zombies: gone.
        assert [p for p in pids if psutil.pid_exists(p)] == []
    finally:
        parent.kill()
        for p in pids:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)


# ---------------------------------------------------------------------------------
# Remote workers


def test_remote_worker_joins_over_tcp_and_strangers_are_refused(children):
    workers = WorkerProcesses(targets.ready_then_sleep, 1, n_remote=1, remote_host="127.0.0.1")
    with workers:
        _processes.track(workers.pids)
        ticket = workers.ticket
        assert ticket.host == "127.0.0.1" and WorkerTicket.parse(str(ticket)) == ticket
        assert workers.names == ["Worker_0", "Worker_1"]

        wrong = WorkerTicket(ticket.host, ticket.port, "0" * len(ticket.token))
        with pytest.raises(PermissionError, match="wrong token"):
            connect_to_parent(wrong, 1, die_with_parent=False)
        with pytest.raises(PermissionError, match="rank 0 is not a remote rank"):
            connect_to_parent(ticket, 0, die_with_parent=False)
        with pytest.raises(PermissionError, match="rank 7 is not a remote rank"):
            connect_to_parent(ticket, 7, die_with_parent=False)

        out = children.queue()
        remote = children.start(targets.remote_worker, out, str(ticket), 1, False)
        _, remote_pid = children.expect(out, "pid", timeout=STARTUP)
        local_info, remote_info = workers.wait_until_ready(timeout=STARTUP)
        assert local_info[0] == 0
        assert remote_info == {"rank": 1, "pid": remote_pid, "where": "remote"}
        info = workers.info()[1]
        assert (info.name, info.rank, info.pid, info.ready) == ("Worker_1", 1, remote_pid, True)
        # The rank is taken now.
        with pytest.raises(PermissionError, match="rank 1 has already joined"):
            connect_to_parent(ticket, 1, die_with_parent=False)
        # The worker is past report_ready (its "R" frame can reach the parent before its
        # own call returns: closing before this report could interrupt that call).
        children.expect(out, "ready")
    # close() asked the remote worker to stop: SIGTERM, a SystemExit(128 + SIGTERM) in its
    # main thread (which the test harness reports as an error).
    report = out.get(timeout=STARTUP)
    assert report[0] == "error" and f"SystemExit: {128 + signal.SIGTERM}" in report[2], report
    remote.join(STARTUP)
    assert remote.exitcode is not None


def test_the_parent_keeps_an_admitted_remote_workers_link_alive():
    """The parent's end of an admitted link has TCP keepalive on (as the worker's end
    has): a worker machine that vanishes without a word ends the link as a loss once the
    kernel's probes go unanswered, rather than never."""
    with WorkerProcesses(targets.ready_then_sleep, 1, n_remote=1, remote_host="127.0.0.1") as workers:
        _processes.track(workers.pids)
        link = by_hand.join(workers.ticket, 1)
        sock = link.sock
        try:
            link.send(b"R", pickle.dumps({"rank": 1}))
            assert workers.wait_until_ready(timeout=STARTUP)[1] == {"rank": 1}
            # The parent's end (the core's, in this process): the connection whose ends
            # are this one's, crossed.
            ends = (sock.getpeername()[:2], sock.getsockname()[:2])
            fds = [
                c.fd
                for c in psutil.Process().net_connections(kind="tcp")
                if c.raddr and (tuple(c.laddr), tuple(c.raddr)) == ends
            ]
            assert len(fds) == 1, fds
            with socket.socket(fileno=os.dup(fds[0])) as parents_end:
                assert parents_end.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
            link.send(b"X", json.dumps({"exitcode": 0, "stderr": []}).encode())
        finally:
            sock.close()


@pytest.mark.parametrize("frame", ["unsealed", "sealed with another token"])
def test_a_frame_on_a_remote_workers_link_that_is_not_the_workers_ends_it(frame):
    """After the handshake every frame is sealed: a ready frame that is not the admitted
    worker's (what a process on the path of the connection could inject: the parent
    would unpickle it) is never taken; the worker is reported as gone, its link closed."""
    with WorkerProcesses(targets.ready_then_sleep, 1, n_remote=1, remote_host="127.0.0.1") as workers:
        _processes.track(workers.pids)
        link = by_hand.join(workers.ticket, 1)
        sock = link.sock
        try:
            info = pickle.dumps({"rank": 1, "forged": True})
            if frame == "unsealed":
                by_hand.send_frame(sock, b"R", info)
            else:
                other = by_hand.SealedEnd(sock, _core.new_secret_text(), "00" * 32, "00" * 32)
                other._session = link._session  # this link's session, another key
                other.send(b"R", info)
            with pytest.raises(WorkerDiedError, match="failed authentication|without its seal") as died:
                workers.wait_until_ready(timeout=STARTUP)
            assert died.value.rank == 1
            sock.settimeout(STARTUP)
            assert sock.recv(1) == b""  # the parent ended the link
        finally:
            sock.close()


@contextlib.contextmanager
def _fake_parent(serve):
    """A listener that plays the parent's side of one connection with ``serve(conn)`` in
    a thread; yields a ticket to it (a random token). The thread must be done at the end:
    the worker hung up."""
    listener = socket.create_server(("127.0.0.1", 0))
    ticket = WorkerTicket("127.0.0.1", listener.getsockname()[1], _core.new_secret_text())

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(STARTUP)
            serve(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield ticket
        t.join(STARTUP)
        assert not t.is_alive()
    finally:
        listener.close()


def test_a_parent_that_cannot_prove_the_token_is_refused_by_the_worker():
    """A listener that answers a worker's hello with "ok" but knows no token (one that
    took the parent's address, say) does not get a worker: the worker raises before it
    reports or takes a stop from it."""
    hellos: list[dict] = []

    def impostor(conn: socket.socket) -> None:
        by_hand.send_frame(conn, b"C", by_hand.challenge(_core.new_secret_text()))
        hellos.append(json.loads(by_hand.recv_frame(conn)[1]))
        by_hand.send_frame(conn, b"A", json.dumps({"ok": True, "mac": "00" * 32}).encode())
        conn.recv(1)  # until the worker hangs up

    with _fake_parent(impostor) as ticket:
        with pytest.raises(PermissionError, match="without proving it knows the ticket's token"):
            connect_to_parent(ticket, 1, die_with_parent=False)
    assert hellos and hellos[0]["rank"] == 1 and len(hellos[0]["nonce"]) == 64


def test_a_worker_tells_a_parent_of_an_older_shmq_from_a_refusal():
    """An older parent's challenge has no version: the worker says so, before it sends a
    hello (not "wrong token", which would send the user off to check the token)."""
    got: list[bytes] = []

    def old_parent(conn: socket.socket) -> None:
        by_hand.send_frame(conn, b"C", json.dumps({"nonce": _core.new_secret_text()}).encode())
        got.append(conn.recv(1))  # b"": the worker hung up without a hello

    with _fake_parent(old_parent) as ticket:
        with pytest.raises(PermissionError, match="speaks worker protocol 1, this worker 2"):
            connect_to_parent(ticket, 1, die_with_parent=False)
    assert got == [b""]


def test_a_remote_worker_stops_when_its_first_sigterm_is_lost_in_a_race(children):
    """CPython runs a SIGTERM's handler when the main thread next runs Python code: one
    that lands just before a blocking call (``time.sleep``) is not acted on until the
    call returns. The link sends it again until shmq's handler ran, so the worker still
    stops within the grace with SystemExit(143), not SIGKILL at its end."""
    with WorkerProcesses(targets.ready_then_sleep, 1, n_remote=1, remote_host="127.0.0.1") as workers:
        _processes.track(workers.pids)
        out = children.queue()
        remote = children.start(targets.remote_worker_that_misses_the_first_sigterm, out, str(workers.ticket), 1)
        children.expect(out, "pid", timeout=STARTUP)
        workers.wait_until_ready(timeout=STARTUP)
        children.expect(out, "ready")
    # close() waits up to the grace (5 s) for the remote worker's exit report; the worker
    # itself would be SIGKILLed by its link at the end of it.
    assert out.get(timeout=STARTUP) == ("first SIGTERM taken",)
    report = out.get(timeout=STARTUP)
    assert report[0] == "error" and f"SystemExit: {128 + signal.SIGTERM}" in report[2], report
    remote.join(STARTUP)
    assert remote.exitcode == 1  # the harness's exit after its report, not -SIGKILL


def test_a_remote_worker_that_fails_is_named_with_its_traceback(children):
    with WorkerProcesses(targets.ready_then_sleep, 1, n_remote=1, remote_host="127.0.0.1") as workers:
        _processes.track(workers.pids)
        out = children.queue()
        remote = children.start(targets.remote_worker, out, str(workers.ticket), 1, True)
        _, remote_pid = children.expect(out, "pid", timeout=STARTUP)
        with pytest.raises(WorkerDiedError) as info:
            workers.wait_until_ready(timeout=STARTUP)
    err = info.value
    assert (err.name, err.rank, err.pid, err.exitcode) == ("Worker_1", 1, remote_pid, 1)
    assert str(err).startswith(f"Worker_1 (rank 1, pid {remote_pid} on ")
    assert "exited with code 1 before it was ready" in str(err)
    assert err.stderr_tail[-1] == "RuntimeError: remote rank 1: no route to the model store"
    remote.join(STARTUP)
    assert remote.exitcode == 1


def test_the_core_group_refuses_a_closed_fd_and_a_rank_it_does_not_have():
    from shmq import _core

    group = _core.WorkerGroup(1, 0, "Worker", 5, False, True, 1.0)
    try:
        r, w = os.pipe()
        os.close(r)
        os.close(w)
        with pytest.raises(OSError):
            group.adopt(0, os.getpid(), True, r, None, True)  # a closed fd: EBADF, nothing adopted
        with pytest.raises(RuntimeError, match="rank 3 is not a local worker waiting to be adopted"):
            group.adopt(3, os.getpid(), True, None, None, True)
        with pytest.raises(ValueError, match="timeout must be a non-negative number"):
            group.wait_ready(-1.0)
        assert group.status()[0][2] is None  # rank 0 was never adopted
    finally:
        group.close_begin()
        group.close_finish()
    assert group.closed


@contextlib.contextmanager
def _link_pair(rank: int = 0):
    """A parent's end (``_core.LinkListener``) and a worker's end (``_core.Link.connect``)
    of one admitted link, both the core's."""
    listener = _core.LinkListener("127.0.0.1", 0)
    accepted: list[Any] = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    t.start()
    worker = _core.Link.connect(listener.ticket, rank, STARTUP)
    t.join(STARTUP)
    parent = accepted[0]
    try:
        yield parent, worker
    finally:
        parent.shutdown()
        worker.shutdown()


STOPS_WITHOUT_A_USABLE_GRACE = [
    b"[1]",
    b"not json",
    b"\xff",
    b"{}",
    b'{"grace": -1}',
    b'{"grace": "3"}',
    b'{"grace": true}',
    b'{"grace": NaN}',
    b'{"grace": Infinity}',
    b'{"grace": 1e400}',
    b'{"grace": ' + b"9" * 400 + b"}",
]


def test_a_stop_frames_grace_that_is_not_one_is_the_default():
    """A worker's link reads a stop frame's grace as Rust's ParentLink::recv does (it is
    that): anything but a finite number of seconds >= 0 is the default grace (never an
    exception that ends the watch thread before it stops the worker)."""
    from shmq.workers.protocol import DEFAULT_GRACE

    with _link_pair() as (parent, worker):
        for payload, grace in [(b'{"grace": 1.5}', 1.5), (b'{"grace": 0}', 0.0)] + [
            (p, DEFAULT_GRACE) for p in STOPS_WITHOUT_A_USABLE_GRACE
        ]:
            parent.send(_core.LinkKind.STOP, payload)
            assert worker.recv() == (_core.LinkKind.STOP, grace), payload


MALFORMED_LEAVING = [
    b"[1]",
    b"not json",
    b"\xff",
    b'{"exitcode": "3"}',
    b'{"exitcode": 2147483648}',
    b'{"exitcode": true}',
    b'{"exitcode": null}',
]


def test_a_malformed_leaving_frame_from_a_remote_worker_is_its_death():
    """A sealed leaving frame that is not one (what a buggy worker of another build could
    send) ends the link and reports the worker gone, as Rust's RemoteWorker::recv does:
    the parent's reading thread never dies with the rank left taken."""
    with _link_pair() as (parent, worker):
        worker.send(_core.LinkKind.LEAVING, b'{"exitcode": 3, "stderr": ["a", 7]}')
        assert parent.recv() == (_core.LinkKind.LEAVING, (3, ["a", "7"]))
    with _link_pair() as (parent, worker):
        worker.send(_core.LinkKind.LEAVING, b"{}")
        assert parent.recv() == (_core.LinkKind.LEAVING, (1, []))
    for payload in MALFORMED_LEAVING:
        with _link_pair() as (parent, worker):
            worker.send(_core.LinkKind.LEAVING, payload)
            with pytest.raises(ConnectionError, match="a malformed leaving frame"):
                parent.recv()
    with WorkerProcesses(targets.ready_then_sleep, 1, n_remote=1, remote_host="127.0.0.1") as workers:
        _processes.track(workers.pids)
        link = by_hand.join(workers.ticket, 1)
        sock = link.sock
        try:
            link.send(b"X", b"[1]")
            with pytest.raises(WorkerDiedError, match="a malformed leaving frame") as died:
                workers.wait_until_ready(timeout=STARTUP)
            assert died.value.rank == 1
            sock.settimeout(STARTUP)
            assert sock.recv(1) == b""  # the parent ended the link
        finally:
            sock.close()


def test_a_sealed_frame_of_a_kind_never_the_workers_ends_its_link():
    """After the handshake a sealed frame of a kind a remote worker never sends (a
    handshake's, the parent's own) ends the link and reports the worker gone, as Rust's
    RemoteWorker::recv; a kind this version does not know (a newer worker's) is skipped."""
    with WorkerProcesses(targets.ready_then_sleep, 1, n_remote=1, remote_host="127.0.0.1") as workers:
        _processes.track(workers.pids)
        link = by_hand.join(workers.ticket, 1)
        sock = link.sock
        try:
            link.send(b"Z", b"a newer worker's")
            link.send(b"S", b"{}")
            with pytest.raises(WorkerDiedError, match="unexpected frame kind 'S'") as died:
                workers.wait_until_ready(timeout=STARTUP)
            assert died.value.rank == 1
            sock.settimeout(STARTUP)
            assert sock.recv(1) == b""  # the parent ended the link
        finally:
            sock.close()


@pytest.mark.parametrize(
    "frames, grace",
    [
        ([(b"Z", b"a newer parent's"), (b"S", b'{"grace": 2}')], 2.0),
        ([(b"S", b"[1]")], protocol.DEFAULT_GRACE),
        ([(b"Z", b""), (b"R", b"")], protocol.DEFAULT_GRACE),
        ([(b"A", b"{}")], protocol.DEFAULT_GRACE),
    ],
)
def test_a_remote_workers_watch_stops_it_for_a_stop_or_a_frame_never_the_parents(frames, grace):
    """The worker's watch thread: a stop's grace (the default for one without a usable
    grace), a kind it does not know skipped, and a sealed kind never the parent's to send
    (a handshake's, a worker's own) taken as the link's failure: the worker is stopped."""
    from shmq.workers.child import ParentLink

    with _link_pair() as (parent, worker):
        link = ParentLink(worker, 0, die_with_parent=False)
        stopped: list[float] = []
        link._stop_main_thread = stopped.append  # type: ignore[method-assign]
        for kind, payload in frames:
            parent.send(ord(kind), payload)
        link._watch()
        assert stopped == [grace]

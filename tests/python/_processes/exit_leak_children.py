"""Programs for test_exit_leaks.py, run in a private ``/dev/shm`` (``unshare --mount``).

Run: ``python _processes/exit_leak_children.py SCENARIO``. Each scenario makes its processes, lets
them end the way the test is about, and prints one JSON line: what is left in
``/dev/shm`` (``left``) and which of its processes still run (``running``). Every wait is
bounded; processes still running at the end are killed (after the report).

Scenarios:

- ``fork-child [fork|forkserver]``: a ``multiprocessing`` child of that start method
  makes a queue with a reader (ring, socket directory, tensor arena), an object store
  and an encoder cache, keeps them in a module-level list and returns (both methods'
  children leave through ``os._exit``);
- ``daemon-enqueue``: a program whose daemon thread made a queue (arena, socket
  directory) and is blocked in ``enqueue`` when the interpreter exits;
- ``parent-sigkilled [START_METHOD]``: a ``WorkerProcesses`` parent whose two workers
  each made a ring and a store and started two ordinary children (a
  ``subprocess.Popen`` and a plain ``os.fork`` child, both sleeping) is SIGKILLed;
  waits up to ``GONE_WITHIN`` s for the segments and the grandchildren to go;
- ``close-daemons [exits|stubborn]``: ``WorkerProcesses.close()`` of a worker that
  double-forked a daemon (``setsid`` + fork) and forks a child in its SIGTERM handler
  (which moves to a session of its own); then the worker exits, or (``stubborn``) waits
  for the SIGKILL at the end of the grace period.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from typing import Any

from _processes.harness import STEP, WaitTimeout, kill, shm_segments, still_running, wait_for

GONE_WITHIN = 20.0  # how long the SIGKILLed parent's leftovers may take to go

_KEEP: list[Any] = []


def _left() -> list[str]:
    """Every shmq segment in this program's private /dev/shm."""
    return sorted(shm_segments())


def _sleeper(start_new_session: bool = False) -> subprocess.Popen:
    """A ``subprocess.Popen`` child that sleeps until killed (not synchronisation: it only
    has to be alive)."""
    return subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep({3 * STEP})"], start_new_session=start_new_session
    )


def _fork_sleeper() -> int:
    """A plain ``os.fork`` child that sleeps (and never runs the parent's exit code)."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(3 * STEP)  # not synchronisation: alive until killed
        finally:
            os._exit(0)
    return pid


def _make_everything() -> None:
    """A queue with a reader (ring, socket directory, arena via a loan), a store and an
    encoder cache, all kept in a module-level list."""
    import numpy as np

    import shmq
    from shmq import MessageQueue, ObjectStorage, RingBuffer

    q = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    loan = q.loan_array((1 << 16,), "float32")
    loan[:] = 1.0
    q.enqueue(loan)
    got = r.dequeue(timeout=STEP)
    assert float(got[0]) == 1.0
    store = ObjectStorage(max_object_size=1 << 20, n_readers=1, ring_buffer=RingBuffer(4 << 20, create=True))
    cache = shmq.EncoderCacheProducer(capacity=8 << 20)
    cache.save("image", np.ones(1 << 12, dtype=np.float32))
    _KEEP.extend([q, r, loan, got, store, cache])


# ---------------------------------------------------------------------------------
# fork-child


def _fork_child_target(out: Any) -> None:
    _make_everything()
    out.put(_left())  # what it made, seen from inside


def fork_child(method: str = "fork") -> dict:
    ctx = multiprocessing.get_context(method)
    out = ctx.SimpleQueue()
    p = ctx.Process(target=_fork_child_target, args=(out,))
    p.start()
    p.join(STEP)
    made = out.get() if not out.empty() else None
    if p.exitcode is None and p.pid is not None:
        kill([p.pid])
    return {"exitcode": p.exitcode, "made": made, "left": _left(), "running": []}


# ---------------------------------------------------------------------------------
# daemon-enqueue

_DAEMON_ENQUEUE = f"""
import os, threading, time
import numpy as np
from shmq import MessageQueue

from _processes.harness import blocked_in_queue, wait_for

made = threading.Event()
rings = []

def blocked():
    # Only this thread refers to the queue: nothing drops it at exit.
    q = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=1)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    q.enqueue(np.ones(1 << 20, dtype=np.float32))  # through the arena: it is made now
    rings.append(q.buffer.name)
    made.set()
    q.enqueue(b"waits for the only chunk, which nobody reads")

threading.Thread(target=blocked, daemon=True).start()
assert made.wait({STEP})
# The thread is blocked in its enqueue (the writer's slot says so) when the script ends.
wait_for(lambda: blocked_in_queue(rings[0]), {STEP}, "the enqueue to block")
print(sorted(n for n in os.listdir("/dev/shm") if n.startswith("shmq_")), flush=True)
"""


def daemon_enqueue() -> dict:
    p = subprocess.run([sys.executable, "-c", _DAEMON_ENQUEUE], capture_output=True, text=True, timeout=STEP)
    return {
        "exitcode": p.returncode,
        "made": p.stdout.strip(),
        "left": _left(),
        "running": [],
        "stderr": p.stderr[-2000:],
    }


# ---------------------------------------------------------------------------------
# parent-sigkilled


def _worker_with_segments_and_children(rank: int) -> None:
    """A worker: a ring and a store of its own, a Popen child and a plain fork child."""
    from shmq import MessageQueue, ObjectStorage, RingBuffer
    from shmq.workers import report_ready

    q = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=8)
    store = ObjectStorage(max_object_size=1 << 20, n_readers=1, ring_buffer=RingBuffer(16 << 20, create=True))
    _KEEP.extend([q, store])
    popen = _sleeper()
    forked = _fork_sleeper()
    report_ready({"worker": os.getpid(), "grandchildren": [popen.pid, forked]})
    time.sleep(3 * STEP)  # not synchronisation: alive until the SIGKILLed parent takes it down


def _parent_of_workers(context: str) -> None:
    from shmq import WorkerProcesses

    workers = WorkerProcesses(_worker_with_segments_and_children, 2, context=context, grace=2.0)
    infos = workers.wait_until_ready(timeout=STEP)
    print(json.dumps({"parent": os.getpid(), "infos": infos}), flush=True)
    time.sleep(3 * STEP)  # not synchronisation: alive until the scenario SIGKILLs it


def parent_sigkilled(context: str = "spawn") -> dict:
    parent = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "_parent", context], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    if not line:
        parent.kill()
        raise RuntimeError("the parent of the workers failed to start them")
    report = json.loads(line)
    workers = [i["worker"] for i in report["infos"]]
    grandchildren = [p for i in report["infos"] for p in i["grandchildren"]]
    made = _left()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(STEP)
    everyone = workers + grandchildren
    try:
        wait_for(lambda: not _left() and not still_running(everyone), GONE_WITHIN, "everything to go", 0.05)
    except WaitTimeout:
        pass  # reported: the test says what stayed
    result = {"made": made, "left": _left(), "running": still_running(everyone), "workers": workers}
    kill(everyone)
    return result


# ---------------------------------------------------------------------------------
# close-daemons


def _worker_with_daemons(rank: int, pid_file: str, stubborn: bool) -> None:
    """Double-fork a daemon (setsid, then fork: the daemon's parent exits at once); on
    SIGTERM, fork a child that sleeps, write its pid to ``pid_file`` and exit (or, if
    ``stubborn``, go on sleeping until SIGKILL)."""
    from shmq.workers import report_ready

    r, w = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.close(r)
            os.write(w, b"%d\n" % os.getpid())
            os.close(w)
            time.sleep(3 * STEP)  # not synchronisation: the daemon lives on until killed
        os._exit(0)
    os.close(w)
    os.waitpid(first, 0)
    with os.fdopen(r) as f:
        daemon_pid = int(f.readline())

    def on_sigterm(signum: int, frame: Any) -> None:
        # A child that leaves the worker's process group and session at once (out of
        # reach of a group kill), forked after close() looked at the worker's tree.
        child = os.fork()
        if child == 0:
            try:
                os.setsid()
                time.sleep(3 * STEP)  # not synchronisation: alive until killed
            finally:
                os._exit(0)
        with open(pid_file, "w") as f:
            f.write(str(child))
        # The child is in its own session before the worker goes on.
        try:
            wait_for(lambda: os.getsid(child) != os.getsid(0), STEP, "the child's own session")
        except WaitTimeout:
            pass  # as before: the test checks what became of it
        if not stubborn:
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    report_ready(daemon_pid)
    time.sleep(3 * STEP)  # not synchronisation: idle until close() stops it


def close_daemons(how: str = "exits") -> dict:
    import tempfile

    from shmq import WorkerProcesses

    pid_file = os.path.join(tempfile.mkdtemp(), "handler_child")
    stubborn = how == "stubborn"
    workers = WorkerProcesses(_worker_with_daemons, 1, args=(pid_file, stubborn), grace=2.0 if stubborn else 5.0)
    (daemon,) = workers.wait_until_ready(timeout=STEP)
    worker = workers.pids[0]
    workers.close()
    handler_child = int(open(pid_file).read()) if os.path.exists(pid_file) else None
    pids = [daemon] + ([handler_child] if handler_child is not None else [])
    # close() waits until what it killed is gone; a moment more for anything else.
    try:
        wait_for(lambda: not still_running(pids), 2.0, "the daemons to go", 0.05)
    except WaitTimeout:
        pass  # reported: the test says what still runs
    result = {
        "worker": worker,
        "daemon": daemon,
        "handler_child": handler_child,
        "running": still_running(pids),
        "left": _left(),
        "finished": workers.finished(),
    }
    kill(pids)
    return result


SCENARIOS = {
    "fork-child": fork_child,
    "daemon-enqueue": daemon_enqueue,
    "parent-sigkilled": parent_sigkilled,
    "close-daemons": close_daemons,
}

if __name__ == "__main__":
    if sys.argv[1] == "_parent":
        _parent_of_workers(sys.argv[2])
    else:
        print(json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])), flush=True)

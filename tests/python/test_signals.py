"""shmq's SIGBUS handler leaves a program's own handler working (issue 32 item 2).

A program with a C handler of its own for SIGBUS, installed before shmq's, that recovers
from faults in memory of its own (``csrc/own_sigbus.c``): shmq chains to it for every
fault that is not in a shmq mapping. It must work as it does without shmq when two
threads fault at once while the handler works (shmq's old loop guard sent the second one
to the default action: killed), and when it recovers with ``siglongjmp`` (the guard was
never reset: the second fault killed). A handler the program installs after shmq's stays
installed when shmq maps more segments (shmq used to put its own back over it).

Each case runs in a fresh interpreter (a fault that kills must not take pytest with it);
the C file is built with the machine's C compiler.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import _processes
from _processes import STEP

SOURCE = Path(__file__).resolve().parent / "csrc" / "own_sigbus.c"


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the program's own handler (cc/gcc)"
    out = tmp_path_factory.mktemp("csrc") / "own_sigbus.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out), str(SOURCE)], check=True, timeout=120)
    return str(out)


def _run(library: str, tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        f"""
        import ctypes, sys
        lib = ctypes.CDLL({library!r})
        lib.current_sigbus_handler.restype = ctypes.c_size_t
        lib.install_over.restype = ctypes.c_size_t
        import shmq

        def make_queue():
            q = shmq.MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
            r = shmq.MessageQueue.create_from_handle(q.export_handle(), 0)
            q.wait_until_ready(10); r.wait_until_ready(10)
            q.enqueue(b"x"); assert r.dequeue(timeout=10) == b"x"
            return q, r
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=STEP, cwd=tmp_path
    )


def test_the_programs_handler_recovers_faults_in_two_threads_at_once(library, tmp_path):
    p = _run(
        library,
        tmp_path,
        f"""
        assert lib.install_and_prepare({str(tmp_path / "region")!r}.encode(), 1 << 20, 0) == 0
        keep = make_queue()  # shmq's handler now, chaining to the program's
        for round in range(5):
            n = lib.fault_in_threads(4)
        print("RECOVERED", n)
        """,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "RECOVERED 4" in p.stdout, p.stdout


def test_the_programs_handler_recovers_with_siglongjmp_again_and_again(library, tmp_path):
    p = _run(
        library,
        tmp_path,
        f"""
        assert lib.install_and_prepare({str(tmp_path / "region")!r}.encode(), 1 << 16, 1) == 0
        keep = make_queue()
        print("RECOVERED", lib.fault_with_longjmp(5))
        """,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "RECOVERED 5" in p.stdout, p.stdout


def test_a_handler_installed_after_shmqs_stays(library, tmp_path):
    p = _run(
        library,
        tmp_path,
        """
        first = make_queue()  # shmq installs its handler
        mine = lib.install_over()
        more = [make_queue() for _ in range(3)]  # more segments mapped
        print("SAME", lib.current_sigbus_handler() == mine)
        """,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "SAME True" in p.stdout, p.stdout


# ---------------------------------------------------------------------------------
# Signals handled while a queue waits to be ready (issue 44 item 1)
#
# A Python handler that only counts (SIGUSR1; servers install one for SIGCHLD) must
# not break ``wait_until_ready()``: ZeroMQ's poll, interrupted by the signal (EINTR),
# used to end the wait with ``OSError: ... Interrupted system call``, and Ctrl-C there
# raised that ``OSError`` before the ``KeyboardInterrupt``. Every side runs in a
# process of its own (signals go to a process's main thread); the test signals one
# side while it waits for a reader that joins late.

# How late the last reader joins, while the waiting side is signalled every SIGNAL_EVERY.
LATE = 3.0
SIGNAL_EVERY = 0.1

_SIDE = """
import os, pickle, signal, sys, time
import shmq

STEP = {step!r}
handled = 0


def count(signum, frame):
    global handled
    handled += 1


signal.signal({signum}, count)
# Ctrl-C is KeyboardInterrupt even if this process was started with SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
handle_path, role, n_reader, n_local = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "writer":
    q = shmq.MessageQueue(
        n_reader, n_local, max_chunk_bytes=4096, max_chunks=2, connect_ip="127.0.0.1"
    )
    with open(handle_path + ".tmp", "wb") as f:
        pickle.dump(q.export_handle(), f)
    os.rename(handle_path + ".tmp", handle_path)
else:
    from _processes.harness import wait_for_file

    with open(wait_for_file(handle_path, STEP, "the writer's handle"), "rb") as f:
        q = shmq.MessageQueue.create_from_handle(pickle.load(f), int(role))
print("WAITING", flush=True)
try:
    q.wait_until_ready(STEP)
except BaseException as e:
    print("RAISED", type(e).__name__, repr(e.__context__), flush=True)
    raise
print("READY", handled, flush=True)
if role == "writer":
    for i in range(n_reader):
        q.enqueue(("go", i), timeout=STEP)
else:
    got = [q.dequeue(timeout=STEP) for _ in range(n_reader)]
    assert got == [("go", i) for i in range(n_reader)], got
print("DONE", flush=True)
"""


def _start_side(
    tmp_path: Path, role: str, n_reader: int, n_local: int, signum: int = signal.SIGUSR1
) -> subprocess.Popen:
    script = _SIDE.format(step=STEP, signum=int(signum))
    p = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "handle"), role, str(n_reader), str(n_local)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),  # it imports _processes
    )
    # The leftover check counts segments these processes made, too.
    _processes.CHILD_PIDS.add(p.pid)
    return p


def _waiting(p: subprocess.Popen) -> None:
    """Wait until ``p`` says it is about to call ``wait_until_ready``."""
    line = p.stdout.readline()
    if line != "WAITING\n":
        p.kill()
        out, err = p.communicate(timeout=STEP)
        raise AssertionError(f"expected WAITING, got {line!r}{out!r}; stderr:\n{err[-3000:]}")


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=STEP)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(STEP)
    return out


# (the signalled side, readers, local readers): every side that waits to be ready. A
# reader waits for nothing of its writer's (a local one for nothing at all, a remote one
# for its connection only: issue 59), so none is a case here; ``test_handshake_order.py``
# has them.
CASES = {
    "writer-local-readers": ("writer", 1, 1),
    "writer-remote-readers": ("writer", 1, 0),
}


@pytest.mark.parametrize(
    "case,signum",
    [(c, signal.SIGUSR1) for c in CASES] + [("writer-local-readers", signal.SIGCHLD)],
    ids=[*CASES, "writer-local-readers-SIGCHLD"],
)
def test_wait_until_ready_goes_on_through_handled_signals(tmp_path, case, signum):
    signalled, n_reader, n_local = CASES[case]
    ranks = [str(r) for r in range(n_reader)]
    early = ["writer", *ranks[:1]] if signalled != "writer" else ["writer"]
    late = [r for r in ranks if r not in early]
    procs = [_start_side(tmp_path, role, n_reader, n_local, signum) for role in early]
    target = procs[early.index(signalled)]
    try:
        for p in procs:
            _waiting(p)
        # Signal the waiting side while the last reader is late, then let it join: not a
        # wait for a state but the behaviour under test (signals for LATE seconds).
        sent = 0
        deadline = time.monotonic() + LATE
        while time.monotonic() < deadline and target.poll() is None:
            target.send_signal(signum)
            sent += 1
            time.sleep(SIGNAL_EVERY)  # not synchronisation: the pace of the signals
        procs += [_start_side(tmp_path, role, n_reader, n_local, signum) for role in late]
    finally:
        results = _finish(procs)
    sides = dict(zip(early + late, results, strict=True))
    # The signalled side first: the others fail when it does.
    for role in sorted(sides, key=lambda r: r != signalled):
        code, out, err = sides[role]
        assert code == 0, f"{role}: exit {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
        assert "DONE" in out, (role, out)
    out = sides[signalled][1]
    ready = [line for line in out.splitlines() if line.startswith("READY ")]
    assert ready and int(ready[0].split()[1]) > 0, f"the handler ran for none of {sent} signals: {out}"


@pytest.mark.parametrize("case", list(CASES))
def test_ctrl_c_in_wait_until_ready_is_a_keyboard_interrupt_and_nothing_else(tmp_path, case):
    signalled, n_reader, n_local = CASES[case]
    early = ["writer", "0"] if signalled != "writer" else ["writer"]
    procs = [_start_side(tmp_path, role, n_reader, n_local) for role in early]
    target = procs[early.index(signalled)]
    try:
        for p in procs:
            _waiting(p)
        # Inside the wait: its one thread asleep in a call (ZeroMQ's poll most of the time).
        _processes.wait_for(
            lambda: psutil.Process(target.pid).status() == psutil.STATUS_SLEEPING, STEP, "the side to sleep in its wait"
        )
        target.send_signal(signal.SIGINT)
        code, out, err = _finish([target])[0]
    finally:
        # The other side still waits: Ctrl-C it too (it removes its segment as it goes).
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        _finish(procs)
    assert code != 0, (out, err[-3000:])
    assert "RAISED KeyboardInterrupt None" in out, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert err.rstrip().endswith("KeyboardInterrupt"), err[-3000:]
    assert "OSError" not in err and "Interrupted system call" not in err, err[-3000:]

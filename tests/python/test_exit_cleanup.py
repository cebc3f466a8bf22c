"""Every segment a process creates is removed by it, also at interpreter exit, whatever
still refers to it, in every normal ending (issue 18 item 1): end of script, ``sys.exit``
in a spawned worker, exit with daemon threads alive, exit while another thread is
blocked in a shmq call, SIGINT with its default handling; and, through the process's
janitor (``shmq._janitor``), every ending that runs no exit hook: SIGTERM's default
action, SIGKILL, ``os._exit``. shmq installs no signal handler for any of it (issue 32).

Each test runs a script in a fresh interpreter that prints the pids of the processes it
makes (``PID <n>``); afterwards no shmq name of those pids may be left in ``/dev/shm``
(a segment's name, and its socket directory's, carry its creator's pid).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _processes import WaitTimeout, segments_of, wait_for

STEP = 60.0
REPO_PYTHON = str(Path(__file__).resolve().parent)

# A queue with a reader opened on it (ring, arena and socket directory), a loan, an object
# store and an encoder cache, all kept alive in module-level names.
MAKE_EVERYTHING = """
import os, sys, threading, time
import numpy as np
import shmq
from shmq import MessageQueue, ObjectStorage, RingBuffer

KEEP = []

def make_everything():
    q = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    loan = q.loan_array((1 << 20,), "float32")
    loan[:] = 1.0
    q.enqueue(loan)
    got = r.dequeue(timeout=10)
    assert float(got[0]) == 1.0
    store = ObjectStorage(max_object_size=1 << 20, n_readers=1, ring_buffer=RingBuffer(4 << 20, create=True))
    cache = shmq.EncoderCacheProducer(capacity=8 << 20)
    cache.save("image", np.ones(1 << 16, dtype=np.float32))
    KEEP.extend([q, r, loan, got, store, cache])
    try:
        import torch
    except ImportError:
        pass
    else:
        tensor = q.loan_tensor((1 << 18,))  # the README's loan, never sent
        tensor.fill_(2.0)
        KEEP.append(tensor)
    # A daemon thread that refers to all of it: nothing is dropped at exit (its sleep is
    # not synchronisation: it keeps the references until the interpreter exits).
    threading.Thread(target=lambda keep: time.sleep(600), args=(list(KEEP),), daemon=True).start()
    return q, r
"""


def _run(script: str, tmp_path: Path, *, signal_after_ready: int | None = None) -> tuple[int, str, set[int]]:
    """Run ``script``; return its exit status, its output and the pids it printed."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(MAKE_EVERYTHING) + textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO_PYTHON, os.environ.get("PYTHONPATH", "")]))
    # SIGINT back to its default in the child: a shell without job control starts
    # background commands (`pytest &`) with SIGINT ignored, and the child would inherit
    # that and never see the signal the test sends.
    p = subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    pids = {p.pid}
    lines: list[str] = []
    try:
        if signal_after_ready is not None:
            assert p.stdout is not None

            def ready() -> bool:
                line = p.stdout.readline()
                lines.append(line)
                return not line or line.startswith("READY")  # at its end, the caller says why

            wait_for(ready, STEP, lambda: "its READY:\n" + "".join(lines), 0)
            p.send_signal(signal_after_ready)
        out, _ = p.communicate(timeout=STEP)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = "".join(lines) + out
    pids |= {int(line.split()[1]) for line in text.splitlines() if line.startswith("PID ")}
    return p.returncode, text, pids


def _assert_nothing_left(pids: set[int], output: str) -> None:
    # A child's exit can trail its parent's by a moment.
    wait_for(
        lambda: not segments_of(pids),
        5.0,
        lambda: f"their segments to go; left in /dev/shm: {sorted(segments_of(pids))}\n--- output:\n{output}",
        0.05,
    )


def test_end_of_script_with_everything_still_referenced(tmp_path):
    code, out, pids = _run(
        """
        q, r = make_everything()
        q.shutdown()  # the loan stays alive after it
        print("PID", os.getpid())
        """,
        tmp_path,
    )
    assert code == 0, out
    _assert_nothing_left(pids, out)


@pytest.mark.parametrize(
    "ending, exitcode",
    [("", 0), ("sys.exit(3)", 3)],
    ids=["spawn-child-returns-keeping-all-in-module-state", "sys-exit-in-a-spawned-worker"],
)
def test_a_spawned_child_that_ends_normally(tmp_path, ending, exitcode):
    # make_everything keeps what it made in a module-level list, with a daemon thread
    # alive; the child then returns, or leaves through sys.exit.
    (tmp_path / "exit_child.py").write_text(
        textwrap.dedent(MAKE_EVERYTHING)
        + textwrap.dedent(
            f"""
            def child():
                print("PID", os.getpid(), flush=True)
                make_everything()
                {ending}
            """
        )
    )
    code, out, pids = _run(
        """
        import multiprocessing as mp
        import exit_child
        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=exit_child.child)
            p.start()
            p.join(60)
            print("EXIT", p.exitcode)
        """,
        tmp_path,
    )
    assert code == 0 and f"EXIT {exitcode}" in out, out
    _assert_nothing_left(pids, out)


def test_exit_while_daemon_threads_are_blocked_in_enqueue_and_dequeue(tmp_path):
    code, out, pids = _run(
        """
        q, r = make_everything()
        q2 = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=1)
        r2 = MessageQueue.create_from_handle(q2.export_handle(), 0)
        q2.enqueue(b"fills the only chunk")
        errors = []
        def blocked(f):
            try:
                f()
            except BaseException as e:
                errors.append(e)
        threading.Thread(target=blocked, args=(lambda: q2.enqueue(b"waits"),), daemon=True).start()
        threading.Thread(target=blocked, args=(lambda: r.dequeue(),), daemon=True).start()
        # Both threads are blocked in their calls (as each queue's slot shows) when the
        # interpreter exits.
        from _processes.harness import blocked_in_queue, wait_for
        wait_for(
            lambda: blocked_in_queue(q2.buffer.name) and blocked_in_queue(q.buffer.name, 0), 30, "the threads to block"
        )
        print("PID", os.getpid())
        """,
        tmp_path,
    )
    assert code == 0, out
    _assert_nothing_left(pids, out)


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"]
)
def test_default_signal_handling(tmp_path, sig):
    code, out, pids = _run(
        """
        q, r = make_everything()
        print("PID", os.getpid())
        print("READY", flush=True)
        time.sleep(60)  # not synchronisation: runs until the test signals it
        """,
        tmp_path,
        signal_after_ready=sig,
    )
    # SIGTERM and SIGKILL kill (same status as without shmq): the janitor removes what
    # the process made; SIGINT is KeyboardInterrupt, and the exit hook does.
    if sig == signal.SIGINT:
        assert code != 0 and "KeyboardInterrupt" in out, out
    else:
        assert code == -sig, out
    _assert_nothing_left(pids, out)


def test_sigterm_kills_at_once_a_program_busy_in_native_code(tmp_path):
    # With no handler of its own, a program dies of SIGTERM at once, whatever its main
    # thread does; a Python-level handler (shmq's until issue 32) would run only when the
    # main thread next executed bytecode: never, in this C loop (sum over a range runs
    # in C and checks for no signal).
    code, out, pids = _run(
        """
        q, r = make_everything()
        print("PID", os.getpid())
        print("READY", flush=True)
        sum(range(10**15))
        """,
        tmp_path,
        signal_after_ready=signal.SIGTERM,
    )
    assert code == -signal.SIGTERM, out
    _assert_nothing_left(pids, out)


def test_os_exit_leaves_nothing(tmp_path):
    code, out, pids = _run(
        """
        q, r = make_everything()
        print("PID", os.getpid(), flush=True)
        os._exit(5)
        """,
        tmp_path,
    )
    assert code == 5, out
    _assert_nothing_left(pids, out)


def test_a_program_with_its_own_sigterm_handler_keeps_it(tmp_path):
    code, out, pids = _run(
        """
        import signal
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        q, r = make_everything()
        print("PID", os.getpid())
        print("READY", flush=True)
        time.sleep(60)  # not synchronisation: runs until the test signals it
        """,
        tmp_path,
        signal_after_ready=signal.SIGTERM,
    )
    assert code == 7, out
    _assert_nothing_left(pids, out)


def test_shmq_installs_no_signal_handler_and_a_fork_starts_its_own_janitor(tmp_path):
    code, out, pids = _run(
        """
        import signal
        from shmq import _core
        before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        q, r = make_everything()
        print("SAME", {s: signal.getsignal(s) for s in before} == before)
        print("JANITOR", _core.has_janitor())
        pid = os.fork()
        if pid == 0:
            # The parent's janitor is not the child's; its first segment starts its own,
            # which removes it when the child leaves through os._exit (no exit hook).
            print("CHILD JANITOR", _core.has_janitor(), flush=True)
            child_q = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
            print("CHILD JANITOR AFTER", _core.has_janitor(), flush=True)
            print("PID", os.getpid(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("PID", os.getpid())
        """,
        tmp_path,
    )
    assert code == 0, out
    assert "SAME True" in out and "JANITOR True" in out, out
    assert "CHILD JANITOR False" in out and "CHILD JANITOR AFTER True" in out, out
    _assert_nothing_left(pids, out)


def test_a_named_segment_taken_over_after_the_exit_hook_is_not_removed_by_its_late_drop(tmp_path):
    # The exit hook removes a named encoder cache whose producer is still referenced; a
    # new producer of the same name (another process) takes the name; the old object is
    # dropped later, and its process ends (its janitor then runs): neither may remove
    # the new producer's segment, whose name is the same.
    import shmq

    name = f"takeover-{os.getpid()}-{os.urandom(4).hex()}"
    script = tmp_path / "named.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import gc, sys
            import shmq
            from shmq import _cleanup

            old = shmq.EncoderCacheProducer(capacity=1 << 20, name={name!r})
            old.save("k", b"old")
            _cleanup._clean_up()  # what the exit hook does; `old` stays referenced
            print("CLEANED", flush=True)
            sys.stdin.readline()  # the name has been taken over
            del old
            gc.collect()
            print("DROPPED", flush=True)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_PYTHON, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    new = None
    try:
        assert p.stdout.readline().strip() == "CLEANED"
        ours = [n for n in os.listdir("/dev/shm") if n.endswith(name)]
        assert ours == [], f"the exit hook left {ours}"
        new = shmq.EncoderCacheProducer(capacity=1 << 20, name=name)
        new.save("k", b"new")
        ours = [n for n in os.listdir("/dev/shm") if n.endswith(name)]
        assert len(ours) == 1, ours
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "DROPPED"
        assert p.wait(timeout=STEP) == 0
        # Its janitor runs once it is gone: not synchronisation, a bounded check that
        # nothing removes the new segment within 2 s (a janitor takes milliseconds).
        with contextlib.suppress(WaitTimeout):
            wait_for(lambda: not os.path.exists(f"/dev/shm/{ours[0]}"), 2.0, "a removal that must not come", 0.05)
        assert os.path.exists(f"/dev/shm/{ours[0]}"), "the old producer's late drop or janitor removed the new one"
        consumer = shmq.EncoderCacheConsumer(name)
        try:
            assert consumer.get("k") == b"new"
        finally:
            consumer.close()
    finally:
        p.kill()
        p.wait(timeout=STEP)
        if new is not None:
            new.close()

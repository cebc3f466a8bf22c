"""Exits that used to leak shared memory or processes (issue 18, items 6 and 11), in real
processes: a ``fork``- or ``forkserver``-context child that returns (it leaves through
``os._exit``); a daemon thread blocked in ``enqueue`` at interpreter exit (a guard: it
did not leak here before the fix either); a ``WorkerProcesses`` parent SIGKILLed (its
workers' segments must go, and their ordinary children die); ``WorkerProcesses.close()``
of a worker with a double-forked daemon and a child forked into a session of its own in
its SIGTERM handler.

Each scenario runs as a program (``_processes/exit_leak_children.py``) in a mount namespace with a
``/dev/shm`` of its own (``unshare --mount`` and a fresh tmpfs), so that what it leaves
is exactly what is listed there afterwards, whatever else runs on the machine. Skipped,
with the reason, where mount namespaces cannot be made. Waits are bounded; nothing is
timed.
"""

from __future__ import annotations

import os
import signal

import pytest

from _processes.private_shm import run_in_private_shm

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "_processes", "exit_leak_children.py")


def _scenario(name: str, *args: str) -> dict:
    """Run scenario ``name`` (with ``args``) in a private 512 MiB /dev/shm; its report."""
    return run_in_private_shm(PROGRAM, [name, *args], "512m", 240)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_fork_child_that_returns_leaves_nothing(method):
    got = _scenario("fork-child", method)
    assert got["exitcode"] == 0, got
    # It made all of it (ring, socket directory, arena, store, encoder cache)...
    kinds = {n.split("_")[1] for n in got["made"]}
    assert {"ring", "arena", "store", "ec"} <= kinds and any(n.endswith(".sock") for n in got["made"]), got
    # ...and none of it is left once it has exited through os._exit.
    assert got["left"] == [], got


def test_a_daemon_thread_blocked_in_enqueue_at_exit_leaves_nothing():
    got = _scenario("daemon-enqueue")
    assert got["exitcode"] == 0, got
    assert "arena" in got["made"] and ".sock" in got["made"], got
    assert got["left"] == [], got


@pytest.mark.parametrize("context", ["spawn", "forkserver", "fork"])
def test_a_sigkilled_parent_strands_neither_segments_nor_grandchildren(context):
    # Each worker: a ring and a store of its own, a Popen child and a plain fork child.
    got = _scenario("parent-sigkilled", context)
    # Two rings and two stores (one each per worker) were there while the parent lived.
    kinds = [n.split("_")[1] for n in got["made"] if not n.endswith(".sock")]
    assert sorted(kinds) == ["ring", "ring", "store", "store"], got
    assert got["left"] == [], f"the workers' segments outlived their SIGKILLed parent: {got}"
    assert got["running"] == [], f"workers or their children outlived the SIGKILLed parent: {got}"


@pytest.mark.parametrize("how", ["exits", "stubborn"])
def test_close_kills_a_double_forked_daemon_and_a_child_forked_in_the_sigterm_handler(how):
    # The handler's child moves to a session of its own; the worker then exits (its exit
    # kills it), or waits for close()'s SIGKILL (close() finds it in the worker's tree
    # before it sends that).
    got = _scenario("close-daemons", how)
    assert got["handler_child"] is not None, f"the worker's SIGTERM handler did not run: {got}"
    assert got["running"] == [], f"survived close(): {got}"
    assert got["left"] == [], got
    assert got["finished"] == {"Worker_0": -signal.SIGKILL if how == "stubborn" else 0}, got

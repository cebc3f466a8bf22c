"""Fixtures shared by the Python tests: child processes, and the /dev/shm leftover check
(every test, once, here).

Helpers and child-process code live in the ``_processes`` package (a child cannot import
this file).
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    # Spawned children inherit sys.path, so they can import _processes too.
    sys.path.insert(0, str(HERE))

import _processes  # noqa: E402


@pytest.fixture
def children():
    """Start child processes with ``children.start(fn, out_queue, *args)``; at the end
    of the test they are joined, and killed if they are still running."""
    c = _processes.Children()
    try:
        yield c
    finally:
        c.close()


def _our_pids() -> set[int]:
    return {os.getpid()} | _processes.CHILD_PIDS


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item.shmq_failed = True
    return report


@pytest.fixture(autouse=True)
def no_leftover_segments(request):
    """No test may leave a shmq segment in /dev/shm that this process or one of its
    children created (other processes on the machine may use shmq meanwhile, hence the
    pid filter; a segment's name carries its creator's pid)."""
    before = _processes.shm_segments()
    yield
    if getattr(request.node, "shmq_failed", False):
        # pytest keeps the failure's traceback (and so the test's locals, queues
        # included) in sys.last_*; let it go so that this check reports real leftovers
        # only. The failure itself has already been reported.
        for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, attr):
                setattr(sys, attr, None)
    _processes.wait_until_gone(
        lambda: {n for n in _processes.segments_of(_our_pids()) if n not in before},
        "the shmq segments this test made",
    )


def pytest_sessionfinish(session, exitstatus):
    gc.collect()
    left = _processes.segments_of(_our_pids())
    if left:
        sys.stderr.write(f"\nshmq segments left in /dev/shm by the test session: {sorted(left)}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def cache_name():
    """A unique cache name; no segment of it may be left at the end."""
    name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    _processes.wait_until_gone(
        lambda: {n for n in os.listdir(_processes.SHM_DIR) if name in n}, f"the segments of encoder cache {name}"
    )

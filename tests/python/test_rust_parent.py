"""A Rust parent for Python workers (issue 59 item 6), in real processes: the Rust
example ``examples/python_workers.rs`` (built here with cargo) starts ``python`` workers
with ``shmq::workers::Workers::spawn``; each calls ``shmq.report_ready`` and the parent
prints the payload it read from the ready pipe: empty for ``report_ready()``, the bytes
as given for ``report_ready(raw=...)``, pickle bytes for an ``info`` object. A child of
such a worker, which inherits ``SHMQ_READY_FD`` but not the pipe, is refused. A Python
parent gets ``raw`` as a ``bytes`` object."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import shmq
from _processes.async_children import raw_ready_worker
from _processes.harness import STEP
from _processes.rust_examples import build_example, build_test
from shmq import WorkerProcesses

pytestmark = pytest.mark.timeout(900)

RAW = b"\x00raw\xff bytes\n"
INFO = {"rank": 2, "queue": "results-2"}

REFUSED = "import shmq\ntry:\n shmq.report_ready(raw=b'x')\nexcept RuntimeError as e:\n print('refused:', e)"

WORKER = f"""
import os, subprocess, sys
import shmq
rank = int(os.environ["SHMQ_WORKER_RANK"])
if rank == 0:
    shmq.report_ready()
elif rank == 1:
    # A child inherits the variable, not the pipe: report_ready refuses there.
    child = subprocess.run(
        [sys.executable, "-c", {REFUSED!r}],
        capture_output=True, text=True, timeout={STEP},
    )
    assert child.stdout.startswith("refused: report_ready() is for worker processes"), (child.stdout, child.stderr)
    shmq.report_ready(raw={RAW!r})
    shmq.report_ready(raw=b"again")  # a second call does nothing
else:
    shmq.report_ready({INFO!r})
import signal
signal.pause()  # serve until the parent closes the group
"""


def test_a_rust_parent_reads_python_workers_ready_reports() -> None:
    example = build_example("python_workers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(shmq.__file__).parents[1]), *sys.path]))
    run = subprocess.run(
        [example, "3", sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=4 * STEP, env=env
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "ready 0 ",
        f"ready 1 {RAW.hex()}",
        f"ready 2 {pickle.dumps(INFO, protocol=pickle.HIGHEST_PROTOCOL).hex()}",
        "closed",
    ], run.stderr


def test_a_rust_parent_names_a_python_worker_that_fails_before_it_is_ready() -> None:
    example = build_example("python_workers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(shmq.__file__).parents[1]), *sys.path]))
    code = "import sys; print('no model here', file=sys.stderr); sys.exit(5)"
    run = subprocess.run(
        [example, "1", sys.executable, "-c", code], capture_output=True, text=True, timeout=4 * STEP, env=env
    )
    assert run.returncode != 0
    assert "ready" not in run.stdout
    assert "no model here" in run.stderr and "5" in run.stderr, run.stderr


def test_a_python_parent_gets_a_raw_payload_as_bytes() -> None:
    with WorkerProcesses(raw_ready_worker, 2, args=(RAW,)) as workers:
        assert workers.wait_until_ready(timeout=STEP) == [RAW, RAW]


def test_report_ready_takes_info_or_raw() -> None:
    with pytest.raises(ValueError, match="info or raw, not both"):
        shmq.report_ready({"a": 1}, raw=b"x")
    with pytest.raises(RuntimeError, match="report_ready\\(\\) is for worker processes"):
        shmq.report_ready(raw=b"x")


def test_a_rust_monitor_tells_a_python_worker_of_its_siblings_failure() -> None:
    """``crates/workers/tests/monitor.rs``'s Python-worker case, run here with this
    interpreter (the test command's ``cargo test`` runs before the extension is built,
    and the system's ``python3`` may lack shmq's dependencies: that run skips it). A Rust
    ``Workers::monitor`` tells a Python worker, through the notice pipe, which sibling
    failed: its ``shmq.workers.sibling_failure()`` names Worker_0 and its exit code 7."""
    binary = build_test("shmq-workers", "monitor")
    env = dict(os.environ, PYTHON=sys.executable)
    run = subprocess.run(
        [binary, "a_python_worker_hears_of_a_sibling_failure", "--exact", "--nocapture", "--test-threads=1"],
        capture_output=True,
        text=True,
        timeout=4 * STEP,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "SKIPPED" not in run.stderr, run.stderr[-3000:]
    assert "1 passed" in run.stdout and "told: " in run.stderr, run.stdout[-2000:] + run.stderr[-2000:]

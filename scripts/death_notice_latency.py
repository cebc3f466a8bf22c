"""How long a parent takes to learn that a worker's target raised (issue 36).

Each run starts one spawned worker that imports torch (what makes a Python interpreter's
teardown slow), reports ready, then raises an exception whose message carries the
``time.monotonic()`` of the raise (CLOCK_MONOTONIC: one clock for every process on the
machine). The parent blocks in ``workers.join()``, which raises the ``WorkerDiedError``
as soon as the core has recorded the failure; the latency is the parent's
``time.monotonic()`` at that moment minus the worker's. For comparison, the same with a
worker SIGKILLed by the parent (the latency from ``os.kill`` to the error).

    .venv/bin/python scripts/death_notice_latency.py [--runs 10] [--no-torch]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import time

from shmq import WorkerDiedError, WorkerProcesses
from shmq.workers import report_ready


def raises_after_ready(rank: int, with_torch: bool) -> None:
    if with_torch:
        import torch  # noqa: F401 - what makes the teardown slow

    report_ready()
    time.sleep(0.3)
    raise RuntimeError(f"simulated failure raised at t={time.monotonic()!r}")


def idles_after_ready(rank: int, with_torch: bool) -> None:
    if with_torch:
        import torch  # noqa: F401

    report_ready()
    time.sleep(60)


def one_raise(with_torch: bool) -> float:
    with WorkerProcesses(raises_after_ready, 1, args=(with_torch,), forward_stderr=False, grace=5.0) as workers:
        workers.wait_until_ready(timeout=120)
        try:
            workers.join(timeout=60)
        except WorkerDiedError as e:
            now = time.monotonic()
            match = re.search(r"raised at t=([0-9.]+)", str(e))
            assert match, str(e)
            return now - float(match.group(1))
    raise AssertionError("the worker did not fail")


def one_sigkill(with_torch: bool) -> float:
    with WorkerProcesses(idles_after_ready, 1, args=(with_torch,), forward_stderr=False, grace=5.0) as workers:
        workers.wait_until_ready(timeout=120)
        (pid,) = workers.pids
        assert pid is not None
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            workers.join(timeout=60)
        except WorkerDiedError:
            return time.monotonic() - t0
    raise AssertionError("the worker did not fail")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--no-torch", action="store_true")
    opts = parser.parse_args()
    with_torch = not opts.no_torch
    for name, fn in (("raise", one_raise), ("SIGKILL", one_sigkill)):
        samples = [fn(with_torch) for _ in range(opts.runs)]
        ms = sorted(s * 1000 for s in samples)
        print(
            f"{name:8s} torch={with_torch}: median {statistics.median(ms):7.1f} ms  "
            f"min {ms[0]:7.1f}  max {ms[-1]:7.1f}  ({opts.runs} runs)"
        )


if __name__ == "__main__":
    main()

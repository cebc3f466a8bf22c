"""A parent process for test_workers.py: starts workers and waits, so that the test can
SIGKILL it or press Ctrl-C (SIGINT) and check what becomes of the workers.

Run: python _worker_parent.py N_WORKERS [START_METHOD]
Prints one JSON line {"parent": pid, "workers": [pids]} once every worker is ready, then
waits for the workers (so a SIGINT arrives while it blocks in join_first).
"""

import json
import os
import sys

from shmq.workers import WorkerProcesses

import _worker_targets

if __name__ == "__main__":
    n = int(sys.argv[1])
    context = sys.argv[2] if len(sys.argv) > 2 else "spawn"
    with WorkerProcesses(_worker_targets.ready_then_sleep, n, context=context, grace=2.0) as workers:
        workers.wait_until_ready(timeout=60)
        print(json.dumps({"parent": os.getpid(), "workers": workers.pids}), flush=True)
        workers.join_first(timeout=60)

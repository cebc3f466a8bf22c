"""A parent process for test_workers.py: starts workers, so that the test can SIGKILL it,
press Ctrl-C (SIGINT), or let it exit without closing them, and check what becomes of the
workers.

Run: python _worker_parent.py N_WORKERS [START_METHOD] [MODE]
Prints one JSON line {"parent": pid, "workers": [pids]} once every worker is ready. MODE
"wait" (default): then waits for the workers (so a SIGINT arrives while it blocks in
join_first). MODE "exit": then exits without closing them, and they do not die with it
(death_signal=None): only the interpreter-exit hook can stop them.
"""

import json
import os
import signal
import sys

from shmq.workers import WorkerProcesses

import _worker_targets

if __name__ == "__main__":
    # Python turns SIGINT into KeyboardInterrupt only if it was not ignored when the
    # interpreter started, and a test run started in the background of a shell without
    # job control (`cmd &` in a script) passes SIGINT on ignored: be the foreground
    # program a user presses Ctrl-C in, whatever started the tests.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    n = int(sys.argv[1])
    context = sys.argv[2] if len(sys.argv) > 2 else "spawn"
    mode = sys.argv[3] if len(sys.argv) > 3 else "wait"
    if mode == "exit":
        workers = WorkerProcesses(_worker_targets.ready_then_sleep, n, context=context, death_signal=None, grace=2.0)
        workers.wait_until_ready(timeout=60)
        print(json.dumps({"parent": os.getpid(), "workers": workers.pids}), flush=True)
        sys.exit(0)  # no close(): the exit hook closes them
    with WorkerProcesses(_worker_targets.ready_then_sleep, n, context=context, grace=2.0) as workers:
        workers.wait_until_ready(timeout=60)
        print(json.dumps({"parent": os.getpid(), "workers": workers.pids}), flush=True)
        workers.join_first(timeout=60)

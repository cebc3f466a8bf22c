"""A parent process for test_workers.py: starts workers, so that the test can SIGKILL it,
press Ctrl-C (SIGINT), or let it exit without closing them, and check what becomes of the
workers.

Run: python _processes/worker_parent.py N_WORKERS [START_METHOD] [MODE] [FREE_FDS]
Prints one JSON line {"parent": pid, "workers": [pids]} once every worker is ready. MODE
"wait" (default): then waits for the workers (so a SIGINT arrives while it blocks in
join_first). MODE "exit": then exits without closing them, and they do not die with it
(death_signal=None): only the interpreter-exit hook can stop them.

MODE "remote": a parent of N_WORKERS local workers and one remote worker (rank
N_WORKERS) listening on 127.0.0.1, for test_worker_port_hostile.py. It prints
{"parent": pid, "ticket": str, "free_fds": n} at once (``free_fds``: with FREE_FDS, its
RLIMIT_NOFILE is lowered so that exactly that many descriptors can still be opened;
else null), then {"ready": [infos]} once every worker is ready (or {"died": message} once
one failed before), and closes the group
once a line (or the end) comes on its stdin.
"""

import fcntl
import json
import os
import resource
import signal
import sys

from shmq.workers import WorkerDiedError, WorkerProcesses

from _processes import worker_targets


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    # Python turns SIGINT into KeyboardInterrupt only if it was not ignored when the
    # interpreter started, and a test run started in the background of a shell without
    # job control (`cmd &` in a script) passes SIGINT on ignored: be the foreground
    # program a user presses Ctrl-C in, whatever started the tests.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    n = int(sys.argv[1])
    context = sys.argv[2] if len(sys.argv) > 2 else "spawn"
    mode = sys.argv[3] if len(sys.argv) > 3 else "wait"
    if mode == "remote":
        with WorkerProcesses(
            worker_targets.ready_then_sleep, n, n_remote=1, remote_host="127.0.0.1", context=context, grace=2.0
        ) as workers:
            free = None
            if len(sys.argv) > 4:
                # A new descriptor takes the lowest free number below the soft limit: the
                # limit that leaves exactly FREE_FDS of them.
                free = int(sys.argv[4])
                limit, left = 0, free
                while left:
                    if not _is_open(limit):
                        left -= 1
                    limit += 1
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            print(json.dumps({"parent": os.getpid(), "ticket": str(workers.ticket), "free_fds": free}), flush=True)
            try:
                infos = workers.wait_until_ready(timeout=60)
            except WorkerDiedError as e:  # (its remote worker's link failed)
                print(json.dumps({"died": str(e)}), flush=True)
            else:
                print(json.dumps({"ready": infos}), flush=True)
            sys.stdin.readline()  # until the test says so (a line, or the end of its pipe)
        sys.exit(0)
    if mode == "exit":
        workers = WorkerProcesses(worker_targets.ready_then_sleep, n, context=context, death_signal=None, grace=2.0)
        workers.wait_until_ready(timeout=60)
        print(json.dumps({"parent": os.getpid(), "workers": workers.pids}), flush=True)
        sys.exit(0)  # no close(): the exit hook closes them
    with WorkerProcesses(worker_targets.ready_then_sleep, n, context=context, grace=2.0) as workers:
        workers.wait_until_ready(timeout=60)
        print(json.dumps({"parent": os.getpid(), "workers": workers.pids}), flush=True)
        workers.join_first(timeout=60)

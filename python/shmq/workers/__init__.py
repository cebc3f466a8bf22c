"""Worker processes: start them, wait until they are ready, notice when one dies, and
shut them all down, process trees and shared-memory segments included.

The glue around the queues that every serving stack writes by hand (vLLM's
``CoreEngineProcManager``, ``wait_for_engine_startup``, ``shutdown``)::

    def worker(rank, queue_handle, store_handle):
        queue = MessageQueue.create_from_handle(queue_handle, rank)
        store = ObjectStorage.create_from_handle(store_handle)
        report_ready()                      # set-up done
        queue.wait_until_ready()
        try:
            while (batch := queue.dequeue()) is not None:
                ...
        except QueueShutDownError:          # the parent stopped: a sibling failed?
            print("stopped:", sibling_failure())   # its WorkerDiedError, or None

    with WorkerProcesses(worker, 4, args=(queue.export_handle(), store.handle())) as workers:
        infos = workers.wait_until_ready(timeout=60)  # by rank; WorkerDiedError if one dies
        queue.wait_until_ready()
        with workers.monitor(queue):           # a crash wakes the blocked enqueue
            for batch in batches:
                queue.enqueue(batch)
            queue.enqueue(None)
            codes = workers.join(timeout=60)   # {"Worker_0": 0, ...}, in rank order
    # leaving the block: SIGTERM, a shared grace period, SIGKILL of whole process trees,
    # and the dead workers' /dev/shm segments removed

What it guarantees:

- **Start.** ``target(rank, *args, **kwargs)`` runs in processes named ``Worker_0``...
  (``spawn`` context by default). If starting one fails, those already started are shut
  down before the error propagates.
- **Ready, with a deadline.** Each worker calls :func:`report_ready` after its own set-up;
  :meth:`WorkerProcesses.wait_until_ready` returns when all have, and raises
  :class:`WorkerDiedError` at once when one dies first (rank, pid, exit code or signal,
  the last lines it wrote to stderr), or :class:`WorkersNotReadyError` naming the
  stragglers when the deadline passes. Workers on other machines join over TCP with the
  same :func:`report_ready` (:func:`connect_to_parent`, authenticated by a random token
  carried in the :class:`WorkerTicket`).
- **A sibling's death.** The monitor shuts the monitored queues down: the surviving
  workers' ``dequeue`` raises ``QueueShutDownError`` after the messages sent before, and
  :func:`sibling_failure` (told to every worker before the queues end) names the worker
  that failed, so a worker loop ends cleanly. :meth:`~WorkerProcesses.join` raises a
  failure once: one already raised (by ``wait_until_ready``, a monitor, an earlier
  ``join``) is not raised again, and ``join`` returns every exit code.
- **Supervision.** A native thread of the core (``crates/workers/src/``, the same supervision
  Rust serving stacks use) watches every worker (pidfds) and forwards each worker's
  stderr to the parent's stderr (file descriptor 2, a whole line per write), prefixed
  ``(Worker_1 pid=...)``, keeping the last lines for error messages. :meth:`~WorkerProcesses.monitor` wakes the parent's
  blocked ``MessageQueue`` calls when a worker fails, and raises ``WorkerDiedError``.
  A worker whose target raises is a failure at once: its bootstrap prints the
  traceback, then sends a death notice (exit code and traceback) on its ready pipe
  before the interpreter tears down (long with torch imported; forever if an ``atexit``
  handler or a non-daemon thread hangs). A killed worker is seen at its exit (pidfd); a
  hung one is alive, so only the parent's timeouts tell.
- **Shutdown.** :meth:`~WorkerProcesses.close`: SIGTERM to every worker's process group,
  one shared grace period, then SIGKILL of what remains, including descendants captured
  before the SIGTERM; reaping; removal of the segments the dead workers (and their
  descendants) created. Idempotent; also runs at interpreter exit, on garbage collection,
  and when Ctrl-C ends a ``with`` block.
- **Orphans.** Each worker dies with the parent, even when the parent is SIGKILLed. By
  default (``death_signal=SIGKILL``) a thread of the core in the worker waits on the
  parent's pidfd and, once the parent is gone, kills the worker's descendants, removes
  the segments the worker created and SIGKILLs it (``_core.exit_with_process``, without
  the GIL: also a worker busy in native code goes). Another ``death_signal`` is sent by
  the kernel (``PR_SET_PDEATHSIG``), or by such a thread where the worker's parent is
  not the process it is to die with. Each worker leads its own process group, so its
  descendants go down with it, and a Ctrl-C in the terminal reaches only the parent,
  which then shuts the workers down in order.

Caveats, and how they are handled:

- ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the
  process. Workers are therefore always forked from a long-lived thread: the main
  thread, or (when :class:`WorkerProcesses` is made in another thread) a daemon launcher
  thread that lives as long as the process.
- With the ``forkserver`` context the parent of a worker is the fork server: the
  worker's thread watches the real parent's pidfd (for every death signal).
- A worker killed by a death signal other than the default SIGKILL cannot remove its own
  segments (its janitor does, or the next ``python -m shmq cleanup``). A worker's own
  children die with it only if they are in its process group (the default for anything
  it starts) or call :func:`die_with_parent` themselves.
- A spawned worker writes to the parent's pipe from its first line of Python, so what it
  writes while multiprocessing starts it (re-importing the main module, unpickling its
  target and arguments) is in the tail: a script without an
  ``if __name__ == "__main__":`` guard fails with the worker's traceback. With ``fork``
  and ``forkserver`` the pipe takes over in the bootstrap; what a fork server's child
  writes before that goes to the fork server's stderr, and the error says so. What the
  interpreter itself writes before it runs any Python (a broken ``.pth`` file) is never
  in the tail.

The package's layers, each using only those before it: ``protocol`` (the ticket, the
TCP frames), ``errors``, ``child`` (what runs in a worker), ``spawn`` (starting a spawned worker with
its stderr in the parent's pipe), ``supervisor`` (starting workers and handing them to
the core's ``WorkerGroup``, which watches them and shuts them down; failures to the
monitors; remote workers' handshake), ``processes`` (:class:`WorkerProcesses`).
"""

from .child import ParentLink, connect_to_parent, die_with_parent, report_ready, sibling_failure
from .errors import WorkerDiedError, WorkersNotReadyError
from .processes import WorkerMonitor, WorkerProcesses
from .protocol import DEFAULT_GRACE, WorkerTicket
from .supervisor import WorkerInfo

__all__ = [
    "DEFAULT_GRACE",
    "ParentLink",
    "WorkerDiedError",
    "WorkerInfo",
    "WorkerMonitor",
    "WorkerProcesses",
    "WorkerTicket",
    "WorkersNotReadyError",
    "connect_to_parent",
    "die_with_parent",
    "report_ready",
    "sibling_failure",
]

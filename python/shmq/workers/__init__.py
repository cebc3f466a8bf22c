"""Worker processes: start them, wait until they are ready, notice when one dies, and
shut them all down, process trees and shared-memory segments included.

:class:`WorkerProcesses` runs ``target(rank, *args)`` in processes named ``Worker_0``...;
each worker calls :func:`report_ready` once set up, and :func:`sibling_failure` tells it
why the parent shut its queues down. :meth:`WorkerProcesses.wait_until_ready` raises
:class:`WorkerDiedError` at once when a worker dies first; leaving the block sends
SIGTERM, waits one grace period, SIGKILLs whole process trees and removes the dead
workers' segments. Workers die with the parent, even a SIGKILLed one; workers on other
machines join with :func:`connect_to_parent`::

    def worker(rank, queue_handle):
        queue = MessageQueue.create_from_handle(queue_handle, rank)
        report_ready()                      # set-up done
        queue.wait_until_ready()
        try:
            while (batch := queue.dequeue()) is not None:
                ...
        except QueueShutDownError:          # the parent stopped: a sibling failed?
            print("stopped:", sibling_failure())

    with WorkerProcesses(worker, 4, args=(queue.export_handle(),)) as workers:
        workers.wait_until_ready(timeout=60)   # infos by rank; WorkerDiedError if one dies
        queue.wait_until_ready()
        with workers.monitor(queue):           # a crash wakes the blocked enqueue
            for batch in batches:
                queue.enqueue(batch)
            queue.enqueue(None)
            codes = workers.join(timeout=60)   # {"Worker_0": 0, ...}, in rank order

What the parent learns, and when: docs/guide.md ("Worker processes"). How the package
is layered, how workers die with their parent, and the caveats: docs/design.md
("Worker processes").
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

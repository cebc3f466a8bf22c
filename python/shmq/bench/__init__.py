"""``python -m shmq bench``: shmq's queue side by side with the alternatives.

Every scenario runs once per transport (shmq ``MessageQueue``, ``multiprocessing.Queue``,
pyzmq PUB/SUB over ``ipc://``, and vLLM's ``MessageQueue`` without and with its tensor
arena when vLLM is importable), in processes started with the ``spawn`` context, and
the results are printed as one table. The method (the one the project's performance
targets were measured with):

- the *small object* is :data:`SMALL_OBJECT` (135 bytes pickled);
- *one-way latency* is half the round trip of a ping-pong between two processes
  through two queues, p50/p99 over a number of round trips after a warm-up;
- *throughput* is N objects from the writer's first enqueue to the last reader's last
  dequeue, readers in separate processes (clock: ``CLOCK_MONOTONIC``, which all
  processes share);
- the *pickle only* rows (floors) time ``dumps`` and ``loads`` alone in one process:
  one object handed over costs at least both (the latency floor), a stream at least
  the slower of the two per object (writer and reader pickle in parallel).

- *tensor* rows send a contiguous float32 CPU tensor of 1, 16 or 256 MiB to 1 or 3
  readers, each of which touches the tensor's last element; the figure is bytes per
  reader per second, after a warm-up that every process waits out at a barrier. The
  *loaned* rows (shmq only) fill a tensor borrowed from the queue and send it without a
  copy; their writer-cost row is the time of the ``enqueue`` call alone.

The package, one module per part (each uses only the ones before it):

- :mod:`.common`: the small object, queue geometry, shared clock, ``BenchError``;
- :mod:`.transports`: a :class:`Transport` opens the writer and reader endpoints
  (:class:`Endpoint`) of a channel; the parent makes the channel (something picklable
  handed to the children);
- :mod:`.roles`: what a child process runs (``_role_*``); roles only use endpoints,
  so one role serves all transports;
- :mod:`.harness`: :class:`Harness` starts the roles of one run in child processes;
- :mod:`.scenarios`: a *scenario* function (``_bench_*``) starts roles through the
  harness and turns what they return into metrics; :data:`SCENARIOS` lists them with
  their table rows, :data:`FLOORS` the single-process reference rows;
- :mod:`.report`: ``run_bench``, the table, and the command line (``add_arguments``,
  ``main``).

The harness is defensive: every wait has a timeout, a failed or hung child makes the
parent terminate all children of that run (and remove the shared-memory segments they
created), readers check they received exactly the objects sent, and a failure (of a
cell or of a floor) is shown in its cell and listed under the table while the other
cells still run; the exit code is 1 only then. A row that cannot run here (torch, vLLM
or pyzmq not installed) says "skipped", and one line under the table per reason says
what it needs; skips are not failures. Without torch, the tensor rows send float32
numpy arrays (the labels say so).
"""

from __future__ import annotations

from .common import SMALL_OBJECT
from .report import add_arguments, main, run_bench
from .scenarios import FLOORS, SCENARIOS
from .transports import TRANSPORTS

__all__ = ["SMALL_OBJECT", "SCENARIOS", "FLOORS", "TRANSPORTS", "add_arguments", "main", "run_bench"]

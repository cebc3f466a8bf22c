"""``python -m shmq bench``: shmq's queue side by side with the alternatives.

Every scenario runs once per transport (shmq ``MessageQueue``, ``multiprocessing.Queue``,
pyzmq PUB/SUB over ``ipc://``, vLLM 0.33's ``MessageQueue`` without and with its tensor
arena when vLLM is importable, and ``torch.multiprocessing`` queues when torch is), in
processes of their own (spawned; ``--quick`` forks them from a server that imported
torch and vLLM once), and the results are printed as one table. The method (the one the
project's performance targets were measured with):

- the *small object* is :data:`SMALL_OBJECT` (135 bytes pickled); the *step* is
  :data:`STEP_OBJECT`, a decode step's scheduler output for 64 requests (12,986 bytes);
- *one-way latency* is half the round trip of a ping-pong between two processes
  through two queues, p50/p99 over a number of round trips after a warm-up; the step's
  has its pickle floor (``dumps`` + ``loads`` in one process) right under it;
- *throughput* is N objects from the writer's first enqueue to the last reader's last
  dequeue, readers in separate processes (clock: ``CLOCK_MONOTONIC``, which all
  processes share);
- the *pickle only* rows (floors) time ``dumps`` and ``loads`` alone in one process:
  one object handed over costs at least both (the latency floor), a stream at least
  the slower of the two per object (writer and reader pickle in parallel).
- *fresh* tensor rows (what users feel): the writer makes a new float32 tensor for every
  send (``torch.full``, inside the clock: the producer's work in every transport alike)
  and each of 1 or 3 readers copies every byte into its own buffer (made before the
  clock) and checks the message's number at both ends; 1, 16 and 256 MiB; torch's
  intra-op threads at 1 in every process; warm-up messages outside the clock; the
  figure is bytes per reader per second from the writer's first measured send to the
  last reader's last consume, plus the send call's p50. The *loaned* rows (shmq only)
  fill a tensor borrowed from the queue (``loan_tensor``) and send it without a copy.
- *hand-over only* tensor rows: the same tensor every send, each reader reads one
  element: what the transport alone costs (torch.multiprocessing is handed a tensor
  already in shared memory after the first send: no copy at all).
- *consume*: one reader's copy of a received 16 MiB view into its own buffer, next to
  its copy of a persistent mapping of a ``/dev/shm`` file (the limit), same run.
- the *encoder cache* floor (:mod:`.encoder_cache`): a fresh 16 MiB embedding handed
  to 2 consumer processes that consume every byte, through shmq's encoder cache, vLLM
  0.33's upstream CPU connector's data path, and torch.multiprocessing.

Without torch, the tensor rows send float32 numpy arrays (the labels say so) and the
rows that need torch say so under the table.

The package, one module per part (each uses only the ones before it):

- :mod:`.common`: the objects sent, queue geometry, shared clock, timing helpers, the
  arrays the tensor rows send (:class:`~.common.Arrays`), ``BenchError`` and ``Skip``;
- :mod:`.transports`: a :class:`Transport` opens the writer and reader endpoints
  (:class:`Endpoint`) of a channel; the parent makes the channel (something picklable
  handed to the children);
- :mod:`.roles`: what a child process runs (``_role_*``); roles only use endpoints,
  so one role serves all transports;
- :mod:`.harness`: :class:`Harness` starts the roles of one run in child processes;
- :mod:`.encoder_cache`: the encoder-cache hand-offs (starts its own consumer
  processes);
- :mod:`.scenarios`: a *scenario* function (``_bench_*``) starts roles through the
  harness and turns what they return into metrics; :data:`SCENARIOS` lists them with
  their table rows, :data:`FLOORS` the single-process reference rows;
- :mod:`.gpu`: ``--scenarios gpu``, tensors received into device memory beside the
  pinned limit and the encoder cache's IPC hand-off, one JSON line per row (its own
  processes; on the CPU twin of the device seam where torch sees no GPU);
- :mod:`.report`: ``run_bench``, the table, and the command line (``add_arguments``,
  ``main``).

The harness is defensive: every wait has a timeout, a failed child or a run in which no
child makes progress for 10 s (each beats a shared counter as its messages go:
:func:`.roles.beat`) makes the parent terminate all children of that run (and remove the
shared-memory segments they created), readers check they received exactly the objects
sent, and a failure (of a cell or of a floor) is shown in its cell and listed under the
table while the other cells still run; the exit code is 1 only then. A run that is
merely slow (a busy machine) keeps its figures, marked "(slow)" with a note under the
table. A row that cannot run here (torch, vLLM
or pyzmq not installed) says "skipped", and one line under the table per reason says
what it needs; skips are not failures. Without torch, the tensor rows send float32
numpy arrays (the labels say so).
"""

from __future__ import annotations

from .common import SMALL_OBJECT, STEP_OBJECT
from .report import add_arguments, main, run_bench
from .scenarios import FLOORS, SCENARIOS
from .transports import TRANSPORTS

__all__ = ["SMALL_OBJECT", "STEP_OBJECT", "SCENARIOS", "FLOORS", "TRANSPORTS", "add_arguments", "main", "run_bench"]

"""What every part of the benchmark shares: the small object, the queue geometry, the
shared clock and the error a failed run raises."""

from __future__ import annotations

import pickle
import time

#: The object every scenario sends (a scheduler step's batch, in miniature).
SMALL_OBJECT = {"req_ids": list(range(16)), "tokens": [[1, 2, 3, 4]] * 8, "flag": True, "name": "scheduler-output"}

MiB = 1 << 20
#: Queue geometry of every shmq queue in the benchmark (24 MiB x 10 chunks: large enough
#: for a 16 MiB tensor in one chunk, as the project's performance targets assume).
MAX_CHUNK_BYTES = 24 * MiB
MAX_CHUNKS = 10

#: Seconds a child waits for a handle, a handshake or the other processes at a barrier.
SYNC_TIMEOUT = 30.0

PROTOCOL = pickle.HIGHEST_PROTOCOL


def now_ns() -> int:
    """A clock that every process on the machine shares (``CLOCK_MONOTONIC``)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class BenchError(RuntimeError):
    """A benchmark run failed; the message says which process and why."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details

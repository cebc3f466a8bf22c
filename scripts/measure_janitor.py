"""What the janitor costs a process: the time its first segment takes (the janitor is
started then) against its second, with and without a janitor (SHMQ_NO_JANITOR=1), each
in a fresh interpreter; medians of 15. Run: python scripts/measure_janitor.py"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

CHILD = """
import time
from shmq import MessageQueue
t0 = time.perf_counter()
first = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
t1 = time.perf_counter()
second = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def main() -> None:
    for label, env in (("with a janitor", {}), ("SHMQ_NO_JANITOR=1", {"SHMQ_NO_JANITOR": "1"})):
        first, second = [], []
        for _ in range(15):
            out = subprocess.run(
                [sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True, check=True
            ).stdout.split()
            first.append(float(out[0]) * 1e3)
            second.append(float(out[1]) * 1e3)
        print(f"{label}: first queue {statistics.median(first):.2f} ms, second {statistics.median(second):.2f} ms")


if __name__ == "__main__":
    main()

"""What the janitor costs a process: the time its first segment takes (the janitor is
started then) against its second, with and without a janitor (SHMQ_NO_JANITOR=1), each
in a fresh interpreter; medians of 15. Then its memory: N processes (default 20) that
each made a queue, and their janitors' proportional set size (PSS: shared pages counted
once across the processes that share them) in all and per janitor, beside an owner's.

    python scripts/measure_janitor.py [N]"""

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


HOLDER = """
import sys
from shmq import MessageQueue
q = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
print("ready", flush=True)
sys.stdin.read()
"""


def _janitors_of(owners: set[int]) -> list[int]:
    """The janitors of ``owners``: the processes at the other end of their janitor
    sockets (``ss`` shows both ends' inodes)."""
    import re

    listing = subprocess.run(["ss", "-xpn"], capture_output=True, text=True).stdout
    lines = [line.split() for line in listing.splitlines()]
    peers = set()
    for f, line in ((f, " ".join(f)) for f in lines if f and f[0] == "u_seq"):
        m = re.search(r"pid=(\d+),", line)
        if m and int(m.group(1)) in owners:
            peers.add(f[7])
    out = []
    for f in lines:
        if f and f[0] == "u_seq" and f[5] in peers:
            m = re.search(r"pid=(\d+),", " ".join(f))
            if m:
                out.append(int(m.group(1)))
    return out


def memory(n: int) -> None:
    import psutil

    owners = [subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for _ in range(n)]
    try:
        for p in owners:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        pids = {p.pid for p in owners}
        ours = [psutil.Process(pid) for pid in _janitors_of(pids)]
        pss = [j.memory_full_info().pss for j in ours]
        owner_pss = [psutil.Process(pid).memory_full_info().pss for pid in pids]
        mib = 1 << 20
        print(
            f"{n} owners: {len(ours)} janitors, PSS {sum(pss) / mib:.1f} MiB in all, "
            f"{statistics.median(pss) / mib:.2f} MiB each (median); "
            f"an owner {statistics.median(owner_pss) / mib:.1f} MiB"
        )
    finally:
        for p in owners:
            p.kill()
            p.wait()


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
    memory(int(sys.argv[1]) if len(sys.argv) > 1 else 20)

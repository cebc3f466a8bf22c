"""What the two segment designs of docs/operations.md ("The designs weighed") cost here:
creating and opening a 1 MiB segment by name in /dev/shm (shmq's), and as a sealed memfd
(F_SEAL_SHRINK) whose descriptor is passed over a Unix socket. Medians of 2000, in µs.

Run: python scripts/measure_memfd.py
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import statistics
import time
from typing import Callable

N = 2000
SIZE = 1 << 20
SHM = f"/dev/shm/shmq_measure_{os.getpid()}"


def median_us(f: Callable[[], None]) -> float:
    times = []
    for _ in range(N):
        t = time.perf_counter_ns()
        f()
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1000


def named_create() -> None:
    fd = os.open(SHM + "_c", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SIZE)
    mmap.mmap(fd, SIZE).close()
    os.close(fd)
    os.unlink(SHM + "_c")


def memfd_create() -> None:
    fd = os.memfd_create("shmq", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    mmap.mmap(fd, SIZE).close()
    os.close(fd)


def main() -> None:
    fd = os.open(SHM, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, SIZE)
    os.close(fd)
    memfd = os.memfd_create("shmq", os.MFD_ALLOW_SEALING)
    os.ftruncate(memfd, SIZE)
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def named_open() -> None:
        fd = os.open(SHM, os.O_RDWR)
        mmap.mmap(fd, SIZE).close()
        os.close(fd)

    def fd_open() -> None:
        socket.send_fds(here, [b"h"], [memfd])
        _, fds, _, _ = socket.recv_fds(there, 16, 1)
        mmap.mmap(fds[0], SIZE).close()
        os.close(fds[0])

    try:
        print(f"create 1 MiB: by name {median_us(named_create):.1f} us, memfd + seals {median_us(memfd_create):.1f} us")
        by_name, by_fd = median_us(named_open), median_us(fd_open)
        print(f"open 1 MiB: by name {by_name:.1f} us, descriptor over a Unix socket {by_fd:.1f} us")
    finally:
        os.unlink(SHM)


if __name__ == "__main__":
    main()

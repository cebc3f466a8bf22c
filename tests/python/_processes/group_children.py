"""Child entry points of test_group.py (StatelessProcessGroup, create_from_process_group)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from shmq import MessageQueue

from .harness import STEP
from .objects import iter_objects
from .queue_children import read_stream


# Ports handed out by free_port(), never the same twice in a process.
_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1, free a moment ago, that no outgoing connection will take.

    Port 0 would give one of the kernel's ephemeral range (32768-60999 by default), where
    every outgoing connection of this machine also takes its local port: between this
    check and the caller's bind (vLLM's StatelessProcessGroup's, say) another test's
    connection can take it (EADDRINUSE, seen in CI). So the ports come from below that
    range, each pytest-xdist worker from a band of its own (12000 + 2500 * n), never the
    same one twice in a process, and each is checked bindable without SO_REUSEADDR, so
    one a closed connection left in TIME_WAIT is skipped too.
    """
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker[2:].isdigit() else 0
    base = 12000 + 2500 * (n % 8)
    start = base + (os.getpid() * 7) % 2500  # processes of one worker start apart
    for i in range(2500):
        port = base + (start - base + i) % 2500
        if port in _PORTS_GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {base}-{base + 2499}")


def _join_group(kind: str, port: int, rank: int, world_size: int) -> Any:
    """Join a ``world_size``-process group on 127.0.0.1:``port``: torch's default
    process group over gloo (``kind == "gloo"``) or a StatelessProcessGroup."""
    if kind == "gloo":
        import datetime

        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=2 * STEP),
        )
        return dist.group.WORLD
    from shmq import StatelessProcessGroup

    return StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=int(2 * STEP))


def _only_the_writer_is_local(pg: Any, source_rank: int = 0) -> list[bool]:
    """Stand-in for ``shmq.group.in_the_same_node_as`` that reports every rank but
    ``source_rank`` as on another machine (without any collective)."""
    from shmq.group import _Ops

    return [r == source_rank for r in range(_Ops(pg).world_size)]


def group_queue_member(
    out: Any,
    kind: str,
    port: int,
    rank: int,
    world_size: int,
    subgroup: Any,
    writer_rank: int,
    plan: list,
    big: int,
    max_chunks: int,
    remote: bool,
    release: Any,
) -> None:
    """One process of a ``kind`` group ("gloo" or "stateless") of ``world_size``.

    ``subgroup``: None, or the world ranks of a ``torch.distributed.new_group`` that the
    queues are made on (world ranks outside it only create the subgroup). For each
    ``(seed, n)`` of ``plan``, in turn: ``MessageQueue.create_from_process_group`` with
    ``writer_rank`` (a group rank); the writer sends the ``iter_objects(seed, n, big)``
    stream and reports ("sent", ...); each reader checks it and reports ("done", ...).
    ``remote``: replace same-machine detection so that every reader is remote and the
    writer publishes on 127.0.0.1. Every queue is kept until ``release`` is set."""
    import shmq.group

    if remote:
        os.environ["SHMQ_HOST_IP"] = "127.0.0.1"
        shmq.group.in_the_same_node_as = _only_the_writer_is_local
    pg = _join_group(kind, port, rank, world_size)
    group_rank = rank
    if subgroup is not None:
        import torch.distributed as dist

        pg = dist.new_group(list(subgroup))  # collective over the whole world
        group_rank = dist.get_rank(pg)  # -1 outside the subgroup
    queues = []
    if group_rank >= 0:
        for qi, (seed, n) in enumerate(plan):
            mq = MessageQueue.create_from_process_group(pg, big, max_chunks, writer_rank=writer_rank)
            queues.append(mq)
            if group_rank == writer_rank:
                for obj in iter_objects(seed, n, big):
                    mq.enqueue(obj, timeout=STEP)
                handle = mq.export_handle()
                out.put(
                    (
                        "sent",
                        {
                            "queue": qi,
                            "rank": rank,
                            "group_rank": group_rank,
                            "local_reader_ranks": list(handle.local_reader_ranks),
                            "remote_subscribe_addr": handle.remote_subscribe_addr,
                            "n_local_reader": mq.n_local_reader,
                            "n_remote_reader": mq.n_remote_reader,
                        },
                    )
                )
                continue
            report = {"queue": qi, "rank": rank, "group_rank": group_rank, **read_stream(mq, seed, n, big)}
            out.put(("done", report))
    else:
        out.put(("outside", rank))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")
    del queues
    if kind == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


def stateless_ops_member(out: Any, port: int, rank: int, world_size: int, release: Any) -> None:
    """Exercise StatelessProcessGroup's send/recv, broadcast, all_gather and barrier
    (including a barrier that times out because the last rank stays away) and report
    what this rank saw."""
    from shmq import StatelessProcessGroup

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=int(STEP))
    seen: dict[str, Any] = {"rank": pg.rank, "world_size": pg.world_size}

    # send/recv: three messages to every other rank, received in order per source.
    for dst in range(world_size):
        if dst != rank:
            for i in range(3):
                pg.send_obj((rank, dst, i, np.arange(i + rank, dtype=np.int64)), dst=dst)
    received = {}
    for src in reversed(range(world_size)):
        if src != rank:
            got = [pg.recv_obj(src) for _ in range(3)]
            received[src] = [(s, d, i, a.tolist()) for s, d, i, a in got]
    seen["received"] = received

    # broadcast from every rank in turn, then all_gather.
    seen["broadcast"] = [
        pg.broadcast_obj({"from": src, "payload": "x" * src} if rank == src else None, src=src)
        for src in range(world_size)
    ]
    seen["all_gather"] = pg.all_gather_obj(("rank", rank, [rank] * rank))

    t0 = time.monotonic()
    pg.barrier(timeout=STEP)
    seen["barrier_s"] = time.monotonic() - t0

    # The last rank stays away from the next barrier until the others have timed out.
    last = world_size - 1
    if rank != last:
        t0 = time.monotonic()
        try:
            pg.barrier(timeout=1.0)
        except RuntimeError as e:
            seen["timeout"] = ("RuntimeError", str(e), time.monotonic() - t0)
        else:
            seen["timeout"] = ("returned", "", time.monotonic() - t0)
        pg.store.set(f"test/timed_out/{rank}", b"1")
    else:
        pg.store.wait([f"test/timed_out/{r}" for r in range(last)])
        pg.barrier(timeout=STEP)  # late: the others' arrival keys are still there
    pg.barrier(timeout=STEP)  # and everyone is in step again
    out.put(("seen", seen))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")


def stateless_expiry_member(out: Any, port: int, rank: int, expiration: float, release: Any) -> None:
    """Two ranks: rank 0 sends, rank 1 receives; after ``expiration`` s rank 0's
    expire_data() must delete the old entry and keep a fresh one."""
    from shmq import StatelessProcessGroup

    pg = StatelessProcessGroup.create(
        "127.0.0.1", port, rank, 2, data_expiration_seconds=expiration, store_timeout=int(STEP)
    )
    report: dict[str, Any] = {"data_expiration_seconds": pg.data_expiration_seconds}
    old_key = "send_to/1/from/0/0"
    new_key = "send_to/1/from/0/1"
    if rank == 0:
        pg.send_obj("old", dst=1)
        report["old_before"] = pg.store.check([old_key])
        pg.barrier(timeout=STEP)  # rank 1 has received "old"
        time.sleep(expiration + 0.5)  # not synchronisation: lets the data expire (the behaviour under test)
        pg.expire_data()
        report["old_after_expire"] = pg.store.check([old_key])
        pg.send_obj("new", dst=1)  # send_obj expires too; "new" is fresh and stays
        pg.expire_data()
        report["new_after_expire"] = pg.store.check([new_key])
        report["entries"] = [key for key, _ in pg.entries]
        pg.barrier(timeout=STEP)
    else:
        report["got"] = [pg.recv_obj(0)]
        pg.barrier(timeout=STEP)
        pg.barrier(timeout=STEP)
        report["got"].append(pg.recv_obj(0))
    out.put(("expiry", rank, report))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")


def barrier_then_exit_member(out: Any, port: int, rank: int, world_size: int, rounds: int) -> None:
    """Join a StatelessProcessGroup, pass ``rounds`` barriers, report, and exit at once:
    rank 0 hosts the store, so its barrier must not return before the others are done
    with the store."""
    from shmq import StatelessProcessGroup

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=int(STEP))
    for _ in range(rounds):
        pg.barrier(timeout=STEP)
    out.put(("passed", rank))

"""Four GPU-worker-like processes get one broadcast queue with one call.

Rank 2 writes; the ranks on its machine read through shared memory, ranks on other
machines over TCP (decided by which ranks can open a probe segment of the writer's, not
by host names). Run: python examples/process_group.py   (scripts/test.sh runs it)
Needs torch (its TCPStore): pip install 'shmq[torch]'.
"""

import multiprocessing as mp
import socket

from shmq import MessageQueue, StatelessProcessGroup

WORLD_SIZE, WRITER = 4, 2


def worker(rank, port):
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, WORLD_SIZE)
    queue = MessageQueue.create_from_process_group(pg, max_chunk_bytes=1 << 20, max_chunks=8, writer_rank=WRITER)
    if rank == WRITER:
        for step in range(3):
            queue.enqueue({"step": step, "req_ids": list(range(step, step + 4))})
    else:
        for _ in range(3):
            print(f"rank {rank} ({'shared memory' if queue._is_local_reader else 'tcp'}): {queue.dequeue()}")
    pg.barrier()  # rank 0 hosts the store: everyone leaves together


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, port)) for rank in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"a worker exited with {p.exitcode}"

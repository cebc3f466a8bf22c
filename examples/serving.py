"""A scheduler and four workers, the way a serving engine runs them.

Each step the scheduler puts the step's multimodal tensor (embeddings of an image) in
the object store once, broadcasts the step's batch to the four workers through the
queue, and collects one result per worker from a queue each worker writes (its handle
came back with the worker's ready report). ``WorkerProcesses`` starts the workers, waits
for them under a deadline, watches them, and shuts everything down.

With ``--crash``, worker 2 fails at step 5 (a simulated CUDA error). The scheduler is
blocked waiting for its result at that moment; the monitor wakes it with an error that
names the worker and shows its traceback, and shuts the batch queue down: the other
workers' ``dequeue`` raises ``QueueShutDownError``, ``sibling_failure()`` tells them
which worker failed, and they return (exit code 0, no traceback). ``join`` then has
every exit code (it does not raise the failure the monitor raised), and the script ends
cleanly: no worker processes and no shared-memory segments are left behind.

Run: python examples/serving.py [--crash]   (scripts/test.sh runs both)
"""

import argparse
import os
import sys

import numpy as np

from shmq import (
    MessageQueue,
    ObjectStorage,
    QueueShutDownError,
    RingBuffer,
    WorkerDiedError,
    WorkerProcesses,
    report_ready,
)
from shmq.admin import list_segments
from shmq.workers import sibling_failure

N_WORKERS, N_STEPS = 4, 10
CRASH_RANK, CRASH_STEP = 2, 5


def worker(rank, batch_handle, store_handle, crash):
    batches = MessageQueue.create_from_handle(batch_handle, rank)
    store = ObjectStorage.create_from_handle(store_handle)
    results = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    report_ready(results.export_handle())  # set-up done; the scheduler reads our results here
    batches.wait_until_ready()
    results.wait_until_ready()
    try:
        while (batch := batches.dequeue()) is not None:
            if crash and rank == CRASH_RANK and batch["step"] == CRASH_STEP:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            # The shared tensor by its signed handle: (address, id), signature, key.
            address, monotonic_id, signature, key = batch["embeddings"]
            embeddings = store.get(address, monotonic_id, signature=signature, key=key)
            tokens = [req * 1000 + batch["step"] for req in batch["req_ids"]]  # "sampled tokens"
            results.enqueue({"rank": rank, "step": batch["step"], "sum": float(embeddings.sum()), "tokens": tokens})
    except QueueShutDownError:
        # The scheduler ended the queue before its None: it is shutting down, because a
        # worker failed (sibling_failure() names it) or for reasons of its own (None).
        failed = sibling_failure()
        if failed is not None:
            print(f"worker {rank}: stopping: {failed.name} (pid {failed.pid}) failed with exit code {failed.exitcode}")


def serve(crash):
    batches = MessageQueue(n_reader=N_WORKERS, n_local_reader=N_WORKERS, max_chunk_bytes=1 << 20, max_chunks=8)
    store = ObjectStorage(max_object_size=4 << 20, n_readers=N_WORKERS, ring_buffer=RingBuffer(32 << 20, create=True))
    rng = np.random.default_rng(0)
    with WorkerProcesses(worker, N_WORKERS, args=(batches.export_handle(), store.handle(), crash)) as workers:
        result_handles = workers.wait_until_ready(timeout=120)
        batches.wait_until_ready()
        results = [MessageQueue.create_from_handle(h, 0) for h in result_handles]
        for queue in results:
            queue.wait_until_ready()
        print(f"scheduler: {N_WORKERS} workers ready: {', '.join(map(str, workers.pids))}")
        try:
            # A worker that fails wakes the scheduler wherever it blocks on these queues.
            with workers.monitor(batches, *results):
                for step in range(N_STEPS):
                    embeddings = rng.standard_normal((256, 512), dtype=np.float32)  # 512 KiB
                    batch = {"step": step, "req_ids": list(range(step, step + 8))}
                    key = f"image-{step}"
                    batch["embeddings"] = (*store.put(key, embeddings), store.get_signature(key), key)
                    batches.enqueue(batch)
                    outputs = [queue.dequeue() for queue in results]
                    assert all(o["step"] == step and np.isclose(o["sum"], embeddings.sum()) for o in outputs)
                    print(f"scheduler: step {step}: {len(outputs)} results, tokens {outputs[0]['tokens'][:3]}...")
                batches.enqueue(None)  # stop
                print(f"scheduler: workers finished: {workers.join(timeout=60)}")
        except WorkerDiedError as e:
            if not crash:
                raise
            print(f"scheduler: a worker failed, shutting down:\n{e}")
            # The other workers end by themselves (their queue was shut down); join
            # waits for them and does not raise the failure above again.
            print(f"scheduler: exit codes: {workers.join(timeout=60)}")
        finally:
            pids = set(workers.pids)
            del results
    # Leaving the block closed the workers: SIGTERM, grace period, SIGKILL of whole
    # process trees, and the segments dead workers left were removed.
    store.close()  # removes the store's segment now (the store is in reference cycles)
    del batches, store
    return pids


def check_clean(worker_pids):
    running = [pid for pid in worker_pids if os.path.exists(f"/proc/{pid}")]
    segments = [s.name for s in list_segments() if s.creator_pid in worker_pids | {os.getpid()}]
    assert not running, f"worker processes still running: {running}"
    assert not segments, f"shared-memory segments left behind: {segments}"
    print("scheduler: clean exit: no worker processes, no shared-memory segments left")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--crash", action="store_true", help=f"worker {CRASH_RANK} crashes at step {CRASH_STEP}")
    args = parser.parse_args()
    check_clean(serve(args.crash))
    sys.exit(0)

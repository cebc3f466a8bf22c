"""One scheduler broadcasts each step's batch to two worker processes; multimodal
tensors are put once in the object store and read by every worker.

Run: python examples/broadcast.py   (scripts/test.sh runs it)
"""

import multiprocessing as mp

import numpy as np

from shmq import MessageQueue, ObjectStorage, RingBuffer


def worker(queue_handle, store_handle, rank):
    queue = MessageQueue.create_from_handle(queue_handle, rank)
    store = ObjectStorage.create_from_handle(store_handle)
    queue.wait_until_ready()
    while (batch := queue.dequeue()) is not None:
        image = store.get(batch["image"])  # an ObjectRef: the shared tensor, signed
        print(f"worker {rank}: step {batch['step']}, image {image.shape} sum {image.sum():.0f}")


if __name__ == "__main__":
    queue = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1 << 20, max_chunks=8)
    store = ObjectStorage(max_object_size=16 << 20, n_readers=2, ring_buffer=RingBuffer(64 << 20, create=True))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(queue.export_handle(), store.handle(), r)) for r in range(2)]
    for p in procs:
        p.start()
    queue.wait_until_ready()
    for step in range(3):
        key = f"image-{step}"
        image = store.put_ref(key, np.full((224, 224, 3), step, dtype=np.float32))  # picklable
        queue.enqueue({"step": step, "req_ids": list(range(16)), "image": image})
    queue.enqueue(None)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"

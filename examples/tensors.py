"""Large tensors to two worker processes: one copy into shared memory, zero-copy views
out, and a loaned tensor that is filled in place and sent without any copy — through
the broadcast queue, and through the object store.

Run: python examples/tensors.py
"""

import multiprocessing as mp

import torch

from shmq import MessageQueue, ObjectStorage, RingBuffer


def worker(handle, store_handle, rank):
    queue = MessageQueue.create_from_handle(handle, rank)
    store = ObjectStorage.create_from_handle(store_handle)
    queue.wait_until_ready()
    while (step := queue.dequeue()) is not None:
        if "stored" in step:  # a store handle: get() returns a view, O(1) in the size
            embeds = store.get(*step["stored"])["embeds"]
            print(f"worker {rank}: stored embeddings {tuple(embeds.shape)}, sum {embeds.float().sum():.0f}")
            continue
        pixels = step["pixel_values"]  # a view of shared memory: no copy was made
        pixels.mul_(2)  # writable, and private: the writer and the other worker never see it
        print(f"worker {rank}: step {step['step']}, {tuple(pixels.shape)}, mean {pixels.mean():.1f}")


if __name__ == "__main__":
    queue = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1 << 20, max_chunks=8)
    store = ObjectStorage(max_object_size=64 << 20, n_readers=2, ring_buffer=RingBuffer(128 << 20, create=True))
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=worker, args=(queue.export_handle(), store.handle(), r)) for r in range(2)]
    for w in workers:
        w.start()
    queue.wait_until_ready()

    image = torch.full((3, 1024, 1024), 1.0)  # 12 MiB: copied once into the tensor arena
    queue.enqueue({"step": 0, "pixel_values": image})

    loaned = queue.loan_tensor((3, 1024, 1024), torch.float32)  # memory in the arena
    loaned.fill_(5.0)  # e.g. an encoder writes its output here
    queue.enqueue({"step": 1, "pixel_values": loaned})  # sends a reference: no copy at all
    del loaned  # given back once both workers have dropped their views too

    embeds = store.loan_tensor((1024, 4096), torch.float16)  # memory in the store's ring
    embeds.fill_(1.0)
    address, monotonic_id = store.put("image-7", {"embeds": embeds})  # written around it
    del embeds  # the object can be evicted in its turn once the workers have read it
    queue.enqueue({"stored": (address, monotonic_id, store.get_signature("image-7"), "image-7")})

    queue.enqueue(None)
    for w in workers:
        w.join()
    assert torch.all(image == 1.0), "a worker's write reached the writer"
    print("writer: its own tensor is unchanged; arena:", queue.arena_stats())

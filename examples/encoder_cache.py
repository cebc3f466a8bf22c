"""Encoder-cache hand-off: an encoder process saves image embeddings under their content
hash; the scheduler (this process) asks which are ready and tells two language-model
workers, over a shmq queue, which to load; the workers load them as zero-copy views.

Run: python examples/encoder_cache.py
"""

import hashlib
import multiprocessing as mp
import os
import time

import torch

from shmq import EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer, MessageQueue

CACHE = f"example-{os.getpid()}"  # the encoder's name: consumers find its cache by it
IMAGES = [b"cat.png", b"dog.png", b"owl.png"]


def mm_hash(image: bytes) -> str:
    return hashlib.sha256(image).hexdigest()


def encoder(cache: str) -> None:
    # min_consumers=2: a key counts as loaded once both workers loaded it.
    with EncoderCacheProducer(cache, capacity=256 << 20, min_consumers=2) as producer:
        for i, image in enumerate(IMAGES):
            embedding = torch.full((576, 4096), float(i), dtype=torch.bfloat16)  # 4.5 MiB
            producer.save(mm_hash(image), embedding)  # returns at once; copied in the background
        for image in IMAGES:
            producer.wait_loaded(mm_hash(image), timeout=60)
        print("encoder: both workers loaded every embedding")


def worker(cache: str, handle, rank: int) -> None:
    consumer = EncoderCacheConsumer(cache)
    queue = MessageQueue.create_from_handle(handle, rank)
    queue.wait_until_ready()
    encoder_cache: dict = {}
    while (step := queue.dequeue()) is not None:
        missing = consumer.load(step["keys"], encoder_cache)  # views of shared memory, no copy
        assert not missing, missing
        for key in step["keys"]:
            e = encoder_cache[key]
            print(f"worker {rank}: step {step['step']}: {key[:8]}… {tuple(e.shape)} {e.dtype}, value {e[0, 0]:.0f}")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1 << 16, max_chunks=4)
    procs = [ctx.Process(target=worker, args=(CACHE, queue.export_handle(), r)) for r in range(2)]
    procs.append(ctx.Process(target=encoder, args=(CACHE,)))
    for p in procs:
        p.start()
    queue.wait_until_ready()

    # The scheduler: which embeddings are ready? (O(1) lookups in shared memory.)
    index = EncoderCacheIndex(CACHE)
    pending, step, deadline = [mm_hash(i) for i in IMAGES], 0, time.monotonic() + 60
    while pending and time.monotonic() < deadline:
        ready = [k for k in pending if index.has(k)]
        if ready:
            queue.enqueue({"step": step, "keys": ready})
            pending, step = [k for k in pending if k not in ready], step + 1
        else:
            time.sleep(0.001)
    queue.enqueue(None)
    for p in procs:
        p.join(60)
    assert not pending and all(p.exitcode == 0 for p in procs), "the example failed"
    print("scheduler: done")

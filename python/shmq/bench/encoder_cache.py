"""Encoder-cache rows of ``python -m shmq bench`` (single-process floors that start their
own consumer processes): the hand-off of one image's embedding from an encoder to two
language-model workers.

- *save*: ``EncoderCacheProducer.save`` of a fresh 16 MiB float32 tensor until it is
  published (``flush``), per image;
- *load*: one consumer's ``load`` of that key into a dict plus a read of the tensor's
  last element (a view: no copy), per image and consumer (median);
- *hand-off*: from the start of the save to the later of the two consumers having the
  tensor (each is told the key over a ``multiprocessing`` queue, whose latency is
  included), per image (median);
- the same hand-off through a ``torch.multiprocessing`` queue per consumer (torch moves
  the tensor to shared memory and sends a handle), measured in the same run;
- the engine's published figures for its SHM encoder-cache connector (311 ms save,
  72 ms load per image, on its hardware; shown for reference, not measured here);
- ``has(key)`` from an index in this process, and the load of a held key of 1 and
  64 MiB (in this process): the load is a mapping, so its time does not grow with size.
"""

from __future__ import annotations

import gc
import os
import queue as queue_mod
import statistics
import uuid
from typing import Any

from .common import MiB, SYNC_TIMEOUT, Arrays, BenchError, measure_parts, need_torch, now_ns
from .scenarios import Floor, Metric, Params, _time_per_call_us

EMBEDDING_BYTES = 16 * MiB
#: vLLM's SHM encoder-cache connector, per image, as its authors published them.
PUBLISHED_SAVE_MS = 311.0
PUBLISHED_LOAD_MS = 72.0
N_CONSUMERS = 2


def _images(params: Params) -> tuple[int, int]:
    """``(measured, warm-up)`` images per run."""
    return (12, 2) if params.objects >= 50_000 else (6, 2)


def _shmq_consumer(cache: str, keys: Any, done: Any, rank: int) -> None:
    from shmq import EncoderCacheConsumer

    consumer = EncoderCacheConsumer(cache)
    done.put(("ready", rank))
    while (key := keys.get(timeout=SYNC_TIMEOUT)) is not None:
        t0 = now_ns()
        got: dict = {}
        missing = consumer.load([key], got)
        if missing:
            done.put(("error", rank, f"key {key} missing"))
            return
        float(got[key][-1])
        t1 = now_ns()
        del got
        done.put(("done", rank, t0, t1))
    consumer.close()


def _torch_consumer(tensors: Any, done: Any, rank: int) -> None:
    import torch  # noqa: F401  (the tensors' reductions)

    done.put(("ready", rank))
    while (t := tensors.get(timeout=SYNC_TIMEOUT)) is not None:
        float(t[-1])
        t1 = now_ns()
        del t
        done.put(("done", rank, 0, t1))


class _Children:
    """Consumer processes of one run; stopped (killed if need be) on exit."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.procs: list[Any] = []
        self.done = ctx.Queue()

    def start(self, target: Any, *args: Any) -> None:
        p = self.ctx.Process(target=target, args=(*args, self.done, len(self.procs)), daemon=True)
        p.start()
        self.procs.append(p)

    def receive(self, tag: str) -> tuple:
        try:
            msg = self.done.get(timeout=SYNC_TIMEOUT)
        except queue_mod.Empty:
            raise BenchError("an encoder-cache consumer did not report in time") from None
        if msg[0] != tag:
            raise BenchError(f"encoder-cache consumer: expected {tag!r}, got {msg!r}")
        return msg

    def __enter__(self) -> "_Children":
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _fresh_embeddings(n: int, lib: str) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(EMBEDDING_BYTES // 4, dtype=np.float32) for _ in range(n)]
    if lib == "torch":
        import torch

        return [torch.from_numpy(a) for a in arrays]
    return arrays


def _shmq_handoff(n: int, warmup: int, lib: str) -> dict[str, float]:
    import multiprocessing

    from shmq import EncoderCacheProducer

    ctx = multiprocessing.get_context("spawn")
    cache = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    saves, loads, handoffs = [], [], []
    with EncoderCacheProducer(cache, capacity=8 * EMBEDDING_BYTES + 8 * MiB) as producer, _Children(ctx) as kids:
        keys = [ctx.Queue() for _ in range(N_CONSUMERS)]
        for q in keys:
            kids.start(_shmq_consumer, cache, q)
        for _ in keys:
            kids.receive("ready")
        for i, emb in enumerate(_fresh_embeddings(n + warmup, lib)):
            key = f"image-{i}"
            t0 = now_ns()
            producer.save(key, emb, timeout=SYNC_TIMEOUT)
            producer.flush(SYNC_TIMEOUT)
            t1 = now_ns()
            for q in keys:
                q.put(key)
            results = [kids.receive("done") for _ in keys]
            if i >= warmup:
                saves.append((t1 - t0) / 1e6)
                loads += [(r[3] - r[2]) / 1e6 for r in results]
                handoffs.append((max(r[3] for r in results) - t0) / 1e6)
            del emb
        for q in keys:
            q.put(None)
    return {
        "save_ms": statistics.median(saves),
        "load_ms": statistics.median(loads),
        "handoff_ms": statistics.median(handoffs),
    }


def _torch_handoff(n: int, warmup: int) -> dict[str, float]:
    need_torch()
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    handoffs = []
    with _Children(ctx) as kids:
        queues = [ctx.Queue() for _ in range(N_CONSUMERS)]
        for q in queues:
            kids.start(_torch_consumer, q)
        for _ in queues:
            kids.receive("ready")
        for i, emb in enumerate(_fresh_embeddings(n + warmup, "torch")):
            t0 = now_ns()
            for q in queues:
                q.put(emb)
            results = [kids.receive("done") for _ in queues]
            if i >= warmup:
                handoffs.append((max(r[3] for r in results) - t0) / 1e6)
            del emb
        for q in queues:
            q.put(None)
    return {"torch_ms": statistics.median(handoffs)}


def _held_key_costs(params: Params) -> dict[str, float]:
    """``has`` and the load of held keys of 1 and 64 MiB, all in this process."""
    from shmq import EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer

    cache = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    out = {}
    with EncoderCacheProducer(cache, capacity=80 * MiB) as producer:
        index, consumer = EncoderCacheIndex(cache), EncoderCacheConsumer(cache)
        key = "0" * 64  # a sha256 hex digest's length
        arrays = Arrays(params.arrays)
        producer.save(key, arrays.full(MiB // 4, 0.0))
        producer.save("big", arrays.full(64 * MiB // 4, 0.0))
        producer.flush(SYNC_TIMEOUT)
        out["has_us"] = _time_per_call_us(lambda: index.has(key), params.objects)

        def load(k: str) -> None:
            got: dict = {}
            consumer.load([k], got)

        out["load1_us"] = _time_per_call_us(lambda: load(key), 2000, batch=20)
        out["load64_us"] = _time_per_call_us(lambda: load("big"), 2000, batch=20)
        gc.collect()
        consumer.close()
        index.close()
    return out


def _floor_encoder_cache(params: Params) -> dict[str, float]:
    n, warmup = _images(params)
    result: dict = _shmq_handoff(n, warmup, params.arrays)
    result.update(measure_parts(["torch_ms"], lambda: _torch_handoff(n, warmup)))
    result["published_save_ms"] = PUBLISHED_SAVE_MS
    result["published_load_ms"] = PUBLISHED_LOAD_MS
    result.update(_held_key_costs(params))
    return result


ENCODER_CACHE_FLOORS: list[Floor] = [
    Floor("encoder_cache", "encoder cache hand-off", _floor_encoder_cache, [
        Metric("save_ms", "encoder cache: save 16 MiB embedding, per image", "ms", False),
        Metric("load_ms", "encoder cache: load by each of 2 consumers, per image", "ms", False),
        Metric("handoff_ms", "encoder cache: save + load by 2 consumers, per image", "ms", False),
        Metric("torch_ms", "torch.multiprocessing queue hand-off to 2, per image", "ms", False),
        Metric("published_save_ms", "vLLM SHM EC connector save (published), per image", "ms", False),
        Metric("published_load_ms", "vLLM SHM EC connector load (published), per image", "ms", False),
        Metric("has_us", "encoder cache: has(key)", "us", False),
        Metric("load1_us", "encoder cache: load of a held 1 MiB key", "us", False),
        Metric("load64_us", "encoder cache: load of a held 64 MiB key", "us", False),
    ]),
]  # fmt: skip

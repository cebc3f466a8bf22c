"""The encoder-cache hand-off, measured: one image's embedding (a fresh 16 MiB float32
tensor, 1024 tokens x 4096) goes from an encoder (this process) to two language-model
workers (consumer processes), each of which consumes every byte (copies it into its
own buffer, made before the clock, and checks the image's number at both ends).

Three ways, in the same run:

- shmq's encoder cache: ``EncoderCacheProducer.save`` + ``flush`` (published), then
  each consumer's ``load`` (a zero-copy view) and its copy;
- vLLM 0.33's upstream encoder-cache CPU connector (``vllm.distributed.ec_transfer.
  ec_connector.cpu``), its data path driven directly: the shared region
  (``ECSharedRegion``: one ``/dev/shm`` file, ``MAP_SHARED``, pre-faulted with
  ``MADV_POPULATE_WRITE``, viewed as ``(num_blocks, block_size_bytes)`` int8 blocks of
  one token's embedding each) opened by the encoder and by each consumer, the
  scheduler's block allocator (``EmbeddingCache``: ``alloc``, ``mark_ready``, ``pin``
  for a dispatched load, ``unpin`` once every consumer reported), and the copies of
  ``ECCPUWorker.save_caches`` / ``start_load_caches`` over the same runs of blocks
  (``_coalesce_runs``). What is *not* driven, and why: ``ECCPUWorker`` itself needs a
  ``VllmConfig`` with an ``ec_transfer_config`` and an initialised tensor-parallel group
  (``get_tensor_model_parallel_rank``), and its copies are ``swap_blocks_batch``
  (``torch.ops._C_cache_ops``, vLLM's compiled CUDA kernels: a batch of
  ``cudaMemcpyAsync`` between the region and GPU memory, on CUDA streams and events);
  they cannot run without a GPU. So each copy that kernel would make is made here by
  ``Tensor.copy_`` on the CPU, over exactly the same blocks, into a buffer the consumer
  made before the clock (vLLM copies into a fresh GPU buffer per load). The block ids
  and shape travel to the consumers over a ``multiprocessing`` queue (in vLLM, in the
  scheduler's per-step connector metadata);
- ``torch.multiprocessing`` queues (one per consumer): the storage moved to shared
  memory at the send, a handle to each consumer.

Rows: per image (median), the save until published (shmq) or until the blocks hold it
(vLLM); each consumer's load and consume; the hand-off from the start of the save to
the later of the two consumers having consumed it (the key reaching the consumers over
a queue is inside it); and, in this process, ``has(key)`` and the load of a held key of
1 and 64 MiB (a mapping: its time does not grow with size).
"""

from __future__ import annotations

import gc
import logging
import os
import queue as queue_mod
import statistics
import traceback
import uuid
from functools import partial
from typing import Any, Callable

from .common import (
    SYNC_TIMEOUT,
    Arrays,
    BenchError,
    MiB,
    Skip,
    need_torch,
    now_ns,
    time_per_call_us,
)
from .transports import vllm_missing

EMBEDDING_BYTES = 16 * MiB
#: The embedding's shape: tokens x hidden size (vLLM's block is one token's row).
HIDDEN = 4096
EMBEDDING_SHAPE = (EMBEDDING_BYTES // 4 // HIDDEN, HIDDEN)
N_CONSUMERS = 2
#: Embeddings each cache holds at once (older ones are evicted once consumed).
CAPACITY_IMAGES = 8


def _consumer(
    setup: Callable[[], dict], consume: Callable[[dict, Any, Any], None], inbox: Any, done: Any, rank: int
) -> None:
    """A consumer process: ``state = setup()`` (its ``"arrays"``: an :class:`Arrays`;
    its ``"close"``, if any, is called at the end), then for each message from ``inbox``
    until ``None``: ``consume(state, message, own)`` into its own buffer ``own``, timed,
    and a check of the image's number (the message's last item) at both ends. Reports
    ``("done", rank, t0, t1)`` per message, or ``("error", rank, text, traceback)``."""
    try:
        state = setup()
        arrays = state["arrays"]
        own = arrays.full(EMBEDDING_BYTES // 4, -1.0)  # made, and its pages touched, before the clock
        done.put(("ready", rank))
        while (message := inbox.get(timeout=SYNC_TIMEOUT)) is not None:
            t0 = now_ns()
            consume(state, message, own)
            t1 = now_ns()
            arrays.check(own, message[-1], f"consumer {rank}")
            done.put(("done", rank, t0, t1))
        close = state.get("close")
        if close is not None:
            close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        done.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))


class _Children:
    """Consumer processes of one run; stopped (killed if need be) on exit."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.procs: list[Any] = []
        self.done = ctx.Queue()

    def start(self, *args: Any) -> None:
        p = self.ctx.Process(target=_consumer, args=(*args, self.done, len(self.procs)), daemon=True)
        p.start()
        self.procs.append(p)

    def receive(self, tag: str) -> tuple:
        try:
            msg = self.done.get(timeout=SYNC_TIMEOUT)
        except queue_mod.Empty:
            raise BenchError("an encoder-cache consumer did not report in time") from None
        if msg[0] == "error":
            raise BenchError(f"encoder-cache consumer {msg[1]}: {msg[2]}", msg[3])
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


def _handoff(
    ctx: Any,
    n: int,
    warmup: int,
    consumer: tuple,
    save: Callable[[int], Any],
    inboxes: list,
    after: Callable[[int], None] = lambda i: None,
) -> dict[str, float]:
    """The loop every way shares: per image ``i``, ``message = save(i)`` (timed: the
    save), the message to each consumer, both reports (the hand-off), ``after(i)``."""
    saves, loads, handoffs = [], [], []
    with _Children(ctx) as kids:
        for inbox in inboxes:
            kids.start(*consumer, inbox)
        for _ in inboxes:
            kids.receive("ready")
        try:
            for i in range(n + warmup):
                t0 = now_ns()
                message = save(i)
                t1 = now_ns()
                for inbox in inboxes:
                    inbox.put(message)
                del message
                results = [kids.receive("done") for _ in inboxes]
                after(i)
                if i >= warmup:
                    saves.append((t1 - t0) / 1e6)
                    loads += [(r[3] - r[2]) / 1e6 for r in results]
                    handoffs.append((max(r[3] for r in results) - t0) / 1e6)
        finally:
            for inbox in inboxes:
                inbox.put(None)
    return {
        "save_ms": statistics.median(saves),
        "load_ms": statistics.median(loads),
        "handoff_ms": statistics.median(handoffs),
    }


# shmq's encoder cache ------------------------------------------------------------------


def _shmq_open(cache: str, lib: str) -> dict:
    from shmq import EncoderCacheConsumer

    consumer = EncoderCacheConsumer(cache)
    return {"consumer": consumer, "arrays": Arrays(lib), "close": consumer.close}


def _shmq_consume(state: dict, message: tuple, own: Any) -> None:
    key, _value = message
    got: dict = {}
    if state["consumer"].load([key], got):
        raise RuntimeError(f"key {key} missing")
    state["arrays"].copy(own, got.pop(key).reshape(-1))


def shmq_handoff(ctx: Any, n: int, warmup: int, lib: str) -> dict[str, float]:
    """shmq's encoder cache, ``lib`` arrays ("torch" tensors or "numpy" arrays)."""
    from shmq import EncoderCacheProducer

    arrays = Arrays(lib)
    cache = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    with EncoderCacheProducer(cache, capacity=CAPACITY_IMAGES * EMBEDDING_BYTES + 8 * MiB) as producer:
        embedding: list = []

        def save(i: int) -> tuple:
            key = f"image-{i}"
            producer.save(key, embedding.pop(), timeout=SYNC_TIMEOUT)
            producer.flush(SYNC_TIMEOUT)
            return key, float(i)

        def make(i: int) -> None:  # the encoder's output, before the clock
            embedding.append(arrays.full(EMBEDDING_BYTES // 4, float(i)).reshape(EMBEDDING_SHAPE))

        inboxes = [ctx.Queue() for _ in range(N_CONSUMERS)]
        make(0)
        consumer = (partial(_shmq_open, cache, lib), _shmq_consume)
        return _handoff(ctx, n, warmup, consumer, save, inboxes, after=lambda i: make(i + 1))


# vLLM 0.33's encoder-cache CPU connector, its data path -----------------------------------


def _vllm_ec() -> tuple[Any, Any, Any]:
    """``ECSharedRegion``, ``EmbeddingCache`` and the worker's ``_coalesce_runs``;
    ``Skip`` where vLLM 0.33 (with that connector) cannot be imported."""
    reason = vllm_missing()
    if reason is not None:
        raise Skip(reason)
    # The worker module imports vLLM's compiled ops, which warn (through the root
    # logger: vLLM has not set up its own) that a CPU build has none: not this bench's
    # concern, it only uses the module's `_coalesce_runs`.
    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)
    try:
        from vllm.distributed.ec_transfer.ec_connector.cpu.ec_shared_region import ECSharedRegion
        from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import EmbeddingCache
        from vllm.distributed.ec_transfer.ec_connector.cpu.worker import _coalesce_runs
    except Exception as e:  # noqa: BLE001 - a vLLM without that connector
        raise Skip(
            f"needs vLLM 0.33's encoder-cache CPU connector (importing it failed: {type(e).__name__}: {e})"
        ) from e
    finally:
        vllm_log.setLevel(level)
    return ECSharedRegion, EmbeddingCache, _coalesce_runs


def _block_runs(coalesce: Callable, block_ids: list[int], block_bytes: int, nbytes: int) -> list[tuple[int, int, int]]:
    """``(offset in the tensor, offset in the region, bytes)`` of each run of consecutive
    blocks, as ``ECCPUWorker`` describes its copies (only the tensor's bytes)."""
    used = -(-nbytes // block_bytes)
    slots, first_blocks, counts = coalesce(block_ids[:used])
    runs = []
    for slot, first, count in zip(slots.tolist(), first_blocks.tolist(), counts.tolist(), strict=True):
        start = slot * block_bytes
        runs.append((start, first * block_bytes, min(count * block_bytes, nbytes - start)))
    return runs


def _vllm_open(engine_id: str, num_blocks: int, block_bytes: int) -> dict:
    region_class, _cache, coalesce = _vllm_ec()
    arrays = Arrays("torch")
    region = region_class(engine_id, num_blocks, block_bytes)  # opens the encoder's file
    state = {"region": region, "flat": region.blocks.view(-1), "coalesce": coalesce, "arrays": arrays}
    state["close"] = partial(_vllm_close, state)
    return state


def _vllm_close(state: dict) -> None:
    del state["flat"]  # the views of the mapping go before it is closed
    gc.collect()
    state["region"].cleanup()


def _vllm_consume(state: dict, message: tuple, own: Any) -> None:
    """``start_load_caches``' copy, on the CPU: each run of blocks into this consumer's
    buffer (the bytes of ``own``), at the run's place in the tensor."""
    import torch

    block_ids, _value = message
    flat, out = state["flat"], own.view(torch.int8)
    runs = _block_runs(state["coalesce"], block_ids, state["region"].block_size_bytes, out.numel())
    for start, region_at, length in runs:
        out[start : start + length].copy_(flat[region_at : region_at + length])


def vllm_cpu_handoff(ctx: Any, n: int, warmup: int) -> dict[str, float]:
    """vLLM 0.33's encoder-cache CPU connector's data path (see the module docstring)."""
    region_class, cache_class, coalesce = _vllm_ec()
    import torch

    arrays = Arrays("torch")
    block_bytes = HIDDEN * 4  # vLLM: hidden size x element size, one token per block
    blocks_per_image = EMBEDDING_BYTES // block_bytes
    num_blocks = CAPACITY_IMAGES * blocks_per_image
    engine_id = f"shmq-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    region = region_class(engine_id, num_blocks, block_bytes)  # creates and pre-faults the file
    mapped = {"flat": region.blocks.view(-1)}  # emptied before the region is closed
    try:
        cache = cache_class(num_blocks)
        embedding: list = [arrays.full(EMBEDDING_BYTES // 4, 0.0).reshape(EMBEDDING_SHAPE)]

        def save(i: int) -> tuple:
            key = f"image-{i}"
            src = embedding.pop().reshape(-1).view(torch.int8)
            entry = cache.alloc(key, blocks_per_image, EMBEDDING_SHAPE)
            if entry is None:
                raise RuntimeError("vLLM's EmbeddingCache had no room (consumed images should be evictable)")
            block_ids, flat = list(entry.block_ids), mapped["flat"]
            for start, region_at, length in _block_runs(coalesce, block_ids, block_bytes, src.numel()):
                flat[region_at : region_at + length].copy_(src[start : start + length])
            cache.mark_ready(key)  # the worker reported the save done
            cache.pin(key)  # a load dispatched: pinned until every consumer reported it
            return block_ids, float(i)

        def after(i: int) -> None:
            cache.unpin(f"image-{i}")  # every consumer reported its load
            embedding.append(arrays.full(EMBEDDING_BYTES // 4, float(i + 1)).reshape(EMBEDDING_SHAPE))

        inboxes = [ctx.Queue() for _ in range(N_CONSUMERS)]
        consumer = (partial(_vllm_open, engine_id, num_blocks, block_bytes), _vllm_consume)
        result = _handoff(ctx, n, warmup, consumer, save, inboxes, after)
    finally:
        mapped.clear()  # the views of the mapping go before it is closed
        gc.collect()
        region.cleanup()
    return {f"vllm_{k}": v for k, v in result.items()}


# torch.multiprocessing --------------------------------------------------------------------


def _torch_open() -> dict:
    import torch.multiprocessing  # noqa: F401 (the tensors' reductions)

    return {"arrays": Arrays("torch")}


def _torch_consume(state: dict, message: tuple, own: Any) -> None:
    tensor, _value = message
    own.copy_(tensor.reshape(-1))


def torch_handoff(ctx: Any, n: int, warmup: int) -> dict[str, float]:
    """The same hand-off through a ``torch.multiprocessing`` queue per consumer: the
    send moves the tensor's storage to shared memory (inside the clock)."""
    need_torch()
    import torch.multiprocessing as tmp

    arrays = Arrays("torch")
    embedding: list = [arrays.full(EMBEDDING_BYTES // 4, 0.0).reshape(EMBEDDING_SHAPE)]

    def save(i: int) -> tuple:
        return embedding.pop(), float(i)  # the queues' feeder threads move it when sending

    def after(i: int) -> None:
        embedding.append(arrays.full(EMBEDDING_BYTES // 4, float(i + 1)).reshape(EMBEDDING_SHAPE))

    inboxes = [tmp.get_context("spawn").Queue() for _ in range(N_CONSUMERS)]
    result = _handoff(ctx, n, warmup, (_torch_open, _torch_consume), save, inboxes, after)
    return {"torch_ms": result["handoff_ms"]}


# Costs of held keys, in this process ------------------------------------------------------


def held_key_costs(lib: str, calls: int) -> dict[str, float]:
    """``has`` and the load (a view, no copy) of held keys of 1 and 64 MiB."""
    from shmq import EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer

    cache = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    out = {}
    with EncoderCacheProducer(cache, capacity=80 * MiB) as producer:
        index, consumer = EncoderCacheIndex(cache), EncoderCacheConsumer(cache)
        key = "0" * 64  # a sha256 hex digest's length
        arrays = Arrays(lib)
        producer.save(key, arrays.full(MiB // 4, 0.0))
        producer.save("big", arrays.full(64 * MiB // 4, 0.0))
        producer.flush(SYNC_TIMEOUT)
        out["has_us"] = time_per_call_us(lambda: index.has(key), calls)

        def load(k: str) -> None:
            got: dict = {}
            consumer.load([k], got)

        out["load1_us"] = time_per_call_us(lambda: load(key), 2000, batch=20)
        out["load64_us"] = time_per_call_us(lambda: load("big"), 2000, batch=20)
        gc.collect()
        consumer.close()
        index.close()
    return out

"""Scenarios (run once per transport) and floors (references measured once, in this
process): what is measured and how the roles' results become table rows."""

from __future__ import annotations

import os
import pickle
import statistics
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

from shmq._core import LOAN_SEAL_MIN, SHM_DIR
from . import encoder_cache
from .common import (
    PROTOCOL,
    SMALL_OBJECT,
    STEP_OBJECT,
    MiB,
    Skip,
    measure_parts,
    percentile,
    time_per_call_us,
)
from .harness import Harness, Job
from .roles import (
    _role_consume_reader,
    _role_consume_writer,
    _role_idle_reader,
    _role_idle_writer,
    _role_ping,
    _role_pong,
    _role_reader,
    _role_step_reader,
    _role_step_writer,
    _role_tensor_reader,
    _role_tensor_writer,
    _role_writer,
)
from .transports import Transport, vllm_missing


@dataclass
class Params:
    """How much each scenario measures, and how its processes start."""

    rounds: int  # ping-pong round trips measured
    warmup: int  # ping-pong round trips before measuring
    objects: int  # objects sent in the throughput scenarios
    wakes: int = 10  # wake-ups from a short idle stretch in the idle scenario
    idle_s: float = 0.3  # seconds of each short idle stretch (under 1 s: see IDLE_STEADY_WINDOW)
    #: Long idle stretches in the idle scenario, after the short ones: the reader's CPU
    #: is measured over IDLE_STEADY_WINDOW of each, and the message that ends it wakes it.
    steady_wakes: int = 2  # (at least 1)
    tensor_sizes: tuple[int, ...] = (MiB, 16 * MiB, 256 * MiB)  # bytes of the tensor rows
    #: What the tensor rows send: "torch" tensors, or "numpy" arrays where torch is not
    #: installed (``common.array_lib``; their labels say "numpy array" then).
    arrays: str = "torch"
    #: Ping-pong round trips of the step's latency (None: ``rounds``; never more); its
    #: warm-up is a tenth of them at most.
    step_rounds: Optional[int] = None
    #: Bytes each tensor run sends to each reader after its warm-up (at most 200 messages,
    #: at least 4).
    tensor_budget: int = 1600 * MiB
    #: Warm-up messages of the realistic tensor rows (3 at most for sizes over 16 MiB).
    fresh_warmup: int = 10
    #: Messages measured in the consume scenario.
    consume_messages: int = 50
    #: Images measured, and before them warm-up images, in the encoder-cache floor.
    images: tuple[int, int] = (12, 2)
    #: How every child process starts: "spawn" (the documented method) or "forkserver"
    #: (a server that imported torch/vLLM once forks each one: starts in milliseconds).
    start_method: str = "spawn"


PRESETS = {
    # The project's standard counts (the performance targets were taken with these).
    "default": Params(rounds=20_000, warmup=1_000, objects=50_000, wakes=10, idle_s=0.3),
    # Under a minute on 2 cores: 16 MiB tensors only, fewer messages, and processes forked
    # from a server that has imported torch and vLLM (each spawned process would import
    # them again: seconds each).
    "quick": Params(
        rounds=5_000,
        warmup=500,
        objects=10_000,
        wakes=5,
        idle_s=0.2,
        steady_wakes=1,
        tensor_sizes=(16 * MiB,),
        step_rounds=1_000,
        tensor_budget=160 * MiB,
        fresh_warmup=3,
        consume_messages=10,
        images=(6, 2),
        start_method="forkserver",
    ),
}


@dataclass
class Metric:
    """One table row produced by a scenario."""

    key: str  # key in the scenario's result dict
    label: str  # the row's name in the table; "{tensor}" in it: what the tensor rows send
    unit: str  # "us", "ms", "obj/s", "GB/s", "%", "x" or "" (a count)
    higher_is_better: bool


@dataclass
class Floor:
    """A reference measured once, in this process, without any transport:
    ``run(params)`` returns ``{metric key: value}`` (a ``NotMeasured`` for a metric
    that could not be measured here)."""

    key: str
    title: str
    run: Callable[[Params], dict[str, Any]]
    metrics: list[Metric]


@dataclass
class Scenario:
    """A scenario runs once per transport: ``run(harness, transport, params)`` returns
    ``{metric key: value}``."""

    key: str
    title: str
    run: Callable[[Harness, Transport, Params], dict[str, float]]
    metrics: list[Metric]
    #: Only these transports can run it (the others' cells show "-").
    only: Optional[tuple[str, ...]] = None
    #: Run only when the preset includes this tensor size.
    tensor_size: Optional[int] = None
    #: Floors measured with it and shown right under its rows (e.g. the pickle floor of
    #: the object it sends).
    floors: list[Floor] = field(default_factory=list)

    def applies(self, params: Params) -> bool:
        return self.tensor_size is None or self.tensor_size in params.tensor_sizes


# Latency, throughput, idle -----------------------------------------------------------------


def _bench_latency(harness: Harness, transport: Transport, params: Params, *, obj: str = "small") -> dict[str, float]:
    """Ping-pong of ``OBJECTS[obj]`` through two 1-reader channels; one-way latency =
    round trip / 2."""
    channels = (harness.channel(transport, 1), harness.channel(transport, 1))
    rounds, warmup = params.rounds, params.warmup
    if obj == "step" and params.step_rounds is not None:
        rounds = min(rounds, params.step_rounds)
        warmup = min(warmup, max(1, rounds // 10))
    kwargs = {"rounds": rounds, "warmup": warmup, "obj": obj}
    samples, _ = harness.run(transport, [Job(_role_ping, channels, kwargs), Job(_role_pong, channels, kwargs)])
    one_way_us = sorted(ns / 2 / 1000 for ns in samples)
    return {"p50": percentile(one_way_us, 50), "p99": percentile(one_way_us, 99)}


def _bench_latency_remote(harness: Harness, transport: Transport, params: Params) -> dict[str, float]:
    """The ping-pong of ``_bench_latency`` over TCP on 127.0.0.1: shmq's remote readers
    (authenticated stream) next to pyzmq over TCP."""
    from .transports import ShmqTransport, ZmqTransport

    tcp = ShmqTransport(remote=True) if transport.name == "shmq" else ZmqTransport(tcp=True)
    return _bench_latency(harness, tcp, params)


def _bench_step_two_nodes(harness: Harness, transport: Transport, params: Params) -> dict[str, float]:
    """vLLM's executor on two nodes (TP=2, one worker per node), without the engine: a
    writer with 2 readers, rank 0 local (the ring) and rank 1 remote (TCP on 127.0.0.1:
    shmq's authenticated stream, vLLM's plain ZeroMQ PUB socket), sending the 64-request
    step, both readers taking every one. Paced (each step sent once both readers took
    the one before, as the executor does): the send call's time, p50 and p99, and the
    time from the send's start to the remote reader's receive (its ``dequeue``'s return,
    unpickled), p50; then unpaced: steps per second, from the first measured send to the
    last reader's last receive, and the send call's p50 at that rate. Every process
    unpinned (the engine's two-node bench pins each node to a core)."""
    from .transports import ShmqTransport, VllmTransport

    two_nodes = ShmqTransport(n_local=1) if transport.name == "shmq" else VllmTransport(arena=False, n_local=1)
    out: dict[str, float] = {}
    rounds = params.rounds if params.step_rounds is None else min(params.rounds, params.step_rounds)
    for paced, n in ((True, rounds), (False, params.objects)):
        warmup = max(1, n // 10)
        total = warmup + n
        ctx = harness.ctx
        taken, sent_at, got_at = ctx.RawArray("Q", 2), ctx.RawArray("Q", total), ctx.RawArray("Q", 2 * total)
        channels = (harness.channel(two_nodes, 2), taken, sent_at, got_at)
        jobs = [Job(_role_step_writer, channels, {"warmup": warmup, "n": n, "paced": paced})]
        jobs += [Job(_role_step_reader, channels, {"rank": r, "total": total}) for r in range(2)]
        writer, *t_ends = harness.run(two_nodes, jobs)
        calls_us = sorted(ns / 1000 for ns in writer["calls_ns"])
        if paced:
            out["p50"], out["p99"] = percentile(calls_us, 50), percentile(calls_us, 99)
            remote_us = sorted((got_at[total + i] - sent_at[i]) / 1000 for i in range(warmup, total))
            out["remote_p50"] = percentile(remote_us, 50)
        else:
            out["rate"] = n / ((max(t_ends) - writer["t_first"]) / 1e9)
            out["unpaced_p50"] = percentile(calls_us, 50)
    return out


def _bench_throughput(harness: Harness, transport: Transport, params: Params, *, n_readers: int) -> dict[str, float]:
    """N objects from the writer's first send to the last reader's last receive."""
    channels = (harness.channel(transport, n_readers),)
    n = params.objects
    jobs = [Job(_role_writer, channels, {"n": n})]
    jobs += [Job(_role_reader, channels, {"n": n, "rank": r}) for r in range(n_readers)]
    t0, *t_ends = harness.run(transport, jobs)
    return {"rate": n / ((max(t_ends) - t0) / 1e9)}


#: Seconds after a reader's last message over which its steady idle CPU is measured:
#: from well after vLLM's readers stop spinning (they spin for 1 s after each read,
#: then sleep on a ZeroMQ socket) for 3 s.
IDLE_STEADY_WINDOW = (1.5, 4.5)
#: Seconds the writer waits before each message of the long idle stretches (the window
#: must end before it sends).
IDLE_STEADY_GAP_S = 5.0


def _bench_idle(harness: Harness, transport: Transport, params: Params) -> dict[str, float]:
    """A reader blocked while its writer is idle. ``wakes`` short stretches of
    ``idle_s`` s (each message within the first second after the one before): the
    reader's CPU use over them (user + sys, all its threads) and how long a message
    sent after each takes to arrive. Then ``steady_wakes`` stretches of
    IDLE_STEADY_GAP_S s: its CPU over IDLE_STEADY_WINDOW after each message (the steady
    idle), and the median wake-up latency of the message that ends each."""
    channels = (harness.channel(transport, 1),)
    kwargs = {"wakes": params.wakes, "steady_wakes": params.steady_wakes}
    jobs = [
        Job(_role_idle_writer, channels, {**kwargs, "idle_s": params.idle_s, "steady_gap_s": IDLE_STEADY_GAP_S}),
        Job(_role_idle_reader, channels, {**kwargs, "steady_window_s": IDLE_STEADY_WINDOW}),
    ]
    timeout = harness.timeout + params.wakes * params.idle_s + params.steady_wakes * IDLE_STEADY_GAP_S
    _, reader = harness.run(transport, jobs, timeout=timeout)
    wake_us = sorted(ns / 1000 for ns in reader["latencies_ns"])
    out = {
        "cpu_recent_pct": 100 * reader["cpu"] / max(reader["wall"], 1e-9),
        "wake_p50": percentile(wake_us, 50),
        "wake_p99": percentile(wake_us, 99),
    }
    out["cpu_steady_pct"] = 100 * reader["steady_cpu"] / max(reader["steady_wall"], 1e-9)
    out["wake_steady"] = statistics.median(ns / 1000 for ns in reader["steady_latencies_ns"])
    return out


def _floor_pickle_step(params: Params) -> dict[str, float]:
    """What one step handed over costs at least: ``dumps`` + ``loads`` of the step in
    one process (per call, batches of 10)."""
    step_us = time_per_call_us(lambda: pickle.loads(pickle.dumps(STEP_OBJECT, PROTOCOL)), params.rounds // 4, batch=10)
    return {"step_us": step_us}


# Tensors -----------------------------------------------------------------------------------

#: Seconds one tensor run may take (the slow transports move GBs at well under 1 GB/s).
TENSOR_TIMEOUT = 120.0


def _tensor_counts(params: Params, nbytes: int) -> int:
    """Messages of ``nbytes`` measured per tensor run: ``tensor_budget`` bytes, 4 to 200."""
    return max(4, min(200, params.tensor_budget // nbytes))


def _bench_tensor(
    harness: Harness,
    transport: Transport,
    params: Params,
    *,
    nbytes: int,
    n_readers: int,
    fresh: bool,
    loan: bool = False,
) -> dict[str, float]:
    """``fresh``: realistic, a new array made by the producer for every send (with
    ``loan``: a loan filled in place), every reader copying all of it into its own
    buffer; otherwise hand-over only (the same array every send, each reader reads one
    element). Bytes per reader per second from the writer's first measured send (before
    making it) to the last reader's last message, the send call's p50, and (``fresh``)
    how many loans were not the transport's memory."""
    channels = (harness.channel(transport, n_readers),)
    n = _tensor_counts(params, nbytes)
    if fresh:
        warmup = params.fresh_warmup if nbytes <= 16 * MiB else min(3, params.fresh_warmup)
    else:
        warmup = max(2, n // 10)
    kwargs = {"n": n, "warmup": warmup, "nbytes": nbytes, "fresh": fresh, "lib": params.arrays}
    jobs = [Job(_role_tensor_writer, channels, {**kwargs, "loan": loan})]
    jobs += [Job(_role_tensor_reader, channels, {**kwargs, "rank": r}) for r in range(n_readers)]
    writer, *ends = harness.run(transport, jobs, timeout=max(harness.timeout, TENSOR_TIMEOUT))
    seconds = (max(end["t_end"] for end in ends) - writer["t0"]) / 1e9
    send_us = sorted(ns / 1000 for ns in writer["send_ns"])
    out = {"rate": n * nbytes / seconds / 1e9, "send_p50": percentile(send_us, 50)}
    for key in ("make", "loan", "fill", "drop"):
        if f"{key}_ns" in writer:  # the split of the writer's time per send (fresh rows)
            out[f"{key}_p50"] = percentile(sorted(ns / 1000 for ns in writer[f"{key}_ns"]), 50)
    if fresh:
        out["fallbacks"] = float(writer["loan_fallbacks"])
        if loan:  # how the loans went: sent by reference (sealed), or copied (too small)
            out["by_reference"] = float(writer["loaned_parts"])
        # The floor: each reader's median copy of the row's bytes from its own memory, all
        # readers at once, in the same processes right after the row; the slowest reader's.
        floor = min(nbytes / statistics.median(end["floor_ns"]) for end in ends)  # bytes/ns = GB/s
        out["floor"] = floor
        out["of_floor"] = out["rate"] / floor
    return out


def _bench_consume(harness: Harness, transport: Transport, params: Params, *, nbytes: int) -> dict[str, float]:
    """One reader's copy of a received ``nbytes`` view into its own buffer, next to its
    copy of a persistent mapping of a ``/dev/shm`` file (mapped once, written by the
    writer just before, like the view): p50 of each, in ms, and their ratio."""
    path = os.path.join(SHM_DIR, f"shmq-bench-consume-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        channels = (harness.channel(transport, 1),)
        kwargs = {"n": params.consume_messages, "warmup": 3, "nbytes": nbytes, "path": path, "lib": params.arrays}
        jobs = [Job(_role_consume_writer, channels, kwargs), Job(_role_consume_reader, channels, kwargs)]
        _, reader = harness.run(transport, jobs, timeout=max(harness.timeout, TENSOR_TIMEOUT))
    finally:
        os.unlink(path)
    view_ms = statistics.median(reader["view_ns"]) / 1e6
    mapping_ms = statistics.median(reader["mapping_ns"]) / 1e6
    return {"view_ms": view_ms, "mapping_ms": mapping_ms, "ratio": view_ms / mapping_ms}


def _size_name(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB"


def _readers(r: int) -> str:
    return f"{r} reader{'s' if r > 1 else ''}"


SIZES = (MiB, 16 * MiB, 256 * MiB)


#: The tensor rows' kinds: the row's words, its short name (the send call's row), the
#: scenario's title.
_TENSOR_KINDS = {
    "fresh": ("fresh {tensor} per send, consumed", "fresh {tensor}", "fresh + consumed"),
    "loan": ("loaned {tensor}, filled per send, consumed", "loaned {tensor}", "loaned + consumed"),
    "tensor": (
        "hand-over only (same {tensor}, one element read)",
        "hand-over only (same {tensor}, one element read)",
        "hand-over only",
    ),
}


def _tensor_scenarios(*kinds: str) -> list[Scenario]:
    """The tensor rows of ``kinds``, per size (in that order within a size), 1 and 3
    readers each: "fresh" (realistic: a fresh array per send, every byte consumed),
    "loan" (shmq only: the same with a loan the producer fills), "tensor" (the transport
    alone: the same array every send, one element read)."""
    out = []
    for nbytes in SIZES:
        size, mib = _size_name(nbytes), nbytes // MiB
        for kind in kinds:
            what, short, title = _TENSOR_KINDS[kind]
            for r in (1, 3):
                metrics = [Metric("rate", f"{size} {what}, {_readers(r)}, per reader", "GB/s", True)]
                if kind != "tensor":
                    floor_row = f"{size} {short}, {_readers(r)}: copy floor per reader (memcpy of its bytes)"
                    metrics.append(Metric("floor", floor_row, "GB/s", True))
                    of_floor = f"{size} {short}, {_readers(r)}: per reader / copy floor"
                    metrics.append(Metric("of_floor", of_floor, "x", True))
                if r == 1:
                    # The writer's time per send, split (p50 of each step): what a copy
                    # costs against what a loan costs instead.
                    if kind == "fresh":
                        made = f"{size} {short}: the writer makes it (a new array), p50"
                        metrics.append(Metric("make_p50", made, "us", False))
                    if kind == "loan":
                        metrics.append(Metric("loan_p50", f"{size} {short}: the loan call, p50", "us", False))
                        metrics.append(Metric("fill_p50", f"{size} {short}: the writer fills it, p50", "us", False))
                    metrics.append(Metric("send_p50", f"{size} {short}: send call, p50", "us", False))
                    if kind != "tensor":
                        drop = "drop (a sealed loan's pages given back)" if kind == "loan" else "drop"
                        metrics.append(Metric("drop_p50", f"{size} {short}: {drop}, p50", "us", False))
                    if kind == "loan":
                        fallbacks = f"{size} {short}: loans that were not shared memory (copied)"
                        metrics.append(Metric("fallbacks", fallbacks, "", False))
                        sealed_from = _size_name(LOAN_SEAL_MIN)
                        by_ref = f"{size} {short}: loans sent by reference, sealed (under {sealed_from}: copied)"
                        metrics.append(Metric("by_reference", by_ref, "", False))
                out.append(
                    Scenario(
                        f"{kind}{mib}_{r}",
                        f"{size} {title}, {_readers(r)}",
                        partial(_bench_tensor, nbytes=nbytes, n_readers=r, fresh=kind != "tensor", loan=kind == "loan"),
                        metrics,
                        only=("shmq",) if kind == "loan" else None,
                        tensor_size=nbytes,
                    )
                )
    return out


def _consume_scenarios() -> list[Scenario]:
    nbytes = 16 * MiB
    size = _size_name(nbytes)
    return [
        Scenario(
            "consume16",
            f"consume a received {size} view",
            partial(_bench_consume, nbytes=nbytes),
            [
                Metric("view_ms", f"consume a received {size} view", "ms", False),
                Metric("mapping_ms", f"consume a persistent {size} mapping (limit)", "ms", False),
                Metric("ratio", f"consume {size}: received view / persistent mapping", "x", False),
            ],
            only=("shmq", "vLLM arena", "torch.mp"),
            tensor_size=nbytes,
        )
    ]


# Floors ------------------------------------------------------------------------------------


def _floor_pickle(params: Params) -> dict[str, float]:
    """Pickle alone, in this process: what a transport adds nothing to. ``dumps`` and
    ``loads`` of the small object are timed separately; one object handed over costs
    both in a row, while a writer and a reader on two cores run them in parallel, so a
    stream is bounded by the slower of the two."""
    pickled = pickle.dumps(SMALL_OBJECT, PROTOCOL)
    dumps_us = time_per_call_us(partial(pickle.dumps, SMALL_OBJECT, PROTOCOL), params.objects)
    loads_us = time_per_call_us(partial(pickle.loads, pickled), params.objects)
    return {
        "serial_us": dumps_us + loads_us,
        "serial_rate": 1e6 / (dumps_us + loads_us),
        "parallel_rate": 1e6 / max(dumps_us, loads_us),
    }


def _floor_store(params: Params) -> dict[str, float]:
    """shmq's object store in this process (MsgpackSerde): put and get of a 4 MiB
    float32 tensor (numpy array without torch); the small object is in the "calls"
    floor."""
    from shmq import ObjectStorage, RingBuffer

    class _NoLock:
        # A reader_lock makes the writer's own gets count as reads, so objects can be
        # evicted as the loop goes (the store needs no lock; this one does nothing).
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    store = ObjectStorage(8 * MiB, 1, RingBuffer(256 * MiB, create=True), reader_lock=_NoLock())

    big: Any  # a torch tensor, or a numpy array without torch
    try:
        import torch

        big = torch.rand(MiB)  # 1 Mi float32 = 4 MiB
    except ImportError:
        import numpy as np

        big = np.random.rand(MiB).astype(np.float32)
    # Rounds of 32 puts (128 MiB, half the ring) then their 32 gets (copies, so that
    # this measures moving the bytes), so every put finds room once the previous round
    # has been read; the median round gives each rate.
    put_rates, get_rates, clock = [], [], time.perf_counter_ns
    for r in range(6):
        t0 = clock()
        round_handles = [store.put(f"big-{r}-{i}", big) for i in range(32)]
        t1 = clock()
        for h in round_handles:
            store.get(*h, copy=True)
        t2 = clock()
        put_rates.append(32 * 4 * MiB / (t1 - t0))  # bytes/ns = GB/s
        get_rates.append(32 * 4 * MiB / (t2 - t1))
    store.close()
    out = {
        "big_put": statistics.median(put_rates),
        "big_get_copy": statistics.median(get_rates),
    }
    # The zero-copy get of one 4 MiB tensor, again and again (the writer's own gets
    # do not count as reads without a reader lock, so nothing is evicted meanwhile).
    viewer = ObjectStorage(8 * MiB, 1, RingBuffer(16 * MiB, create=True))
    h = viewer.put("big", big)
    out["big_get_us"] = time_per_call_us(lambda: viewer.get(*h), 2000, batch=20)
    # What a reader does with it: get, then read every byte (a copy into a buffer of its
    # own, as into a GPU staging buffer).
    consume = _consumer(big)
    out["big_consume_us"] = time_per_call_us(lambda: consume(viewer.get(*h)), 500, batch=10)
    viewer.close()

    def vllm_get() -> dict[str, float]:
        # Each is a copy of 4 MiB and more, the slow call here: 500 in the standard run,
        # 100 in --quick.
        calls = min(500, params.objects // 100)
        vllm_us = _vllm_store_get_us(big, calls)
        vllm_consume_us = _vllm_store_get_us(big, calls, consume)
        return {
            "vllm_big_get_us": vllm_us,
            "big_get_ratio": vllm_us / out["big_get_us"],
            "vllm_big_consume_us": vllm_consume_us,
            "big_consume_ratio": vllm_consume_us / out["big_consume_us"],
        }

    out.update(
        measure_parts(["vllm_big_get_us", "big_get_ratio", "vllm_big_consume_us", "big_consume_ratio"], vllm_get)
    )
    return out


def _consumer(like: Any) -> Callable[[Any], None]:
    """``consume(x)``: copy every byte of ``x`` (a tensor or array like ``like``) into a
    buffer made once, here."""
    if type(like).__module__.startswith("torch"):
        own = like.clone()
        return own.copy_
    import numpy as np

    own_array = like.copy()
    return lambda x: np.copyto(own_array, x)


def _vllm_store_classes() -> tuple[Any, Any]:
    """vLLM 0.33's ``SingleWriterShmObjectStorage`` and ``SingleWriterShmRingBuffer``;
    ``Skip`` when vLLM (or torch, which its serde needs) is absent or its import fails."""
    reason = vllm_missing()
    if reason is not None:
        raise Skip(reason)
    from vllm.distributed.device_communicators.shm_object_storage import (
        SingleWriterShmObjectStorage,
        SingleWriterShmRingBuffer,
    )

    return SingleWriterShmObjectStorage, SingleWriterShmRingBuffer


def _unpinned(ser_de: Any) -> None:
    """vLLM's decoders in ``ser_de`` make plain copies: vLLM 0.33 pins a tensor it
    copies when torch says pinned memory is available, which needs a GPU driver."""
    for name in ("tensor_decoder", "mm_decoder"):
        decoder = getattr(ser_de, name, None)
        if decoder is not None and hasattr(decoder, "pin_tensors"):
            decoder.pin_tensors = False


def _floor_small_calls(params: Params) -> dict[str, float]:
    """The cheap calls, in this process, next to vLLM 0.33's classes when importable:
    ``allocate_buf`` of 64 bytes (timed in batches of 100, the ring freed between
    batches, untimed), and the object store's ``put`` and ``get`` of the small object
    (MsgpackSerde on both sides)."""
    from shmq import ObjectStorage, RingBuffer

    n = min(params.objects, 20_000)

    def alloc_us(ring: Any) -> float:
        # `time_per_call_us`'s loop, written out: the call is well under a microsecond,
        # and calling it through a lambda or partial there would add a visible share of
        # that to what is measured.
        per_call, clock = [], time.perf_counter_ns
        for _ in range(max(10, n // 100)):
            t0 = clock()
            for _ in range(100):
                ring.allocate_buf(64)
            per_call.append((clock() - t0) / 100 / 1000)
            ring.free_buf(lambda _id, _buf: True)
        return statistics.median(per_call)

    def put_get_us(store: Any) -> tuple[float, float]:
        keys = iter([f"small-{i}" for i in range(10 * n + 100)])
        handles: list[Any] = []
        put = time_per_call_us(lambda: handles.append(store.put(next(keys), SMALL_OBJECT)), n)
        got = iter(handles)
        return put, time_per_call_us(lambda: store.get(*next(got)), min(n, len(handles)))

    ring = RingBuffer(MiB, create=True)
    out: dict[str, Any] = {"alloc_us": alloc_us(ring)}
    ring.close()
    store = ObjectStorage(MiB, 1, RingBuffer(256 * MiB, create=True))
    out["put_us"], out["get_us"] = put_get_us(store)
    store.close()
    vllm_keys = [f"vllm_{k}_us" for k in ("alloc", "put", "get")] + [f"{k}_ratio" for k in ("alloc", "put", "get")]
    out.update(measure_parts(vllm_keys, lambda: _vllm_small_calls(out, alloc_us, put_get_us)))
    return out


def _vllm_small_calls(ours: dict[str, float], alloc_us: Callable, put_get_us: Callable) -> dict[str, float]:
    """``_floor_small_calls``'s calls on vLLM 0.33's classes, and their ratios to ``ours``."""
    SingleWriterShmObjectStorage, SingleWriterShmRingBuffer = _vllm_store_classes()
    out = {}
    vring = SingleWriterShmRingBuffer(MiB, create=True)
    try:
        out["vllm_alloc_us"] = alloc_us(vring)
    finally:
        vring.close()
    vring = SingleWriterShmRingBuffer(256 * MiB, create=True)
    try:
        out["vllm_put_us"], out["vllm_get_us"] = put_get_us(SingleWriterShmObjectStorage(MiB, 1, vring))
    finally:
        vring.close()
    for k in ("alloc", "put", "get"):
        out[f"{k}_ratio"] = out[f"vllm_{k}_us"] / ours[f"{k}_us"]
    return out


def _vllm_store_get_us(big: Any, calls: int, consume: Optional[Callable[[Any], None]] = None) -> float:
    """vLLM 0.33's ``SingleWriterShmObjectStorage.get`` of the same 4 MiB tensor (its own
    MsgpackSerde), in the writer as above, followed by ``consume`` of what it returned
    when given; ``Skip`` if vLLM is not importable."""
    SingleWriterShmObjectStorage, SingleWriterShmRingBuffer = _vllm_store_classes()
    ring = SingleWriterShmRingBuffer(16 * MiB, create=True)
    try:
        store = SingleWriterShmObjectStorage(8 * MiB, 1, ring)
        _unpinned(store.ser_de)
        h = store.put("big", big)
        if consume is None:
            return time_per_call_us(lambda: store.get(*h), calls, batch=10)
        return time_per_call_us(lambda: consume(store.get(*h)), calls, batch=10)
    finally:
        ring.close()


def _floor_mm_item(params: Params) -> dict[str, Any]:
    """What a vLLM worker pays per image read from the multimodal cache's store: ``get``
    of one ``MultiModalKwargsItem`` (a 336x336 image's float32 pixels, 1.3 MiB, and its
    size), then every byte of the pixels read (a copy into a buffer of its own), in
    this process, the same stored item again and again (its bytes warm in the cache: a
    worker reading a fresh image pays more, for the copy and the view alike): vLLM
    0.33's store with its ``MsgpackSerde`` (vLLM alone), shmq's
    store with the same serde (the plugin before :mod:`shmq.vllm_serde`), and with
    ``VllmMsgpackSerde`` (the plugin now: the pixels a view)."""
    SingleWriterShmObjectStorage, SingleWriterShmRingBuffer = _vllm_store_classes()
    import torch
    from vllm.distributed.device_communicators.shm_object_storage import MsgpackSerde as VllmSerde
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem, MultiModalSharedField

    from shmq import ObjectStorage, RingBuffer
    from shmq.vllm_serde import VllmMsgpackSerde

    field = MultiModalSharedField(batch_size=1)
    item = MultiModalKwargsItem(
        {
            "pixel_values": MultiModalFieldElem(data=torch.rand(3, 336, 336), field=field),
            "image_sizes": MultiModalFieldElem(data=torch.tensor([336, 336]), field=field),
        }
    )
    own = item["pixel_values"].data.clone()
    calls = min(2000, max(200, params.objects // 50))

    def per_item_us(store: Any) -> float:
        h = store.put("image", item)
        return time_per_call_us(lambda: own.copy_(store.get(*h)["pixel_values"].data), calls, batch=10)

    out: dict[str, Any] = {}
    ring = SingleWriterShmRingBuffer(16 * MiB, create=True)
    try:
        vllm_store = SingleWriterShmObjectStorage(8 * MiB, 1, ring)
        _unpinned(vllm_store.ser_de)
        out["vllm_item_us"] = per_item_us(vllm_store)
    finally:
        ring.close()
    for key, serde in (("before_item_us", VllmSerde), ("item_us", VllmMsgpackSerde)):
        store = ObjectStorage(8 * MiB, 1, RingBuffer(16 * MiB, create=True), serde_class=serde)
        _unpinned(store.ser_de)
        out[key] = per_item_us(store)
        store.close()
    out["item_before_ratio"] = out["before_item_us"] / out["item_us"]
    out["item_vllm_ratio"] = out["vllm_item_us"] / out["item_us"]
    return out


def _floor_encoder_cache(params: Params) -> dict[str, Any]:
    """The encoder-cache hand-off (``encoder_cache``): shmq's, vLLM 0.33's CPU
    connector's data path and torch.multiprocessing's, in the same run; each part that
    cannot run here (no torch, no vLLM) or fails leaves the others' rows."""
    import multiprocessing

    ctx = multiprocessing.get_context(params.start_method)
    n, warmup = params.images
    out: dict[str, Any] = measure_parts(
        ["save_ms", "load_ms", "handoff_ms"], lambda: encoder_cache.shmq_handoff(ctx, n, warmup, params.arrays)
    )
    vllm_keys = ["vllm_save_ms", "vllm_load_ms", "vllm_handoff_ms"]
    out.update(measure_parts(vllm_keys, lambda: encoder_cache.vllm_cpu_handoff(ctx, n, warmup)))
    ours, theirs = out["handoff_ms"], out["vllm_handoff_ms"]
    if isinstance(ours, float) and isinstance(theirs, float):
        out["handoff_ratio"] = theirs / ours
    else:
        out["handoff_ratio"] = theirs if not isinstance(theirs, float) else ours
    out.update(measure_parts(["torch_ms"], lambda: encoder_cache.torch_handoff(ctx, n, warmup)))
    out.update(
        measure_parts(
            ["has_us", "load1_us", "load64_us"], lambda: encoder_cache.held_key_costs(params.arrays, params.objects)
        )
    )
    return out


SCENARIOS: list[Scenario] = [
    Scenario(
        "latency",
        "one-way latency (ping-pong)",
        _bench_latency,
        [
            Metric("p50", "one-way latency, small object, p50", "us", False),
            Metric("p99", "one-way latency, small object, p99", "us", False),
        ],
    ),
    Scenario(
        "latency_step",
        "one-way latency of a step (ping-pong)",
        partial(_bench_latency, obj="step"),
        [
            Metric("p50", "one-way latency, 64-request step, p50", "us", False),
            Metric("p99", "one-way latency, 64-request step, p99", "us", False),
        ],
        floors=[
            Floor(
                "pickle_step",
                "pickle floor of the step",
                _floor_pickle_step,
                [Metric("step_us", "pickle floor: 64-request step dumps+loads, one process", "us", False)],
            )
        ],
    ),
    Scenario(
        "latency_remote",
        "one-way latency over TCP",
        _bench_latency_remote,
        [
            Metric("p50", "one-way latency over TCP (remote reader), p50", "us", False),
            Metric("p99", "one-way latency over TCP (remote reader), p99", "us", False),
        ],
        only=("shmq", "pyzmq"),
    ),
    Scenario(
        "step_two_nodes",
        "the step broadcast of vLLM's executor on two nodes (1 local + 1 remote reader, no engine)",
        _bench_step_two_nodes,
        [
            Metric("p50", "two nodes: send of a 64-request step to 1 local + 1 remote reader, paced, p50", "us", False),
            Metric("p99", "two nodes: send of a 64-request step to 1 local + 1 remote reader, paced, p99", "us", False),
            Metric(
                "remote_p50", "two nodes: the step at the remote reader, from the send's start, paced, p50", "us", False
            ),
            Metric("rate", "two nodes: throughput of 64-request steps, 1 local + 1 remote reader", "obj/s", True),
            Metric("unpaced_p50", "two nodes: send of a step at that throughput, p50", "us", False),
        ],
        only=("shmq", "vLLM"),
    ),
    Scenario(
        "throughput1",
        "throughput, 1 reader",
        partial(_bench_throughput, n_readers=1),
        [
            Metric("rate", "throughput, small objects, 1 reader", "obj/s", True),
        ],
    ),
    Scenario(
        "throughput3",
        "throughput, 3 readers",
        partial(_bench_throughput, n_readers=3),
        [
            Metric("rate", "throughput, small objects, 3 readers", "obj/s", True),
        ],
    ),
    Scenario(
        "idle",
        "idle reader",
        _bench_idle,
        [
            Metric(
                "cpu_steady_pct",
                f"idle reader: CPU while blocked, {IDLE_STEADY_WINDOW[0]:g}-{IDLE_STEADY_WINDOW[1]:g} s after its "
                "last message",
                "%",
                False,
            ),
            Metric(
                "wake_steady", f"idle reader: wake-up latency after {IDLE_STEADY_GAP_S:g} s idle, median", "us", False
            ),
            Metric("cpu_recent_pct", "idle reader: CPU while blocked in the 1st second after a message", "%", False),
            Metric("wake_p50", "idle reader: wake-up latency, < 1 s after the last message, p50", "us", False),
            Metric("wake_p99", "idle reader: wake-up latency, < 1 s after the last message, p99", "us", False),
        ],
    ),
    *_tensor_scenarios("fresh", "loan"),
    *_consume_scenarios(),
    *_tensor_scenarios("tensor"),
]

FLOORS: list[Floor] = [
    Floor(
        "store",
        "object store",
        _floor_store,
        [
            Metric("big_put", "object store: put, 4 MiB float32 tensor", "GB/s", True),
            Metric("big_get_copy", "object store: get(copy=True), 4 MiB float32 tensor", "GB/s", True),
            Metric("big_get_us", "object store: get (zero-copy view), 4 MiB float32 tensor", "us", False),
            Metric("vllm_big_get_us", "vLLM 0.33 object store: get, 4 MiB float32 tensor", "us", False),
            Metric("big_get_ratio", "store get 4 MiB: vLLM 0.33's (a copy) / shmq's (a view)", "x", True),
            Metric("big_consume_us", "object store: get + consume every byte, 4 MiB float32 tensor", "us", False),
            Metric("vllm_big_consume_us", "vLLM 0.33 object store: get + consume, 4 MiB float32 tensor", "us", False),
            Metric("big_consume_ratio", "store get + consume 4 MiB: vLLM 0.33's time / shmq's", "x", True),
        ],
    ),
    Floor(
        "mm-item",
        "vLLM's multimodal item from the store",
        _floor_mm_item,
        [
            Metric("vllm_item_us", "vLLM 0.33 store: get + read one 336x336 image item (1.3 MiB), again", "us", False),
            Metric("before_item_us", "shmq store, vLLM's serde: get + read that item (the plugin before)", "us", False),
            Metric("item_us", "shmq store, VllmMsgpackSerde: get + read that item (the plugin now)", "us", False),
            Metric("item_before_ratio", "image item get + read: before / now", "x", True),
            Metric("item_vllm_ratio", "image item get + read: vLLM 0.33's store / shmq's now", "x", True),
        ],
    ),
    Floor(
        "calls",
        "cheap calls",
        _floor_small_calls,
        [
            Metric("alloc_us", "store ring: allocate_buf(64)", "us", False),
            Metric("vllm_alloc_us", "vLLM 0.33 store ring: allocate_buf(64)", "us", False),
            Metric("alloc_ratio", "allocate_buf: vLLM 0.33's time / shmq's", "x", True),
            Metric("put_us", "object store: put, small object", "us", False),
            Metric("vllm_put_us", "vLLM 0.33 object store: put, small object", "us", False),
            Metric("put_ratio", "store put, small: vLLM 0.33's time / shmq's", "x", True),
            Metric("get_us", "object store: get, small object", "us", False),
            Metric("vllm_get_us", "vLLM 0.33 object store: get, small object", "us", False),
            Metric("get_ratio", "store get, small: vLLM 0.33's time / shmq's", "x", True),
        ],
    ),
    Floor(
        "pickle",
        "pickle only",
        _floor_pickle,
        [
            Metric("serial_us", "pickle only: dumps+loads, per object", "us", False),
            Metric("serial_rate", "pickle only: dumps+loads, rate", "obj/s", True),
            Metric("parallel_rate", "pickle only: slower of dumps/loads, rate", "obj/s", True),
        ],
    ),
    Floor("encoder_cache", "encoder cache hand-off", _floor_encoder_cache, [
        Metric("save_ms", "encoder cache: save a fresh 16 MiB embedding, per image", "ms", False),
        Metric("load_ms", "encoder cache: load + consume, each of 2 consumers, per image", "ms", False),
        Metric("handoff_ms", "encoder cache: save until both consumers consumed it, per image", "ms", False),
        Metric("vllm_save_ms", "vLLM 0.33 EC CPU connector data path: save 16 MiB, per image", "ms", False),
        Metric("vllm_load_ms", "vLLM 0.33 EC CPU connector data path: load (copy out), each of 2", "ms", False),
        Metric("vllm_handoff_ms", "vLLM 0.33 EC CPU connector data path: save until both loaded", "ms", False),
        Metric("handoff_ratio", "encoder-cache hand-off: vLLM 0.33 CPU connector's time / shmq's", "x", True),
        Metric("torch_ms", "torch.multiprocessing queue: hand-off to 2 consumers (consumed)", "ms", False),
        Metric("has_us", "encoder cache: has(key)", "us", False),
        Metric("load1_us", "encoder cache: load of a held 1 MiB key (a view)", "us", False),
        Metric("load64_us", "encoder cache: load of a held 64 MiB key (a view)", "us", False),
    ]),  # fmt: skip
]

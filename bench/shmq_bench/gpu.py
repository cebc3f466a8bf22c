"""``python -m shmq bench --scenarios gpu``: tensors received into device memory (issue 55),
beside the copies that bound them, one JSON line per row on stdout.

The device: ``cuda:0`` where torch sees a GPU (``SHMQ_DEVICE=cuda``, the seam's CUDA
implementation); elsewhere, or with ``SHMQ_DEVICE=twin``, the CPU twin of the device seam
(``shmq._device.TwinDevice``: "device memory" is process memory, a copy runs on a worker
thread). Every row then says ``"device": "twin (CPU): protocol only, not a GPU figure"``,
in its label and its JSON, and no target is judged: the twin runs every protocol end to
end (a dry run), but its figures are CPU copies, never GPU ones.

One run per tensor size (16 and 256 MiB on a GPU; 16 MiB on the twin; ``--gpu-sizes``
picks others): a writer process and 4 reader processes (forked from a server that imported
torch and shmq once), in phases, all in the same processes:

- *limits* (``pinned``, ``pageable``): each reader copies a host tensor of the size to
  the device: a pinned one (``.to(dev, non_blocking=True)`` + synchronize: the limit
  the shmq rows are a fraction of) and a plain, pageable one (``.to(dev)``);
- *queue* (``queue<MiB>_<readers>``): the writer sends a fresh float32 tensor per
  message (``torch.full`` with the message's number, then ``enqueue``) on a
  ``MessageQueue`` of 1 reader, then one of 4; each reader takes every message with
  ``dequeue(device=dev)`` and ``wait_device_copies()`` (+ synchronize);
- *store* (``store<MiB>_<readers>``): the same through an ``ObjectStorage`` of 1, then 4
  reader slots: the writer ``put_ref``-s each fresh tensor and hands the reference to
  each reader, which takes it with ``get(ref, device=dev)`` and ``wait_device_copies()``;
- *encoder cache by IPC handle* (``ec_ipc<MiB>_<consumers>``): the writer is an
  encoder whose output is a fresh device tensor per image, saved (``save`` + ``flush``)
  to an ``EncoderCacheProducer(ipc=True)``; 1, then 2 of the readers are its consumers
  (``EncoderCacheConsumer(device=dev)``), each taking the key with ``get(key,
  device=dev)`` and ``wait_device_copies()``. Beside it (``ec_roundtrip<MiB>``), the host
  path it replaces, in the consumers' processes: a device tensor to a pinned host one
  and back to the device (each half ``non_blocking`` + synchronize).

How it is timed: everything moves in lock step (a barrier after each message), so a
clock never includes waiting for the writer. A reader's time is from the receiving call
(the message already there) to its copy's end; readers take their turns one at a time
(one GPU here, where each of vLLM's readers has its own: 4 at once would share one
host-to-device link), so each has the link to itself, as the pinned limit did. GB/s per
reader is the size over that reader's median time; a row's figure is its slowest
reader's, and ``fraction_of_pinned`` the lowest of each reader's figure over its own
pinned limit (target: 0.8). The encoder-cache consumers take a key at the same time
(device-to-device copies); ``ipc_ms`` is the save's median plus the slower consumer's
median ``get``, the data path that the round trip (``roundtrip_ms``, the median over
the consumers) is the host path of, and ``roundtrip_over_ipc`` their ratio (targets: 3
at 16 MiB, 10 at 256 MiB). ``handoff_ms`` (from the save's start to the later consumer
having the data, the key's message to it included) is shown too. Readers check every
message's number at both ends of what they received, on the device, after the clock.
Warm-up messages (the device's first registration of a mapping included) come before
the clock; the first one's time is shown (``first_ms``).
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .common import MAX_CHUNK_BYTES, MAX_CHUNKS, SYNC_TIMEOUT, BenchError, MiB, now_ns
from .harness import Harness, Job
from .roles import _sync

#: What every row on the CPU twin says, in its label and as its ``device``.
TWIN = "twin (CPU): protocol only, not a GPU figure"
#: Reader processes of every run (the rows of 1 reader use the first).
READERS = 4
#: Reader counts of the queue and store rows, consumer counts of the encoder-cache rows.
READER_COUNTS = (1, READERS)
CONSUMER_COUNTS = (1, 2)
#: Each shmq row's figure over the pinned limit, per reader: the target.
PINNED_TARGET = 0.8
#: The round trip through pinned host memory over the IPC hand-off: the targets, by size.
IPC_TARGETS = {16 * MiB: 3.0, 256 * MiB: 10.0}
#: Tensor sizes (MiB) on a GPU, and on the twin (a dry run: < 60 s on 2 cores).
GPU_SIZES_MIB = (16, 256)
TWIN_SIZES_MIB = (16,)
#: Seconds one run (one size: its processes' start, every phase) may take.
RUN_TIMEOUT = 150.0


@dataclass(frozen=True)
class Target:
    """Where the copies go: ``seam`` ("cuda" or "twin", the device seam's implementation)
    and ``device`` (what torch calls it: "cuda:0", or "cpu" for the twin's memory)."""

    seam: str
    device: str

    @property
    def twin(self) -> bool:
        return self.seam == "twin"


def choose_target() -> Target:
    """``cuda:0`` where torch sees a GPU, else the twin; ``SHMQ_DEVICE`` (``twin`` or
    ``cuda``) decides where it is set. ``BenchError`` for ``cuda`` without a GPU."""
    import torch

    wanted = os.environ.get("SHMQ_DEVICE", "").strip().lower()
    if wanted not in ("", "twin", "cuda"):
        raise BenchError(f"SHMQ_DEVICE must be 'twin' or 'cuda', got {wanted!r}")
    if wanted == "twin":
        return Target("twin", "cpu")
    if torch.cuda.is_available():
        return Target("cuda", "cuda:0")
    if wanted == "cuda":
        raise BenchError("SHMQ_DEVICE=cuda, but torch sees no GPU here")
    return Target("twin", "cpu")


def _counts(nbytes: int, target: Target) -> tuple[int, int]:
    """``(warm-up, measured)`` messages per phase: 320 MiB per reader and phase on a GPU
    (128 MiB on the twin), 4 to 20 messages, 2 warm-up ones."""
    budget = (128 if target.twin else 320) * MiB
    return 2, max(4, min(20, budget // nbytes))


# -- in the child processes ----------------------------------------------------------------


class _Copies:
    """A child's copies to the device and its way to wait for them: torch's on CUDA; on
    the twin, a copy into a new CPU tensor (its "device memory")."""

    def __init__(self, target: Target):
        import torch

        torch.set_num_threads(1)  # the machine's cores are the processes'
        self.torch, self.target, self.device = torch, target, target.device
        self.cuda = not target.twin
        if self.cuda:
            torch.cuda.set_device(self.device)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def host(self, numel: int, value: float, pinned: bool = False) -> Any:
        """A float32 host tensor of ``numel`` elements (pinned on CUDA if asked: the twin
        has no pinned memory, its copies are plain ones)."""
        t = self.torch.full((numel,), value)
        return t.pin_memory() if pinned and self.cuda else t

    def on_device(self, numel: int, value: float) -> Any:
        return self.torch.full((numel,), value, device=self.device)

    def to_device(self, src: Any, non_blocking: bool) -> Any:
        if self.cuda:
            return src.to(self.device, non_blocking=non_blocking)
        return self.torch.empty_like(src).copy_(src)  # .to("cpu") would not copy

    def to_host(self, src: Any, dst: Any) -> None:
        dst.copy_(src, non_blocking=self.cuda)

    def check(self, t: Any, value: float, who: str) -> None:
        """``t`` is in device memory and holds ``value`` at both ends (after the clock)."""
        if self.cuda and not t.is_cuda:
            raise RuntimeError(f"{who}: received a tensor on {t.device}, not in device memory")
        first, last = float(t[0]), float(t[-1])
        if first != value or last != value:
            raise RuntimeError(f"{who} read {first:g}...{last:g}, expected {value:g} (a wrong or torn message)")

    def time_copy(self, copy: Callable[[], Any], reps: int, warmup: int = 2) -> list[float]:
        """Seconds of each of ``reps`` ``copy()`` + synchronize, after ``warmup``."""
        clock, out = time.perf_counter, []
        for k in range(warmup + reps):
            t0 = clock()
            result = copy()
            self.sync()
            if k >= warmup:
                out.append(clock() - t0)
            del result
        return out


class _DeviceLog(logging.Handler):
    """shmq's warnings in a reader: a registration the device refused (the host path
    instead), an IPC handle it could not open."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("shmq").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _in_turns(barrier: Any, k: int, rank: Optional[int], work: Callable[[], None]) -> None:
    """Readers ``0..k-1`` each do ``work`` alone, in turn (``rank`` None: the writer, which
    only waits)."""
    for turn in range(k):
        if turn == rank:
            work()
        _sync(barrier)


def _role_gpu_writer(
    _transport: Any,
    channels: Sequence[Any],
    barrier: Any,
    *,
    target: Target,
    nbytes: int,
    warmup: int,
    n: int,
    cache: str,
) -> dict:
    """The writer: opens the queues, stores and encoder caches of the run, hands their
    handles to the readers (``channels``: one inbox each), then sends what each phase
    measures (see the module doc). Returns its saves' ``(start, end)`` (ns) per
    encoder-cache phase."""
    from shmq import EncoderCacheProducer, MessageQueue, ObjectStorage, RingBuffer

    copies = _Copies(target)
    inboxes, numel = channels, nbytes // 4
    queues = {k: MessageQueue(k, k, max_chunk_bytes=MAX_CHUNK_BYTES, max_chunks=MAX_CHUNKS) for k in READER_COUNTS}
    for mq in queues.values():
        mq.reserve_arena(min(1 << 30, 3 * nbytes))  # the kernel's zeroing, before the clock
    object_bytes = nbytes + MiB
    stores = {k: ObjectStorage(object_bytes, k, RingBuffer(3 * object_bytes, create=True)) for k in READER_COUNTS}
    producers = {
        c: EncoderCacheProducer(f"{cache}-{c}", capacity=4 * nbytes + 8 * MiB, ipc=True, device_seam=target.seam)
        for c in CONSUMER_COUNTS
    }
    for r, inbox in enumerate(inboxes):
        inbox.put(
            {
                "queues": {k: mq.export_handle() for k, mq in queues.items() if r < k},
                "stores": {k: s.handle() for k, s in stores.items() if r < k},
                "caches": {c: p.name for c, p in producers.items() if r < c},
            }
        )
    for mq in queues.values():
        mq.wait_until_ready(SYNC_TIMEOUT)
    _sync(barrier)
    _in_turns(barrier, READERS, None, lambda: None)  # the readers' limits
    for path in PATHS:
        for k in READER_COUNTS:
            for i in range(warmup + n):
                value = (i, copies.host(numel, float(i)))  # fresh data, every message
                if path == "queue":
                    queues[k].enqueue(value, SYNC_TIMEOUT)
                else:
                    ref = stores[k].put_ref(f"{path}{k}-{i}", value)
                    for inbox in inboxes[:k]:
                        inbox.put(ref)
                del value
                _sync(barrier)  # the message is there
                _in_turns(barrier, k, None, lambda: None)
    _in_turns(barrier, max(CONSUMER_COUNTS), None, lambda: None)  # the consumers' round trips
    saves: dict[int, list[tuple[int, int]]] = {}
    for c in producers:
        producer, saves[c] = producers[c], []
        for i in range(warmup + n):
            embedding = copies.on_device(numel, float(i))  # the encoder's output, fresh
            copies.sync()
            t0 = now_ns()
            producer.save(f"image-{i}", embedding, timeout=SYNC_TIMEOUT)
            producer.flush(SYNC_TIMEOUT)
            t1 = now_ns()
            del embedding
            for inbox in inboxes[:c]:
                inbox.put((f"image-{i}", float(i)))
            _sync(barrier)  # every consumer has it
            if i >= warmup:
                saves[c].append((t0, t1))
    _sync(barrier)  # the readers closed theirs
    for p in producers.values():
        p.close()
    for s in stores.values():
        s.close()
    for mq in queues.values():
        mq.shutdown()
    return {"saves": saves}


def _role_gpu_reader(
    _transport: Any,
    channels: Sequence[Any],
    barrier: Any,
    *,
    target: Target,
    nbytes: int,
    warmup: int,
    n: int,
    rank: int,
) -> dict:
    """Reader ``rank``: its limits, then every message of the phases it takes part in,
    timed (see the module doc). Returns seconds per copy or message, by phase, and its
    encoder-cache gets' ``(start, end)`` (ns)."""
    from shmq import EncoderCacheConsumer, MessageQueue, ObjectStorage

    copies = _Copies(target)
    log = _DeviceLog()
    inbox, numel, who = channels[rank], nbytes // 4, f"reader {rank}"
    opened = inbox.get(timeout=SYNC_TIMEOUT)
    queues = {k: MessageQueue.create_from_handle(h, rank) for k, h in opened["queues"].items()}
    stores = {k: ObjectStorage.create_from_handle(h) for k, h in opened["stores"].items()}
    consumers = {
        c: EncoderCacheConsumer(name, device=target.device, device_seam=target.seam)
        for c, name in opened["caches"].items()
    }
    for mq in queues.values():
        mq.device_seam = target.seam
        mq.wait_until_ready(SYNC_TIMEOUT)
    for s in stores.values():
        s.device_seam = target.seam
    out: dict[str, Any] = {"rank": rank, "device_log": log.lines}
    if copies.cuda:
        out["gpu"] = copies.torch.cuda.get_device_name(copies.device)
    _sync(barrier)

    def limits() -> None:
        reps = n + warmup
        pinned, pageable = copies.host(numel, 1.0, pinned=True), copies.host(numel, 1.0)
        out["pinned"] = copies.time_copy(lambda: copies.to_device(pinned, non_blocking=True), reps)
        out["pageable"] = copies.time_copy(lambda: copies.to_device(pageable, non_blocking=False), reps)

    _in_turns(barrier, READERS, rank, limits)
    clock = time.perf_counter
    for path in PATHS:
        for k in READER_COUNTS:
            times: list[float] = []

            def receive(i: int, k: int = k, path: str = path, times: list[float] = times) -> None:
                if path == "queue":
                    mq = queues[k]
                    t0 = clock()
                    got = mq.dequeue(SYNC_TIMEOUT, device=target.device)
                    mq.wait_device_copies()
                else:
                    store, ref = stores[k], inbox.get(timeout=SYNC_TIMEOUT)
                    t0 = clock()
                    got = store.get(ref, device=target.device)
                    store.wait_device_copies()
                copies.sync()
                times.append(clock() - t0)
                number, tensor = got
                if number != i:
                    raise RuntimeError(f"{who} ({path}, {k}): got message {number}, expected {i}")
                copies.check(tensor, float(i), f"{who} ({path}, {k} readers)")

            for i in range(warmup + n):
                _sync(barrier)  # the message is there
                _in_turns(barrier, k, rank if rank < k else None, functools.partial(receive, i))
            if rank < k:
                out[f"{path}{k}"] = {"first": times[0], "times": times[warmup:]}

    def roundtrip() -> None:
        device_tensor, pinned = copies.on_device(numel, 1.0), copies.host(numel, 0.0, pinned=True)

        def there_and_back() -> Any:
            copies.to_host(device_tensor, pinned)
            copies.sync()
            return copies.to_device(pinned, non_blocking=True)

        out["roundtrip"] = copies.time_copy(there_and_back, n + warmup)

    _in_turns(barrier, max(CONSUMER_COUNTS), rank, roundtrip)
    for c in CONSUMER_COUNTS:
        gets: list[tuple[int, int]] = []
        for i in range(warmup + n):
            if rank < c:
                consumer = consumers[c]
                key, value = inbox.get(timeout=SYNC_TIMEOUT)
                t0 = now_ns()
                try:
                    got = consumer.get(key, device=target.device)
                except KeyError:
                    # Published by handle only (no host copy): missing where it cannot be opened.
                    raise RuntimeError(f"{who}: {key} missing: the IPC handle was not opened ({log.lines})") from None
                consumer.wait_device_copies()
                copies.sync()
                t1 = now_ns()
                copies.check(got.reshape(-1), value, f"{who} (encoder cache, {c} consumers)")
                del got
                if i >= warmup:
                    gets.append((t0, t1))
            _sync(barrier)
        if rank < c:
            out[f"ec{c}"] = gets
    # Each waits for its copies in flight, then unregisters its mapping (before unmapping it).
    for consumer in consumers.values():
        consumer.close()
    for s in stores.values():
        s.close()
    for mq in queues.values():
        mq.close_device()
    queues.clear()
    _sync(barrier)
    return out


# -- in the parent: runs and rows ----------------------------------------------------------

#: The host-to-device phases, in the order they run.
PATHS = ("queue", "store")


def _labels(nbytes: int) -> dict[str, tuple[str, str]]:
    """``{key: (label, unit)}`` of one size's rows, in the order printed."""
    mib, size = nbytes // MiB, f"{nbytes // MiB} MiB"
    how = {"queue": "MessageQueue.dequeue(device=)", "store": "ObjectStorage.get(ref, device=)"}
    out = {
        f"gpu.pinned{mib}": (
            f"pinned limit: a pinned {size} host tensor .to(device, non_blocking) + synchronize, slowest reader",
            "GB/s",
        ),
        f"gpu.pageable{mib}": (f"pageable copy: a plain {size} host tensor .to(device), slowest reader", "GB/s"),
    }
    for path in PATHS:
        for k in READER_COUNTS:
            readers = f"{k} reader{'s' if k > 1 else ''}"
            label = f"{path}: a fresh {size} tensor per message into device memory by {how[path]}, {readers}, slowest"
            out[f"gpu.{path}{mib}_{k}"] = (label, "GB/s")
    out[f"gpu.ec_roundtrip{mib}"] = (
        f"pinned host round trip: a {size} device tensor to pinned host memory and back, median consumer",
        "ms",
    )
    for c in CONSUMER_COUNTS:
        consumers = f"{c} consumer{'s' if c > 1 else ''}"
        label = f"encoder cache by IPC handle: save + get(key, device=) of a fresh {size} device tensor, {consumers}"
        out[f"gpu.ec_ipc{mib}_{c}"] = (label, "ms")
    return out


def _gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


def _figures(nbytes: int, twin: bool, writer: dict, readers: list[dict]) -> dict[str, dict]:
    """``{key: the row's figures}`` from what one size's processes returned."""
    mib = nbytes // MiB
    out: dict[str, dict] = {}
    pinned = [_gbps(nbytes, r["pinned"]) for r in readers]
    out[f"gpu.pinned{mib}"] = {"value": min(pinned), "per_reader": pinned}
    pageable = [_gbps(nbytes, r["pageable"]) for r in readers]
    out[f"gpu.pageable{mib}"] = {
        "value": min(pageable),
        "per_reader": pageable,
        "fraction_of_pinned": min(p / q for p, q in zip(pageable, pinned, strict=True)),
    }
    for path in PATHS:
        for k in READER_COUNTS:
            got = [r[f"{path}{k}"] for r in readers[:k]]
            rates = [_gbps(nbytes, g["times"]) for g in got]
            fraction = min(rate / p for rate, p in zip(rates, pinned, strict=False))  # each its own limit
            out[f"gpu.{path}{mib}_{k}"] = {
                "value": min(rates),
                "per_reader": rates,
                "fraction_of_pinned": fraction,
                "target": f"fraction_of_pinned >= {PINNED_TARGET}",
                "met": None if twin else fraction >= PINNED_TARGET,
                "first_ms": max(g["first"] for g in got) * 1e3,
                "messages": len(got[0]["times"]),
            }
    trips = [_ms(r["roundtrip"]) for r in readers if "roundtrip" in r]
    roundtrip_ms = statistics.median(trips)
    out[f"gpu.ec_roundtrip{mib}"] = {"value": roundtrip_ms, "per_consumer": trips}
    ipc_target = IPC_TARGETS.get(nbytes)
    for c in CONSUMER_COUNTS:
        saves = writer["saves"][c]
        gets = [r[f"ec{c}"] for r in readers[:c]]
        save_ms = statistics.median((t1 - t0) / 1e6 for t0, t1 in saves)
        get_ms = max(statistics.median((t1 - t0) / 1e6 for t0, t1 in g) for g in gets)
        handoff_ms = statistics.median((max(g[i][1] for g in gets) - saves[i][0]) / 1e6 for i in range(len(saves)))
        ratio = roundtrip_ms / (save_ms + get_ms)
        figures = {
            "value": save_ms + get_ms,
            "save_ms": save_ms,
            "get_ms": get_ms,
            "handoff_ms": handoff_ms,
            "roundtrip_ms": roundtrip_ms,
            "roundtrip_over_ipc": ratio,
            "images": len(saves),
        }
        if ipc_target is not None:
            figures["target"] = f"roundtrip_over_ipc >= {ipc_target:g}"
            figures["met"] = None if twin else ratio >= ipc_target
        out[f"gpu.ec_ipc{mib}_{c}"] = figures
    warnings = sorted({line for r in readers for line in r["device_log"]})
    if warnings:  # e.g. a registration refused: the shmq rows measured the host path
        for key, figures in out.items():
            if not key.startswith((f"gpu.pinned{mib}", f"gpu.pageable{mib}", f"gpu.ec_roundtrip{mib}")):
                figures["shmq_warnings"] = warnings
    return out


def _context() -> Any:
    """A fork server that imported torch and shmq once (each child then starts in
    milliseconds; none of them initialised CUDA before it forks)."""
    from multiprocessing import forkserver

    from . import preload

    ctx = multiprocessing.get_context("forkserver")
    os.environ[preload.ENV] = ",".join(["torch", "shmq", "shmq_bench.gpu"])
    ctx.set_forkserver_preload([preload.__name__])
    forkserver.ensure_running()
    return ctx


def run_size(harness: Harness, target: Target, nbytes: int) -> tuple[str, dict[str, dict]]:
    """One run of ``nbytes`` tensors: the GPU's name ("" on the twin) and each row's
    figures (see :func:`_figures`)."""
    warmup, n = _counts(nbytes, target)
    inboxes = [harness.ctx.Queue() for _ in range(READERS)]
    kwargs = {"target": target, "nbytes": nbytes, "warmup": warmup, "n": n}
    cache = f"bench-gpu-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    jobs = [Job(_role_gpu_writer, inboxes, {**kwargs, "cache": cache})]
    jobs += [Job(_role_gpu_reader, inboxes, {**kwargs, "rank": r}) for r in range(READERS)]
    # The roles open their own queues, stores and caches: no transport.
    writer, *readers = harness.run(None, jobs)  # type: ignore[arg-type]  # no transport: see above
    return readers[0].get("gpu", ""), _figures(nbytes, target.twin, writer, readers)


def main(sizes_mib: Optional[Sequence[int]] = None, quick: bool = False) -> int:
    """Run every size (default: 16 and 256 MiB on a GPU, 16 MiB with ``quick`` or on the
    twin) and print one JSON line per row: its figures, or its ``error`` (the run of its
    size failed). 1 if a run failed, 2 if the device asked for cannot be used."""
    try:
        target = choose_target()
    except BenchError as e:
        print(f"gpu: {e}", file=sys.stderr)
        return 2
    os.environ["SHMQ_DEVICE"] = target.seam  # the children's seam, whatever else they ask
    if sizes_mib is None:
        sizes_mib = TWIN_SIZES_MIB if target.twin or quick else GPU_SIZES_MIB
    import shmq
    import torch

    device = TWIN if target.twin else target.device
    sizes = ", ".join(f"{s} MiB" for s in sizes_mib)
    print(
        f"gpu rows on {device}: {sizes}; 1 writer and {READERS} readers per size; shmq from "
        f"{os.path.dirname(shmq.__file__)}, torch {torch.__version__}",
        file=sys.stderr,
        flush=True,
    )
    started, failed = time.monotonic(), False
    workdir = tempfile.mkdtemp(prefix="shmq-bench-gpu-")
    try:
        harness = Harness(_context(), workdir, RUN_TIMEOUT)
        for mib in sizes_mib:
            nbytes = mib * MiB
            error = None
            try:
                gpu, figures = run_size(harness, target, nbytes)
            except Exception as e:  # noqa: BLE001 - its rows say it failed, the next size runs
                message = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"
                more = e.details if isinstance(e, BenchError) else traceback.format_exc()
                print(f"gpu: the {mib} MiB run failed: {message}\n{more}", file=sys.stderr, flush=True)
                gpu, figures, error, failed = "", {}, message, True
            for key, (label, unit) in _labels(nbytes).items():
                row: dict[str, Any] = {
                    "key": key,
                    "row": f"{label} [{TWIN}]" if target.twin else label,
                    "device": f"{device} ({gpu})" if gpu else device,
                    "unit": unit,
                }
                row.update(figures[key] if error is None else {"value": None, "error": error})
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"gpu: wall time {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return 1 if failed else 0

"""``python -m shmq bench``: shmq's queue side by side with the alternatives.

Every scenario runs once per transport (shmq ``MessageQueue``, ``multiprocessing.Queue``,
pyzmq PUB/SUB over ``ipc://``), in processes started with the ``spawn`` context, and
the results are printed as one table. The method is the one in DESIGN.md ("How the
figures above were taken"):

- the *small object* is :data:`SMALL_OBJECT` (135 bytes pickled);
- *one-way latency* is half the round trip of a ping-pong between two processes
  through two queues, p50/p99 over a number of round trips after a warm-up;
- *throughput* is N objects from the writer's first enqueue to the last reader's last
  dequeue, readers in separate processes (clock: ``CLOCK_MONOTONIC``, which all
  processes share);
- the *pickle only* rows (floors) time ``dumps`` and ``loads`` alone in one process:
  one object handed over costs at least both (the latency floor), a stream at least
  the slower of the two per object (writer and reader pickle in parallel).

Layout, for adding rows later (object store put/get, idle CPU, tensors):

- a :class:`Transport` opens the writer and reader endpoints (:class:`Endpoint`) of a
  channel; the parent makes the channel (something picklable handed to the children);
- *role* functions (``_role_*``) are what a child process runs; they only use
  endpoints, so one role serves all transports;
- a *scenario* function (``_bench_*``) starts roles through :class:`Harness` and turns
  what they return into metrics; :data:`SCENARIOS` lists them with their table rows,
  :data:`FLOORS` the single-process reference rows.

The harness is defensive: every wait has a timeout, a failed or hung child makes the
parent terminate all children of that run (and remove the shared-memory segments they
created), readers check they received exactly the objects sent, and a failure is shown
in its cell while the other cells still run.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
import dataclasses
import faulthandler
import glob
import itertools
import json
import math
import os
import pickle
import platform
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Sequence

__all__ = ["SMALL_OBJECT", "SCENARIOS", "FLOORS", "TRANSPORTS", "add_arguments", "main", "run_bench"]

#: The object every scenario sends (a scheduler step's batch, in miniature).
SMALL_OBJECT = {"req_ids": list(range(16)), "tokens": [[1, 2, 3, 4]] * 8, "flag": True, "name": "scheduler-output"}

MiB = 1 << 20
#: Queue geometry of every shmq queue in the benchmark (DESIGN.md: 24 MiB x 10 chunks).
MAX_CHUNK_BYTES = 24 * MiB
MAX_CHUNKS = 10

#: Seconds a child waits for a handle, a handshake or the other processes at a barrier.
SYNC_TIMEOUT = 30.0

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def _now_ns() -> int:
    """A clock that every process on the machine shares (``CLOCK_MONOTONIC``)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class BenchError(RuntimeError):
    """A benchmark run failed; the message says which process and why."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


# --------------------------------------------------------------------------------------
# Transports
# --------------------------------------------------------------------------------------


def _nothing() -> None:
    pass


@dataclass
class Endpoint:
    """One side of a channel, as a role sees it.

    ``io`` is ``send(obj)`` on a writer and ``recv() -> obj`` on a reader; roles call it
    in their hot loop, so it is the transport's own callable where possible.
    ``ready()`` is the transport's handshake (after it, nothing sent can be lost);
    ``close()`` releases the endpoint once every process is done.
    """

    io: Callable[..., Any]
    ready: Callable[[], None] = _nothing
    close: Callable[[], None] = _nothing


class Transport(ABC):
    """A way to move pickled objects from one writer process to reader processes.

    The parent calls :meth:`make_channel`; the result is passed (pickled by ``spawn``)
    to the children, which call :meth:`open_writer` / :meth:`open_reader` on it.
    ``open_reader`` may wait until the channel's writer is open (shmq hands its handle
    over then), so a process opens its writers before its readers.
    """

    name = "?"

    def unavailable(self) -> Optional[str]:
        """Why this transport cannot run here, or ``None`` when it can."""
        return None

    @abstractmethod
    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> Any:
        """A channel for one writer and ``n_readers`` readers (made in the parent)."""

    @abstractmethod
    def open_writer(self, channel: Any) -> Endpoint:
        """The writing end of ``channel`` (in a child)."""

    @abstractmethod
    def open_reader(self, channel: Any, rank: int) -> Endpoint:
        """Reader ``rank``'s end of ``channel`` (in a child)."""


@dataclass
class _ShmqChannel:
    n_readers: int
    handles: Any  # multiprocessing.Queue: the writer puts its Handle once per reader


class ShmqTransport(Transport):
    """shmq's ``MessageQueue``; the writer passes its ``Handle`` to the readers through
    a ``multiprocessing.Queue`` made with the channel."""

    name = "shmq"

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> _ShmqChannel:
        return _ShmqChannel(n_readers, ctx.Queue())

    def open_writer(self, channel: _ShmqChannel) -> Endpoint:
        from shmq import MessageQueue

        mq = MessageQueue(
            channel.n_readers, channel.n_readers, max_chunk_bytes=MAX_CHUNK_BYTES, max_chunks=MAX_CHUNKS
        )
        for _ in range(channel.n_readers):
            channel.handles.put(mq.export_handle())
        return Endpoint(mq.enqueue, partial(mq.wait_until_ready, SYNC_TIMEOUT))

    def open_reader(self, channel: _ShmqChannel, rank: int) -> Endpoint:
        from shmq import MessageQueue

        mq = MessageQueue.create_from_handle(channel.handles.get(timeout=SYNC_TIMEOUT), rank)
        return Endpoint(mq.dequeue, partial(mq.wait_until_ready, SYNC_TIMEOUT))


class MpQueueTransport(Transport):
    """``multiprocessing.Queue``: one queue per reader, the writer puts into each."""

    name = "mp.Queue"

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> list:
        return [ctx.Queue() for _ in range(n_readers)]

    def open_writer(self, channel: list) -> Endpoint:
        if len(channel) == 1:
            send = channel[0].put
        else:
            puts = [q.put for q in channel]

            def send(obj: Any) -> None:
                for put in puts:
                    put(obj)

        def close() -> None:
            for q in channel:
                q.close()
                q.join_thread()

        return Endpoint(send, close=close)

    def open_reader(self, channel: list, rank: int) -> Endpoint:
        return Endpoint(channel[rank].get)


@dataclass
class _ZmqChannel:
    n_readers: int
    pub_addr: str  # ipc:// address of the writer's PUB socket
    ready_addr: str  # ipc:// address of the writer's PULL socket (readers report in)


class ZmqTransport(Transport):
    """pyzmq PUB/SUB over ``ipc://``, objects pickled with the highest protocol, high
    water marks 0 (never drop).

    Handshake, so that nothing is lost to the slow joiner: the writer publishes
    ``hello`` until every reader has answered on a PUSH/PULL pair, then publishes
    ``start``; a reader answers its first ``hello`` and skips everything up to
    ``start``. Control messages cannot be confused with data (a pickle starts with
    ``0x80``).
    """

    name = "pyzmq"
    _HELLO = b"hello"
    _START = b"start"
    _ids = itertools.count()

    def unavailable(self) -> Optional[str]:
        try:
            import zmq  # noqa: F401
        except ImportError:
            return "pyzmq is not installed"
        return None

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> _ZmqChannel:
        i = next(self._ids)
        return _ZmqChannel(n_readers, f"ipc://{workdir}/{i}.pub", f"ipc://{workdir}/{i}.ready")

    def open_writer(self, channel: _ZmqChannel) -> Endpoint:
        import zmq

        zctx = zmq.Context()
        pub = zctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(channel.pub_addr)
        pull = zctx.socket(zmq.PULL)
        pull.bind(channel.ready_addr)

        def ready() -> None:
            deadline = time.monotonic() + SYNC_TIMEOUT
            answered = 0
            while answered < channel.n_readers:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{answered} of {channel.n_readers} zmq readers answered")
                pub.send(self._HELLO)
                while answered < channel.n_readers and pull.poll(10):
                    pull.recv()
                    answered += 1
            pub.send(self._START)

        raw_send, dumps = pub.send, pickle.dumps

        def send(obj: Any) -> None:
            raw_send(dumps(obj, _PROTOCOL))

        return Endpoint(send, ready, partial(zctx.destroy, linger=0))

    def open_reader(self, channel: _ZmqChannel, rank: int) -> Endpoint:
        import zmq

        zctx = zmq.Context()
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(channel.pub_addr)
        push = zctx.socket(zmq.PUSH)
        push.connect(channel.ready_addr)

        def control() -> bytes:
            if not sub.poll(int(SYNC_TIMEOUT * 1000)):
                raise TimeoutError("the zmq writer sent nothing during the handshake")
            msg = sub.recv()
            if msg not in (self._HELLO, self._START):
                raise RuntimeError(f"zmq reader got {msg[:20]!r} before the handshake ended")
            return msg

        def ready() -> None:
            if control() != self._HELLO:
                raise RuntimeError("zmq reader got 'start' before 'hello'")
            push.send(b"ready")
            while control() != self._START:
                pass

        raw_recv, loads = sub.recv, pickle.loads

        def recv() -> Any:
            return loads(raw_recv())

        return Endpoint(recv, ready, partial(zctx.destroy, linger=0))


#: The transports, in table column order.
TRANSPORTS: list[Transport] = [ShmqTransport(), MpQueueTransport(), ZmqTransport()]


# --------------------------------------------------------------------------------------
# Roles: what a child process runs
# --------------------------------------------------------------------------------------


def _sync(barrier: Any) -> None:
    """Wait for every process of the run (``BrokenBarrierError`` after SYNC_TIMEOUT)."""
    barrier.wait(SYNC_TIMEOUT)


def _role_ping(transport: Transport, channels: Sequence[Any], barrier: Any, *, rounds: int, warmup: int) -> list[int]:
    """Send the small object on ``channels[0]`` and wait for it to come back on
    ``channels[1]``; returns each measured round trip in ns. Ends with ``None``."""
    out = transport.open_writer(channels[0])
    back = transport.open_reader(channels[1], 0)
    out.ready()
    back.ready()
    _sync(barrier)
    send, recv, obj, clock = out.io, back.io, SMALL_OBJECT, time.perf_counter_ns
    for _ in range(warmup):
        send(obj)
        recv()
    samples = [0] * rounds
    for i in range(rounds):
        t0 = clock()
        send(obj)
        recv()
        samples[i] = clock() - t0
    send(None)
    _sync(barrier)
    out.close()
    back.close()
    return samples


def _role_pong(transport: Transport, channels: Sequence[Any], barrier: Any, *, rounds: int, warmup: int) -> int:
    """Echo what arrives on ``channels[0]`` back on ``channels[1]`` until ``None``;
    checks the count and the first object."""
    out = transport.open_writer(channels[1])
    inbox = transport.open_reader(channels[0], 0)
    inbox.ready()
    out.ready()
    _sync(barrier)
    send, recv = out.io, inbox.io
    obj = recv()
    if obj != SMALL_OBJECT:
        raise RuntimeError(f"pong received {obj!r}, not the small object")
    count = 0
    while obj is not None:
        send(obj)
        count += 1
        obj = recv()
    if count != rounds + warmup:
        raise RuntimeError(f"pong echoed {count} objects, expected {rounds + warmup}")
    _sync(barrier)
    out.close()
    inbox.close()
    return count


def _role_writer(transport: Transport, channels: Sequence[Any], barrier: Any, *, n: int) -> int:
    """Send the small object ``n`` times, then ``None``; returns the time of the first
    send (``_now_ns``)."""
    out = transport.open_writer(channels[0])
    out.ready()
    _sync(barrier)
    send, obj = out.io, SMALL_OBJECT
    t0 = _now_ns()
    for _ in range(n):
        send(obj)
    send(None)
    _sync(barrier)
    out.close()
    return t0


def _role_reader(transport: Transport, channels: Sequence[Any], barrier: Any, *, n: int, rank: int) -> int:
    """Receive until ``None``, check that exactly ``n`` small objects came; returns the
    time the last one arrived (``_now_ns``; the ``None`` is one more message, a
    difference of 1/n)."""
    inbox = transport.open_reader(channels[0], rank)
    inbox.ready()
    _sync(barrier)
    recv = inbox.io
    obj = recv()
    if obj != SMALL_OBJECT:
        raise RuntimeError(f"reader {rank} received {obj!r}, not the small object")
    count = 0
    while obj is not None:
        count += 1
        obj = recv()
    t_end = _now_ns()
    if count != n:
        raise RuntimeError(f"reader {rank} received {count} objects, expected {n}")
    _sync(barrier)
    inbox.close()
    return t_end


def _role_idle_writer(transport: Transport, channels: Sequence[Any], barrier: Any, *, wakes: int, idle_s: float) -> int:
    """``wakes`` times: stay idle for ``idle_s`` seconds, then send the send time; ends
    with ``None``."""
    out = transport.open_writer(channels[0])
    out.ready()
    _sync(barrier)
    for _ in range(wakes):
        time.sleep(idle_s)
        out.io(_now_ns())
    out.io(None)
    _sync(barrier)
    out.close()
    return wakes


def _role_idle_reader(transport: Transport, channels: Sequence[Any], barrier: Any, *, wakes: int) -> dict:
    """Block in receive while the writer is idle; returns this process's CPU time over
    the whole wait (user + sys, ``os.times``), the wall time, and each wake-up latency."""
    inbox = transport.open_reader(channels[0], 0)
    inbox.ready()
    _sync(barrier)
    recv = inbox.io
    latencies = []
    t0, wall0 = os.times(), _now_ns()
    for _ in range(wakes):
        sent = recv()
        latencies.append(_now_ns() - sent)
    t1, wall1 = os.times(), _now_ns()
    if recv() is not None:
        raise RuntimeError("the idle reader expected the end mark")
    _sync(barrier)
    inbox.close()
    cpu = (t1.user - t0.user) + (t1.system - t0.system)
    return {"cpu": cpu, "wall": (wall1 - wall0) / 1e9, "latencies_ns": latencies}


def _stack_file(workdir: str, pid: int) -> str:
    return os.path.join(workdir, f"{pid}.stack")


def _child_main(index: int, role: Callable, transport: Transport, channels: Sequence[Any],
                barrier: Any, results: Any, kwargs: dict, workdir: str) -> None:
    """Entry point of every child: run ``role`` and report ``(index, ok, value)``.
    SIGUSR1 writes the child's Python stack to a file in ``workdir`` (the parent asks
    for it when a run hangs)."""
    stacks = open(_stack_file(workdir, os.getpid()), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=False)
    try:
        value = role(transport, channels, barrier, **kwargs)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        try:
            barrier.abort()  # do not leave the others waiting for us
        except Exception:
            pass
        results.put((index, False, f"{type(e).__name__}: {e}", traceback.format_exc()))
    else:
        results.put((index, True, value, ""))


# --------------------------------------------------------------------------------------
# Harness: runs roles in child processes
# --------------------------------------------------------------------------------------


@dataclass
class Job:
    """One child process of a run: ``role(transport, channels, barrier, **kwargs)``."""

    role: Callable
    channels: Sequence[Any]
    kwargs: dict = field(default_factory=dict)


class Harness:
    """Starts the processes of one run and collects what their roles return.

    A run fails (``BenchError``) when a child raises, exits without reporting, or the
    whole run takes longer than ``timeout`` seconds (the error then carries the stuck
    children's Python stacks and kernel wait channels); its children are then
    terminated (killed if they do not stop) and shmq segments they created are removed.
    """

    def __init__(self, ctx: Any, workdir: str, timeout: float):
        self.ctx = ctx
        self.workdir = workdir
        self.timeout = timeout

    def channel(self, transport: Transport, n_readers: int) -> Any:
        return transport.make_channel(self.ctx, n_readers, self.workdir)

    def run(self, transport: Transport, jobs: Sequence[Job]) -> list[Any]:
        """Run ``jobs`` at once, one process each; returns their values in job order."""
        barrier = self.ctx.Barrier(len(jobs))
        results = self.ctx.Queue()
        procs = [
            self.ctx.Process(
                target=_child_main,
                args=(i, job.role, transport, job.channels, barrier, results, job.kwargs, self.workdir),
                name=f"shmq-bench-{job.role.__name__.lstrip('_')}-{i}",
                daemon=True,
            )
            for i, job in enumerate(jobs)
        ]
        values: dict[int, Any] = {}
        ok = False
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + self.timeout
            while len(values) < len(procs):
                try:
                    index, success, value, details = results.get(timeout=0.2)
                except queue.Empty:
                    self._check_alive(procs, values, deadline)
                    continue
                if not success:
                    raise self._first_cause(procs, results, index, value, details)
                values[index] = value
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
                if p.exitcode is None:
                    raise BenchError(f"{p.name} did not exit after reporting")
                if p.exitcode != 0:
                    raise BenchError(f"{p.name} exited with code {p.exitcode} after reporting")
            ok = True
        finally:
            if not ok:
                self._stop(procs)
            results.close()
            results.join_thread()
        return [values[i] for i in range(len(procs))]

    @staticmethod
    def _first_cause(procs: list, results: Any, index: int, message: str, details: str) -> BenchError:
        """The error to report once a child failed: the failing child aborts the
        barrier, so the others fail too, with ``BrokenBarrierError``; give them a moment
        to report and prefer an error that is not that."""
        errors = [(index, message, details)]
        try:
            while True:
                i, success, value, more = results.get(timeout=0.5)
                if not success:
                    errors.append((i, value, more))
        except queue.Empty:
            pass
        causes = [e for e in errors if not e[1].startswith("BrokenBarrierError")] or errors
        i, message, details = causes[0]
        return BenchError(f"{procs[i].name}: {message}", details)

    def _check_alive(self, procs: list, values: dict, deadline: float) -> None:
        for i, p in enumerate(procs):
            if i not in values and p.exitcode not in (None, 0):
                raise BenchError(f"{p.name} exited with code {p.exitcode} without reporting")
        if time.monotonic() > deadline:
            waiting = [p for i, p in enumerate(procs) if i not in values]
            names = ", ".join(p.name for p in waiting)
            raise BenchError(f"timed out after {self.timeout:g} s waiting for {names}", self._stacks(waiting))

    def _stacks(self, procs: list) -> str:
        """Where ``procs`` are stuck: their Python stacks, asked for with SIGUSR1."""
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except (OSError, TypeError):
                pass
        time.sleep(0.5)
        dumps = []
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/wchan") as f:
                    wchan = f.read().strip()
                wchan = wchan if wchan not in ("", "0") else "running"
            except OSError:
                wchan = "?"
            try:
                with open(_stack_file(self.workdir, p.pid)) as f:
                    stack = f.read().rstrip()
            except OSError:
                stack = "(no stack)"
            dumps.append(f"{p.name} (pid {p.pid}, kernel wait channel: {wchan}):\n{stack}")
        return "\n".join(dumps)

    @staticmethod
    def _stop(procs: list) -> None:
        """Terminate, then kill, every child still running; remove the segments of the
        shmq queues they created (the creator removes them on a clean exit only)."""
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is None:
                continue
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        _remove_segments_of({p.pid for p in procs if p.pid is not None})


def _remove_segments_of(pids: set[int]) -> None:
    """Unlink shmq ring segments in /dev/shm whose creator is one of ``pids``."""
    try:
        from shmq import _core
    except ImportError:
        return
    for path in glob.glob(f"/dev/shm/{_core.segment_prefix}*"):
        name = os.path.basename(path)
        try:
            creator = _core.Ring.open(name).creator_pid
        except Exception:  # not a ring segment, or already gone
            continue
        if creator in pids:
            try:
                os.unlink(path)
            except OSError:
                pass


# --------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------


@dataclass
class Params:
    """How much each scenario measures."""

    rounds: int  # ping-pong round trips measured
    warmup: int  # ping-pong round trips before measuring
    objects: int  # objects sent in the throughput scenarios
    wakes: int = 10  # wake-ups from idle in the idle scenario
    idle_s: float = 0.3  # seconds of idleness before each wake-up


PRESETS = {
    # DESIGN.md's counts, so the figures compare with its table; about 20 s here.
    "default": Params(rounds=20_000, warmup=1_000, objects=50_000, wakes=10, idle_s=0.3),
    "quick": Params(rounds=5_000, warmup=500, objects=10_000, wakes=5, idle_s=0.2),
}


@dataclass
class Metric:
    """One table row produced by a scenario."""

    key: str  # key in the scenario's result dict
    label: str  # the row's name in the table
    unit: str  # "us" or "obj/s"
    higher_is_better: bool


@dataclass
class Scenario:
    """A scenario runs once per transport: ``run(harness, transport, params)`` returns
    ``{metric key: value}``."""

    key: str
    title: str
    run: Callable[[Harness, Transport, Params], dict[str, float]]
    metrics: list[Metric]


@dataclass
class Floor:
    """A reference measured once, in this process, without any transport:
    ``run(params)`` returns ``{metric key: value}``."""

    key: str
    title: str
    run: Callable[[Params], dict[str, float]]
    metrics: list[Metric]


def _percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _bench_latency(harness: Harness, transport: Transport, params: Params) -> dict[str, float]:
    """Ping-pong through two 1-reader channels; one-way latency = round trip / 2."""
    channels = (harness.channel(transport, 1), harness.channel(transport, 1))
    kwargs = {"rounds": params.rounds, "warmup": params.warmup}
    samples, _ = harness.run(transport, [Job(_role_ping, channels, kwargs), Job(_role_pong, channels, kwargs)])
    one_way_us = sorted(ns / 2 / 1000 for ns in samples)
    return {"p50": _percentile(one_way_us, 50), "p99": _percentile(one_way_us, 99)}


def _bench_throughput(harness: Harness, transport: Transport, params: Params, *, n_readers: int) -> dict[str, float]:
    """N objects from the writer's first send to the last reader's last receive."""
    channels = (harness.channel(transport, n_readers),)
    n = params.objects
    jobs = [Job(_role_writer, channels, {"n": n})]
    jobs += [Job(_role_reader, channels, {"n": n, "rank": r}) for r in range(n_readers)]
    t0, *t_ends = harness.run(transport, jobs)
    return {"rate": n / ((max(t_ends) - t0) / 1e9)}


def _bench_idle(harness: Harness, transport: Transport, params: Params) -> dict[str, float]:
    """A reader blocked while its writer is idle: its CPU use (os.times, user + sys, over
    ``wakes`` idle stretches of ``idle_s`` s) and how long a message sent after each
    stretch takes to arrive."""
    channels = (harness.channel(transport, 1),)
    kwargs = {"wakes": params.wakes}
    jobs = [
        Job(_role_idle_writer, channels, {**kwargs, "idle_s": params.idle_s}),
        Job(_role_idle_reader, channels, kwargs),
    ]
    _, reader = harness.run(transport, jobs)
    wake_us = sorted(ns / 1000 for ns in reader["latencies_ns"])
    return {
        "cpu_pct": 100 * reader["cpu"] / max(reader["wall"], 1e-9),
        "wake_p50": _percentile(wake_us, 50),
        "wake_p99": _percentile(wake_us, 99),
    }


def _time_per_call_us(fn: Callable[[], Any], calls: int, batch: int = 100) -> float:
    """Median time of one ``fn()`` in µs, over batches of ``batch`` calls (timing each
    batch, so the clock itself is not what is measured)."""
    clock = time.perf_counter_ns
    per_call = []
    for _ in range(max(10, calls // batch)):
        t0 = clock()
        for _ in range(batch):
            fn()
        per_call.append((clock() - t0) / batch / 1000)
    return statistics.median(per_call)


def _floor_pickle(params: Params) -> dict[str, float]:
    """Pickle alone, in this process: what a transport adds nothing to. ``dumps`` and
    ``loads`` of the small object are timed separately; one object handed over costs
    both in a row, while a writer and a reader on two cores run them in parallel, so a
    stream is bounded by the slower of the two."""
    pickled = pickle.dumps(SMALL_OBJECT, _PROTOCOL)
    dumps_us = _time_per_call_us(partial(pickle.dumps, SMALL_OBJECT, _PROTOCOL), params.objects)
    loads_us = _time_per_call_us(partial(pickle.loads, pickled), params.objects)
    return {
        "serial_us": dumps_us + loads_us,
        "serial_rate": 1e6 / (dumps_us + loads_us),
        "parallel_rate": 1e6 / max(dumps_us, loads_us),
    }


def _floor_store(params: Params) -> dict[str, float]:
    """shmq's object store in this process (MsgpackSerde): put and get of the small
    object, then put and get of a 4 MiB float32 tensor (numpy array without torch)."""
    from shmq import ObjectStorage, RingBuffer

    class _NoLock:
        # A reader_lock makes the writer's own gets count as reads, so objects can be
        # evicted as the loop goes (the store needs no lock; this one does nothing).
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    store = ObjectStorage(8 * MiB, 1, RingBuffer(256 * MiB, create=True), reader_lock=_NoLock())
    n = min(params.objects, 20_000)
    keys = iter([f"small-{i}" for i in range(10 * n + 100)])
    handles = []
    put_us = _time_per_call_us(lambda: handles.append(store.put(next(keys), SMALL_OBJECT)), n)
    got = iter(handles)
    get_us = _time_per_call_us(lambda: store.get(*next(got)), min(n, len(handles)))

    try:
        import torch

        big = torch.rand(MiB)  # 1 Mi float32 = 4 MiB
    except ImportError:
        import numpy as np

        big = np.random.rand(MiB).astype(np.float32)
    # Rounds of 32 puts (128 MiB, half the ring) then their 32 gets, so every put finds
    # room once the previous round has been read; the median round gives each rate.
    put_rates, get_rates, clock = [], [], time.perf_counter_ns
    for r in range(6):
        t0 = clock()
        round_handles = [store.put(f"big-{r}-{i}", big) for i in range(32)]
        t1 = clock()
        for h in round_handles:
            store.get(*h)
        t2 = clock()
        put_rates.append(32 * 4 * MiB / (t1 - t0))  # bytes/ns = GB/s
        get_rates.append(32 * 4 * MiB / (t2 - t1))
    store.clear()
    return {
        "put_us": put_us,
        "get_us": get_us,
        "big_put": statistics.median(put_rates),
        "big_get": statistics.median(get_rates),
    }


SCENARIOS: list[Scenario] = [
    Scenario("latency", "one-way latency (ping-pong)", _bench_latency, [
        Metric("p50", "one-way latency, small object, p50", "us", False),
        Metric("p99", "one-way latency, small object, p99", "us", False),
    ]),
    Scenario("throughput1", "throughput, 1 reader", partial(_bench_throughput, n_readers=1), [
        Metric("rate", "throughput, small objects, 1 reader", "obj/s", True),
    ]),
    Scenario("throughput3", "throughput, 3 readers", partial(_bench_throughput, n_readers=3), [
        Metric("rate", "throughput, small objects, 3 readers", "obj/s", True),
    ]),
    Scenario("idle", "idle reader", _bench_idle, [
        Metric("cpu_pct", "idle reader: CPU while blocked", "%", False),
        Metric("wake_p50", "idle reader: wake-up latency, p50", "us", False),
        Metric("wake_p99", "idle reader: wake-up latency, p99", "us", False),
    ]),
]

FLOORS: list[Floor] = [
    Floor("store", "object store", _floor_store, [
        Metric("put_us", "object store: put, small object", "us", False),
        Metric("get_us", "object store: get, small object", "us", False),
        Metric("big_put", "object store: put, 4 MiB float32 tensor", "GB/s", True),
        Metric("big_get", "object store: get, 4 MiB float32 tensor", "GB/s", True),
    ]),
    Floor("pickle", "pickle only", _floor_pickle, [
        Metric("serial_us", "pickle only: dumps+loads, per object", "us", False),
        Metric("serial_rate", "pickle only: dumps+loads, rate", "obj/s", True),
        Metric("parallel_rate", "pickle only: slower of dumps/loads, rate", "obj/s", True),
    ]),
]


# --------------------------------------------------------------------------------------
# Running and reporting
# --------------------------------------------------------------------------------------


@dataclass
class Row:
    """One table row: a metric's value per transport (or one value for a floor)."""

    key: str  # "<scenario key>.<metric key>", stable for readers of the JSON
    label: str
    unit: str
    higher_is_better: bool
    values: dict[str, Optional[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    floor: Optional[float] = None


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, total: int, stream: Any = sys.stderr, enabled: bool = True):
        self.total, self.done, self.stream, self.enabled = total, 0, stream, enabled
        self.tty = enabled and stream.isatty()
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        line = f"[{self.done}/{self.total}, {time.monotonic() - self.started:.1f} s] {text}"
        self.stream.write(f"\r\x1b[K{line}" if self.tty else line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def machine_info() -> dict[str, Any]:
    """Where the figures were measured."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        nproc = os.cpu_count() or 0
    try:
        from shmq import __version__ as shmq_version
    except ImportError:  # pragma: no cover
        shmq_version = "?"
    try:
        import zmq

        zmq_version = f"{zmq.__version__} (libzmq {zmq.zmq_version()})"
    except ImportError:
        zmq_version = None
    return {
        "nproc": nproc,
        "cpu": cpu,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "shmq": shmq_version,
        "pyzmq": zmq_version,
        "busy_before": _cpu_busy(),
    }


def _cpu_busy(interval: float = 0.25) -> Optional[float]:
    """Fraction of all CPUs busy (from /proc/stat) over ``interval`` seconds: other
    work on the machine before the run, which makes the figures noisy."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    try:
        busy0, total0 = sample()
        time.sleep(interval)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / max(1, total1 - total0)


def _median_of(runs: int, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Call ``measure`` ``runs`` times; the median of each metric."""
    results = [measure() for _ in range(runs)]
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def run_bench(params: Params, transports: Sequence[Transport], timeout: float, repeat: int = 1,
              progress: Optional[Progress] = None, details: Optional[list[str]] = None) -> list[Row]:
    """Run every scenario for every transport (``repeat`` times, keeping the median),
    then the floors; returns the rows. Failures land in ``Row.errors`` (and their
    tracebacks in ``details``)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    details = details if details is not None else []
    rows: list[Row] = []
    workdir = tempfile.mkdtemp(prefix="shmq-bench-")
    try:
        harness = Harness(ctx, workdir, timeout)
        for scenario in SCENARIOS:
            scenario_rows = [Row(f"{scenario.key}.{m.key}", m.label, m.unit, m.higher_is_better)
                             for m in scenario.metrics]
            rows += scenario_rows
            for transport in transports:
                if progress:
                    progress.step(f"{scenario.title} - {transport.name}")
                try:
                    reason = transport.unavailable()
                    if reason is not None:
                        raise BenchError(reason)
                    result = _median_of(repeat, partial(scenario.run, harness, transport, params))
                except BenchError as e:
                    for row in scenario_rows:
                        row.values[transport.name] = None
                        row.errors[transport.name] = str(e)
                    if e.details:
                        details.append(f"{scenario.title} - {transport.name}:\n{e.details}")
                    continue
                for metric, row in zip(scenario.metrics, scenario_rows, strict=True):
                    row.values[transport.name] = result[metric.key]
        for floor in FLOORS:
            if progress:
                progress.step(floor.title)
            result = _median_of(repeat, partial(floor.run, params))
            rows += [Row(f"{floor.key}.{m.key}", m.label, m.unit, m.higher_is_better, floor=result[m.key])
                     for m in floor.metrics]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if progress:
            progress.finish()
    return rows


def _format_value(value: Optional[float], unit: str) -> str:
    if value is None:
        return "failed"
    if unit == "us":
        return f"{value:.2f} µs" if value < 100 else f"{value:.0f} µs"
    if unit == "obj/s":
        return f"{value / 1000:,.0f} k/s" if value >= 10_000 else f"{value / 1000:.2f} k/s"
    if unit == "%":
        return f"{value:.2f} %"
    if unit == "GB/s":
        return f"{value:.1f} GB/s"
    return f"{value:.3g} {unit}"


def _format_ratio(row: Row, a: str, b: str) -> str:
    """How ``a`` compares with ``b`` in this row, e.g. ``7.3x faster``."""
    va, vb = row.values.get(a), row.values.get(b)
    if not va or not vb:
        return ""
    ratio = va / vb if row.higher_is_better else vb / va
    better, worse = ("less", "more") if row.unit == "%" else ("faster", "slower")
    return f"{ratio:.1f}x {better}" if ratio >= 1 else f"{1 / ratio:.1f}x {worse}"


def format_table(rows: Sequence[Row], names: Sequence[str], reference: str = "shmq") -> str:
    """The result table: one column per transport, then ratios of ``reference`` to the
    others. A floor row shows its single value in the first column."""
    others = [n for n in names if n != reference] if reference in names else []
    header = ["scenario", *names, *(f"{reference} vs {n}" for n in others)]
    body = []
    for i, row in enumerate(rows):
        if row.floor is not None and i > 0 and rows[i - 1].floor is None:
            body.append(None)  # a rule between the transports' rows and the floors
        if row.floor is not None:
            cells = [_format_value(row.floor, row.unit)] + ["-"] * (len(names) - 1) + [""] * len(others)
        else:
            cells = [_format_value(row.values.get(n), row.unit) for n in names]
            cells += [_format_ratio(row, reference, n) for n in others]
        body.append([row.label, *cells])
    widths = [max(len(r[i]) for r in [header, *body] if r) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) if r else rule for r in body)])


def _header(machine: dict[str, Any], params: Params, repeat: int) -> str:
    """What was measured where: the lines printed above the table."""
    lines = [
        f"shmq {machine['shmq']} bench on {machine['nproc']} CPUs ({machine['cpu']}), "
        f"{machine['implementation']} {machine['python']}, Linux {machine['kernel']}"
        + (f", pyzmq {machine['pyzmq']}" if machine["pyzmq"] else ""),
        f"latency: half the round trip, p50/p99 over {params.rounds:,} round trips after {params.warmup:,} "
        f"warm-up; throughput: {params.objects:,} objects, first send to last receive",
        f"small object of {len(pickle.dumps(SMALL_OBJECT, _PROTOCOL))} bytes pickled; spawned processes; "
        f"shmq queues of {MAX_CHUNKS} x {MAX_CHUNK_BYTES // MiB} MiB chunks"
        + (f"; median of {repeat} runs per cell" if repeat > 1 else ""),
    ]
    busy = machine["busy_before"]
    if busy is not None and busy > 0.1:
        lines.append(f"note: other work kept {busy:.0%} of the CPUs busy just before the run; figures will be noisy")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument("--quick", dest="preset", action="store_const", const="quick", default="default",
                        help="5 000 round trips after 500 warm-up and 10 000 objects, instead of DESIGN.md's "
                             "20 000 after 1 000 and 50 000")
    parser.add_argument("--rounds", type=int, metavar="N", help="ping-pong round trips to measure")
    parser.add_argument("--warmup", type=int, metavar="N", help="ping-pong round trips before measuring")
    parser.add_argument("--objects", type=int, metavar="N", help="objects per throughput run")
    parser.add_argument("--transports", metavar="LIST", default=",".join(t.name for t in TRANSPORTS),
                        help="comma-separated subset of: %(default)s")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="run every cell K times and show the median (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=15.0, metavar="S",
                        help="seconds one run (one scenario, one transport) may take (default %(default)g)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--no-progress", action="store_true", help="do not print the progress line")


def main(args: argparse.Namespace) -> int:
    """``python -m shmq bench``: run, print the table; 1 if any run failed."""
    by_name = {t.name: t for t in TRANSPORTS}
    wanted = [n.strip() for n in args.transports.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        print(f"unknown transport(s) {unknown}; choose from {', '.join(by_name)}", file=sys.stderr)
        return 2
    transports = [by_name[n] for n in wanted]
    base = PRESETS[args.preset]
    params = Params(
        rounds=args.rounds if args.rounds is not None else base.rounds,
        warmup=args.warmup if args.warmup is not None else base.warmup,
        objects=args.objects if args.objects is not None else base.objects,
    )
    if params.rounds < 1 or params.warmup < 0 or params.objects < 1 or args.repeat < 1:
        print("--rounds, --objects and --repeat must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2

    machine = machine_info()
    print(_header(machine, params, args.repeat), flush=True)

    n_steps = len(SCENARIOS) * len(transports) + len(FLOORS)
    progress = Progress(n_steps, enabled=not args.no_progress)
    details: list[str] = []
    started = time.monotonic()
    rows = run_bench(params, transports, args.timeout, args.repeat, progress, details)
    wall = time.monotonic() - started

    print()
    print(format_table(rows, [t.name for t in transports]))
    failures = sorted({f"{name}: {err}" for row in rows for name, err in row.errors.items()})
    if failures:
        print("\nfailed:")
        for failure in failures:
            print(f"  {failure}")
    print(f"\n(wall time {wall:.1f} s)")
    for text in details:
        print(f"\n{text}", file=sys.stderr)

    if args.json:
        doc = {
            "machine": machine,
            "params": {**dataclasses.asdict(params), "repeat": args.repeat},
            "queue": {"max_chunk_bytes": MAX_CHUNK_BYTES, "max_chunks": MAX_CHUNKS},
            "wall_s": wall,
            "rows": [dataclasses.asdict(row) for row in rows],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 1 if failures else 0

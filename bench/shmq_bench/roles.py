"""Roles: what a child process of a run does. A role only uses endpoints of a
:class:`~shmq_bench.transports.Transport`, so one role serves every transport; it
returns a value the scenario turns into metrics."""

from __future__ import annotations

import faulthandler
import functools
import mmap
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Optional, Sequence

from .common import OBJECTS, SMALL_OBJECT, STEP_OBJECT, SYNC_TIMEOUT, Arrays, now_ns
from .transports import Transport


#: This child's progress counter, its cell of the run's shared array (see
#: :class:`~shmq_bench.harness.Harness`): set by :func:`_child_main`.
_beats: Any = None
_beat_index = 0
#: Messages between two beats in the message loops (a beat is a store to shared memory,
#: ~0.1 µs: once per this many messages, the loops' cost stays theirs). A power of two.
BEAT_EVERY = 64


def beat() -> None:
    """Tell the harness that this child made progress (a message, a barrier): a run
    fails only when none of its children beats for the watchdog's time."""
    if _beats is not None:
        _beats[_beat_index] += 1


def _beating(n: int) -> Iterator[range]:
    """``range(n)`` in slices of BEAT_EVERY, a beat before each: ``for part in
    _beating(n): for i in part: ...`` beats without a check per message."""
    for start in range(0, n, BEAT_EVERY):
        beat()
        yield range(start, min(n, start + BEAT_EVERY))


def _sync(barrier: Any) -> None:
    """Wait for every process of the run (``BrokenBarrierError`` after SYNC_TIMEOUT)."""
    beat()
    barrier.wait(SYNC_TIMEOUT)
    beat()


def _role_ping(
    transport: Transport, channels: Sequence[Any], barrier: Any, *, rounds: int, warmup: int, obj: str = "small"
) -> list[int]:
    """Send ``OBJECTS[obj]`` (the small object, or the step) on ``channels[0]`` and wait
    for it to come back on ``channels[1]``; returns each measured round trip in ns. Ends
    with ``None``."""
    out = transport.open_writer(channels[0])
    back = transport.open_reader(channels[1], 0)
    out.ready()
    back.ready()
    _sync(barrier)
    send, recv, sent, clock = out.io, back.io, OBJECTS[obj], time.perf_counter_ns
    for part in _beating(warmup):
        for _ in part:
            send(sent)
            recv()
    samples = [0] * rounds
    for part in _beating(rounds):
        for i in part:
            t0 = clock()
            send(sent)
            recv()
            samples[i] = clock() - t0
    send(None)
    _sync(barrier)
    out.close()
    back.close()
    return samples


def _role_pong(
    transport: Transport, channels: Sequence[Any], barrier: Any, *, rounds: int, warmup: int, obj: str = "small"
) -> int:
    """Echo what arrives on ``channels[0]`` back on ``channels[1]`` until ``None``;
    checks the count and that the first object is ``OBJECTS[obj]``."""
    expected = OBJECTS[obj]
    out = transport.open_writer(channels[1])
    inbox = transport.open_reader(channels[0], 0)
    inbox.ready()
    out.ready()
    _sync(barrier)
    send, recv = out.io, inbox.io
    got = recv()
    if got != expected:
        raise RuntimeError(f"pong received {str(got)[:200]}, not the {obj} object")
    count, mask = 0, BEAT_EVERY - 1
    while got is not None:
        send(got)
        count += 1
        if not count & mask:
            beat()
        got = recv()
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
    t0 = now_ns()
    for part in _beating(n):
        for _ in part:
            send(obj)
    send(None)
    _sync(barrier)
    out.close()
    return t0


def _role_reader(transport: Transport, channels: Sequence[Any], barrier: Any, *, n: int, rank: int) -> int:
    """Receive until ``None``, check that exactly ``n`` small objects came; returns the
    time the last one arrived (``_now_ns``; the ``None`` is one more message, a
    difference of 1/n)."""
    return _receive_all(transport, channels, barrier, rank, SMALL_OBJECT, "the small object", n)


def _receive_all(
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    rank: int,
    expected: Any,
    what: str,
    n: int,
    on_each: Optional[Callable[[int], None]] = None,
) -> int:
    """A reader's run: receive until ``None``, the first message ``expected`` (``what``,
    in the error otherwise), exactly ``n`` of them; ``on_each(k)`` as message ``k``
    (from 0) arrives. Returns the time (``now_ns``) the last one arrived."""
    inbox = transport.open_reader(channels[0], rank)
    inbox.ready()
    _sync(barrier)
    recv = inbox.io
    obj = recv()
    if obj != expected:
        raise RuntimeError(f"reader {rank} received {str(obj)[:200]}, not {what}")
    count, mask = 0, BEAT_EVERY - 1
    while obj is not None:
        if on_each is not None:
            on_each(count)
        count += 1
        if not count & mask:
            beat()
        obj = recv()
    t_end = now_ns()
    if count != n:
        raise RuntimeError(f"reader {rank} received {count} messages, expected {n}")
    _sync(barrier)
    inbox.close()
    return t_end


def _role_step_writer(
    transport: Transport, channels: Sequence[Any], barrier: Any, *, warmup: int, n: int, paced: bool
) -> dict[str, Any]:
    """The executor's step broadcast: send the step ``warmup + n`` times, then ``None``,
    timing each send call (``perf_counter_ns`` around it). ``paced``: after each send,
    wait (outside the clock) until every reader has taken it (``channels[1]``: each
    reader's count), as vLLM's executor waits for its workers before the next step; else
    send as fast as the queue lets it. Each send's start (``now_ns``) goes to
    ``channels[2]``. Returns the measured calls' times (ns) and the time (``now_ns``) of
    the first measured send."""
    out = transport.open_writer(channels[0])
    taken = channels[1]
    out.ready()
    _sync(barrier)
    sent_at = channels[2]
    send, step, clock, pause = out.io, STEP_OBJECT, time.perf_counter_ns, time.sleep
    calls = [0] * n
    t_first = now_ns()
    for part in _beating(warmup + n):
        for i in part:
            if i == warmup:
                t_first = now_ns()
            sent_at[i] = now_ns()
            t0 = clock()
            send(step)
            took = clock() - t0
            if i >= warmup:
                calls[i - warmup] = took
            while paced and min(taken) <= i:
                pause(20e-6)
    send(None)
    _sync(barrier)
    out.close()
    return {"calls_ns": calls, "t_first": t_first}


def _role_step_reader(
    transport: Transport, channels: Sequence[Any], barrier: Any, *, rank: int, total: int
) -> int:
    """Receive steps until ``None``, saying how many it has taken in ``channels[1]``
    (see ``_role_step_writer``) and when each arrived in ``channels[3]`` (``now_ns``, at
    ``rank * total + i``); checks the first one and the count. Returns the time
    (``now_ns``) the last one arrived."""
    taken, got_at, base = channels[1], channels[3], rank * total

    def arrived(k: int) -> None:
        got_at[base + k] = now_ns()
        taken[rank] = k + 1

    return _receive_all(transport, channels, barrier, rank, STEP_OBJECT, "the step", total, arrived)


def _role_idle_writer(
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    *,
    wakes: int,
    idle_s: float,
    steady_wakes: int = 0,
    steady_gap_s: float = 0.0,
) -> int:
    """``wakes`` times: stay idle for ``idle_s`` seconds, then send the send time; then
    ``steady_wakes`` times the same after ``steady_gap_s`` seconds; ends with ``None``."""
    out = transport.open_writer(channels[0])
    out.ready()
    _sync(barrier)
    for gap in [idle_s] * wakes + [steady_gap_s] * steady_wakes:
        time.sleep(gap)
        out.io(now_ns())
        beat()
    out.io(None)
    _sync(barrier)
    out.close()
    return wakes + steady_wakes


def _cpu_window(start_ns: int, end_ns: int, marks: list) -> None:
    """Append (``now_ns()``, this process's CPU time in ns) at ``start_ns`` and at
    ``end_ns`` (a thread of the reader: it sleeps in between; what it costs itself, two
    wake-ups, is in the figure)."""
    for at in (start_ns, end_ns):
        time.sleep(max(0.0, (at - now_ns()) / 1e9))
        marks.append((now_ns(), time.process_time_ns()))


def _role_idle_reader(
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    *,
    wakes: int,
    steady_wakes: int = 0,
    steady_window_s: tuple[float, float] = (1.5, 4.5),
) -> dict:
    """Block in receive while the writer is idle. First ``wakes`` messages a short idle
    stretch apart: this process's CPU time over that whole wait (``process_time``: user
    + sys, all threads), its wall time and each wake-up latency. Then ``steady_wakes``
    messages a long stretch apart: the CPU time over ``steady_window_s`` seconds after
    the previous message arrived (measured by a thread while the main one is blocked in
    receive; the window must end before the next message arrives), its wall time, and
    each wake-up latency."""
    inbox = transport.open_reader(channels[0], 0)
    inbox.ready()
    _sync(barrier)
    recv = inbox.io
    latencies = []
    cpu0, wall0 = time.process_time_ns(), now_ns()
    for _ in range(wakes):
        sent = recv()
        latencies.append(now_ns() - sent)
        beat()
    cpu1, wall1 = time.process_time_ns(), now_ns()
    steady_cpu = steady_wall = 0
    steady_latencies = []
    arrived = wall1
    for i in range(steady_wakes):
        marks: list = []
        start, end = (arrived + int(s * 1e9) for s in steady_window_s)
        sampler = threading.Thread(target=_cpu_window, args=(start, end, marks), daemon=True)
        sampler.start()
        sent = recv()
        arrived = now_ns()
        steady_latencies.append(arrived - sent)
        sampler.join(SYNC_TIMEOUT)
        if len(marks) != 2 or marks[1][0] > sent:
            raise RuntimeError(
                f"steady idle {i}: the measured window ({steady_window_s[0]:g}-{steady_window_s[1]:g} s after a "
                "message) did not end before the next message was sent"
            )
        steady_wall += marks[1][0] - marks[0][0]
        steady_cpu += marks[1][1] - marks[0][1]
    if recv() is not None:
        raise RuntimeError("the idle reader expected the end mark")
    _sync(barrier)
    inbox.close()
    return {
        "cpu": (cpu1 - cpu0) / 1e9,
        "wall": (wall1 - wall0) / 1e9,
        "latencies_ns": latencies,
        "steady_cpu": steady_cpu / 1e9,
        "steady_wall": steady_wall / 1e9,
        "steady_latencies_ns": steady_latencies,
    }


def _role_tensor_writer(
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    *,
    n: int,
    warmup: int,
    nbytes: int,
    fresh: bool,
    loan: bool = False,
    lib: str = "torch",
) -> dict:
    """Send float32 arrays of ``nbytes`` (torch tensors, or numpy arrays with
    ``lib="numpy"``), each filled with (hand-over only: ending in) the message's number
    ``i``: ``warmup`` of them, a barrier (the readers have them), then ``n`` measured ones
    and ``None``.

    - ``fresh``: what a producer does, a new array for every send (``full``, or with
      ``loan`` an array borrowed from the transport and ``fill``-ed in place). Making it
      is inside the clock: it is the producer's work in every transport alike.
    - not ``fresh`` (hand-over only): every send is the same array, only its last element
      changed: what the transport costs alone, not what a producer and its readers do
      with the bytes.

    Returns the time of the first measured send, each measured send call's time (ns),
    the split of the rest of the writer's time per send (``fresh``: ``make_ns``, the new
    array, or with ``loan`` ``loan_ns`` and ``fill_ns``; ``drop_ns``, letting it go: a sent
    loan's pages are given back there), how many loans were ordinary memory (no room in
    the transport's: sending copied) and the large parts the transport sent by reference
    and copied (``loaned_parts``, ``copied_parts``; 0 where it does not count them)."""
    arrays = Arrays(lib)
    out = transport.open_writer(channels[0])
    if loan and out.loan is None:
        raise RuntimeError(f"{transport.name} cannot lend memory")
    if fresh:
        # The memory a few messages in flight take, before the clock (vLLM's arena is
        # allocated whole when it is made; shmq's is taken as used unless reserved).
        out.reserve(min(1 << 30, 4 * nbytes))
    out.ready()
    _sync(barrier)
    numel = nbytes // 4
    lend: Any = out.loan  # not None with `loan` (checked above)
    fixed = None if fresh else arrays.ones(numel)

    send, clock = out.io, time.perf_counter_ns
    # Per measured send: the loan call (or the new array), the fill, the send, the drop.
    split = [[0] * n for _ in range(4)]

    def make(i: int, k: int) -> Any:
        if fixed is not None:
            fixed[-1] = float(i)
            return fixed
        c0 = clock()
        if not loan:
            t = arrays.full(numel, float(i))
            if k >= 0:
                split[0][k] = clock() - c0
            return t
        t = lend(numel, lib)
        c1 = clock()
        arrays.fill(t, float(i))
        if k >= 0:
            split[0][k], split[1][k] = c1 - c0, clock() - c1
        return t

    for i in range(warmup):
        t = make(i, -1)
        send(t)
        del t
        beat()
    _sync(barrier)  # the readers have the warm-up messages
    t0 = now_ns()
    for k in range(n):
        t = make(warmup + k, k)
        c0 = clock()
        send(t)
        c1 = clock()
        del t
        split[2][k], split[3][k] = c1 - c0, clock() - c1
        beat()
    send(None)
    _sync(barrier)
    if fresh:
        _floor_phase(barrier)  # the readers measure the copy floor; the writer waits
    fallbacks = out.loan_fallbacks()
    loaned, copied = out.parts()
    out.close()
    made = {"loan_ns": split[0], "fill_ns": split[1]} if loan else {"make_ns": split[0]}
    return {
        "t0": t0,
        "send_ns": split[2],
        "drop_ns": split[3],
        **made,
        "loan_fallbacks": fallbacks,
        "loaned_parts": loaned,
        "copied_parts": copied,
    }


#: Copies each reader times for the floor of a fresh tensor row.
FLOOR_COPIES = 5


def _floor_phase(barrier: Any, measure: Optional[Callable[[], None]] = None) -> list[int]:
    """The floor of a fresh row, after its measured messages, in the same processes: every
    reader at once (as in the row) times ``FLOOR_COPIES`` of ``measure`` (a copy of the
    row's bytes into its own buffer: what a reader of the row must do at the least),
    between two barriers that the writer joins without copying."""
    _sync(barrier)
    times = []
    if measure is not None:
        for _ in range(FLOOR_COPIES):
            t = now_ns()
            measure()
            times.append(now_ns() - t)
    _sync(barrier)
    return times


def _role_tensor_reader(
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    *,
    n: int,
    warmup: int,
    nbytes: int,
    rank: int,
    fresh: bool,
    lib: str = "torch",
) -> dict[str, Any]:
    """Receive what :func:`_role_tensor_writer` sends: ``warmup`` messages, a barrier,
    then ``n`` more. ``fresh``: what a consumer does, copy every byte of each into its
    own buffer (made, and its pages touched, before the clock) and check the message's
    number at both ends; hand-over only: read each one's last element. Returns when the
    last measured message was taken (``t_end``, ``now_ns``) and, for a fresh row, the
    times of its copies of the row's bytes from its own memory (``floor_ns``)."""
    arrays = Arrays(lib)  # its library imported (and torch's threads at 1) before the clock
    inbox = transport.open_reader(channels[0], rank)
    own = arrays.full(nbytes // 4, -1.0) if fresh else None
    inbox.ready()
    _sync(barrier)
    recv, copy, check, who = inbox.io, arrays.copy, arrays.check, f"reader {rank}"

    def take(i: int) -> None:
        if own is None:
            float(recv()[-1])
            beat()
            return
        got = recv()
        copy(own, got)
        del got
        check(own, float(i), who)
        beat()

    for i in range(warmup):
        take(i)
    _sync(barrier)
    for i in range(warmup, warmup + n):
        take(i)
    t_end = now_ns()
    if recv() is not None:
        raise RuntimeError(f"reader {rank} expected the end mark")
    _sync(barrier)
    floor_ns: list[int] = []
    if own is not None:
        # The floor: the same bytes copied by this process from memory of its own (made
        # and touched first) into the same buffer, every reader at once.
        source = arrays.full(nbytes // 4, 1.0)
        floor_ns = _floor_phase(barrier, functools.partial(copy, own, source))
        del source
    inbox.close()
    return {"t_end": t_end, "floor_ns": floor_ns}


class _Mapping:
    """A float32 array over a file (in ``/dev/shm``) that stays mapped (``MAP_SHARED``)
    for the whole run: the persistent mapping a received view is compared with."""

    def __init__(self, arrays: Arrays, path: str, nbytes: int):
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array: Any = arrays.from_buffer(self.mm)

    def close(self) -> None:
        del self.array  # the buffer export goes first, then the mapping can close
        self.mm.close()


def _role_consume_writer(
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    *,
    n: int,
    warmup: int,
    nbytes: int,
    path: str,
    lib: str = "torch",
) -> int:
    """For :func:`_role_consume_reader`: per message, a new array filled with ``i`` and
    the same ``i`` written over the persistent mapping ``path`` (so both were just
    written by this process), then wait at a barrier until the reader has consumed both
    (lockstep: nothing else runs while the reader is timed)."""
    arrays = Arrays(lib)
    out = transport.open_writer(channels[0])
    mapping = _Mapping(arrays, path, nbytes)
    out.ready()
    _sync(barrier)
    for i in range(warmup + n):
        t = arrays.full(nbytes // 4, float(i))
        arrays.fill(mapping.array, float(i))
        out.io(t)
        del t
        _sync(barrier)
    out.io(None)
    _sync(barrier)
    mapping.close()
    out.close()
    return warmup + n


def _role_consume_reader(
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    *,
    n: int,
    warmup: int,
    nbytes: int,
    path: str,
    lib: str = "torch",
) -> dict:
    """Per message: the time to copy every byte of the received array into this
    reader's own buffer, and of the persistent mapping of the same size (the limit: a
    mapping whose page tables stay), in alternating order. Returns both lists (ns)."""
    arrays = Arrays(lib)
    inbox = transport.open_reader(channels[0], 0)
    mapping = _Mapping(arrays, path, nbytes)
    own = arrays.full(nbytes // 4, -1.0)
    inbox.ready()
    _sync(barrier)
    recv, copy, check, clock = inbox.io, arrays.copy, arrays.check, time.perf_counter_ns
    view_ns, mapping_ns = [], []
    for i in range(warmup + n):
        got = recv()
        times = {}
        for source in ("view", "mapping") if i % 2 == 0 else ("mapping", "view"):
            t0 = clock()
            copy(own, got if source == "view" else mapping.array)
            times[source] = clock() - t0
            check(own, float(i), f"the reader ({source})")
        del got
        if i >= warmup:
            view_ns.append(times["view"])
            mapping_ns.append(times["mapping"])
        _sync(barrier)
    if recv() is not None:
        raise RuntimeError("the consume reader expected the end mark")
    _sync(barrier)
    mapping.close()
    inbox.close()
    return {"view_ns": view_ns, "mapping_ns": mapping_ns}


def _stack_file(workdir: str, pid: int) -> str:
    return os.path.join(workdir, f"{pid}.stack")


def _child_main(
    index: int,
    role: Callable,
    transport: Transport,
    channels: Sequence[Any],
    barrier: Any,
    results: Any,
    kwargs: dict,
    workdir: str,
    beats: Any = None,
) -> None:
    """Entry point of every child: run ``role`` and report ``(index, ok, value)``,
    beating ``beats[index]`` as it goes (:func:`beat`). SIGUSR1 writes the child's
    Python stack to a file in ``workdir`` (the parent asks for it when a run hangs)."""
    global _beats, _beat_index
    _beats, _beat_index = beats, index
    beat()  # started (spawned, its modules imported)
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

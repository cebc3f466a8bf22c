"""What the Python tests run in other processes, and the tools to run it.

Children are started with the multiprocessing "spawn" context, which pickles a child's
target by reference: every child entry point therefore lives at module level here
(``conftest.py`` cannot be imported by a child). A child reports to the test through a
``multiprocessing`` queue: one ``(tag, ...)`` tuple per report, or
``("error", pid, traceback)`` if it raised, so a failure inside a child shows up in the
test with the child's traceback instead of as a bare exit code.

Every blocking call a child makes has a timeout (``STEP``), so a broken queue fails the
test instead of hanging it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import re
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import numpy as np

from shmq import Handle, MessageQueue, ShmRingBuffer

CTX = mp.get_context("spawn")

# Bound on any one blocking call (enqueue, dequeue, ready, a report); generous, because
# it only turns a hang into a failure and the machine may be busy.
STEP = 30.0

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shmq_"
# shmq names its segments shmq_<kind>_<creator pid>_<random>.
_SEGMENT_NAME = re.compile(r"^shmq_[a-z]+_(\d+)_[0-9a-f]+$")

# Pids of every child process the tests started (the leftover check needs them: a
# segment's name carries its creator's pid).
CHILD_PIDS: set[int] = set()


# ---------------------------------------------------------------------------------
# /dev/shm


def shm_segments() -> set[str]:
    """Names of shmq segments currently in /dev/shm (from any process)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX)}
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return set()


def segment_creator_pid(name: str) -> int | None:
    m = _SEGMENT_NAME.match(name)
    return int(m.group(1)) if m else None


def segments_of(pids: set[int]) -> set[str]:
    """shmq segments in /dev/shm created by one of ``pids``."""
    return {n for n in shm_segments() if segment_creator_pid(n) in pids}


# ---------------------------------------------------------------------------------
# Running children


def _child_main(target: Callable[..., None], out: Any, args: tuple) -> None:
    """Entry point of every child: run ``target(out, *args)``, report an exception."""
    try:
        target(out, *args)
    except BaseException:
        out.put(("error", os.getpid(), traceback.format_exc()))
        out.close()
        out.join_thread()
        sys.exit(1)


class ChildFailed(AssertionError):
    pass


class Children:
    """The child processes of one test; ``close()`` joins them and kills stragglers."""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.queues: list[Any] = []

    def queue(self) -> Any:
        q = CTX.Queue()
        self.queues.append(q)
        return q

    def event(self) -> Any:
        return CTX.Event()

    def start(self, target: Callable[..., None], out: Any, *args: Any) -> mp.process.BaseProcess:
        p = CTX.Process(target=_child_main, args=(target, out, args), daemon=True)
        p.start()
        CHILD_PIDS.add(p.pid)
        self.procs.append(p)
        return p

    @staticmethod
    def receive(out: Any, timeout: float = STEP) -> tuple:
        """The next report on ``out``; a child's exception becomes a test failure."""
        try:
            msg = out.get(timeout=timeout)
        except queue.Empty:
            raise ChildFailed(f"no report from the child process(es) within {timeout} s") from None
        if msg[0] == "error":
            raise ChildFailed(f"child process {msg[1]} failed:\n{msg[2]}")
        return msg

    def expect(self, out: Any, tag: str, timeout: float = STEP) -> tuple:
        msg = self.receive(out, timeout)
        assert msg[0] == tag, f"expected a {tag!r} report, got {msg!r:.500}"
        return msg

    def exit_codes(self, timeout: float = STEP) -> dict[int, int | None]:
        """Wait for every child to exit; their exit codes by pid (None: still running)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return {p.pid: p.exitcode for p in self.procs}

    def join(self, timeout: float = STEP) -> None:
        """Wait for every child to exit and check that each exited cleanly."""
        codes = self.exit_codes(timeout)
        assert all(c == 0 for c in codes.values()), f"child exit codes (pid: code): {codes}"

    def close(self) -> None:
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in self.queues:
            q.close()
            q.cancel_join_thread()


# ---------------------------------------------------------------------------------
# Test objects: a deterministic stream, exact comparison, digest


_DTYPES = [
    "float64",
    "float32",
    "float16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint64",
    "bool",
    "complex64",
    "complex128",
    ">i4",  # non-native byte order must survive too
]
_KEYS = ["input_ids", "positions", "kv", "meta", "scheduler", "a", "b", "c", "é", "日本"]


def _random_array(rnd: random.Random, rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    """An array of ``lo..hi`` bytes (a zero-size one when ``hi`` is 0)."""
    dtype = np.dtype(rnd.choice(_DTYPES))
    n = rnd.randint(lo, hi) // dtype.itemsize
    ndim = rnd.randint(1, 3)
    if n == 0:
        shape = tuple([0] + [rnd.randint(1, 4) for _ in range(ndim - 1)])
    else:
        shape = [n]
        if ndim >= 2:
            for d in (2, 3, 4, 5, 7):
                if n % d == 0:
                    shape = [n // d, d]
                    break
        if ndim == 3 and len(shape) == 2 and shape[0] % 2 == 0:
            shape = [2, shape[0] // 2, shape[1]]
        shape = tuple(shape)
    size = int(np.prod(shape))
    if dtype.kind == "b":
        a = rng.integers(0, 2, size=size).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size=size, dtype=dtype.newbyteorder("="), endpoint=True)
    elif dtype.kind == "f":
        a = rng.standard_normal(size) * 1000
    else:
        a = rng.standard_normal(size) + 1j * rng.standard_normal(size)
    a = a.astype(dtype).reshape(shape)
    if a.ndim == 2 and rnd.random() < 0.3:
        a = np.asfortranarray(a)
    return a


def _random_str(rnd: random.Random, n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 _-éüß日本語🙂\n\t\\\"'"
    return "".join(rnd.choice(alphabet) for _ in range(n))


def _random_leaf(rnd: random.Random, rng: np.random.Generator) -> Any:
    k = rnd.randrange(9)
    if k == 0:
        return None
    if k == 1:
        return rnd.randint(-(2**70), 2**70)
    if k == 2:
        return rnd.uniform(-1e9, 1e9)
    if k == 3:
        return _random_str(rnd, rnd.randint(0, 40))
    if k == 4:
        return rnd.randbytes(rnd.randint(0, 64))
    if k == 5:
        return rnd.random() < 0.5
    if k == 6:
        return np.float32(rnd.uniform(-10, 10))
    if k == 7:
        return _random_array(rnd, rng, 0, 256)
    return (rnd.randint(0, 9), _random_str(rnd, 3))


def _random_nested(rnd: random.Random, rng: np.random.Generator, depth: int) -> Any:
    if depth == 0 or rnd.random() < 0.3:
        return _random_leaf(rnd, rng)
    if rnd.random() < 0.5:
        return [_random_nested(rnd, rng, depth - 1) for _ in range(rnd.randint(0, 5))]
    return {
        rnd.choice(_KEYS) + str(i): _random_nested(rnd, rng, depth - 1) for i in range(rnd.randint(0, 5))
    }


def iter_objects(seed: int, n: int, big: int = 64 * 1024) -> Iterator[Any]:
    """A deterministic stream of ``n`` objects of mixed types; about one in eight is
    larger than ``big`` bytes once pickled. Writer and readers each regenerate it from
    ``seed``, so a reader knows exactly what its ``i``-th object must be."""
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    for _ in range(n):
        k = rnd.randrange(16)
        if k == 0:
            yield None
        elif k == 1:
            yield _random_str(rnd, rnd.randint(0, 2000))
        elif k == 2:
            yield rnd.randbytes(rnd.randint(0, 4000))
        elif k in (3, 4, 5):
            yield _random_array(rnd, rng, 0, 16 * 1024)
        elif k in (6, 7, 8):
            yield _random_nested(rnd, rng, 4)
        elif k in (9, 10):
            yield {
                "step": rnd.randint(0, 10**6),
                "tokens": [rnd.randint(0, 50_000) for _ in range(rnd.randint(0, 300))],
                "hidden": _random_array(rnd, rng, 1, 8 * 1024),
                "prompt": _random_str(rnd, rnd.randint(0, 200)),
            }
        elif k == 11:
            yield rnd.randint(-(2**40), 2**40)
        elif k == 12:
            yield _random_array(rnd, rng, big + 1, 4 * big)  # overflows a chunk
        elif k == 13:
            yield rnd.randbytes(rnd.randint(big + 1, 3 * big))  # overflows a chunk
        elif k == 14:
            yield [_random_array(rnd, rng, 1, big // 2), _random_str(rnd, rnd.randint(big // 4, big))]
        else:
            yield (rnd.random(), _random_leaf(rnd, rng))


def same(a: Any, b: Any) -> bool:
    """Exact equality: same types all the way down; arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (float, np.floating)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def describe(obj: Any) -> str:
    if isinstance(obj, np.ndarray):
        return f"ndarray(dtype={obj.dtype}, shape={obj.shape})"
    return f"{type(obj).__name__}: {obj!r:.120}"


def digest_update(h: Any, obj: Any) -> None:
    """Feed a canonical encoding of ``obj`` (type, structure, exact values) into ``h``."""
    h.update(type(obj).__name__.encode() + b"\0")
    if isinstance(obj, np.ndarray):
        h.update(f"{obj.dtype.str}{obj.shape}".encode())
        h.update(obj.tobytes())
    elif isinstance(obj, dict):
        h.update(str(len(obj)).encode() + b"{")
        for k, v in obj.items():
            digest_update(h, k)
            digest_update(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(str(len(obj)).encode() + b"[")
        for v in obj:
            digest_update(h, v)
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        h.update(str(len(data)).encode() + b":" + data)
    elif isinstance(obj, bytes):
        h.update(str(len(obj)).encode() + b":" + obj)
    else:
        h.update(repr(obj).encode())
    h.update(b";")


# ---------------------------------------------------------------------------------
# Child entry points (each takes the report queue first)


def stream_reader(out: Any, handle: Handle, rank: int, seed: int, n: int, big: int) -> None:
    """Join as reader ``rank``, dequeue ``n`` objects and check each against the stream;
    then check that nothing more arrives."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("done", {"rank": rank, **read_stream(mq, seed, n, big)}))


def read_stream(mq: MessageQueue, seed: int, n: int, big: int) -> dict[str, Any]:
    """Dequeue ``n`` objects, check each against the stream, then check that nothing
    more arrives; the findings as a report dict."""
    h = hashlib.sha256()
    mismatches: list[tuple[int, str, str]] = []
    n_mismatch = 0
    count = 0
    for i, expected in enumerate(iter_objects(seed, n, big)):
        obj = mq.dequeue(timeout=STEP)
        count += 1
        digest_update(h, obj)
        if not same(obj, expected):
            n_mismatch += 1
            if len(mismatches) < 5:
                mismatches.append((i, describe(obj), describe(expected)))
    try:
        extra = describe(mq.dequeue(timeout=0.3))
    except TimeoutError:
        extra = None
    # `_is_local_reader` and `local_reader_rank` are the engines' attribute names.
    return {
        "local": mq._is_local_reader,
        "local_reader_rank": mq.local_reader_rank if mq._is_local_reader else None,
        "count": count,
        "n_mismatch": n_mismatch,
        "mismatches": mismatches,
        "digest": h.hexdigest(),
        "extra": extra,
    }


def handle_roundtrip_reader(out: Any, handle_pickle: bytes, rank: int, n: int) -> None:
    """Unpickle a Handle, send it back pickled, and read ``n`` messages through it."""
    import pickle

    handle = pickle.loads(handle_pickle)
    assert type(handle) is Handle, type(handle)
    out.put(("handle", pickle.dumps(handle)))
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("got", [mq.dequeue(timeout=STEP) for _ in range(n)]))


def ring_buffer_peer(out: Any, ring_pickle: bytes, pattern: bytes, reply: bytes) -> None:
    """Unpickle a ShmRingBuffer, report what the parent wrote to chunk 1, and write
    ``reply`` and flags to chunk 2."""
    import pickle

    buf = pickle.loads(ring_pickle)
    assert isinstance(buf, ShmRingBuffer), type(buf)
    with buf.get_data(1) as data:
        seen = bytes(data[: len(pattern)])
        data_len = len(data)
    with buf.get_metadata(1) as meta:
        seen_meta = bytes(meta)
    with buf.get_data(2) as data:
        data[: len(reply)] = reply
    with buf.get_metadata(2) as meta:
        meta[:] = bytes([1] + [1] * (len(meta) - 1))
    out.put(
        (
            "seen",
            {
                "handle": buf.handle(),
                "is_creator": buf.is_creator,
                "data": seen,
                "data_len": data_len,
                "metadata": seen_meta,
            },
        )
    )


def missing_ring_user(out: Any, ring_pickle: bytes) -> None:
    """Unpickle a ShmRingBuffer whose segment does not exist here and try to use it."""
    import pickle

    buf = pickle.loads(ring_pickle)
    outcome = {"handle": buf.handle()}
    for what in ("get_data", "get_metadata"):
        try:
            with getattr(buf, what)(0):
                pass
        except BaseException as e:
            outcome[what] = (type(e).__name__, str(e))
        else:
            outcome[what] = None
    out.put(("missing", outcome))


def idle_reader(out: Any, handle: Handle, rank: int, go: Any, n: int) -> None:
    """Get ready, then read nothing until ``go`` is set; then read ``n`` messages and
    check that no further one arrives."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    if not go.wait(STEP):
        raise TimeoutError("the test never set go")
    got = [mq.dequeue(timeout=STEP) for _ in range(n)]
    try:
        extra = mq.dequeue(timeout=0.3)
    except TimeoutError:
        extra = None
    out.put(("got", got, extra))


def timeout_reader(out: Any, handle: Handle, rank: int) -> None:
    """dequeue(timeout=0.2) with nothing sent must raise TimeoutError; the reader must
    still work afterwards."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    t0 = time.monotonic()
    try:
        obj = mq.dequeue(timeout=0.2)
    except BaseException as e:
        outcome = (type(e).__name__, str(e))
    else:
        outcome = ("returned", describe(obj))
    out.put(("timeout", outcome, time.monotonic() - t0))
    out.put(("got", mq.dequeue(timeout=STEP)))


def cancel_reader(out: Any, handle: Handle, rank: int, how: str) -> None:
    """Block in dequeue and end it from another thread: ``how`` is "event" (a
    threading.Event passed as ``cancel``), "event-indefinite" (the same with
    ``indefinite=True``) or "shutdown" (``mq.shutdown()``)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    ev = threading.Event()
    fired_at: list[float] = []

    def fire() -> None:
        time.sleep(0.3)
        fired_at.append(time.monotonic())
        if how == "shutdown":
            mq.shutdown()
        else:
            ev.set()

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        if how == "shutdown":
            obj = mq.dequeue(timeout=STEP)
        else:
            obj = mq.dequeue(timeout=STEP, cancel=ev, indefinite=how == "event-indefinite")
    except BaseException as e:
        outcome = (type(e).__name__, str(e))
    else:
        outcome = ("returned", describe(obj))
    ended = time.monotonic()
    t.join(STEP)
    out.put(
        (
            "cancel",
            {
                "outcome": outcome,
                "blocked_for": ended - t0,
                "wake_latency": ended - fired_at[0] if fired_at else None,
                "shutting_down": mq.shutting_down,
            },
        )
    )
    if how != "shutdown":
        # A cancelled dequeue loses nothing: the next message still arrives.
        out.put(("got", mq.dequeue(timeout=STEP)))


def zero_copy_reader(out: Any, handle: Handle, rank: int, commands: Any) -> None:
    """Obey ("read", nbytes) / "release" / "exit" commands: report the first nbytes of
    the chunk from acquire_read while still inside it, leave it on "release"."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready", rank))
    while True:
        cmd = commands.get(timeout=STEP)
        if cmd == "exit":
            break
        _, nbytes = cmd
        with mq.acquire_read(timeout=STEP) as buf:
            out.put(("inside", rank, bytes(buf[:nbytes]), len(buf)))
            cmd = commands.get(timeout=STEP)
            assert cmd == "release", cmd
        out.put(("done", rank))


def broadcast_reader(out: Any, handle: Handle, rank: int, n: int) -> None:
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("got", rank, [mq.broadcast_object() for _ in range(n)]))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def warning_reader(out: Any, handle: Handle, rank: int, env: dict[str, str]) -> None:
    """With ``env`` set in this process, report what Python logging receives during a
    dequeue(timeout=1) with nothing sent, then during one with indefinite=True."""
    os.environ.update(env)  # before this process's first wait: the interval is read once
    capture = _Records()
    logging.getLogger().addHandler(capture)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    results = {}
    for label, kwargs in (("plain", {}), ("indefinite", {"indefinite": True})):
        capture.records.clear()
        t0 = time.monotonic()
        try:
            mq.dequeue(timeout=1.0, **kwargs)
        except TimeoutError:
            outcome = "TimeoutError"
        else:
            outcome = "returned"
        results[label] = {"outcome": outcome, "elapsed": time.monotonic() - t0, "records": list(capture.records)}
    out.put(("log", results))


def warning_writer(out: Any, env: dict[str, str]) -> None:
    """With ``env`` set in this process, report what Python logging receives while the
    writer waits (timeout=1) for a chunk that no reader frees."""
    os.environ.update(env)
    capture = _Records()
    logging.getLogger().addHandler(capture)
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=1)
    mq.enqueue("fills the only chunk", timeout=STEP)
    t0 = time.monotonic()
    try:
        mq.enqueue("waits for a reader", timeout=1.0)
    except TimeoutError:
        outcome = "TimeoutError"
    else:
        outcome = "returned"
    out.put(("log", {"outcome": outcome, "elapsed": time.monotonic() - t0, "records": list(capture.records)}))


def killed_reader(out: Any, handle: Handle, rank: int) -> None:
    """Get ready, then sleep until killed."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready", rank))
    time.sleep(STEP)
    del mq


# ---------------------------------------------------------------------------------
# Child entry points of test_liveness.py (idle CPU, dead peers, env wait policy)


def _cpu_seconds() -> float:
    """CPU time (user + system) this process has used so far, all threads."""
    t = os.times()
    return t.user + t.system


def idle_cpu_reader(out: Any, handle: Handle, rank: int) -> None:
    """Report the CPU this reader uses while blocked in dequeue(timeout=3) with nothing
    sent ("idle"), then while blocked until the writer sends one message ("late"; the
    test sends it about 2 s after the "waiting" report)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready",))
    w0, c0 = time.monotonic(), _cpu_seconds()
    try:
        obj = mq.dequeue(timeout=3.0)
    except BaseException as e:
        outcome = (type(e).__name__, str(e))
    else:
        outcome = ("returned", describe(obj))
    out.put(("idle", outcome, _cpu_seconds() - c0, time.monotonic() - w0))
    out.put(("waiting", time.monotonic()))
    w0, c0 = time.monotonic(), _cpu_seconds()
    obj = mq.dequeue(timeout=STEP)
    received = time.monotonic()
    out.put(("late", obj, received, _cpu_seconds() - c0, received - w0))


def sequence_reader(out: Any, handle: Handle, rank: int, stop: Any, delay: float, report_after: int) -> None:
    """Read until a ``None`` message, or until ``stop`` is set and nothing more comes;
    sleep ``delay`` s after each message; after ``report_after`` messages report
    ("progress", rank, count). Reports ("got", rank, messages) at the end."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    out.put(("ready", rank))
    got: list[Any] = []
    last = time.monotonic()
    while True:
        try:
            obj = mq.dequeue(timeout=0.2)
        except TimeoutError:
            if stop is not None and stop.is_set():
                break
            if time.monotonic() - last > STEP:
                raise TimeoutError(f"reader {rank}: nothing for {STEP} s after {len(got)} messages") from None
            continue
        last = time.monotonic()
        if obj is None:
            break
        got.append(obj)
        if len(got) == report_after:
            out.put(("progress", rank, len(got)))
        if delay:
            time.sleep(delay)
    out.put(("got", rank, got))


def doomed_writer(out: Any, n_messages: int) -> None:
    """Create a queue with one local reader, report its handle, send ``n_messages``
    messages, report "sent", then sleep until killed."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=4)
    out.put(("handle", mq.export_handle()))
    mq.wait_until_ready(timeout=STEP)
    for i in range(n_messages):
        mq.enqueue(i, timeout=STEP)
    out.put(("sent",))
    time.sleep(STEP)
    del mq


def orphan_reader(out: Any, handle: Handle, rank: int, n_messages: int, spin_us: Any, yield_us: Any) -> None:
    """Read ``n_messages`` messages, report "waiting", then block in dequeue() with no
    timeout until something ends it; report how it ended and when."""
    mq = MessageQueue.create_from_handle(handle, rank, spin_us=spin_us, yield_us=yield_us)
    mq.wait_until_ready(timeout=STEP)
    got = [mq.dequeue(timeout=STEP) for _ in range(n_messages)]
    out.put(("waiting", got))
    import shmq

    try:
        obj = mq.dequeue()
    except BaseException as e:
        outcome = {
            "type": type(e).__name__,
            "message": str(e),
            "is_peer_died": isinstance(e, shmq.PeerDiedError),
            "is_runtime_error": isinstance(e, RuntimeError),
        }
    else:
        outcome = {"type": "returned", "message": describe(obj)}
    out.put(("ended", outcome, time.monotonic()))


def segment_creator(out: Any) -> None:
    """Create a queue (and so a segment), report its handle, sleep until killed."""
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    out.put(("handle", mq.export_handle()))
    time.sleep(STEP)
    del mq


def _thread_busy_seconds() -> float:
    """Time the calling thread has been running or waiting to run (not sleeping): CPU
    time plus run-queue delay from /proc/thread-self/schedstat, which unlike CPU time
    does not shrink when other processes load the machine. CPU time where schedstat is
    missing."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, run_delay = f.read().split()[:2]
    except (OSError, ValueError):
        return time.thread_time()
    return (int(on_cpu) + int(run_delay)) / 1e9


def env_policy_reader(out: Any, handle: Handle, env: dict[str, str], ranks: tuple[int, int]) -> None:
    """With ``env`` set in this process before its first queue, open reader ``ranks[0]``
    with the default wait policy and reader ``ranks[1]`` with spin_us=0, yield_us=0;
    report how long the calling thread is busy (running or runnable, see
    ``_thread_busy_seconds``) in a dequeue(timeout=0.4) with nothing sent, then read
    one message with each."""
    os.environ.update(env)  # before this process's first wait: the defaults are read once
    by_env = MessageQueue.create_from_handle(handle, ranks[0])
    explicit = MessageQueue.create_from_handle(handle, ranks[1], spin_us=0, yield_us=0)
    by_env.wait_until_ready(timeout=STEP)
    explicit.wait_until_ready(timeout=STEP)
    cpu = {}
    for label, mq in (("env", by_env), ("explicit", explicit)):
        b0, w0 = _thread_busy_seconds(), time.monotonic()
        try:
            mq.dequeue(timeout=0.4)
        except TimeoutError:
            outcome = "TimeoutError"
        else:
            outcome = "returned"
        cpu[label] = (outcome, _thread_busy_seconds() - b0, time.monotonic() - w0)
    out.put(("busy", cpu))
    out.put(("got", by_env.dequeue(timeout=STEP), explicit.dequeue(timeout=STEP)))


# ---------------------------------------------------------------------------------
# Child entry points of test_group.py (StatelessProcessGroup, create_from_process_group)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(kind: str, port: int, rank: int, world_size: int) -> Any:
    """Join a ``world_size``-process group on 127.0.0.1:``port``: torch's default
    process group over gloo (``kind == "gloo"``) or a StatelessProcessGroup."""
    if kind == "gloo":
        import datetime

        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=2 * STEP),
        )
        return dist.group.WORLD
    from shmq import StatelessProcessGroup

    return StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=int(2 * STEP))


def _only_the_writer_is_local(pg: Any, source_rank: int = 0) -> list[bool]:
    """Stand-in for ``shmq.group.in_the_same_node_as`` that reports every rank but
    ``source_rank`` as on another machine (without any collective)."""
    from shmq.group import _Ops

    return [r == source_rank for r in range(_Ops(pg).world_size)]


def group_queue_member(
    out: Any,
    kind: str,
    port: int,
    rank: int,
    world_size: int,
    subgroup: Any,
    writer_rank: int,
    plan: list,
    big: int,
    max_chunks: int,
    remote: bool,
    release: Any,
) -> None:
    """One process of a ``kind`` group ("gloo" or "stateless") of ``world_size``.

    ``subgroup``: None, or the world ranks of a ``torch.distributed.new_group`` that the
    queues are made on (world ranks outside it only create the subgroup). For each
    ``(seed, n)`` of ``plan``, in turn: ``MessageQueue.create_from_process_group`` with
    ``writer_rank`` (a group rank); the writer sends the ``iter_objects(seed, n, big)``
    stream and reports ("sent", ...); each reader checks it and reports ("done", ...).
    ``remote``: replace same-machine detection so that every reader is remote and the
    writer publishes on 127.0.0.1. Every queue is kept until ``release`` is set."""
    import shmq.group

    if remote:
        os.environ["SHMQ_HOST_IP"] = "127.0.0.1"
        shmq.group.in_the_same_node_as = _only_the_writer_is_local
    pg = _join_group(kind, port, rank, world_size)
    group_rank = rank
    if subgroup is not None:
        import torch.distributed as dist

        pg = dist.new_group(list(subgroup))  # collective over the whole world
        group_rank = dist.get_rank(pg)  # -1 outside the subgroup
    queues = []
    if group_rank >= 0:
        for qi, (seed, n) in enumerate(plan):
            mq = MessageQueue.create_from_process_group(pg, big, max_chunks, writer_rank=writer_rank)
            queues.append(mq)
            if group_rank == writer_rank:
                for obj in iter_objects(seed, n, big):
                    mq.enqueue(obj, timeout=STEP)
                handle = mq.export_handle()
                out.put(
                    (
                        "sent",
                        {
                            "queue": qi,
                            "rank": rank,
                            "group_rank": group_rank,
                            "local_reader_ranks": list(handle.local_reader_ranks),
                            "remote_subscribe_addr": handle.remote_subscribe_addr,
                            "n_local_reader": mq.n_local_reader,
                            "n_remote_reader": mq.n_remote_reader,
                        },
                    )
                )
                continue
            report = {"queue": qi, "rank": rank, "group_rank": group_rank, **read_stream(mq, seed, n, big)}
            out.put(("done", report))
    else:
        out.put(("outside", rank))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")
    del queues
    if kind == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


def stateless_ops_member(out: Any, port: int, rank: int, world_size: int, release: Any) -> None:
    """Exercise StatelessProcessGroup's send/recv, broadcast, all_gather and barrier
    (including a barrier that times out because the last rank stays away) and report
    what this rank saw."""
    from shmq import StatelessProcessGroup

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=int(STEP))
    seen: dict[str, Any] = {"rank": pg.rank, "world_size": pg.world_size}

    # send/recv: three messages to every other rank, received in order per source.
    for dst in range(world_size):
        if dst != rank:
            for i in range(3):
                pg.send_obj((rank, dst, i, np.arange(i + rank, dtype=np.int64)), dst=dst)
    received = {}
    for src in reversed(range(world_size)):
        if src != rank:
            got = [pg.recv_obj(src) for _ in range(3)]
            received[src] = [(s, d, i, a.tolist()) for s, d, i, a in got]
    seen["received"] = received

    # broadcast from every rank in turn, then all_gather.
    seen["broadcast"] = [
        pg.broadcast_obj({"from": src, "payload": "x" * src} if rank == src else None, src=src)
        for src in range(world_size)
    ]
    seen["all_gather"] = pg.all_gather_obj(("rank", rank, [rank] * rank))

    t0 = time.monotonic()
    pg.barrier(timeout=STEP)
    seen["barrier_s"] = time.monotonic() - t0

    # The last rank stays away from the next barrier until the others have timed out.
    last = world_size - 1
    if rank != last:
        t0 = time.monotonic()
        try:
            pg.barrier(timeout=1.0)
        except RuntimeError as e:
            seen["timeout"] = ("RuntimeError", str(e), time.monotonic() - t0)
        else:
            seen["timeout"] = ("returned", "", time.monotonic() - t0)
        pg.store.set(f"test/timed_out/{rank}", b"1")
    else:
        pg.store.wait([f"test/timed_out/{r}" for r in range(last)])
        pg.barrier(timeout=STEP)  # late: the others' arrival keys are still there
    pg.barrier(timeout=STEP)  # and everyone is in step again
    out.put(("seen", seen))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")


def stateless_expiry_member(out: Any, port: int, rank: int, expiration: float, release: Any) -> None:
    """Two ranks: rank 0 sends, rank 1 receives; after ``expiration`` s rank 0's
    expire_data() must delete the old entry and keep a fresh one."""
    from shmq import StatelessProcessGroup

    pg = StatelessProcessGroup.create(
        "127.0.0.1", port, rank, 2, data_expiration_seconds=expiration, store_timeout=int(STEP)
    )
    report: dict[str, Any] = {"data_expiration_seconds": pg.data_expiration_seconds}
    old_key = "send_to/1/from/0/0"
    new_key = "send_to/1/from/0/1"
    if rank == 0:
        pg.send_obj("old", dst=1)
        report["old_before"] = pg.store.check([old_key])
        pg.barrier(timeout=STEP)  # rank 1 has received "old"
        time.sleep(expiration + 0.5)
        pg.expire_data()
        report["old_after_expire"] = pg.store.check([old_key])
        pg.send_obj("new", dst=1)  # send_obj expires too; "new" is fresh and stays
        pg.expire_data()
        report["new_after_expire"] = pg.store.check([new_key])
        report["entries"] = [key for key, _ in pg.entries]
        pg.barrier(timeout=STEP)
    else:
        report["got"] = [pg.recv_obj(0)]
        pg.barrier(timeout=STEP)
        pg.barrier(timeout=STEP)
        report["got"].append(pg.recv_obj(0))
    out.put(("expiry", rank, report))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")


def barrier_then_exit_member(out: Any, port: int, rank: int, world_size: int, rounds: int) -> None:
    """Join a StatelessProcessGroup, pass ``rounds`` barriers, report, and exit at once:
    rank 0 hosts the store, so its barrier must not return before the others are done
    with the store."""
    from shmq import StatelessProcessGroup

    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=int(STEP))
    for _ in range(rounds):
        pg.barrier(timeout=STEP)
    out.put(("passed", rank))

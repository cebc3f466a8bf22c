"""Child processes of the window-view tests (``test_window_views.py``): readers that
write partial pages of many views from several threads, fork while holding views,
view store objects and encoder-cache entries twice, or lock their memory.

Every received tensor is compared exactly with what was sent: an int32 ``arange`` plus
a base that tells messages and parts apart (``expected``), with the writes the reader
itself made applied. Every blocking call has a timeout (``STEP``).
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import random
import select
import threading
import time
import traceback
from typing import Any

import torch

from _processes import STEP
from shmq import EncoderCacheConsumer, Handle, MessageQueue, ObjectStorage

Writes = list[tuple[int, int, int]]


def expected(n: int, base: int, writes: Writes = ()) -> torch.Tensor:
    """What a part of ``n`` int32 elements sent with ``base`` holds, once ``writes``
    (``(start, count, value)``, in order) were made into it."""
    t = torch.arange(n, dtype=torch.int32) + base
    for k, m, v in writes:
        t[k : k + m] = v
    return t


def message_size(i: int) -> int:
    """Elements of message ``i``'s tensor: 1 MiB to ~1.4 MiB, most not whole pages."""
    return (1 << 18) + (i * 7919) % 100_003


def message_base(i: int) -> int:
    return i * 1_000_003


def _random_write(rng: random.Random, n: int) -> tuple[int, int]:
    """A partial-page write into ``n`` elements (1024 per 4 KiB page): a few elements,
    often across a page boundary, sometimes several pages."""
    m = rng.choice([1, 2, 3, 17, 700, 1024, 1500, 5000])
    m = min(m, n)
    if rng.random() < 0.6:
        k = rng.randrange(0, n, 1024) - rng.randint(0, min(m, 2))
    else:
        k = rng.randrange(n - m + 1)
    return max(0, min(k, n - m)), m


def mapping_span(address: int) -> tuple[int, int, str]:
    """``(start, end, path)`` of the mapping ``address`` lies in."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return start, end, fields[5].strip() if len(fields) == 6 else ""
    return 0, 0, "?"


# ---------------------------------------------------------------------------------
# Tensor queue: many views written from several threads


class _Held:
    __slots__ = ("i", "t", "writes")

    def __init__(self, i: int, t: torch.Tensor):
        self.i, self.t, self.writes = i, t, []

    def exact(self) -> bool:
        return bool(torch.equal(self.t, expected(self.t.numel(), message_base(self.i), self.writes)))


def threaded_reader(out: Any, handle: Handle, rank: int, n: int, seed: int, workers: int, keep: int) -> None:
    """Receive ``n`` messages ``{"i": i, "t": expected(message_size(i), message_base(i))}``,
    checking each exactly on arrival, and keep up to ``keep`` alive; ``workers`` threads
    take them in random order, write partial pages into them, check them exactly (their
    own writes and nothing else) and drop them in random order (a drop maps nothing back
    while the others write). Reports the failures and, per message, its address and the
    size and path of the mapping it lay in."""
    torch.set_num_threads(1)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    cond = threading.Condition()
    pool: list[_Held] = []
    alive = [0]
    done = [False]
    bad: list[tuple] = []
    errors: list[str] = []

    def drop(h: _Held) -> None:
        h.t = None  # the last reference: the view goes here, in this thread
        with cond:
            alive[0] -= 1
            cond.notify_all()

    def work(wseed: int) -> None:
        rng = random.Random(wseed)
        try:
            while True:
                with cond:
                    if not cond.wait_for(lambda: pool or done[0], 3 * STEP):
                        raise TimeoutError("a worker waited too long for a view")
                    if not pool:
                        return
                    h = pool.pop(rng.randrange(len(pool)))
                for _ in range(rng.randint(1, 4)):
                    k, m = _random_write(rng, h.t.numel())
                    v = -(h.i * 16 + rng.randint(1, 15))
                    h.t[k : k + m] = v
                    h.writes.append((k, m, v))
                if not h.exact():
                    bad.append(("after its writes", h.i, h.writes[-4:]))
                if done[0] or rng.random() < 0.5:
                    drop(h)
                else:
                    with cond:
                        pool.append(h)
                        cond.notify_all()
                del h
        except BaseException:
            errors.append(traceback.format_exc())
            with cond:
                cond.notify_all()  # the reader stops waiting for this worker

    threads = [threading.Thread(target=work, args=(seed * 100 + w,), daemon=True) for w in range(workers)]
    for th in threads:
        th.start()
    addresses = []
    try:
        for i in range(n):
            msg = mq.dequeue(timeout=STEP)
            if msg["i"] != i:
                raise AssertionError(f"message {msg['i']} came as message {i}")
            h = _Held(i, msg["t"])
            del msg
            if h.t.numel() != message_size(i) or not h.exact():
                bad.append(("on arrival", i, h.t.numel()))
            start, end, path = mapping_span(h.t.data_ptr())
            addresses.append((h.t.data_ptr(), end - start, path))
            with cond:
                if not cond.wait_for(lambda: alive[0] < keep or errors, STEP) or alive[0] >= keep:
                    raise TimeoutError(f"the workers kept {alive[0]} views: {errors}")
                alive[0] += 1
                pool.append(h)
                cond.notify_all()
            del h
    finally:
        with cond:
            done[0] = True
            cond.notify_all()
        for th in threads:
            th.join(STEP)
    gc.collect()
    out.put(("threaded", bad[:10], len(bad), errors, addresses))


# ---------------------------------------------------------------------------------
# Tensor queue: a reader that forks while it holds views


def _read_report(fd: int, timeout: float) -> Any:
    chunks = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("no report from the forked child")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return pickle.loads(b"".join(chunks))
        chunks.append(chunk)


def _segment_shows(address: int, n: int, base: int) -> bool:
    """Whether the window's bytes at ``address`` (a view dropped while its message is still
    held, so the segment still holds what was sent) show the segment, not old writes."""
    return ctypes.string_at(address, n * 4) == expected(n, base).numpy().tobytes()


def forking_reader(out: Any, handle: Handle, rank: int, na: int, nb: int) -> None:
    """Receive a message and write all of it (so this reader's pagemap descriptor is
    open and its pages were private copies once), drop it; then receive ``a`` and ``b``
    (placed where it was), write partial pages, and ``os.fork()``. Parent and child each
    write into their copies of both views after the fork, check that they see their own
    writes and nobody else's, drop them, and check that the window shows the segment
    again there. Then the parent receives two more messages into the same memory."""
    torch.set_num_threads(1)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    z = mq.dequeue(timeout=STEP)
    z_exact = bool(torch.equal(z, expected(na, 0)))
    z_ptr = z.data_ptr()
    z.fill_(-9)
    del z
    gc.collect()
    out.put(("z", z_exact, z_ptr))
    a = mq.dequeue(timeout=STEP)
    b = mq.dequeue(timeout=STEP)
    a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
    before = (bool(torch.equal(a, expected(na, 1_000_000))), bool(torch.equal(b, expected(nb, 2_000_000))))
    pre_a: Writes = [(0, 1, -1), (1023, 2, -1), (5000, 4000, -1), (na - 1, 1, -1)]
    pre_b: Writes = [(nb - 3, 3, -1), (4096, 1, -1)]
    for k, m, v in pre_a:
        a[k : k + m] = v
    for k, m, v in pre_b:
        b[k : k + m] = v
    go_r, go_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(go_w)
            os.close(rep_r)
            if not select.select([go_r], [], [], STEP)[0]:
                raise TimeoutError("no go from the parent")
            os.read(go_r, 1)
            res = {
                # The parent's writes after the fork do not show here.
                "a as forked": bool(torch.equal(a, expected(na, 1_000_000, pre_a))),
                "b as forked": bool(torch.equal(b, expected(nb, 2_000_000, pre_b))),
            }
            mine_a: Writes = [(1500, 2000, -3), (na - 5, 5, -3), (3 * 1024 + 1, 1, -3)]
            mine_b: Writes = [(0, 10, -3), (nb - 1, 1, -3)]
            for k, m, v in mine_a:
                a[k : k + m] = v
            for k, m, v in mine_b:
                b[k : k + m] = v
            res["a with the child's writes"] = bool(torch.equal(a, expected(na, 1_000_000, pre_a + mine_a)))
            res["b with the child's writes"] = bool(torch.equal(b, expected(nb, 2_000_000, pre_b + mine_b)))
            del a, b
            gc.collect()
            # The parent still holds both messages: the segment has what was sent.
            res["a's window range shows the segment"] = _segment_shows(a_ptr, na, 1_000_000)
            res["b's window range shows the segment"] = _segment_shows(b_ptr, nb, 2_000_000)
            os.write(rep_w, pickle.dumps(("ok", res)))
        except BaseException:
            os.write(rep_w, pickle.dumps(("error", traceback.format_exc())))
            code = 1
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(rep_w)
    mine_a = [(100, 100, -2), (3000, 100, -2), (na - 2, 1, -2)]
    mine_b = [(500, 1, -2), (nb - 1500, 1500, -2)]
    for k, m, v in mine_a:
        a[k : k + m] = v
    for k, m, v in mine_b:
        b[k : k + m] = v
    os.write(go_w, b"g")
    child = _read_report(rep_r, STEP)
    _, status = os.waitpid(pid, 0)
    parent = {
        "a with the parent's writes only": bool(torch.equal(a, expected(na, 1_000_000, pre_a + mine_a))),
        "b with the parent's writes only": bool(torch.equal(b, expected(nb, 2_000_000, pre_b + mine_b))),
    }
    del a, b
    gc.collect()
    # The writer waits for this report before it sends again: the segment still has a, b.
    parent["a's window range shows the segment"] = _segment_shows(a_ptr, na, 1_000_000)
    parent["b's window range shows the segment"] = _segment_shows(b_ptr, nb, 2_000_000)
    out.put(("forked", before, child, os.waitstatus_to_exitcode(status), parent, (z_ptr, a_ptr, b_ptr)))
    c = mq.dequeue(timeout=STEP)
    d = mq.dequeue(timeout=STEP)
    after = (bool(torch.equal(c, expected(na, 3_000_000))), bool(torch.equal(d, expected(nb, 4_000_000))))
    out.put(("after", after, (c.data_ptr(), d.data_ptr())))
    del c, d
    mq.dequeue(timeout=STEP)  # "bye"


# ---------------------------------------------------------------------------------
# Object store and encoder cache: views taken twice, partial writes, random drops


class _Parts:
    """Tensors a reader keeps by (tag, name), each with what was sent and its writes."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], list[Any]] = {}  # → [tensor, n, base, writes]

    def add(self, tag: str, obj: dict, spec: dict[str, tuple[int, int]]) -> tuple[bool, dict]:
        exact, where = True, {}
        for name, (n, base) in spec.items():
            t = obj[name]
            exact = exact and isinstance(t, torch.Tensor) and bool(torch.equal(t, expected(n, base)))
            self.held[(tag, name)] = [t, n, base, []]
            start, end, path = mapping_span(t.data_ptr())
            where[name] = (t.data_ptr(), end - start, path)
        return exact, where

    def write(self, tag: str, name: str, k: int, m: int, v: int) -> None:
        entry = self.held[(tag, name)]
        entry[0][k : k + m] = v
        entry[3].append((k, m, v))

    def drop(self, tag: str, name: str) -> None:
        del self.held[(tag, name)]
        gc.collect()

    def bad(self) -> list[tuple[str, str]]:
        """The kept tensors that do not hold exactly what was sent and their own writes."""
        return [key for key, (t, n, base, w) in self.held.items() if not bool(torch.equal(t, expected(n, base, w)))]


def _serve(out: Any, cmds: Any, load: Any) -> None:
    """Commands: ``("get", tag, spec, *args)`` → ``("got", tag, exact, where)`` (``load(*args)``
    gives the object: a dict of tensors); ``("write", tag, name, k, m, v)`` and
    ``("drop", tag, name)`` → ``("bad", [...])`` (every kept part checked); ``("stop",)``."""
    parts = _Parts()
    while True:
        cmd = cmds.get(timeout=STEP)
        op = cmd[0]
        if op == "stop":
            break
        if op == "get":
            tag, spec, *args = cmd[1:]
            obj = load(*args)
            exact, where = parts.add(tag, obj, spec)
            del obj
            out.put(("got", tag, exact, where))
        elif op == "write":
            parts.write(*cmd[1:])
            out.put(("bad", parts.bad()))
        elif op == "drop":
            parts.drop(*cmd[1:])
            out.put(("bad", parts.bad()))
        else:
            raise ValueError(f"unknown command {cmd!r}")
    parts.held.clear()
    gc.collect()
    out.put(("stopped",))


def store_window_reader(out: Any, handle_pickle: bytes, cmds: Any, signing_key: str) -> None:
    """A store reader serving ``_serve``'s commands; ``get`` takes ``(address, id)``."""
    torch.set_num_threads(1)
    store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
    out.put(("ready", os.getpid(), store.ring_buffer.shared_memory.name))

    def load(address: int, mid: int) -> Any:
        signature = list(store._make_signature(signing_key, address, mid))
        return store.get(address, mid, signature, signing_key)

    _serve(out, cmds, load)
    store = None  # drop it (and its views' owner) before the collection below
    gc.collect()


def ec_window_consumer(out: Any, names: list[str], cmds: Any) -> None:
    """An encoder-cache consumer serving ``_serve``'s commands; ``get`` takes a key."""
    torch.set_num_threads(1)
    consumer = EncoderCacheConsumer(names)
    out.put(("ready", os.getpid()))

    def load(key: str) -> Any:
        got: dict = {}
        missing = consumer.load([key], got)
        if missing:
            raise KeyError(key)
        return got[key]

    _serve(out, cmds, load)
    consumer.close()


# ---------------------------------------------------------------------------------
# Readers whose memory is locked (mlockall)


def locked_reader(out: Any, handle: Handle, rank: int, n: int, flags: int, keep: bool) -> None:
    """Call ``mlockall(flags)``, then read ``n`` tensors (message ``i`` is
    ``expected(MiB // 4, i * 1_000_003)``) one at a time, checking each exactly; unless
    ``keep``, overwrite each one and drop it before the next (so that the next lies in the
    same memory); with ``keep``, keep them all. Acks each; then reports what it saw."""
    libc = ctypes.CDLL(None, use_errno=True)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    if libc.mlockall(flags) != 0:
        raise OSError(ctypes.get_errno(), "mlockall")
    kept, seen = [], []
    try:
        for i in range(n):
            t = mq.dequeue(timeout=STEP)
            seen.append((bool(torch.equal(t, expected(t.numel(), i * 1_000_003))), t.data_ptr()))
            if keep:
                kept.append(t)
            else:
                t.fill_(-7)
            del t
            gc.collect()
            out.put(("ack",))
    finally:
        libc.munlockall()
    out.put(("seen", seen))
    kept.clear()

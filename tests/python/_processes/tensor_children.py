"""Child processes of the tensor tests (``test_tensors.py``), and the digest both sides
use to compare what was sent with what arrived, exactly (type, dtype, shape, bytes).

Each child reports through a multiprocessing queue (see ``_processes.Children``); every
blocking call has a timeout (``STEP``).
"""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import time
from typing import Any

import numpy as np
import torch

from _processes import STEP
from shmq import Handle, MessageQueue


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(obj: Any) -> Any:
    """A comparable summary of ``obj``: containers by structure, tensors and arrays by
    type, dtype, shape, flags and a hash of their bytes in logical order."""
    if isinstance(obj, torch.Tensor):
        return (
            type(obj).__name__,
            str(obj.dtype),
            tuple(obj.shape),
            obj.requires_grad,
            obj.device.type,
            hashlib.sha256(_tensor_bytes(obj)).hexdigest(),
        )
    if isinstance(obj, np.ndarray):
        # Read-only arrays arrive read-only (protocol 5's READONLY_BUFFER keeps the flag).
        # Memory order: a Fortran-ordered array arrives Fortran-ordered ("C" for every
        # other, a non-contiguous one included: it arrives as its contiguous copy).
        order = "F" if obj.flags.f_contiguous and not obj.flags.c_contiguous else "C"
        return (
            "ndarray",
            obj.dtype.str,
            str(obj.dtype),  # a user-defined dtype's .str is only "|V<size>"
            obj.shape,
            obj.flags.writeable,
            order,
            hashlib.sha256(obj.tobytes()).hexdigest(),
        )
    if isinstance(obj, dict):
        return ("dict", [(k, digest(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [digest(v) for v in obj])
    if isinstance(obj, (bytearray, memoryview, pickle.PickleBuffer)):
        return ("buffer", hashlib.sha256(bytes(memoryview(obj))).hexdigest())
    return (type(obj).__name__, repr(obj))


def tensors_in(obj: Any) -> list[Any]:
    """The tensors and arrays inside ``obj``."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def scribble(obj: Any) -> None:
    """Write into every received tensor and array (they must be writable, but for arrays
    sent read-only)."""
    for t in tensors_in(obj):
        if t.size == 0 if isinstance(t, np.ndarray) else t.numel() == 0:
            continue
        if isinstance(t, np.ndarray):
            if not t.flags.writeable:
                continue
            t.reshape(-1).view(np.uint8)[:1] = 0x5A
        else:
            flat = t.detach().reshape(-1)
            if flat.is_contiguous():
                flat.view(torch.uint8)[:1] = 0x5A


def digest_reader(out: Any, handle: Handle, rank: int, n: int, write: bool) -> None:
    """Read ``n`` objects; report their digests (taken before writing into them when
    ``write``), then whether every tensor was writable."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    digests = []
    for _ in range(n):
        obj = mq.dequeue(timeout=STEP)
        digests.append(digest(obj))
        if write:
            scribble(obj)
    out.put(("digests", digests))


def keeping_reader(out: Any, handle: Handle, rank: int, n: int, keep: int, go: Any) -> None:
    """Read ``n`` messages ``{"i": i, "t": tensor filled with i}``; keep the first ``keep``
    tensors alive (and write into them), drop the rest at once. Then report whether the
    kept ones still hold what they held, wait for ``go``, drop them and report again."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    kept = []
    seen = []
    for _ in range(n):
        msg = mq.dequeue(timeout=STEP)
        t = msg["t"]
        seen.append((msg["i"], bool(torch.all(t == msg["i"]))))
        if len(kept) < keep:
            t[0] = -1.0  # a private write
            kept.append((msg["i"], t))
        del msg, t
    intact = [bool(t[0] == -1.0) and bool(torch.all(t[1:] == i)) for i, t in kept]
    out.put(("read", seen, intact))
    if not go.wait(STEP):
        raise TimeoutError("no go")
    del kept
    gc.collect()
    out.put(("dropped",))
    # Stay until the test is done looking (a dead reader would give its holds back anyway).
    mq.dequeue(timeout=STEP)


def private_write_reader(out: Any, handle: Handle, rank: int, writer_rank: int, go: Any) -> None:
    """Read one tensor; reader ``writer_rank`` overwrites it; after ``go`` every reader
    reports the first bytes it sees."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    t = mq.dequeue(timeout=STEP)
    if rank == writer_rank:
        t.fill_(7.0)
    out.put(("read",))
    if not go.wait(STEP):
        raise TimeoutError("no go")
    out.put(("sees", float(t[0]), float(t[-1]), float(t.sum())))
    mq.dequeue(timeout=STEP)


def holding_reader(out: Any, handle: Handle, rank: int, n: int) -> None:
    """Read ``n`` messages, keep every tensor, report, then wait to be killed."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    kept = [mq.dequeue(timeout=STEP) for _ in range(n)]
    out.put(("holding", len(kept), os.getpid()))
    time.sleep(3 * STEP)  # not synchronisation: holds its tensors until killed


def releasing_reader(out: Any, handle: Handle, rank: int, n: int) -> None:
    """Read ``n`` messages, dropping each at once; report their first values."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    firsts = []
    for _ in range(n):
        msg = mq.dequeue(timeout=STEP)
        firsts.append(float(msg["t"][0]))
        del msg
    out.put(("firsts", firsts))


def loan_reader(out: Any, handle: Handle, rank: int) -> None:
    """Read a loaned tensor and array, then "go"; report what they hold after "go" (the
    writer wrote its loans in between: sealed once sent, the writes reach no reader),
    then what a second send of the tensor holds."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    first = mq.dequeue(timeout=STEP)
    second = mq.dequeue(timeout=STEP)
    assert second == "go", second
    t, a = first["tensor"], first["array"]
    out.put(("loaned", float(t[0]), float(t[-1]), a.dtype.str, a.shape, float(a[0, 0]), float(a[-1, -1])))
    again = mq.dequeue(timeout=STEP)
    out.put(("again", float(again["tensor"][5]), float(again["tensor"][0])))


def sealed_loan_reader(out: Any, handle: Handle, rank: int) -> None:
    """Read ``(i, tensor)`` messages until None; report every ``i`` whose tensor is not
    all ``i`` (the writer writes ``1000 + i`` into each loan right after sending it)."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    n, wrong = 0, []
    while (msg := mq.dequeue(timeout=STEP)) is not None:
        i, t = msg
        lo, hi = float(t.min()), float(t.max())
        if (lo, hi) != (i, i):
            wrong.append((i, lo, hi))
        n += 1
        del msg, t
    out.put(("sealed", n, wrong))


def raw_reader(out: Any, handle: Handle, rank: int) -> None:
    """Take one message through ``acquire_read`` (as a raw chunk), then one through
    ``dequeue``; report the second."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    with mq.acquire_read(timeout=STEP) as buf:
        n = len(buf)
    obj = mq.dequeue(timeout=STEP)
    out.put(("second", n, digest(obj)))


def rewriting_reader(out: Any, handle: Handle, rank: int, n: int) -> None:
    """Read ``n`` tensors one at a time: check each holds exactly what was sent (filled
    with its index), overwrite every byte of it, drop it and ack, so that the writer places
    the next one in the same memory. Reports whether each was exact and where it lay."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    for i in range(n):
        t = mq.dequeue(timeout=STEP)
        exact = bool(torch.equal(t, torch.full_like(t, float(i))))
        where = t.data_ptr()
        t.fill_(-7.0)  # every page becomes this reader's private copy
        del t
        gc.collect()
        out.put(("ack", exact, where))


def two_views_reader(out: Any, handle: Handle, rank: int) -> None:
    """Keep the views of two messages (filled with 1 and 2) alive together; write into
    each and report what each then holds."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    a = mq.dequeue(timeout=STEP)
    b = mq.dequeue(timeout=STEP)
    a.fill_(5.0)
    b_after_a = (float(b.min()), float(b.max()))
    b[: b.numel() // 2] = 6.0
    a_after_b = (float(a.min()), float(a.max()))
    out.put(("views", b_after_a, a_after_b, float(b[0]), float(b[-1])))


def consuming_reader(out: Any, handle: Handle, rank: int, n: int, measured: int) -> None:
    """Read ``n`` tensors, consuming each in full (``copy_`` into a buffer of this
    reader's); report the minor page faults the consumes of the last ``measured`` took
    (``getrusage``: a count, not a time) and whether every consume read what was sent."""
    import resource

    torch.set_num_threads(1)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    buf: Any = None
    faults = 0
    exact = True
    for i in range(n):
        t = mq.dequeue(timeout=STEP)
        if buf is None:
            buf = torch.zeros_like(t)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buf.copy_(t)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if i >= n - measured:
            faults += after - before
        exact = exact and float(buf[0]) == i and float(buf[-1]) == i
        del t
    out.put(("faults", faults, exact, buf.numel() * 4))

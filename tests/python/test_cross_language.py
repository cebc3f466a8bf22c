"""A Rust scheduler and Python workers in one queue, both ways, in real processes: raw
bytes and typed arrays (numpy arrays, torch tensors; a few bytes to 16 MiB) in order and
intact, 10⁵ messages each way; each side refuses a message of another kind with an error
naming it, the message consumed and the reader going on.

The Rust side is ``examples/cross_language.rs`` (built here with cargo): its ``writer``
sends messages ``0..count`` of ``expected(i)`` below, its ``reader`` checks them.

Names cross languages too (issue 59 item 9): a Rust writer holding a name
(``named-writer``) is opened by Python's ``MessageQueue.open`` and refuses Python a
writer of its name while it lives; a Python writer's name is opened by Rust's
``Reader::open_by_name`` (``named-reader``) and refused to a Rust writer; the name is
free once the writer ends, and a killed writer's name is reported gone in the other
language.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from _processes.rust_examples import build_example

from shmq import Handle, MessageKindError, MessageQueue, metrics

STEP = 120  # seconds: every wait here has a bound
COUNT = 100_000
SIZES = [0, 1, 7, 100, 1000, 4097, 70_000]  # as the example's
LARGE = 16 << 20

pytestmark = pytest.mark.timeout(900)


# (i * 31 + j) % 251 for j in range(n) is PATTERN[(i * 31) % 251:][:n]: a view, no work.
PATTERN = np.arange(LARGE + 251, dtype=np.int64) % 251


def expected(i: int) -> tuple[str, tuple[int, ...], np.ndarray]:
    """The example's message ``i``: ``("bytes", (n,), values)`` or ``(dtype, shape,
    values)``, element ``j`` being ``(i * 31 + j) % 251``."""
    large = i % 10_007 == 5
    n = LARGE if large else SIZES[(i // 4) % len(SIZES)]
    kind = i % 4
    if kind == 0:
        dtype, shape = "bytes", (n,)
    elif kind == 1:
        dtype, shape = "float32", (n // 4 if large else n,)
    elif kind == 2:
        dtype, shape = "int64", (2, n // 16 if large else n)
    else:
        dtype, shape = "uint16", (n // 2 if large else n, 1)
    count = shape[0] * (shape[1] if len(shape) == 2 else 1)
    start = (i * 31) % 251
    return dtype, shape, PATTERN[start : start + count]


def message(i: int) -> Any:
    """Message ``i`` as a Python writer sends it: bytes, or an array (the int64 ones as
    torch tensors, to send both kinds of array)."""
    dtype, shape, values = expected(i)
    if dtype == "bytes":
        return values.astype(np.uint8).tobytes()
    array = values.astype(dtype).reshape(shape)
    return torch.from_numpy(array) if dtype == "int64" else array


def wrong(i: int, got: Any) -> bool:
    """Whether ``got`` (read with ``dequeue_bytes`` or ``dequeue``) is not message ``i``."""
    dtype, shape, values = expected(i)
    if dtype == "bytes":
        return type(got) is not bytes or got != values.astype(np.uint8).tobytes()
    return (
        type(got) is not np.ndarray
        or got.dtype.name != dtype
        or got.shape != shape
        or not np.array_equal(got.reshape(-1), values)
    )


def read_all(out: Any, handle: Handle, rank: int, count: int) -> None:
    """A Python reader: every message in order, checked; puts ``(read, wrong indices)``."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    bad = []
    for i in range(count):
        got = mq.dequeue_bytes(timeout=STEP) if i % 4 == 0 else mq.dequeue(timeout=STEP)
        if wrong(i, got):
            bad.append(i)
    out.put((count, bad[:10]))


@pytest.fixture(scope="module")
def rust_example() -> str:
    return build_example("cross_language")


def test_message_matches_the_examples() -> None:
    assert expected(5)[1] == (LARGE // 4,) and expected(6)[1] == (2, 1)
    assert expected(3)[1] == (0, 1) and expected(7)[0] == "uint16" and list(expected(7)[2]) == [217]


def _finish(proc: subprocess.Popen[str]) -> str:
    """What the example printed, once it ended well."""
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(timeout=STEP)
    assert proc.returncode == 0, out
    return out


def test_a_rust_writer_feeds_two_python_readers_and_a_rust_reader(rust_example: str) -> None:
    writer = subprocess.Popen(
        [rust_example, "writer", "3", str(COUNT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    rust_reader = None
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    readers = []
    try:
        assert writer.stdout is not None and writer.stdin is not None
        line = writer.stdout.readline()
        handle = Handle.from_str(line)
        readers = [ctx.Process(target=read_all, args=(out, handle, rank, COUNT)) for rank in (0, 1)]
        for r in readers:
            r.start()
        rust_reader = subprocess.Popen(
            [rust_example, "reader", "2", str(COUNT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert rust_reader.stdin is not None
        rust_reader.stdin.write(line)
        rust_reader.stdin.close()
        results = [out.get(timeout=600) for _ in readers]
        assert results == [(COUNT, []), (COUNT, [])]
        assert _finish(rust_reader).startswith(f"ok {COUNT} ")
        assert writer.stdout.readline().startswith(f"sent {COUNT} ")
        writer.stdin.close()
        writer.wait(timeout=STEP)
        assert writer.returncode == 0
    finally:
        for p in (writer, rust_reader):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for r in readers:
            r.join(timeout=STEP)
            if r.is_alive():
                r.kill()


def test_a_python_writer_feeds_a_rust_reader_and_a_python_reader(rust_example: str) -> None:
    mq = MessageQueue(2, 2, max_chunk_bytes=1 << 20, max_chunks=16)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    python_reader = ctx.Process(target=read_all, args=(out, mq.export_handle(), 1, COUNT))
    python_reader.start()
    rust_reader = subprocess.Popen(
        [rust_example, "reader", "0", str(COUNT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rust_reader.stdin is not None
        rust_reader.stdin.write(str(mq.export_handle()) + "\n")
        rust_reader.stdin.close()
        mq.wait_until_ready(timeout=STEP)
        for i in range(COUNT):
            m = message(i)
            if i % 4 == 0:
                mq.enqueue_bytes(m, timeout=STEP)
            else:
                mq.enqueue_array(m, timeout=STEP)
        assert out.get(timeout=600) == (COUNT, [])
        assert _finish(rust_reader).startswith(f"ok {COUNT} ")
    finally:
        if rust_reader.poll() is None:
            rust_reader.kill()
            rust_reader.wait()
        python_reader.join(timeout=STEP)
        if python_reader.is_alive():
            python_reader.kill()
        mq.shutdown()


def test_a_rust_reader_names_a_pickled_object_and_goes_on(rust_example: str) -> None:
    mq = MessageQueue(1, 1)
    rust_reader = subprocess.Popen(
        [rust_example, "reader", "0", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rust_reader.stdin is not None
        rust_reader.stdin.write(str(mq.export_handle()) + "\n")
        rust_reader.stdin.close()
        mq.wait_until_ready(timeout=STEP)
        mq.enqueue_bytes(message(0))
        mq.enqueue({"not": "an array"})  # message 1 is an array: refused, named
        assert rust_reader.stdout is not None
        out = rust_reader.stdout.read()
        assert rust_reader.wait(timeout=STEP) == 1
        assert "message 1" in out and "a message of 1 part(s) (a Python writer's enqueue of a pickled object" in out
    finally:
        if rust_reader.poll() is None:
            rust_reader.kill()
            rust_reader.wait()
        mq.shutdown()


def _kinds_reader(out: Any, handle: Handle) -> None:
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)
    got: list[Any] = []
    calls = [
        ("dequeue_bytes", {}),  # an array: refused
        ("dequeue_array", {}),  # a pickled object: refused
        ("dequeue_array", {}),  # raw bytes: refused
        ("dequeue_array", {"kind": "torch"}),
        ("dequeue_array", {"kind": "memoryview"}),
        ("dequeue", {}),  # bfloat16: a torch tensor
        ("dequeue", {}),  # strided on the writer's side: sent contiguous
        ("dequeue_array", {"kind": "numpy"}),  # 8 MiB: the arena, no copy
    ]
    for name, kwargs in calls:
        try:
            v = getattr(mq, name)(timeout=STEP, **kwargs)
        except MessageKindError as e:
            got.append(("error", str(e)))
            continue
        if isinstance(v, torch.Tensor):
            got.append(("torch", str(v.dtype), tuple(v.shape), v.float().sum().item()))
        elif isinstance(v, memoryview):
            got.append(("memoryview", v.format, v.shape, v.tolist()))
        else:
            got.append(("numpy", v.dtype.name, v.shape, v.tolist() if v.size < 100 else float(v.sum())))
    # The last (8 MiB) array is a view of the tensor arena, not a copy.
    got.append(("last array over", type(v.base).__name__))
    out.put(got)


def test_a_python_reader_reads_arrays_as_asked_and_names_other_kinds() -> None:
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_kinds_reader, args=(out, mq.export_handle()))
    child.start()
    try:
        mq.wait_until_ready(timeout=STEP)
        mq.enqueue_array(np.arange(3, dtype=np.int8))
        mq.enqueue({"step": 1})
        mq.enqueue_bytes(b"raw")
        mq.enqueue_array(np.ones((2, 3), dtype=np.float16))
        mq.enqueue_array(memoryview(np.arange(6, dtype=np.int32)).cast("B").cast("i", [3, 2]))
        mq.enqueue_array(torch.full((4,), 2.5, dtype=torch.bfloat16))
        mq.enqueue_array(np.arange(12, dtype=np.uint32).reshape(3, 4).T)
        mq.enqueue_array(np.ones(2 << 20, dtype=np.float32))
        got = out.get(timeout=STEP)
        assert mq.handle is not None and mq.handle.buffer_handle is not None
        arena_parts = metrics.collect([mq.handle.buffer_handle[3]])[0]["arena_parts"]
    finally:
        child.join(timeout=STEP)
        if child.is_alive():
            child.kill()
        mq.shutdown()
    assert child.exitcode == 0
    assert got[0][0] == "error" and "typed array (by enqueue_array)" in got[0][1] and "dequeue_array()" in got[0][1]
    assert got[1][0] == "error" and "pickled Python object" in got[1][1] and "read it with dequeue()" in got[1][1]
    assert got[2][0] == "error" and "raw bytes" in got[2][1] and "dequeue_bytes()" in got[2][1]
    assert got[3] == ("torch", "torch.float16", (2, 3), 6.0)
    assert got[4] == ("memoryview", "i", (3, 2), [[0, 1], [2, 3], [4, 5]])
    assert got[5] == ("torch", "torch.bfloat16", (4,), 10.0)
    assert got[6] == ("numpy", "uint32", (4, 3), np.arange(12).reshape(3, 4).T.tolist())
    assert got[7] == ("numpy", "float32", (2 << 20,), float(2 << 20))
    assert got[8] == ("last array over", "ShmView") and arena_parts == 1


def test_enqueue_array_refuses_what_it_cannot_send() -> None:
    mq = MessageQueue(1, 1)  # no reader needed: every call fails before sending
    with pytest.raises(TypeError, match="numpy array of dtype complex64"):
        mq.enqueue_array(np.ones(2, dtype=np.complex64))
    with pytest.raises(TypeError, match="got list"):
        mq.enqueue_array([1, 2, 3])
    with pytest.raises(TypeError, match="dtype object"):
        mq.enqueue_array(np.array([None]))
    mq.shutdown()


@pytest.mark.parametrize("kind", ["bytes", "f32", "pickled"])
def test_the_benchs_python_writer_and_reader(kind: str) -> None:
    """The Python side of ``python -m shmq bench --scenarios cross-language`` (the same
    command line as the Rust example's ``send`` / ``take``): every message arrives, each
    read in full (the sum of its bytes: the message numbers in its first 8 bytes)."""
    count, nbytes = 200, 4096 if kind != "f32" else 1 << 20
    command = [sys.executable, "-m", "shmq_bench.cross_language"]
    writer = subprocess.Popen(
        [*command, "send", "1", str(count), kind, str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        reader = subprocess.run(
            [*command, "take", "0", str(count), kind],
            input=writer.stdout.readline(),
            capture_output=True,
            text=True,
            timeout=STEP,
        )
        assert reader.returncode == 0, reader.stderr
        took, n, _seconds, total = reader.stdout.split()
        # Message i carries i as a little-endian u64 in its first bytes, zeros elsewhere.
        assert (took, int(n), int(total)) == ("took", count, sum(sum(i.to_bytes(8, "little")) for i in range(count)))
        writer.stdin.close()
        assert writer.wait(timeout=STEP) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_a_rust_program_without_a_logger_hears_shmqs_warnings(rust_example: str) -> None:
    """shmq's warnings reach a Rust program that set no logger (on stderr), not only
    one with a `log` logger."""
    writer = subprocess.Popen(
        [rust_example, "writer", "1", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SHMQ_ARENA_BYTES": "lots"},
    )
    try:
        assert writer.stderr is not None and writer.stdout is not None
        line = writer.stderr.readline()
        handle = Handle.from_str(writer.stdout.readline())
    finally:
        writer.kill()
        writer.communicate()
    assert line == 'shmq warning: ignoring SHMQ_ARENA_BYTES="lots": not a number of bytes\n'
    # Killed, the writer (a Rust program: no janitor) leaves its ring; remove it here.
    assert handle.buffer_handle is not None
    ring = Path("/dev/shm") / handle.buffer_handle[3]
    ring.unlink()
    shutil.rmtree(f"{ring}.sock", ignore_errors=True)


# -- names across languages (issue 59 item 9) --------------------------------------------

NAMED = 2_000


def _name(what: str) -> str:
    return f"{what} {os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def private_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A directory of names of the test's own, for it and the Rust programs it starts
    (they inherit ``SHMQ_NAMES_DIR``): every claim removes the dead records it finds, so
    in the user's own directory these tests would sweep the other tests' records, and a
    killed writer's record could be swept before this test saw it gone."""
    monkeypatch.setenv("SHMQ_NAMES_DIR", str(tmp_path / "names"))


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("private_names")
def test_a_python_reader_opens_a_rust_writers_named_queue_while_rust_holds_the_name(rust_example: str) -> None:
    name = _name("rust steps →")
    writer = subprocess.Popen(
        [rust_example, "named-writer", name, str(NAMED)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    mq = None
    try:
        assert writer.stdout is not None and writer.stdin is not None
        line = writer.stdout.readline()  # printed once the writer holds the name
        assert line.startswith("shmq-handle-"), line
        # A Python writer of the name the Rust writer holds is refused, naming it.
        with pytest.raises(FileExistsError, match=f"a queue named {name!r} already exists .*pid {writer.pid}"):
            MessageQueue(1, 1, name=name)
        mq = MessageQueue.open(name, 0)
        assert mq.name == name
        mq.wait_until_ready(timeout=STEP)
        bad = []
        for i in range(NAMED):
            got = mq.dequeue_bytes(timeout=STEP) if i % 4 == 0 else mq.dequeue(timeout=STEP)
            if wrong(i, got):
                bad.append(i)
        assert bad == []
        assert writer.stdout.readline().startswith(f"sent {NAMED} ")
        writer.stdin.close()
        assert writer.wait(timeout=STEP) == 0
    finally:
        _kill(writer)
        if mq is not None:
            mq.shutdown()
    # The Rust writer ended: its name is free, for a Python writer too.
    with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
        MessageQueue.open(name, 0)
    MessageQueue(1, 1, name=name).shutdown()


@pytest.mark.usefixtures("private_names")
def test_a_rust_reader_opens_a_python_writers_named_queue_and_rust_is_refused_its_name(rust_example: str) -> None:
    name = _name("python steps")
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=16, name=name)
    rust_reader = subprocess.Popen(
        [rust_example, "named-reader", name, "0", str(NAMED)], stdout=subprocess.PIPE, text=True
    )
    try:
        refused = subprocess.run(
            [rust_example, "named-writer", name, "1"], capture_output=True, text=True, timeout=STEP
        )
        assert refused.returncode == 1, refused.stdout
        assert f"a queue named '{name}' already exists (made by pid {os.getpid()}" in refused.stdout
        mq.wait_until_ready(timeout=STEP)
        for i in range(NAMED):
            m = message(i)
            if i % 4 == 0:
                mq.enqueue_bytes(m, timeout=STEP)
            else:
                mq.enqueue_array(m, timeout=STEP)
        assert _finish(rust_reader).startswith(f"ok {NAMED} ")
    finally:
        _kill(rust_reader)
        mq.shutdown()
    # Shut down: Rust finds no such queue, and may take the name.
    gone = subprocess.run([rust_example, "named-reader", name, "0", "1"], capture_output=True, text=True, timeout=STEP)
    assert gone.returncode == 1 and f"no queue named '{name}'" in gone.stdout, gone.stdout


@pytest.mark.usefixtures("private_names")
def test_a_killed_rust_writers_name_is_gone_for_python_then_taken_over(rust_example: str) -> None:
    name = _name("killed rust")
    writer = subprocess.Popen(
        [rust_example, "named-writer", name, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        handle = Handle.from_str(writer.stdout.readline())
    finally:
        _kill(writer)  # SIGKILL: its record stays behind, its lock does not
    # A Rust program has no janitor: remove what the killed writer left.
    assert handle.buffer_handle is not None
    ring = Path("/dev/shm") / handle.buffer_handle[3]
    ring.unlink(missing_ok=True)
    shutil.rmtree(f"{ring}.sock", ignore_errors=True)
    with pytest.raises(FileNotFoundError, match=f"the queue named {name!r} is gone: its writer \\(pid {writer.pid}\\)"):
        MessageQueue.open(name, 0)
    taken = MessageQueue(1, 1, name=name)
    try:
        assert MessageQueue.open(name, 0).name == name
    finally:
        taken.shutdown()

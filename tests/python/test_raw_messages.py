"""Raw bytes and pickled objects in one queue, across the language boundary, in real
processes.

A Rust writer's ``enqueue(&[u8])`` is read in Python with ``dequeue_bytes()``; a Python
writer's ``enqueue_bytes`` reaches a Rust reader's ``dequeue`` as sent; each side refuses
the kind it was not asked for (Python ``dequeue`` on raw bytes, ``dequeue_bytes`` on a
pickled object, Rust ``dequeue`` on a pickled object) with an error naming the mismatch,
the message consumed and the reader going on. The Rust side is
``examples/raw_to_python.rs``, built here with cargo.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
from pathlib import Path
from typing import Any

import pytest

from _processes.rust_examples import build_example

import shmq
from shmq import Handle, MessageKindError, MessageQueue

ROOT = Path(__file__).resolve().parents[2]
STEP = 30  # seconds: every wait here has a bound
SIZES = [0, 1, 100, 4095, 4096, 4097, 65_536, 300_001, 1 << 20]  # as the example's

pytestmark = pytest.mark.timeout(900)


def message(i: int) -> bytes:
    """The example's message ``i``: byte ``j`` is ``(i * 31 + j) % 251``."""
    n = SIZES[i % len(SIZES)]
    pattern = bytes((k % 251) for k in range(251))
    start = (i * 31) % 251
    reps = (n + start) // 251 + 1
    return (pattern * reps)[start : start + n]


def fnv1a(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


@pytest.fixture(scope="module")
def rust_example() -> str:
    """The path of the built ``raw_to_python`` example."""
    return build_example("raw_to_python")


def test_message_matches_the_examples() -> None:
    assert message(0) == b"" and message(2) == bytes((62 + j) % 251 for j in range(100))


def test_a_rust_writers_raw_bytes_reach_a_python_reader(rust_example: str) -> None:
    count = 1000
    writer = subprocess.Popen(
        [rust_example, "writer", "1", str(64 * 1024), str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        line = writer.stdout.readline()
        reader = MessageQueue.create_from_handle(Handle.from_str(line), 0)
        reader.wait_until_ready(timeout=STEP)
        wrong = []
        for i in range(count):
            got = reader.dequeue_bytes(timeout=STEP)
            assert type(got) is bytes
            if got != message(i):
                wrong.append((i, len(got)))
        assert wrong == []
        writer.stdin.close()
        writer.wait(timeout=STEP)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == 0


def _mixed_reader(out: Any, handle: Handle) -> None:
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready(timeout=STEP)
    got: list[Any] = []
    for kind in ["dequeue", "dequeue", "dequeue_bytes", "dequeue_bytes", "dequeue", "dequeue", "dequeue_bytes"]:
        try:
            got.append(("ok", getattr(mq, kind)(timeout=STEP)))
        except MessageKindError as e:
            got.append(("error", isinstance(e, ValueError), str(e)))
    out.put(got)


def test_a_python_reader_refuses_the_other_kind_and_goes_on() -> None:
    big = b"r" * (3 * 4096)  # over a chunk: the overflow socket
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_mixed_reader, args=(out, mq.export_handle()))
    child.start()
    try:
        mq.wait_until_ready(timeout=STEP)
        mq.enqueue_bytes(b"raw one")  # dequeue: refused
        mq.enqueue({"step": 1})  # dequeue: read
        mq.enqueue_bytes(bytearray(big))  # dequeue_bytes: read
        mq.enqueue(b"\x80\x05pickled bytes")  # dequeue_bytes: refused
        mq.enqueue_bytes(big)  # dequeue: refused (overflow)
        mq.enqueue(b"x" * (3 * 4096))  # dequeue: read (overflow)
        mq.enqueue_bytes(b"\x80\x05K\x07.")  # a valid pickle, sent raw: dequeue_bytes reads it
        got = out.get(timeout=STEP)
    finally:
        child.join(timeout=STEP)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert got[0][:2] == ("error", True) and "sent as raw bytes" in got[0][2] and "dequeue_bytes()" in got[0][2]
    assert got[1] == ("ok", {"step": 1})
    assert got[2] == ("ok", big)
    assert got[3][:2] == ("error", True) and "pickled Python object" in got[3][2] and "dequeue()" in got[3][2]
    assert got[4][:2] == ("error", True) and "sent as raw bytes" in got[4][2]
    assert got[5] == ("ok", b"x" * (3 * 4096))
    assert got[6] == ("ok", b"\x80\x05K\x07.")
    assert shmq.MessageKindError is MessageKindError and issubclass(MessageKindError, ValueError)


def test_python_enqueue_bytes_reaches_a_rust_reader(rust_example: str) -> None:
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    sent = [message(i) for i in range(18)]
    reader = subprocess.Popen(
        [rust_example, "reader", "0", str(len(sent) + 2)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdin is not None and reader.stdout is not None
        reader.stdin.write(str(mq.export_handle()) + "\n")
        reader.stdin.close()
        mq.wait_until_ready(timeout=STEP)
        for m in sent[:9]:
            mq.enqueue_bytes(m, timeout=STEP)
        mq.enqueue({"a pickled": "object"}, timeout=STEP)  # refused by Rust's dequeue
        mq.enqueue(b"p" * 10_000, timeout=STEP)  # the same, over the overflow socket
        for m in sent[9:]:
            mq.enqueue_bytes(m, timeout=STEP)
        lines = reader.stdout.read().splitlines()
        reader.wait(timeout=STEP)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0
    expected = [f"{len(m)} {fnv1a(m)}" for m in sent]
    assert lines[:9] == expected[:9] and lines[11:] == expected[9:]
    for refused in lines[9:11]:
        assert refused.startswith("error: ") and "Python writer's enqueue of a pickled object" in refused

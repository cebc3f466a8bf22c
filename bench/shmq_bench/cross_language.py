"""``python -m shmq bench --scenarios cross-language``: Rust and Python on either side of one
queue, each direction next to Rust -> Rust.

One writer and one reader, each in its own process: Rust (``examples/cross_language.rs``,
built here with ``cargo build --release``) or Python (``python -m
shmq_bench.cross_language``, the same command line). Two kinds of message, each made new only
in its first 8 bytes (its number; the rest of the producer's buffer is reused, so the
producer's own writing of fresh data is not in the figure: the writer's copy into shared
memory and the reader's pass over every byte are) and read in full by the reader (a sum
over every byte):
4 KiB of raw bytes (``enqueue`` / ``enqueue_bytes`` -> ``dequeue`` / ``dequeue_bytes``) and
a 1 MiB float32 array (``enqueue_array`` -> ``dequeue_array`` / ``dequeue()``, through the
tensor arena). Messages per second from the reader's first message to its last, the
median over the rounds; the ratio is against Rust -> Rust in the same run.

It needs a checkout of shmq with cargo on PATH (the Rust side is an example of the crate).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from typing import Any, Optional

from .common import ROOT

KINDS = [("4 KiB raw bytes", "bytes", 4096), ("1 MiB float32 array", "f32", 1 << 20)]
DIRECTIONS = [("Rust", "Rust"), ("Rust", "Python"), ("Python", "Rust"), ("Python", "Python")]


def _build() -> Optional[str]:
    """The release build of the example, or None (with a note) where it cannot be built."""
    if shutil.which("cargo") is None or not (ROOT / "Cargo.toml").exists():
        print("cross-language: needs a checkout of shmq and cargo on PATH", file=sys.stderr)
        return None
    build = subprocess.run(
        ["cargo", "build", "--release", "--quiet", "--example", "cross_language", "--message-format=json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        print(f"cross-language: cargo build failed:\n{build.stderr[-2000:]}", file=sys.stderr)
        return None
    for line in build.stdout.splitlines():
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cross_language" and m.get("executable"):
            return str(m["executable"])
    return None


def _command(side: str, example: str, *args: str) -> list[str]:
    if side == "Rust":
        return [example, *args]
    return [sys.executable, "-m", "shmq_bench.cross_language", *args]


def _round(example: str, writer: str, reader: str, kind: str, nbytes: int, count: int) -> float:
    """Messages per second a reader on ``reader``'s side took from a writer on ``writer``'s."""
    w = subprocess.Popen(
        _command(writer, example, "send", "1", str(count), kind, str(nbytes)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert w.stdout is not None and w.stdin is not None
        handle = w.stdout.readline()
        r = subprocess.run(
            _command(reader, example, "take", "0", str(count), kind),
            input=handle,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0 or not r.stdout.startswith("took "):
            raise RuntimeError(f"{writer} -> {reader} {kind}: {r.stdout[-500:]}{r.stderr[-2000:]}")
        seconds = float(r.stdout.split()[2])
        return count / seconds if seconds > 0 else float("inf")
    finally:
        if w.stdin is not None:
            w.stdin.close()
        try:
            w.wait(timeout=60)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def main(rounds: int, quick: bool) -> int:
    example = _build()
    if example is None:
        return 2
    counts = {"bytes": 5_000 if quick else 50_000, "f32": 300 if quick else 2_000}
    print(f"\nRust and Python on either side of one queue (1 writer, 1 reader), medians of {rounds} round(s)")
    print("each message new in its first 8 bytes only (the producer's buffer reused), read in full by the reader")
    print("| message | writer -> reader | messages/s | vs Rust -> Rust |")
    print("|---|---|---|---|")
    for label, kind, nbytes in KINDS:
        base = None
        for writer, reader in DIRECTIONS:
            rates = [_round(example, writer, reader, kind, nbytes, counts[kind]) for _ in range(rounds)]
            rate = statistics.median(rates)
            base = rate if base is None else base
            print(f"| {label} | {writer} -> {reader} | {rate:,.0f} | {rate / base:.2f}x |", flush=True)
        if kind == "bytes" and base is not None:
            # The same bytes pickled (enqueue / dequeue): what the raw path is an
            # alternative to, between Python processes.
            rates = [_round(example, "Python", "Python", "pickled", nbytes, counts[kind]) for _ in range(rounds)]
            rate = statistics.median(rates)
            print(f"| {label}, pickled (enqueue/dequeue) | Python -> Python | {rate:,.0f} | {rate / base:.2f}x |")
    return 0


def _send(n_readers: int, count: int, kind: str, nbytes: int) -> None:
    import numpy as np

    from shmq import MessageQueue

    mq = MessageQueue(n_readers, n_readers, max_chunk_bytes=max(2 * nbytes, 1 << 16), max_chunks=16)
    print(mq.export_handle(), flush=True)
    mq.wait_until_ready(timeout=60)
    message = np.zeros(max((nbytes + 3) // 4, 2), dtype=np.float32)
    number = message.view(np.uint64)
    raw = message.view(np.uint8)[:nbytes]
    for i in range(count):
        number[0] = i  # fresh data
        if kind == "bytes":
            mq.enqueue_bytes(raw, timeout=60)
        elif kind == "pickled":
            mq.enqueue(raw.tobytes(), timeout=60)
        else:
            mq.enqueue_array(message, timeout=60)
    sys.stdin.read()
    mq.shutdown()


def _take(rank: int, count: int, kind: str) -> None:
    import time

    import numpy as np

    from shmq import Handle, MessageQueue

    mq = MessageQueue.create_from_handle(Handle.from_str(sys.stdin.readline()), rank)
    mq.wait_until_ready(timeout=60)
    total, start = 0, None
    for _ in range(count):
        m: Any
        if kind == "bytes":
            m = mq.dequeue_bytes(timeout=60)
        elif kind == "pickled":
            m = mq.dequeue(timeout=60)
        else:
            m = mq.dequeue_array(timeout=60)
        start = time.perf_counter() if start is None else start
        total += int(np.frombuffer(m, dtype=np.uint8).sum())
    print(f"took {count} {time.perf_counter() - (start or 0.0):.6f} {total}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["send"] and len(args) == 5:
        _send(int(args[1]), int(args[2]), args[3], int(args[4]))
    elif args[:1] == ["take"] and len(args) == 4:
        _take(int(args[1]), int(args[2]), args[3])
    else:
        sys.exit(
            "usage: python -m shmq_bench.cross_language send <n_readers> <count> <bytes|f32|pickled> <nbytes> "
            "| take <rank> <count> <bytes|f32|pickled>"
        )

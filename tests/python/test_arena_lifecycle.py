"""The tensor arena's life (issue 18, items 3 and 7(c)), with real processes.

* A queue names its arena when it is made (the name travels in the handle) but creates
  the segment only when the first large part, a loan or ``reserve_arena`` needs it;
  readers open it when the first message that refers to it arrives. A queue that only
  carries small messages leaves no ``shmq_arena_*`` file in ``/dev/shm``.
* ``python -m shmq inspect <arena>`` says which queue (ring) an arena belongs to.
* A reader SIGKILLed while it holds arena views: the writer drops its holds as soon as
  the reader is proved dead (not only when the arena runs short of room), so later
  tensors still go through the arena instead of being copied.
"""

from __future__ import annotations

import json
import os
import signal

import torch

from _processes import (
    STEP,
    hoarding_reader,
    segment_exists,
    shmq_cli,
    small_then_large_reader,
    tensor_counting_reader,
    wait_for,
)
from shmq import MessageQueue

MiB = 1 << 20


def test_small_messages_make_no_arena_and_the_first_large_part_makes_it(children):
    mq = MessageQueue(2, 2, max_chunk_bytes=64 * 1024, max_chunks=4)
    arena = mq.export_handle().arena_name
    assert arena and arena.startswith("shmq_arena_"), arena
    assert not segment_exists(arena), "the arena was made before anything needed it"
    go = children.event()
    outs = [children.queue() for _ in range(2)]
    for rank, out in enumerate(outs):
        children.start(small_then_large_reader, out, mq.export_handle(), rank, 50, go)
    mq.wait_until_ready(timeout=STEP)
    small = [{"i": i, "s": "x" * (i * 100)} for i in range(50)]
    for obj in small:
        mq.enqueue(obj, timeout=STEP)
    for out in outs:
        assert children.expect(out, "small")[1] == small
    # Small messages only, read by both readers: still no arena file at all.
    assert not segment_exists(arena), "small messages made an arena file"
    stats = mq.arena_stats()
    assert stats["name"] == arena
    assert (stats["reserved"], stats["outstanding"], stats["fallbacks"]) == (0, 0, 0), stats

    # The first large part makes it; readers that joined before open it when it comes.
    t = torch.full((2 * MiB,), 7.0)  # 8 MiB
    mq.enqueue({"t": t}, timeout=STEP)
    assert segment_exists(arena)
    for out in outs:
        assert children.expect(out, "large")[1:] == (2 * MiB, True)
    # Zero-copy: both readers hold the one part that was placed in the arena.
    assert mq.arena_stats()["outstanding"] == 1
    assert mq.arena_fallbacks == 0
    go.set()
    for out in outs:
        children.expect(out, "dropped")
    wait_for(lambda: mq.arena_stats()["outstanding"] == 0, STEP, "the dropped parts to come back")
    assert mq.arena_stats()["outstanding"] == 0
    mq.enqueue("bye", timeout=STEP)
    children.join()


def test_reserve_arena_and_loan_make_the_arena():
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    arena = mq.arena_stats()["name"]
    assert not segment_exists(arena)
    assert mq.reserve_arena(MiB) == MiB
    assert segment_exists(arena)
    assert mq.arena_stats()["reserved"] == MiB

    mq2 = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    arena2 = mq2.arena_stats()["name"]
    assert not segment_exists(arena2)
    loaned = mq2.loan(MiB)
    assert segment_exists(arena2)
    assert mq2.arena_stats()["outstanding"] == 1
    del loaned
    assert mq2.arena_stats()["outstanding"] == 0

    # No arena at all: nothing named, nothing made.
    none = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, arena_bytes=0)
    assert none.export_handle().arena_name is None
    assert none.reserve_arena(MiB) == 0
    del mq, mq2, none


def test_inspect_names_the_queue_an_arena_belongs_to():
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    ring, arena = mq.buffer.name, mq.arena_stats()["name"]
    mq.reserve_arena(0)
    r = shmq_cli("inspect", arena)
    assert r.returncode == 0, r.stderr
    assert f"queue: {ring}" in r.stdout, r.stdout
    r = shmq_cli("inspect", "--json", arena)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "arena" and info["queue"] == ring, info
    del mq


def test_a_sigkilled_readers_arena_holds_come_back_without_a_shortage(children):
    # The arena (default: 1 GiB) never runs short here, so only the liveness check can
    # give the dead reader's holds back.
    mq = MessageQueue(2, 2, max_chunk_bytes=64 * 1024, max_chunks=4, on_dead_reader="drop")
    held, more = 16, 24
    out0, out1 = children.queue(), children.queue()
    children.start(tensor_counting_reader, out0, mq.export_handle(), 0, held + more)
    doomed = children.start(hoarding_reader, out1, mq.export_handle(), 1, held)
    mq.wait_until_ready(timeout=STEP)
    for i in range(held):
        mq.enqueue({"i": i, "t": torch.full((MiB // 2,), float(i))}, timeout=STEP)  # 2 MiB
    children.expect(out1, "holding")
    assert mq.arena_stats()["outstanding"] >= held
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(STEP)
    children.procs.remove(doomed)
    # Within a bounded time of the death, its holds are gone (reader 0 drops its own).
    wait_for(
        lambda: mq.arena_stats()["outstanding"] == 0, 10.0, "the dead reader's holds to be given back"
    )
    assert mq.arena_stats()["outstanding"] == 0, "the dead reader's holds were not given back"
    # Later tensors go through the arena (no copy), and reader 0 gets them all.
    for i in range(held, held + more):
        mq.enqueue({"i": i, "t": torch.full((MiB // 2,), float(i))}, timeout=STEP)
    assert children.expect(out0, "read")[1] == [True] * (held + more)
    assert mq.arena_fallbacks == 0
    assert mq.dropped_readers == [1], mq.dropped_readers
    children.join()

"""Large tensors through the queue: protocol-5 out-of-band buffers, the tensor arena
(one copy in, zero-copy private views out), loans (no copy at all), in real processes.

Every comparison is exact: a digest of type, dtype, shape, ``requires_grad`` and the
bytes, taken on both sides (``_processes.tensor_children.digest``).
"""

from __future__ import annotations

import gc
import os
import pickle
import signal

import numpy as np
from numpy._core._rational_tests import rational
import pytest
import torch

from _processes import STEP, WaitTimeout, wait_for
from _processes.tensor_children import (
    consuming_reader,
    digest,
    digest_reader,
    holding_reader,
    keeping_reader,
    loan_reader,
    private_write_reader,
    raw_reader,
    releasing_reader,
    rewriting_reader,
    sealed_loan_reader,
    two_views_reader,
)
from shmq import MessageQueue, _core

MiB = 1 << 20


def _torch_dtypes() -> list[torch.dtype]:
    names = [
        "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool",
        "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    ]  # fmt: skip
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _filled(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` elements of ``dtype`` with varied bits (made from random bytes)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)
    if dtype == torch.bool:
        t = raw.view(torch.bool) & True  # valid bools only
    return t


class _Sub(torch.Tensor):
    pass


def every_kind_of_object() -> list:
    """Tensors and arrays of every sort, each message one object."""
    objs: list = []
    for i, dt in enumerate(_torch_dtypes()):
        size = torch.empty((), dtype=dt).element_size()
        objs.append(_filled(1024 // size, dt, i))  # 1 KiB: copied inline
        objs.append(_filled((2 * MiB) // size, dt, 100 + i).reshape(64, -1))  # the arena
    base = torch.arange(6 * MiB // 4, dtype=torch.float32).reshape(1024, -1)
    objs += [
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 5),  # empty
        base.t(),  # non-contiguous, large
        base[::3, 1::2],  # strided slice
        torch.arange(10, dtype=torch.int64)[::2],
        torch.randn(1000, dtype=torch.complex64).conj(),  # conjugate bit
        torch.randn(400_000, dtype=torch.complex64).conj(),
        torch.randn(300).neg(),
        torch.ones(5, requires_grad=True),  # a leaf that requires grad
        torch.nn.Parameter(torch.randn(600_000)),  # a Parameter, large
        torch.randn(3, 4).as_subclass(_Sub),  # a subclass: torch's own pickling
        np.arange(24, dtype=np.float64).reshape(4, 6),
        np.asfortranarray(np.arange(600_000, dtype=np.int32).reshape(600, 1000)),  # F order
        np.arange(10, dtype=">i4"),
        np.arange(20)[::3],  # non-contiguous: copied contiguous once, out of band
        # Non-contiguous and big-endian: numpy's own pickling would hand back '<i4'.
        np.arange(24, dtype=">i4").reshape(4, 6)[:, ::2],
        # A user-defined dtype (numpy's own test dtype): numpy's pickling, not raw bytes.
        np.array([rational(1, 2), rational(-3, 4)]),
        np.array(2.5, dtype=np.float32),  # 0-d array
    ]
    ro = np.arange(2 * MiB // 8, dtype=np.float64)
    ro.flags.writeable = False  # read-only arrays travel too
    objs.append(ro)
    objs.append(pickle.PickleBuffer(bytearray(b"x" * (3 * MiB))))
    objs.append(
        {
            "pixel_values": torch.randn(3, 336, 336),
            "image_grid": [torch.tensor([1, 24, 24]), (np.ones((2, 2)), "patch")],
            "embeds": torch.randn(1 << 19, dtype=torch.bfloat16),
            "meta": {"ids": list(range(5)), "name": "img", "none": None},
        }
    )
    return objs


def test_every_kind_of_tensor_reaches_three_readers_exactly(children):
    objs = every_kind_of_object()
    mq = MessageQueue(3, 3, max_chunk_bytes=1 * MiB, max_chunks=4)
    outs = []
    for rank in range(3):
        out = children.queue()
        # Reader 2 writes into what it gets: every tensor must be writable.
        children.start(digest_reader, out, mq.export_handle(), rank, len(objs), rank == 2)
        outs.append(out)
    mq.wait_until_ready(timeout=STEP)
    expected = []
    for obj in objs:
        expected.append(digest(obj))
        mq.enqueue(obj, timeout=STEP)
    for out in outs:
        got = children.expect(out, "digests")[1]
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"object {i}: sent {e}, received {g}"
    # The writer's objects are untouched by reader 2's writes.
    assert [digest(o) for o in objs] == expected
    assert mq.arena_fallbacks == 0
    children.join()


@pytest.mark.parametrize("nbytes", [1024, MiB - 4, MiB, 16 * MiB, 256 * MiB], ids=lambda n: f"{n}B")
def test_sizes_from_1_kib_to_256_mib(children, nbytes):
    mq = MessageQueue(3, 3, max_chunk_bytes=4 * MiB, max_chunks=4)
    t = _filled(nbytes // 4, torch.float32, nbytes)
    outs = [children.queue() for _ in range(3)]
    for rank, out in enumerate(outs):
        children.start(digest_reader, out, mq.export_handle(), rank, 2, False)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue(t, timeout=STEP)
    mq.enqueue({"again": t, "n": nbytes}, timeout=STEP)
    want = [digest(t), digest({"again": t, "n": nbytes})]
    for out in outs:
        assert children.expect(out, "digests", timeout=4 * STEP)[1] == want
    children.join()


def test_views_stay_intact_while_the_writer_sends_many_more(children):
    # An arena of 8 parts of 2 MiB: while the reader keeps 4 views, the writer goes
    # round it many times. A range reused under a live view would change the view.
    mq = MessageQueue(1, 1, max_chunk_bytes=256 * 1024, max_chunks=4, arena_bytes=16 * MiB)
    n, keep = 60, 4
    out, go = children.queue(), children.event()
    children.start(keeping_reader, out, mq.export_handle(), 0, n, keep, go)
    mq.wait_until_ready(timeout=STEP)
    for i in range(n):
        mq.enqueue({"i": i, "t": torch.full((MiB // 2,), float(i))}, timeout=STEP)
    _, seen, intact = children.expect(out, "read")
    assert seen == [(i, True) for i in range(n)]
    assert intact == [True] * keep
    # The kept views hold their parts; everything else came back.
    assert _outstanding(mq, at_most=keep) <= keep
    go.set()
    children.expect(out, "dropped")
    assert _outstanding(mq, at_most=0) == 0, "the parts did not come back after the views went"
    mq.enqueue("bye", timeout=STEP)
    children.join()


def _outstanding(mq: MessageQueue, at_most: int) -> int:
    """The arena's outstanding parts, waiting (bounded) until they are ``at_most``."""
    try:
        wait_for(lambda: mq.arena_stats()["outstanding"] <= at_most, STEP, f"at most {at_most} parts out", 0.01)
    except WaitTimeout:
        pass  # the caller's assertion says how many
    return mq.arena_stats()["outstanding"]


def test_the_writer_never_waits_for_a_full_arena(children):
    # Room for two parts; the reader keeps every view. The writer goes on by copying
    # (through the overflow socket: a part is larger than a chunk) and counts it, once
    # per part.
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=4 * MiB)
    n = 8
    out = children.queue()
    reader = children.start(holding_reader, out, mq.export_handle(), 0, n)
    mq.wait_until_ready(timeout=STEP)
    for i in range(n):
        mq.enqueue({"t": torch.full((MiB // 2,), float(i))}, timeout=STEP)
    children.expect(out, "holding")
    assert mq.arena_fallbacks == n - 2
    assert mq.arena_stats()["outstanding"] == 2
    reader.kill()


def test_a_readers_write_never_reaches_the_writer_or_the_other_readers(children):
    mq = MessageQueue(3, 3, max_chunk_bytes=64 * 1024, max_chunks=4)
    t = torch.ones(4 * MiB // 4)
    go = children.event()
    outs = [children.queue() for _ in range(3)]
    for rank, out in enumerate(outs):
        children.start(private_write_reader, out, mq.export_handle(), rank, 1, go)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue(t, timeout=STEP)
    for out in outs:
        children.expect(out, "read")
    go.set()
    sees = [children.expect(out, "sees")[1:] for out in outs]
    n = float(t.numel())
    assert sees[1] == (7.0, 7.0, 7.0 * n), "the writing reader's own write is lost"
    assert sees[0] == sees[2] == (1.0, 1.0, n), f"a reader's write reached another reader: {sees}"
    assert bool(torch.all(t == 1.0)), "a reader's write reached the writer"
    mq.enqueue("bye", timeout=STEP)
    children.join()


def test_a_readers_writes_are_gone_when_its_memory_carries_the_next_message(children):
    # Lockstep: the reader overwrites every byte of what it got and drops it before the
    # writer sends the next, so the arena places every tensor in the same memory (lowest
    # first) and the reader sees it at the same place of its own mapping. What the reader
    # wrote must never show through what the writer sends next.
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=16 * MiB)
    n = 6
    out = children.queue()
    children.start(rewriting_reader, out, mq.export_handle(), 0, n)
    mq.wait_until_ready(timeout=STEP)
    acks = []
    for i in range(n):
        mq.enqueue(torch.full((MiB,), float(i)), timeout=STEP)  # 4 MiB
        acks.append(children.expect(out, "ack")[1:])
    assert [exact for exact, _ in acks] == [True] * n, f"a reader's old writes showed through: {acks}"
    assert len({where for _, where in acks}) == 1, "the tensors did not lie in the same memory of the reader"
    assert mq.arena_fallbacks == 0
    children.join()


def test_two_live_views_in_one_reader_stay_independent(children):
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4)
    out = children.queue()
    children.start(two_views_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    one, two = torch.full((MiB,), 1.0), torch.full((MiB,), 2.0)
    mq.enqueue(one, timeout=STEP)
    mq.enqueue(two, timeout=STEP)
    _, b_after_a, a_after_b, b_first, b_last = children.expect(out, "views")
    assert b_after_a == (2.0, 2.0), "a write into one view reached another message's view"
    assert a_after_b == (5.0, 5.0), "a write into one view reached another message's view"
    assert (b_first, b_last) == (6.0, 2.0)
    assert bool(torch.all(one == 1.0)) and bool(torch.all(two == 2.0))
    children.join()


def test_consuming_a_view_after_thousands_of_messages_does_not_fault(children):
    # 2000 tensors of 1 MiB (256 pages each); the consumes of the last 100 read 25 600
    # pages. A view mapped anew per message faults on every one of them; views of a
    # mapping that stays fault on none once the arena's memory has been read once.
    # Faults are counts (getrusage), not times.
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=8)
    n, measured = 2000, 100
    out = children.queue()
    children.start(consuming_reader, out, mq.export_handle(), 0, n, measured)
    mq.wait_until_ready(timeout=STEP)
    for i in range(n):
        mq.enqueue(torch.full((MiB // 4,), float(i)), timeout=STEP)
    _, faults, exact, nbytes = children.expect(out, "faults", timeout=4 * STEP)
    assert exact, "a consume did not read what was sent"
    pages = measured * nbytes // 4096
    assert faults < 64, f"{faults} minor faults over {measured} consumes of {pages} pages"
    assert mq.arena_fallbacks == 0
    children.join()


def test_the_arena_can_be_reserved_ahead(children):
    # Reserved before the first send, the arena does not grow while tensors within the
    # reservation go through (the first sends pay nothing for it).
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4)
    assert mq.arena_stats()["reserved"] == 0
    assert mq.reserve_arena(48 * MiB + 1) == 48 * MiB + 4096
    assert mq.reserve_arena(MiB) == 48 * MiB + 4096  # never less than before
    out = children.queue()
    children.start(releasing_reader, out, mq.export_handle(), 0, 4)
    mq.wait_until_ready(timeout=STEP)
    for i in range(4):
        mq.enqueue({"t": torch.full((2 * MiB,), float(i))}, timeout=STEP)  # 8 MiB each
    assert children.expect(out, "firsts")[1] == [0.0, 1.0, 2.0, 3.0]
    assert mq.arena_stats()["reserved"] == 48 * MiB + 4096
    assert mq.arena_fallbacks == 0
    with pytest.raises(ValueError, match="nbytes"):
        mq.reserve_arena(-1)
    assert MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, arena_bytes=0).reserve_arena(MiB) == 0
    children.join()


def test_a_killed_reader_gives_its_parts_back(children):
    # Arena of 4 parts. Reader 1 holds 3 and is killed; reader 0 keeps nothing. The next
    # parts fit only if the dead reader's holds are dropped: no fallback may happen.
    mq = MessageQueue(2, 2, max_chunk_bytes=64 * 1024, max_chunks=8, arena_bytes=8 * MiB)
    out0, out1 = children.queue(), children.queue()
    children.start(releasing_reader, out0, mq.export_handle(), 0, 6)
    doomed = children.start(holding_reader, out1, mq.export_handle(), 1, 3)
    mq.wait_until_ready(timeout=STEP)
    for i in range(3):
        mq.enqueue({"t": torch.full((MiB // 2,), float(i))}, timeout=STEP)
    children.expect(out1, "holding")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(STEP)
    children.procs.remove(doomed)
    for i in range(3, 6):
        mq.enqueue({"t": torch.full((MiB // 2,), float(i))}, timeout=STEP)
    assert children.expect(out0, "firsts")[1] == [float(i) for i in range(6)]
    assert mq.arena_fallbacks == 0, "the dead reader's parts were not given back"
    children.join()


def test_loaned_memory_is_sent_without_a_copy(children):
    mq = MessageQueue(2, 2, max_chunk_bytes=64 * 1024, max_chunks=4)
    outs = [children.queue() for _ in range(2)]
    for rank, out in enumerate(outs):
        children.start(loan_reader, out, mq.export_handle(), rank)
    mq.wait_until_ready(timeout=STEP)
    tensor = mq.loan_tensor((4 * MiB // 4,), torch.float32)
    array = mq.loan_array((512, 1024), "<f8")
    tensor.fill_(5.0)
    array[:] = 3.0
    before = mq.arena_stats()["outstanding"]
    mq.enqueue({"tensor": tensor, "array": array}, timeout=STEP)
    assert mq.arena_stats()["outstanding"] == before, "a loan send allocated (copied) a new part"
    # Written after the send: sending sealed the loans (the writer's pages are its own
    # copy now), so the writer reads its writes and the readers still see what was sent.
    tensor.fill_(6.0)
    array[:] = 4.0
    assert (float(tensor[0]), float(array[-1, -1])) == (6.0, 4.0)
    mq.enqueue("go", timeout=STEP)
    for out in outs:
        assert children.expect(out, "loaned")[1:] == (5.0, 5.0, "<f8", (512, 1024), 3.0, 3.0)
    # The same loan sent again carries what the writer sees now (copied, like any part).
    tensor[5] = 9.0
    mq.enqueue({"tensor": tensor}, timeout=STEP)
    for out in outs:
        assert children.expect(out, "again")[1:] == (9.0, 6.0)
    assert mq.loan_fallbacks == 0
    children.join()
    del tensor, array
    gc.collect()
    assert _outstanding(mq, at_most=0) == 0


def test_a_loan_written_after_it_was_sent_changes_nothing_readers_get(children):
    """Sending seals a loan: the writer's mapping of it becomes its own copy-on-write
    view. ``fill_(i)`` → ``enqueue`` → ``fill_(1000 + i)``: both readers get ``i`` in
    every element, and the writer reads ``1000 + i``. 40 loans (of the smallest size that
    is sealed, ``LOAN_SEAL_MIN``) through an arena with room for 8 at a time (a ring of 4
    messages keeps at most 6 alive): dropped loans are mapped shared again before their
    memory is lent again, so every later message is right too (a page left private would
    send zeros or an older message's bytes)."""
    mq = MessageQueue(2, 2, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=8 * _core.LOAN_SEAL_MIN)
    outs = [children.queue() for _ in range(2)]
    for rank, out in enumerate(outs):
        children.start(sealed_loan_reader, out, mq.export_handle(), rank)
    mq.wait_until_ready(timeout=STEP)
    for i in range(40):
        t = mq.loan_tensor((_core.LOAN_SEAL_MIN // 4,), torch.float32)  # sealed: smaller ones are copied
        t.fill_(float(i))
        mq.enqueue((i, t), timeout=STEP)
        t.fill_(1000.0 + i)
        assert float(t.min()) == float(t.max()) == 1000.0 + i
        del t
    mq.enqueue(None, timeout=STEP)
    for out in outs:
        assert children.expect(out, "sealed")[1:] == (40, [])
    assert mq.loan_fallbacks == 0, "loans were not given back"
    children.join()


def test_a_dropped_loan_is_given_back():
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, arena_bytes=8 * MiB)
    loans = [mq.loan(2 * MiB) for _ in range(4)]
    assert mq.arena_stats()["outstanding"] == 4
    assert mq.loan_fallbacks == 0
    # Full: a fifth loan is ordinary memory.
    extra = mq.loan(2 * MiB)
    assert mq.loan_fallbacks == 1 and len(extra) == 2 * MiB
    del loans
    gc.collect()
    assert mq.arena_stats()["outstanding"] == 0
    again = mq.loan(8 * MiB)
    assert mq.loan_fallbacks == 1, "the dropped loans were not given back"
    del again
    for bad in (-1, 1.5, "8"):
        with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
            mq.loan(bad)
    assert len(mq.loan(0)) == 0 and mq.loan_fallbacks == 1


def test_remote_and_local_readers_get_the_same_tensors(children):
    mq = MessageQueue(2, 1, max_chunk_bytes=64 * 1024, max_chunks=4, connect_ip="127.0.0.1")
    objs = [torch.randn(MiB), {"a": np.arange(1000), "b": torch.zeros(3, dtype=torch.bfloat16)}, torch.tensor(1)]
    outs = [children.queue() for _ in range(2)]
    for rank, out in enumerate(outs):
        children.start(digest_reader, out, mq.export_handle(), rank, len(objs), True)
    mq.wait_until_ready(timeout=STEP)
    for o in objs:
        mq.enqueue(o, timeout=STEP)
    want = [digest(o) for o in objs]
    for out in outs:
        assert children.expect(out, "digests")[1] == want
    children.join()


@pytest.mark.parametrize("arena_bytes", [0, None], ids=["no-arena", "arena"])
def test_messages_of_many_parts_larger_than_a_chunk(children, arena_bytes):
    # Many small arrays (inline parts) that do not fit a 4 KiB chunk together, and a
    # large tensor: with an arena all of it goes through the arena (the small parts too,
    # until the rest fits a chunk: issue 54), without one through the socket.
    mq = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=2, arena_bytes=arena_bytes)
    objs = [
        [np.full(1000, i, dtype=np.uint8) for i in range(40)],
        {"big": torch.randn(2 * MiB), "small": [np.ones(300)] * 3},
        "plain",
    ]
    outs = [children.queue() for _ in range(2)]
    for rank, out in enumerate(outs):
        children.start(digest_reader, out, mq.export_handle(), rank, len(objs), False)
    mq.wait_until_ready(timeout=STEP)
    for o in objs:
        mq.enqueue(o, timeout=STEP)
    for out in outs:
        assert children.expect(out, "digests")[1] == [digest(o) for o in objs]
    if arena_bytes == 0:
        assert mq._writer.overflow_count >= 1
    else:
        assert mq._writer.overflow_count == 0, "a message went over the socket though the arena had room"
    children.join()


def test_a_message_taken_raw_gives_its_parts_back(children):
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4)
    out = children.queue()
    children.start(raw_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue(torch.ones(MiB), timeout=STEP)
    mq.enqueue({"next": np.arange(5)}, timeout=STEP)
    _, n, second = children.expect(out, "second")
    assert 0 < n < 64 * 1024 and second == digest({"next": np.arange(5)})
    assert _outstanding(mq, at_most=0) == 0, "acquire_read kept the arena part"
    children.join()

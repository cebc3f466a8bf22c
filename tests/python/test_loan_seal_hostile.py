"""Hostile tests of sealed loans: what a reader gets once the writer wrote a loan after
sending (or putting) it, in the corners of sealing.

A writer out of mappings (``vm.max_map_count``: each mapping and each split of one
counts) cannot seal a loan, whose pages are then still shared with the readers. Such a
loan must be sent by copy: before, the failure was only logged and the loan sent by
reference, so the writer's writes after the send reached the readers.
"""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest
import torch

from _processes.loan_seal_children import hogged_queue_writer, hogged_store_writer, two_part_reader
from _processes import STEP
from _processes.store_children import signed_get
from _processes.tensor_children import sealed_loan_reader
from shmq import MessageQueue, ObjectStorage, _core, metrics

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
#: The smallest loaned part a queue seals and sends by reference (smaller ones are copied).
SEALED = _core.LOAN_SEAL_MIN


def test_a_writer_out_of_mappings_sends_loans_by_copy_not_by_a_shared_reference(children):
    out = children.queue()
    children.start(hogged_queue_writer, out, 5)
    handle = children.expect(out, "handle")[1]
    reader = MessageQueue.create_from_handle(handle, 0)
    reader.wait_until_ready(timeout=STEP)
    got = []
    while (msg := reader.dequeue(timeout=STEP)) is not None:
        i, a = msg
        got.append((i, float(a.min()), float(a.max())))
        del msg, a
    _, at_limit, maps, fallbacks = children.expect(out, "sent")
    assert got[0] == (-1, -1.0, -1.0)
    wrong = [g for g in got[1:] if g != (g[0], g[0], g[0])]
    assert not wrong, f"writes after the send reached the reader: {wrong} ({at_limit} mappings)"
    assert [g[0] for g in got[1:]] == list(range(5))
    children.expect(out, "done")
    del reader
    gc.collect()
    children.join()


def test_a_store_writer_out_of_mappings_puts_loans_by_copy(children):
    out, cmds = children.queue(), children.queue()
    children.start(hogged_store_writer, out, cmds, 4)
    store = ObjectStorage.create_from_handle(pickle.loads(children.expect(out, "handle")[1]))
    _, handles, at_limit, maps, fallbacks = children.expect(out, "put")
    wrong = []
    for i, (address, mid) in enumerate(handles):
        a = signed_get(store, address, mid)["a"]
        lo, hi = float(np.min(a)), float(np.max(a))
        if (lo, hi) != (i, i):
            wrong.append((i, lo, hi))
        del a
    cmds.put("stop")
    assert not wrong, f"writes after the put reached the reader: {wrong} ({at_limit} mappings)"
    gc.collect()
    children.join()
    store.close()


def test_two_arrays_of_one_loan_in_one_message_are_both_references_and_both_sealed(children):
    """A message with two arrays viewing one loan (its halves): both go by reference
    (sealing the loan for the first must not make the second a copy), and a write after
    the send reaches neither. Loans are dropped and lent again: reused memory is clean."""
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=32 * MiB)
    out = children.queue()
    children.start(two_part_reader, out, mq.export_handle())
    mq.wait_until_ready(timeout=STEP)
    for i in range(12):
        a = mq.loan_array((2 * SEALED // 4,))
        a[:] = i
        mq.enqueue((i, a[: SEALED // 4], a[SEALED // 4 :]), timeout=STEP)
        a[:] = 1000 + i
        assert float(a.min()) == 1000 + i
        del a
    mq.enqueue(None, timeout=STEP)
    assert children.expect(out, "read")[1:] == (12, [])
    m = metrics.collect([mq.export_handle().buffer_handle[3]])[0]
    assert (m["loaned_parts"], m["arena_parts"], m["fallback_parts"]) == (24, 0, 0), m
    children.join()


def test_a_fork_after_the_send_changes_nothing_readers_get(children):
    """The writer forks after each send; the child writes the loan (its own copy of the
    private view) and exits; the parent writes it too, then drops it. Readers get what
    was sent, and memory lent again after the drops is shared again (clean)."""
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=32 * MiB)
    out = children.queue()
    children.start(sealed_loan_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    for i in range(16):
        t = mq.loan_tensor((SEALED // 4,), torch.float32)
        t.fill_(float(i))
        mq.enqueue((i, t), timeout=STEP)
        pid = os.fork()
        if pid == 0:
            try:
                t.numpy()[:] = 2000.0 + i  # numpy: no torch thread pool in the child
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert float(t.min()) == float(t.max()) == float(i), "the child's write reached the parent"
        t.fill_(1000.0 + i)
        del t
    mq.enqueue(None, timeout=STEP)
    assert children.expect(out, "sealed")[1:] == (16, [])
    assert mq.loan_fallbacks == 0
    children.join()


def test_a_loan_sent_to_a_local_and_a_remote_reader_reaches_neither_once_written(children):
    """One local reader (arena reference) and one remote reader (ZeroMQ frames, in
    another process): the writer writes each loan right after the send; both readers get
    what was sent (the remote frames are copied out of the loan within the send)."""
    mq = MessageQueue(2, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=32 * MiB)
    outs = [children.queue() for _ in range(2)]
    for rank, out in enumerate(outs):
        children.start(sealed_loan_reader, out, mq.export_handle(), rank)
    mq.wait_until_ready(timeout=STEP)
    for i in range(16):
        t = mq.loan_tensor((SEALED // 4,), torch.float32)
        t.fill_(float(i))
        mq.enqueue((i, t), timeout=STEP)
        t.fill_(1000.0 + i)
        del t
    mq.enqueue(None, timeout=STEP)
    for out in outs:
        assert children.expect(out, "sealed")[1:] == (16, [])
    assert mq.loan_fallbacks == 0
    children.join()


def test_sent_loans_dropped_by_another_thread_while_the_writer_sends_leave_reuse_clean(children):
    """Each sent loan goes to a thread that writes it and drops it (its pages mapped
    shared again there) while the main thread goes on lending and sending: every message
    a reader gets is what was sent, also in memory reused after such drops."""
    import queue
    import threading

    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=32 * MiB)
    out = children.queue()
    children.start(sealed_loan_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    handoff: queue.Queue = queue.Queue()

    def dropper() -> None:
        while (item := handoff.get()) is not None:
            i, t = item
            t.fill_(1000.0 + i)
            del item, t  # the loan goes back now (no collection needed: no cycle holds it)

    th = threading.Thread(target=dropper)
    th.start()
    try:
        for i in range(40):
            t = mq.loan_tensor((SEALED // 4,), torch.float32)
            t.fill_(float(i))
            mq.enqueue((i, t), timeout=STEP)
            handoff.put((i, t))
            del t
    finally:
        handoff.put(None)
        th.join()
    mq.enqueue(None, timeout=STEP)
    assert children.expect(out, "sealed")[1:] == (40, [])
    children.join()


def test_a_loan_smaller_than_the_seal_size_is_copied_and_stays_the_writers_to_reuse(children):
    """A loaned part under ``LOAN_SEAL_MIN`` is copied at the send (sealing would cost
    more than the copy): the reader in another process gets what was sent, the writer's
    later writes reach no message, and the same loan, written again, is sent again (a
    copy each time). The metrics count them as copied parts, none loaned."""
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=32 * MiB)
    out = children.queue()
    children.start(sealed_loan_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    t = mq.loan_tensor(((SEALED - 4096) // 4,), torch.float32)
    for i in range(8):
        t.fill_(float(i))
        mq.enqueue((i, t), timeout=STEP)
        t.fill_(1000.0 + i)
    del t
    mq.enqueue(None, timeout=STEP)
    assert children.expect(out, "sealed")[1:] == (8, [])
    m = metrics.collect([mq.export_handle().buffer_handle[3]])[0]
    assert (m["loaned_parts"], m["arena_parts"], m["fallback_parts"]) == (0, 8, 0), m
    assert mq.arena_stats()["outstanding"] == 0, "the loan was not given back"
    children.join()

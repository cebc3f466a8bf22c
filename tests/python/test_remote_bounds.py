"""The remote stream's bounds (issue 18, items 8 and 9), across real processes: a remote
reader that stops reading holds the writer at its credit (messages or bytes), neither
process's memory grows, and ``slow_remote_reader`` decides between waiting and
dropping; connections that never say HELLO are closed, so they cannot use up the
writer's file descriptors, and a real reader still joins after them."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import pytest
import zmq

from shmq import MessageQueue

from _processes import (
    STEP,
    WaitTimeout,
    guarded_writer,
    numbered_message,
    one_message_reader,
    stalled_remote_reader,
    wait_for,
)

MIB = 1 << 20
# 300 messages of 2 MiB: 600 MB, which an unbounded stream would hold in the reader.
N_MESSAGES = 300
# How much either process may grow while the reader does not read (the bounds allow
# ~20-32 MiB in flight; the rest is slack for allocators).
RSS_BOUND = 200 * MIB


def _rss(pid: int) -> int:
    """Resident memory of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _n_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _start_stalled(children, **options):
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", **options)
    out, cmds = children.queue(), children.queue()
    children.start(stalled_remote_reader, out, mq.export_handle(), 0, cmds)
    mq.wait_until_ready(timeout=STEP)
    _, pid = children.expect(out, "ready")
    return mq, out, cmds, pid, _rss(pid)


@pytest.mark.parametrize(
    "bound",
    [{"remote_hwm": 10}, {"remote_max_queued_bytes": 16 * MIB}],
    ids=["messages", "bytes"],
)
def test_a_reader_that_stops_reading_blocks_the_writer_within_bounded_memory(children, bound):
    mq, out, cmds, pid, reader_rss = _start_stalled(children, slow_remote_reader="block", **bound)
    writer_rss = _rss(os.getpid())
    sent = 0
    with pytest.raises(TimeoutError):
        for i in range(N_MESSAGES):
            mq.enqueue(numbered_message(i), timeout=2.0)
            sent += 1
    # Held at its credit: about 10 (or 8) messages, well before 300.
    assert 1 <= sent <= 20, sent
    assert _rss(pid) - reader_rss < RSS_BOUND, f"reader RSS grew {(_rss(pid) - reader_rss) / MIB:.0f} MiB"
    assert _rss(os.getpid()) - writer_rss < RSS_BOUND, "the writer's memory grew"
    # The reader takes what was sent, in order; the timed-out message went to nobody, so
    # the stream goes on whole with it.
    cmds.put((sent, STEP))
    _, got, err = children.expect(out, "got")
    assert (got, err) == (list(range(sent)), None)
    mq.enqueue(numbered_message(sent), timeout=STEP)
    cmds.put((1, STEP))
    assert children.expect(out, "got")[1:] == ([sent], None)
    cmds.put(None)
    mq.shutdown()


def test_writers_made_one_after_another_each_get_their_reader(children):
    """A process's remote sockets share one ZeroMQ context. A writer dropped with
    messages still queued for its reader emits the last monitor events of its port from
    ZeroMQ's I/O thread after the drop; its guard must go on reading them, or that thread
    blocks and the next writer's port accepts nobody (this timed out within a few
    rounds before the guard drained its monitor)."""
    for round_ in range(10):
        mq = MessageQueue(1, 0, connect_ip="127.0.0.1", slow_remote_reader="block", remote_hwm=10)
        out, cmds = children.queue(), children.queue()
        children.start(stalled_remote_reader, out, mq.export_handle(), 0, cmds)
        mq.wait_until_ready(timeout=STEP)  # round 2-10: the next writer's port
        children.expect(out, "ready")
        sent = 0
        with pytest.raises(TimeoutError):
            for i in range(N_MESSAGES):
                mq.enqueue(numbered_message(i), timeout=0.5)
                sent += 1
        cmds.put((sent, STEP))
        assert children.expect(out, "got")[1:] == (list(range(sent)), None), round_
        cmds.put(None)
        mq.shutdown()
        del mq


def test_a_reader_that_stops_reading_is_dropped_and_the_writer_goes_on(children, caplog):
    mq, out, cmds, pid, reader_rss = _start_stalled(children, slow_remote_reader="drop", remote_hwm=10)
    with caplog.at_level(logging.WARNING, logger="shmq"):
        for i in range(N_MESSAGES):
            mq.enqueue(numbered_message(i), timeout=STEP)
    # (``dropped_readers`` lists local readers only; the warning names the remote one.)
    assert any("rank 0 is not keeping up" in r.getMessage() for r in caplog.records), caplog.text
    assert _rss(pid) - reader_rss < RSS_BOUND, f"reader RSS grew {(_rss(pid) - reader_rss) / MIB:.0f} MiB"
    # It got a prefix of the stream, then an error that says it was dropped (issue 33;
    # it waited for its timeout before).
    cmds.put((N_MESSAGES, 2.0))
    _, got, err = children.expect(out, "got")
    assert 1 <= len(got) <= 20 and got == list(range(len(got))), got
    assert err is not None and err[0] == "ConnectionError" and "dropped" in err[1], err
    cmds.put(None)
    mq.shutdown()


N_DEALERS = 200


def _dealers(ctx, address: str, reconnect: bool) -> list:
    """``N_DEALERS`` ZeroMQ DEALERs connected to ``address`` that never send anything
    (``reconnect``: ZeroMQ's default of connecting again once closed)."""
    socks = []
    for _ in range(N_DEALERS):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if not reconnect:
            s.setsockopt(zmq.RECONNECT_IVL, -1)
        s.connect(address)
        socks.append(s)
    return socks


@contextlib.contextmanager
def _flooded_writer(children, reconnect: bool):
    """A writer (in a child) with ``N_DEALERS`` silent DEALERs connected to its remote
    port: yields its descriptor count before the flood and its pid. On leaving, checks
    that a real reader still joins and gets the stream, then closes everything."""
    out, cmds = children.queue(), children.queue()
    children.start(guarded_writer, out, cmds)
    _, handle, pid = children.expect(out, "handle")
    base = _n_fds(pid)
    ctx = zmq.Context()
    socks = _dealers(ctx, handle.remote_subscribe_addr, reconnect=reconnect)
    try:
        yield base, pid
        # A real reader still joins and gets the stream (it reports on a queue of its
        # own: the writer's "sent" and its "got" come from two processes, in any order).
        reader_out = children.queue()
        children.start(one_message_reader, reader_out, handle, 0)
        assert children.expect(out, "sent") == ("sent",)
        assert children.expect(reader_out, "got") == ("got", "after the flood")
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        cmds.put(None)


def test_connections_that_never_say_hello_are_closed_and_a_reader_still_joins(children):
    # Not back once closed, so that the writer's count can go back to its start.
    with _flooded_writer(children, reconnect=False) as (base, pid):
        # They connect (the writer holds a descriptor for each, up to the guard's count
        # bound), then within the guard's time bound every one of them is closed.
        most = base

        def came_and_went() -> bool:
            nonlocal most
            n = _n_fds(pid)
            most = max(most, n)
            return most >= base + 32 and n <= base + 2

        with contextlib.suppress(WaitTimeout):
            wait_for(came_and_went, STEP, "the connections to come and be closed", 0.05)
        assert most >= base + 32, f"the connections never reached the writer ({most} vs {base})"
        assert _n_fds(pid) <= base + 2, f"{_n_fds(pid)} descriptors, {base} before"


def test_connections_that_come_back_stay_bounded_in_number(children):
    """DEALERs that reconnect at once when closed (ZeroMQ's default): the writer holds at
    most the guard's count bound of them (64) and a burst, never all 200, and a real
    reader still joins among them."""
    with _flooded_writer(children, reconnect=True) as (base, pid):
        most = base
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            most = max(most, _n_fds(pid))
            time.sleep(0.02)  # not synchronisation: sampling the count for 3 s
        assert base + 32 <= most < base + N_DEALERS - 20, (most, base)

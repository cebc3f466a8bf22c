"""The remote stream's faults (issue 33, items 1-4), in real processes over 127.0.0.1: no
remote wait goes on without an end, and joining survives what a network and its peers
do to it.

- A remote reader learns that its writer is gone, and raises what a local reader
  raises: ``PeerDiedError`` for a writer killed (at once: its connection closes), stopped
  or cut off (ZeroMQ's heartbeats: within ``SILENT_WRITER_BOUND``), or dead before the
  reader joined (``SILENT_WRITER_BOUND``); ``QueueShutDownError`` after every message for
  a writer that shut the queue down and left at once.
- A reader that ``slow_remote_reader="drop"`` dropped gets the messages sent to it before,
  then an error that says it was dropped (it waited forever before).
- Joining: a reader's HELLO is said again until the writer answers, so a flood of silent
  TCP connections that makes the writer's port guard close the reader's first connection
  does not keep it out (before: the writer raised "Host unreachable" on every call and
  the reader timed out); a rank whose reader died before the queue was ready is free
  again for a replacement (before: "Host unreachable", then "rank 0 has joined
  already").

- A writer blocked on a remote reader's credit does not wait for a reader that stopped
  answering (issue 44): a reader process stopped (SIGSTOP) answers none of the writer's
  ZeroMQ heartbeats, as a machine that hangs or a link that is cut
  (test_remote_link_cut.py has the link): within ``SILENT_READER_BOUND`` the writer
  counts it gone (a warning naming its rank) and its enqueue returns (before: it waited
  until its own timeout, for good without one). A reader stopped for less (2 s) is not
  cut off: it gets every message once it reads.

Each test failed (a timeout, or a wrong error) before these were made.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import psutil
import pytest

from _processes import (
    STEP,
    busy_writer,
    counting_writer,
    hello_then_sleep,
    joining_reader,
    stalled_remote_reader,
    wait_for,
)
from shmq import MessageQueue, PeerDiedError, QueueShutDownError

# A writer that stops answering is found by ZeroMQ's heartbeats: a PING every second, the
# connection given up 4 s after one goes unanswered: at most 5 s (docs/operations.md).
SILENT_WRITER_BOUND = 5.0
# The writer's side of the same heartbeats: a PING every second, the reader's
# connection given up when nothing comes back for 4 s: at most 5 s after the last thing
# heard from it.
SILENT_READER_BOUND = 5.0
# Slack for a busy 2-core machine on top of the bounds above.
SLACK = 2.5


def _remote_reader_of(children, n: int):
    """A writer child for one remote reader that sends ``n`` numbers, and this process's
    reader of them, ready: (reader, writer process, its command queue)."""
    out, cmds = children.queue(), children.queue()
    proc = children.start(counting_writer, out, n, cmds)
    _, handle, _ = children.expect(out, "handle")
    reader = MessageQueue.create_from_handle(handle, 0)
    reader.wait_until_ready(timeout=STEP)
    children.expect(out, "sent")
    assert [reader.dequeue(timeout=STEP) for _ in range(n)] == list(range(n))
    return reader, proc, cmds


def _connections_accepted(pid: int, port: int) -> int:
    """How many TCP connections process ``pid`` has accepted on its port ``port``."""
    return sum(
        c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
        for c in psutil.Process(pid).net_connections("tcp")
    )


def _gone(children, proc) -> None:
    proc.join(STEP)
    children.procs.remove(proc)


def test_a_remote_reader_learns_at_once_that_its_writer_was_killed(children):
    reader, writer, _ = _remote_reader_of(children, 100)
    os.kill(writer.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError, match="the writer at tcp://127.0.0.1:.* is gone") as e:
        reader.dequeue(timeout=20)
    took = time.monotonic() - t0
    assert took < 1.0 + SLACK, f"{took:.2f} s"
    assert "100 messages received" in str(e.value)
    # Every later call says the same, at once.
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError):
        reader.dequeue(timeout=20)
    assert time.monotonic() - t0 < 1.0
    _gone(children, writer)


def test_a_remote_reader_learns_that_its_writer_stopped_answering(children):
    """A stopped writer process (SIGSTOP) answers nothing, as a machine that hangs or a
    link that went down: ZeroMQ's heartbeats find it within their bound."""
    reader, writer, _ = _remote_reader_of(children, 5)
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError, match="is gone"):
            reader.dequeue(timeout=20)
        took = time.monotonic() - t0
        assert took < SILENT_WRITER_BOUND + SLACK, f"{took:.2f} s"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        os.kill(writer.pid, signal.SIGCONT)
    _gone(children, writer)


def test_a_remote_reader_of_a_writer_dead_before_it_joined_does_not_wait_for_its_timeout(children):
    out, cmds = children.queue(), children.queue()
    writer = children.start(counting_writer, out, 0, cmds)
    _, handle, _ = children.expect(out, "handle")
    os.kill(writer.pid, signal.SIGKILL)
    _gone(children, writer)
    reader = MessageQueue.create_from_handle(handle, 0)
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError, match="cannot reach the writer"):
        reader.wait_until_ready(timeout=20)
    took = time.monotonic() - t0
    assert took < SILENT_WRITER_BOUND + SLACK, f"{took:.2f} s"


def test_a_writer_that_shuts_down_and_leaves_at_once_ends_its_remote_reader(children):
    reader, writer, cmds = _remote_reader_of(children, 10)
    cmds.put("shutdown")
    t0 = time.monotonic()
    with pytest.raises(QueueShutDownError):
        reader.dequeue(timeout=20)
    assert time.monotonic() - t0 < 1.0 + SLACK
    _gone(children, writer)


def test_a_dropped_remote_reader_is_told_it_was_dropped(children):
    """``slow_remote_reader="drop"``: a reader stopped (SIGSTOP) while the writer goes on is
    dropped at its credit; resumed, it gets what was sent to it before, then an error
    that says so, also after the writer shut down (before: it waited forever)."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", slow_remote_reader="drop", remote_hwm=10)
    out, cmds = children.queue(), children.queue()
    reader = children.start(stalled_remote_reader, out, mq.export_handle(), 0, cmds)
    mq.wait_until_ready(timeout=STEP)
    children.expect(out, "ready")
    os.kill(reader.pid, signal.SIGSTOP)
    try:
        for i in range(30):
            mq.enqueue(i.to_bytes(8, "little"), timeout=STEP)
        mq.shutdown()
    finally:
        os.kill(reader.pid, signal.SIGCONT)
    t0 = time.monotonic()
    cmds.put((100, 10.0))
    _, got, err = children.expect(out, "got")
    took = time.monotonic() - t0
    assert got == list(range(10)), got
    assert err is not None and err[0] == "ConnectionError", err
    assert "dropped" in err[1] and "rank 0" in err[1], err
    assert took < 1.0 + SLACK, f"{took:.2f} s"
    cmds.put(None)


N_SILENT = 100


def test_a_reader_joins_a_busy_writer_through_a_flood_of_silent_connections(children):
    """The reader says HELLO, then 100 plain TCP connections that never say anything reach
    the writer's port while the writer is busy elsewhere: its port guard closes the
    oldest beyond its bound at once, the reader's first among them. The reader says HELLO
    again on its next connection, and the writer, once it waits, goes on past the dead
    one (before: "Host unreachable" from every wait_until_ready, a TimeoutError in the
    reader)."""
    out = children.queue()
    children.start(busy_writer, out, 3.0)
    _, handle, writer_pid = children.expect(out, "handle")
    reader_out = children.queue()
    children.start(joining_reader, reader_out, handle, 0, 20.0)
    children.expect(reader_out, "hello")
    port = int(handle.remote_subscribe_addr.rsplit(":", 1)[1])
    # Its connection is the oldest: the writer has accepted it before the flood comes.
    wait_for(lambda: _connections_accepted(writer_pid, port) >= 1, STEP, "the writer to accept the reader's connection")
    silent = [socket.create_connection(("127.0.0.1", port), timeout=STEP) for _ in range(N_SILENT)]
    try:
        assert children.expect(out, "sent") == ("sent",)
        assert children.expect(reader_out, "got") == ("got", "after the flood")
    finally:
        for s in silent:
            s.close()


def test_a_rank_whose_reader_died_before_the_queue_was_ready_takes_a_replacement(children):
    """Two remote readers: rank 0 joins (the writer takes its HELLO while it waits for
    rank 1) and is killed. The writer waits on (timeouts, never an error about the dead
    one), a replacement takes rank 0, and once rank 1 joins every reader gets the stream
    (before: the replacement was refused with "rank 0 has joined already", and the writer
    raised "Host unreachable" once both ranks were in)."""
    mq = MessageQueue(2, 0, connect_ip="127.0.0.1")
    handle = mq.export_handle()
    out = children.queue()
    first = children.start(hello_then_sleep, out, handle, 0)
    children.expect(out, "hello")
    with pytest.raises(TimeoutError):
        mq.wait_until_ready(timeout=1.0)  # takes rank 0's HELLO, waits for rank 1
    os.kill(first.pid, signal.SIGKILL)
    _gone(children, first)
    with pytest.raises(TimeoutError):
        mq.wait_until_ready(timeout=0.5)
    replacement_out, other_out = children.queue(), children.queue()
    children.start(joining_reader, replacement_out, handle, 0, STEP)
    assert children.expect(replacement_out, "hello")[0] == "hello"
    with pytest.raises(TimeoutError):
        mq.wait_until_ready(timeout=1.0)  # rank 1 is not there yet
    children.start(joining_reader, other_out, handle, 1, STEP)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue("to both", timeout=STEP)
    assert children.expect(replacement_out, "got") == ("got", "to both")
    assert children.expect(other_out, "hello")[0] == "hello"
    assert children.expect(other_out, "got") == ("got", "to both")
    mq.shutdown()


HWM = 4


def _num(i: int) -> bytes:
    """Message ``i`` as ``stalled_remote_reader`` reads it (its number, 8 bytes)."""
    return i.to_bytes(8, "little")


def _writer_with_stalled_reader(children, **options):
    """This process writes to one remote reader (a child that reads only when told) with
    room for ``HWM`` messages in flight; the window is full: the next enqueue waits for
    the reader. (queue, reader process, its report queue, its command queue)."""
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", remote_hwm=HWM, **options)
    out, cmds = children.queue(), children.queue()
    reader = children.start(stalled_remote_reader, out, mq.export_handle(), 0, cmds)
    mq.wait_until_ready(timeout=STEP)
    children.expect(out, "ready")
    for i in range(HWM):
        mq.enqueue(_num(i), timeout=STEP)
    return mq, reader, out, cmds


def test_a_writer_blocked_on_a_remote_reader_that_stopped_answering_goes_on_without_it(children, caplog):
    mq, reader, out, cmds = _writer_with_stalled_reader(children)
    os.kill(reader.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="shmq"):
            mq.enqueue(_num(HWM), timeout=STEP)
            took = time.monotonic() - t0
            # Later messages go on at once: the gone reader holds nothing up.
            t1 = time.monotonic()
            mq.enqueue(_num(HWM + 1), timeout=STEP)
            assert time.monotonic() - t1 < 1.0
    finally:
        os.kill(reader.pid, signal.SIGCONT)
    assert 3.0 < took < SILENT_READER_BOUND + SLACK, f"{took:.2f} s (its timeout: {STEP} s)"
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert gone and "remote reader rank 0 (host 127.0.0.1)" in gone[0], caplog.text
    # The reader, resumed, gets what had arrived, then learns its connection is gone.
    cmds.put((100, 10.0))
    _, got, err = children.expect(out, "got")
    assert got == list(range(HWM)), got
    assert err is not None and err[0] == "PeerDiedError" and "is gone" in err[1], err
    cmds.put(None)
    mq.shutdown()


def test_a_lost_remote_reader_is_an_error_for_a_writer_that_asks_for_one(children):
    """``on_lost_remote_reader="raise"`` (the vLLM plugin's default: vLLM's engine cannot
    go on without a worker node): the send that finds the reader gone raises
    ``PeerDiedError`` naming it, and so does every later one."""
    mq, reader, out, cmds = _writer_with_stalled_reader(children, on_lost_remote_reader="raise")
    os.kill(reader.pid, signal.SIGSTOP)
    try:
        with pytest.raises(PeerDiedError, match=r"remote reader rank 0 \(host 127.0.0.1\) is gone"):
            mq.enqueue(_num(HWM), timeout=STEP)
        with pytest.raises(PeerDiedError, match="rank 0"):
            mq.enqueue(_num(HWM + 1), timeout=STEP)
    finally:
        os.kill(reader.pid, signal.SIGCONT)
    cmds.put(None)
    mq.shutdown()
    with pytest.raises(ValueError, match="on_lost_remote_reader must be 'warn' or 'raise'"):
        MessageQueue(1, 0, connect_ip="127.0.0.1", on_lost_remote_reader="ignore")  # type: ignore[arg-type]


def test_a_writer_that_sends_nothing_learns_of_a_lost_remote_reader_within_the_bound(children):
    """``lost_remote_readers()``: a writer waiting for something else (vLLM's executor,
    for its workers' answers) finds a reader that stopped answering by the connection
    ZeroMQ closed, without sending; never waits itself."""
    mq, reader, out, cmds = _writer_with_stalled_reader(children)
    assert mq.lost_remote_readers() == []
    os.kill(reader.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        lost = wait_for(mq.lost_remote_readers, SILENT_READER_BOUND + SLACK + 2, "the stopped reader lost")
        took = time.monotonic() - t0
    finally:
        os.kill(reader.pid, signal.SIGCONT)
    assert lost == [(0, "127.0.0.1")], lost
    assert took < SILENT_READER_BOUND + SLACK, took
    assert MessageQueue(1, 1).lost_remote_readers() == []  # no remote readers
    cmds.put(None)
    mq.shutdown()


def test_a_remote_reader_stopped_for_less_than_the_bound_is_not_cut_off(children, caplog):
    mq, reader, out, cmds = _writer_with_stalled_reader(children)
    os.kill(reader.pid, signal.SIGSTOP)
    resume = threading.Timer(2.0, os.kill, (reader.pid, signal.SIGCONT))
    resume.start()
    try:
        t0 = time.monotonic()
        # The writer waits for the reader past the bound: it was silent for less than
        # the heartbeats' timeout, and it is still there (it takes nothing: stalled).
        with caplog.at_level(logging.WARNING, logger="shmq"):
            with pytest.raises(TimeoutError, match="remote reader rank 0"):
                mq.enqueue(_num(HWM), timeout=SILENT_READER_BOUND + SLACK)
        assert time.monotonic() - t0 >= SILENT_READER_BOUND + SLACK - 0.1
    finally:
        resume.join()
        os.kill(reader.pid, signal.SIGCONT)
    assert not [r for r in caplog.records if "is gone" in r.getMessage()], caplog.text
    # The reader reads: the message that timed out is sent again, and it gets them all.
    cmds.put((HWM + 1, 10.0))
    mq.enqueue(_num(HWM), timeout=STEP)
    _, got, err = children.expect(out, "got")
    assert (got, err) == (list(range(HWM + 1)), None)
    cmds.put(None)
    mq.shutdown()

"""The user's name in every message (issue 59 item 2), in real processes: a queue made
with ``name=`` is named so (its segment beside it) in a dead writer's ``PeerDiedError``,
the writer's shutdown as its reader hears it, a reader's timeout, and the warning that a
dead reader was dropped; before, they named only the segment (``shmq_ring_<pid>_<hex>``)
or nothing. Over TCP too: the writer says the name in its WELCOME (under its MAC), and a
remote reader's errors and waits name the queue by it, as the writer's warnings about
its remote readers do."""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import pytest

from _processes.handshake_children import reader_until_told
from _processes.harness import STEP
from _processes.named_children import named_remote_writer, named_writer
from shmq import MessageQueue, PeerDiedError, QueueShutDownError


def _name() -> str:
    return f"results-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("how", ["kill", "shutdown"])
def test_a_readers_errors_name_the_queue_as_its_writer_named_it(children, how) -> None:
    name = _name()
    out, go, end = children.queue(), children.event(), children.event()
    children.start(named_writer, out, name, go, ["one"], end, how)
    children.expect(out, "ready")
    reader = MessageQueue.open(name, 0)
    reader.wait_until_ready(timeout=STEP)
    words = f"queue '{name}' (segment {reader.buffer.name})"
    with pytest.raises(TimeoutError) as waited:
        reader.dequeue(timeout=0.5)  # nothing sent yet
    assert f"local reader 0 (rank 0) of {words} waiting for the writer" in str(waited.value), waited.value
    go.set()
    assert reader.dequeue(timeout=STEP) == "one"
    end.set()
    error = PeerDiedError if how == "kill" else QueueShutDownError
    with pytest.raises(error) as ended:
        reader.dequeue(timeout=STEP)
    assert words in str(ended.value), ended.value


def test_the_warning_that_a_dead_reader_was_dropped_names_the_queue(children, caplog) -> None:
    name = _name()
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2, name=name, on_dead_reader="drop")
    out, end = children.queue(), children.event()
    reader = children.start(reader_until_told, out, mq.export_handle(), 0, end)
    children.expect(out, "made")
    mq.wait_until_ready(timeout=STEP)
    os.kill(reader.pid, signal.SIGKILL)
    reader.join(STEP)
    children.procs.remove(reader)
    with caplog.at_level(logging.WARNING, logger="shmq"):
        for i in range(3):  # the third waits for the dead reader's chunk: dropped
            mq.enqueue(i, timeout=STEP)
    died = [r.getMessage() for r in caplog.records if "died; going on without it" in r.getMessage()]
    assert died and f"reader 0 (pid {reader.pid}) of queue '{name}' (segment {mq.buffer.name}) died" in died[0], died
    assert mq.dropped_readers == [0]
    mq.shutdown()


@pytest.mark.parametrize("how", ["kill", "shutdown"])
def test_a_remote_readers_errors_name_the_queue_as_its_writer_named_it(children, how) -> None:
    name = _name()
    out, go, end = children.queue(), children.event(), children.event()
    children.start(named_remote_writer, out, name, go, ["one"], end, how)
    _, _, handle = children.expect(out, "ready")
    reader = MessageQueue.create_from_handle(handle, 0)
    reader.wait_until_ready(timeout=STEP)
    endpoint = handle.remote_subscribe_addr
    with pytest.raises(TimeoutError) as waited:
        reader.dequeue(timeout=0.5)  # nothing sent yet
    assert f"the writer of queue '{name}' at {endpoint}" in str(waited.value), waited.value
    go.set()
    assert reader.dequeue(timeout=STEP) == "one"
    end.set()
    error = PeerDiedError if how == "kill" else QueueShutDownError
    with pytest.raises(error) as ended:
        reader.dequeue(timeout=4 * STEP)
    words = f"of queue '{name}' at {endpoint}" if how == "kill" else f"of queue '{name}' (at {endpoint})"
    assert words in str(ended.value), ended.value


def test_the_writers_warning_that_a_remote_reader_is_gone_names_the_queue(children, caplog) -> None:
    name = _name()
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1", name=name)
    out, end = children.queue(), children.event()
    reader = children.start(reader_until_told, out, mq.export_handle(), 0, end)
    mq.wait_until_ready(timeout=STEP)
    children.expect(out, "made")
    os.kill(reader.pid, signal.SIGKILL)
    reader.join(STEP)
    children.procs.remove(reader)
    with caplog.at_level(logging.WARNING, logger="shmq"):
        for i in range(200):  # until the writer sees its connection closed
            mq.enqueue(i, timeout=STEP)
            if any("is gone" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.02)
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert gone and f"remote reader rank 0 (host 127.0.0.1) of queue '{name}' is gone" in gone[0], gone
    mq.shutdown()

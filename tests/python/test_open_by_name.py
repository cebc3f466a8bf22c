"""Opening a queue or a store by name (issue 45 item 5), in real processes: a writer in
one process, readers that know only its name in another; a missing name, a name already
held, a writer that died, another user, a directory of names that is not the user's."""

from __future__ import annotations

import os
import uuid

import pytest

from _processes.harness import STEP, wait_for
from _processes.named_children import named_store, named_writer, open_as_another_user
from shmq import MessageQueue, ObjectStorage, QueueShutDownError, _names


def _name(what: str) -> str:
    return f"{what} {os.getpid()}-{uuid.uuid4().hex[:8]}"


def test_a_reader_opens_a_queue_of_another_process_by_its_name(children) -> None:
    name = _name("results →")
    out = children.queue()
    children.start(named_writer, out, name, None, [{"n": i} for i in range(5)], None, "shutdown")
    children.expect(out, "ready")
    mq = MessageQueue.open(name, 0)
    mq.wait_until_ready(timeout=STEP)
    assert mq.name == name
    assert [mq.dequeue(timeout=STEP) for _ in range(5)] == [{"n": i} for i in range(5)]
    with pytest.raises(QueueShutDownError):
        mq.dequeue(timeout=STEP)
    children.join()
    # Shut down: the name is free, and opening it says there is no such queue.
    with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
        MessageQueue.open(name, 0)


def test_a_missing_name_and_a_name_held_by_a_live_writer_are_clear_errors() -> None:
    name = _name("missing")
    with pytest.raises(FileNotFoundError, match=f"no queue named {name!r} on this machine for this user"):
        MessageQueue.open(name, 0)
    with pytest.raises(FileNotFoundError, match=f"no store named {name!r}"):
        ObjectStorage.open(name)
    held = MessageQueue(1, 1, name=name)
    try:
        with pytest.raises(FileExistsError, match=f"a queue named {name!r} already exists .*pid {os.getpid()}"):
            MessageQueue(1, 1, name=name)
    finally:
        held.shutdown()
    # Free again once its writer shut down.
    again = MessageQueue(1, 1, name=name)
    again.shutdown()


def test_a_killed_writer_leaves_no_name_behind(children) -> None:
    name = _name("killed")
    out, go = children.queue(), children.event()
    p = children.start(named_writer, out, name, go, [], None, "kill")
    children.expect(out, "ready")
    mq = MessageQueue.open(name, 0)
    mq.wait_until_ready(timeout=STEP)
    go.set()
    wait_for(lambda: not p.is_alive(), what="the writer to be killed")
    with pytest.raises(FileNotFoundError, match=f"the queue named {name!r} is gone: its writer \\(pid {p.pid}\\)"):
        MessageQueue.open(name, 0)
    # The name is taken over by a new writer (no stale record in the way).
    new = MessageQueue(1, 1, name=name)
    try:
        assert MessageQueue.open(name, 0).name == name
    finally:
        new.shutdown()


def test_a_reader_opens_a_store_of_another_process_by_its_segment_name(children) -> None:
    name = f"shmqtest_store_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    out, end = children.queue(), children.event()
    children.start(named_store, out, name, end)
    _, address, signature = children.expect(out, "ready")
    store = ObjectStorage.open(name)
    assert store.n_readers == 1 and store.max_object_size == 1 << 16
    assert store.get(*address, signature=signature, key="image-1") == {"pixels": list(range(8))}
    store.close()
    end.set()
    children.expect(out, "closed")
    children.join()
    with pytest.raises(FileNotFoundError, match=f"no store named {name!r}"):
        ObjectStorage.open(name)


@pytest.mark.skipif(os.getuid() != 0, reason="acting as another user needs root")
def test_another_user_finds_neither_the_queue_nor_the_store(children) -> None:
    queue_name = _name("private")
    store_name = f"shmqtest_private_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    out, end = children.queue(), children.event()
    children.start(named_store, out, store_name, end)
    children.expect(out, "ready")
    mq = MessageQueue(1, 1, name=queue_name)
    try:
        children.start(open_as_another_user, out, 54321, queue_name, store_name)
        _, found = children.expect(out, "tried")
        (queue_error, queue_message), (store_error, store_message) = found
        assert queue_error == "FileNotFoundError" and f"no queue named {queue_name!r}" in queue_message
        assert "uid 54321" in queue_message
        assert store_error == "PermissionError", store_message
        assert f"segment {store_name!r} belongs to another user (uid 0" in store_message
    finally:
        mq.shutdown()
        end.set()
    children.expect(out, "closed")


@pytest.mark.skipif(os.getuid() != 0, reason="giving the directory to another user needs root")
def test_a_directory_of_names_that_is_not_the_users_is_refused() -> None:
    name = _name("squatted")
    mq = MessageQueue(1, 1, name=name)
    directory = _names.directory()
    try:
        os.chown(directory, 54321, -1)
        with pytest.raises(PermissionError, match="is not this user's directory of queue and store names"):
            MessageQueue.open(name, 0)
    finally:
        os.chown(directory, os.getuid(), -1)
        mq.shutdown()


def test_a_damaged_record_is_no_queue_and_its_name_can_be_taken() -> None:
    name = _name("damaged")
    mq = MessageQueue(1, 1, name=name)
    record = _names._record_path("queue", name, create=False)
    mq.shutdown()
    for garbage in ("not json", '{"pid": "x"}', "[1, 2]"):
        with open(record, "w") as f:
            f.write(garbage)
        with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
            MessageQueue.open(name, 0)
        taken = MessageQueue(1, 1, name=name)
        try:
            assert MessageQueue.open(name, 0).name == name
        finally:
            taken.shutdown()


def test_a_killed_writers_record_is_removed_by_the_next_named_writer(children) -> None:
    name = _name("swept")
    out, go = children.queue(), children.event()
    p = children.start(named_writer, out, name, go, [], None, "kill")
    children.expect(out, "ready")
    record = _names._record_path("queue", name, create=False)
    assert os.path.exists(record)
    mq = MessageQueue.open(name, 0)
    mq.wait_until_ready(timeout=STEP)
    go.set()
    wait_for(lambda: not p.is_alive(), what="the writer to be killed")
    other = MessageQueue(1, 1, name=_name("another"))  # any claim sweeps the dead writers' records
    try:
        assert not os.path.exists(record)
        with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
            MessageQueue.open(name, 0)
    finally:
        other.shutdown()

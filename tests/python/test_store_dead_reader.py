"""The object store's readers that die, close or lag (issue 45): each reader takes a
reader slot, whose lock proves it alive; a ``put`` that finds no room because the oldest
object waits for a reader that died raises ``StoreReaderDiedError`` naming it
(``on_dead_reader="raise"``, a ``PeerDiedError`` and a ``MemoryError``) or goes on
without it (``"drop"``); a live reader, however slow, is never dropped, and one that
closed the store is not reported as died. A full store's ``MemoryError`` says what holds
the room, and ``clear()`` empties it.

Readers are real processes (spawned), killed with SIGKILL where they die (and joined);
the tests wait for states (``wait_for``, a join), never for a guessed while.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

import shmq
from shmq import ObjectStorage, RingBuffer, object_storage

from _processes.harness import STEP, Children, wait_for
from _processes.store_children import store_reader

pytestmark = pytest.mark.timeout(120)

CAPACITY = 16 * 1024
VALUE = b"v" * 1500
# More objects than the ring holds at once.
LAP = CAPACITY // len(VALUE) + 1


class Reader:
    """A ``store_reader`` child driven by the test."""

    def __init__(self, children: Children, blob: bytes):
        self.children = children
        self.out, self.cmds = children.queue(), children.queue()
        self.proc = children.start(store_reader, self.out, blob, self.cmds)
        _, self.pid, _, self.slot = children.expect(self.out, "ready")

    def get(self, handle) -> bytes:
        self.cmds.put(("get", "g", *handle))
        msg = self.children.receive(self.out)
        assert msg[0] == "got", f"reader slot {self.slot} could not get {handle}: {msg}"
        return msg[2]

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(STEP)
        assert self.proc.exitcode == -signal.SIGKILL

    def close(self) -> None:
        self.cmds.put(("close", "c"))
        self.children.expect(self.out, "closed")

    def exit_keeping_the_store(self) -> None:
        """End normally with the store still referenced: only the exit lets it go."""
        self.cmds.put(("exit keeping it",))
        self.children.expect(self.out, "exiting")
        self.proc.join(STEP)
        assert self.proc.exitcode == 0

    def stop(self) -> None:
        self.cmds.put(("stop",))
        self.children.expect(self.out, "stopped")


def writer(n_readers: int = 2, **kw) -> tuple[ObjectStorage, bytes]:
    store = ObjectStorage(4096, n_readers, RingBuffer(CAPACITY, create=True), **kw)
    return store, pickle.dumps(store.handle())


def status(store: ObjectStorage, slot: int) -> str:
    return store.readers()[slot].status


def put_until_full(store: ObjectStorage, readers: list[Reader], start: int = 0) -> tuple[list, MemoryError]:
    """Put objects, each read by ``readers`` at once, until a put fails: the handles put,
    and the error. Fails the test if the ring never fills."""
    handles = []
    for i in range(start, start + LAP + 1):
        try:
            h = store.put(f"k{i}", VALUE)
        except MemoryError as e:
            return handles, e
        for r in readers:
            assert r.get(h) == VALUE
        handles.append(h)
    pytest.fail(f"{LAP + 1} puts of {len(VALUE)} bytes never filled a ring of {CAPACITY}")


# ---------------------------------------------------------------------------------
# A reader killed


def test_a_killed_reader_fails_the_put_that_needs_its_room_naming_it(children):
    store, blob = writer()
    a, b = Reader(children, blob), Reader(children, blob)
    b.kill()
    handles, e = put_until_full(store, [a])
    # The first put that finds no room raises, at once: the ring held what fits.
    assert len(handles) >= LAP - 2, handles
    assert isinstance(e, shmq.PeerDiedError) and isinstance(e, MemoryError), repr(e)
    assert isinstance(e, object_storage.StoreReaderDiedError)
    assert {a.slot, b.slot} == {0, 1}
    assert store.readers()[b.slot][1:3] == (b.pid, "dead")
    msg = str(e)
    assert msg.startswith("Not enough space in the data buffer"), msg
    assert f"reader slot {b.slot} (pid {b.pid}) died before reading it" in msg, msg
    assert 'on_dead_reader="drop"' in msg and "clear()" in msg and "free_buf" not in msg, msg
    # It keeps raising, quickly, for every put that needs the room; nothing is lost.
    t = time.monotonic()
    with pytest.raises(object_storage.StoreReaderDiedError):
        store.put("again", VALUE)
    assert time.monotonic() - t < 1.0
    assert store.dropped_readers == []
    assert all(store.is_cached(f"k{i}") for i in range(len(handles)))
    assert a.get(handles[0]) == VALUE
    # The documented way out of a full store: the writer's clear().
    store.clear()
    assert not store.is_cached("k0")
    h = store.put("after the clear", VALUE)
    assert a.get(h) == VALUE
    a.stop()
    store.close()


def test_with_drop_the_store_goes_on_with_the_surviving_reader(children):
    store, blob = writer(on_dead_reader="drop")
    assert store.on_dead_reader == "drop"
    a, b = Reader(children, blob), Reader(children, blob)
    # b reads the first object, then dies; a (alive) has not read it yet.
    first = store.put("first", VALUE)
    assert b.get(first) == VALUE
    b.kill()
    wait_for(lambda: status(store, b.slot) == "dead", what="the writer to see reader b dead")
    handles, e = put_until_full(store, [a], start=1)
    # b is dropped, but "first" still waits for a: a live reader is never dropped, and
    # the dead reader's read does not stand in for it.
    assert not isinstance(e, shmq.PeerDiedError), e
    assert store.dropped_readers == [b.slot]
    assert status(store, b.slot) == "dropped" and status(store, a.slot) == "alive"
    assert f"reader slot {a.slot} (pid {a.pid}, alive) has not read it yet" in str(e), e
    assert store.is_cached("first")
    assert a.get(first) == VALUE
    # Now every later object waits for a alone: puts go on, lap after lap.
    for i in range(len(handles) + 1, len(handles) + 1 + 3 * LAP):
        h = store.put(f"k{i}", VALUE)
        assert a.get(h) == VALUE
    assert store.dropped_readers == [b.slot]
    a.stop()
    store.close()


def policy_kw(policy: str) -> dict:
    """The store's arguments for ``policy`` (the default, "raise", given by none)."""
    return {} if policy == "raise" else {"on_dead_reader": policy}


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_the_only_reader_killed(children, policy):
    store, blob = writer(n_readers=1, **policy_kw(policy))
    r = Reader(children, blob)
    r.kill()
    if policy == "raise":
        _, e = put_until_full(store, [])
        assert isinstance(e, shmq.PeerDiedError) and f"reader slot 0 (pid {r.pid}) died" in str(e), repr(e)
    else:
        for i in range(3 * LAP):
            store.put(f"k{i}", VALUE)
        assert store.dropped_readers == [0]
    assert r.slot == 0 and status(store, 0) == ("dead" if policy == "raise" else "dropped")
    store.close()


# ---------------------------------------------------------------------------------
# Readers that live: slow, or closed


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_live_but_slow_reader_is_never_dropped(children, policy):
    store, blob = writer(**policy_kw(policy))
    a, b = Reader(children, blob), Reader(children, blob)
    handles, e = put_until_full(store, [a])
    assert type(e) is MemoryError, e
    msg = str(e)
    assert msg.startswith("Not enough space in the data buffer") and "free_buf" not in msg, msg
    assert f"reader slot {b.slot} (pid {b.pid}, alive) has not read it yet" in msg, msg
    assert "clear()" in msg, msg
    assert store.dropped_readers == [] and status(store, b.slot) == "alive"
    # b reads everything at last: nothing was evicted under it, and the store goes on.
    for h in handles:
        assert b.get(h) == VALUE
    h = store.put("after", VALUE)
    assert a.get(h) == b.get(h) == VALUE
    a.stop()
    b.stop()
    store.close()


@pytest.mark.parametrize("policy", ["raise", "drop"])
@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_reader_that_closed_is_not_reported_as_died(children, how, policy):
    store, blob = writer(**policy_kw(policy))
    a, b = Reader(children, blob), Reader(children, blob)
    if how == "close":
        b.close()  # closed, and alive
    else:
        b.exit_keeping_the_store()  # its process ends normally, the store still held
    handles, e = put_until_full(store, [a])
    assert type(e) is MemoryError, repr(e)
    assert f"reader slot {b.slot} (pid {b.pid}) closed the store before reading it" in str(e), e
    assert store.dropped_readers == [] and status(store, b.slot) == "left"
    # Its reads are still expected: a reader that opens the store takes its slot.
    c = Reader(children, blob)
    assert c.slot == b.slot
    for h in handles:
        assert c.get(h) == VALUE
    h = store.put("after", VALUE)
    assert a.get(h) == c.get(h) == VALUE
    for r in (a, c) if how == "exit" else (a, b, c):
        r.stop()
    store.close()


# ---------------------------------------------------------------------------------
# Readers that join later (issue 54, item 5): a dead reader's dropped slot is taken
# again, and a reader without a slot never reads in a live reader's place


def put_read_by(store: ObjectStorage, readers: list[Reader], start: int, n: int) -> tuple[list, MemoryError | None]:
    """Put up to ``n`` objects, each read by ``readers`` at once; stop at the first
    ``MemoryError``: the handles put, and the error (``None`` if every put went in)."""
    handles = []
    for i in range(start, start + n):
        try:
            h = store.put(f"k{i}", VALUE)
        except MemoryError as e:
            return handles, e
        for r in readers:
            assert r.get(h) == VALUE
        handles.append(h)
    return handles, None


def test_a_new_reader_takes_a_dropped_readers_slot_and_never_reads_for_a_slow_one(children):
    store, blob = writer(on_dead_reader="drop")
    a, b = Reader(children, blob), Reader(children, blob)
    b.kill()
    # b is dropped by the first put that needs its room; a reads everything.
    handles, e = put_read_by(store, [a], 0, 3 * LAP)
    assert e is None, e
    assert store.dropped_readers == [b.slot]
    # A new reader joins: it takes the dropped reader's slot (it does not read
    # anonymously), and the writer waits for it again.
    c = Reader(children, blob)
    assert c.slot == b.slot, f"the new reader found no slot (slot {c.slot}); slot {b.slot} was dropped"
    wanted = store.put("wanted by the slow reader", VALUE)
    assert c.get(wanted) == VALUE
    # a is alive and slow: it has not read "wanted" yet. c's reads never count for a's.
    start = len(handles) + 1
    later, e = put_read_by(store, [c], start, LAP + 1)
    assert e is not None, f"{LAP + 1} puts went in: an object a had not read was evicted"
    assert type(e) is MemoryError, repr(e)
    assert f"reader slot {a.slot} (pid {a.pid}, alive) has not read it yet" in str(e), e
    assert a.get(wanted) == VALUE
    for h in later:
        assert a.get(h) == VALUE
    # And c is waited for in its turn: objects put now wait for its reads.
    start += len(later) + 1
    mine, e = put_read_by(store, [a], start, LAP + 1)
    assert e is not None and type(e) is MemoryError, repr(e)
    assert f"reader slot {c.slot} (pid {c.pid}, alive) has not read it yet" in str(e), e
    assert store.dropped_readers == []
    for h in mine:
        assert c.get(h) == VALUE
    h = store.put("after", VALUE)
    assert a.get(h) == c.get(h) == VALUE
    a.stop()
    c.stop()
    store.close()


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_reader_without_a_slot_never_reads_in_a_live_readers_place(children, policy):
    store, blob = writer(**policy_kw(policy))
    a, b = Reader(children, blob), Reader(children, blob)
    # A third reader of a store of two finds no slot: its reads are its own.
    c = Reader(children, blob)
    assert c.slot is None
    wanted = store.put("wanted by the slow reader", VALUE)
    assert b.get(wanted) == VALUE and c.get(wanted) == VALUE
    later, e = put_read_by(store, [b, c], 1, LAP + 1)
    assert e is not None, f"{LAP + 1} puts went in: an object a had not read was evicted"
    assert type(e) is MemoryError, repr(e)
    assert f"reader slot {a.slot} (pid {a.pid}, alive) has not read it yet" in str(e), e
    assert a.get(wanted) == VALUE
    for h in later:
        assert a.get(h) == VALUE
    h = store.put("after", VALUE)
    assert a.get(h) == b.get(h) == VALUE
    for r in (a, b, c):
        r.stop()
    store.close()

"""Fuzzing with hypothesis of what a reader process is handed and cannot trust:
``ObjectStorage.get``/``touch`` with arbitrary handles (addresses, ids, signatures, keys)
against a store another process wrote, ``RingBuffer.access_buf`` with arbitrary
addresses, and garbled ``Handle`` objects (as unpickled) given to
``MessageQueue.create_from_handle``. Each must answer with the object, or a clear Python
exception (``ValueError``, ``TypeError``, ``FileNotFoundError``, ``RuntimeError``,
``ConnectionError``), never crash, hang or return another object. Bounded: a few hundred
examples each, the whole file in well under a minute.

Also the issue's small fixes, each a test that failed before: ``access_buf(-1)`` is a
``ValueError``, an object too small for its serde's framing is a ``ValueError`` (not
``struct.error``), ``inspect`` of a store it cannot open says why as a store, and a
``free_buf`` callback may use its own ring (it once deadlocked, then raised).

The core's own fuzz targets (cargo-fuzz, ``fuzz/``) write over the segments themselves;
see the README's Develop section.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from _processes import STEP, STORE_VALUES, store_writer
from shmq import Handle, MessageQueue, MsgpackSerde, ObjectStorage, RingBuffer

#: What a reader may raise for a handle it cannot use.
CLEAR_ERRORS = (ValueError, TypeError, FileNotFoundError, RuntimeError, ConnectionError)

FUZZ = settings(
    # More by hand: SHMQ_FUZZ_EXAMPLES=5000 (see the README's Develop section).
    max_examples=int(os.environ.get("SHMQ_FUZZ_EXAMPLES", "300")),
    deadline=2000,  # ms per example: a hang fails, it does not wait for the test timeout
    database=None,  # no .hypothesis directory in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Values of every odd kind, for fields that should hold something else.
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.binary(max_size=30),
    st.lists(st.integers(min_value=-3, max_value=2**65), max_size=4),
    st.tuples(
        st.integers(min_value=-3, max_value=2**64 + 1),
        st.integers(min_value=-3, max_value=2**64 + 1),
        st.integers(min_value=-3, max_value=20),
        st.text(max_size=20),
    ),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@pytest.fixture
def store_from_another_process(children):
    """A reader of a store that a child process wrote, and its handles:
    ``(reader, [(key, address, id, signature)])``."""
    out, done = children.queue(), children.event()
    children.start(store_writer, out, done)
    _, handle, handles = children.expect(out, "ready")
    reader = ObjectStorage.create_from_handle(handle)
    assert not reader.is_writer
    try:
        yield reader, handles
    finally:
        reader.close()
        done.set()
        children.join()


def _near(values: list[int]) -> st.SearchStrategy[int]:
    """Integers at and around ``values``, and anywhere."""
    return st.one_of(
        st.sampled_from(values),
        st.builds(lambda v, d: v + d, st.sampled_from(values), st.integers(min_value=-80, max_value=80)),
        st.integers(min_value=-(2**66), max_value=2**66),
    )


def test_store_get_and_touch_with_arbitrary_handles(store_from_another_process):
    reader, handles = store_from_another_process
    keys = [h[0] for h in handles]
    real = {(k, a, i): s for k, a, i, s in handles}
    signatures = st.one_of(
        st.sampled_from([h[3] for h in handles]),
        st.none(),
        st.lists(st.integers(min_value=0, max_value=255), min_size=32, max_size=32),
        st.lists(st.integers(min_value=-300, max_value=300), max_size=40),
        st.builds(
            lambda s, k, v: s[:k] + [v] + s[k + 1 :],
            st.sampled_from([h[3] for h in handles]),
            st.integers(0, 31),
            st.integers(-1, 256),
        ),
        ODD,
    )
    names = st.one_of(st.sampled_from(keys), st.text(max_size=20), ODD)

    @FUZZ
    @given(
        address=st.one_of(_near([h[1] for h in handles]), ODD),
        monotonic_id=st.one_of(_near([h[2] for h in handles]), ODD),
        signature=signatures,
        key=names,
        how=st.sampled_from(["get", "touch"]),
    )
    def check(address, monotonic_id, signature, key, how):
        genuine = (
            type(key) is str
            and type(address) is int
            and type(monotonic_id) is int
            and type(signature) is list
            and real.get((key, address, monotonic_id)) == signature
            and all(type(b) is int for b in signature)
            and key != "gone"
        )
        try:
            if how == "get":
                got = reader.get(address, monotonic_id, signature, key)
            else:
                got = reader.touch(key, address, monotonic_id, signature)
        except CLEAR_ERRORS as e:
            assert not genuine, f"a genuine handle was refused: {e!r}"
            return
        assert genuine, f"{how} accepted a handle it did not issue: {(key, address, monotonic_id)}"
        if how == "get" and key != "array":
            assert got == STORE_VALUES[key]

    check()


def test_access_buf_with_arbitrary_addresses(store_from_another_process):
    reader, handles = store_from_another_process
    ring = reader.ring_buffer
    capacity = ring.data_buffer_size

    @FUZZ
    @given(address=st.one_of(_near([h[1] for h in handles] + [0, capacity - 8, capacity]), ODD))
    def check(address):
        try:
            with ring.access_buf(address) as (view, (chunk_id, size)):
                assert size >= 8 and len(view) == size - 8
                assert address % capacity + size <= capacity
                bytes(view)  # every byte readable
        except ValueError as e:
            # No chunk header fits there (or a negative or huge int): the documented error.
            assert isinstance(address, int) and "no chunk can be at address" in str(e), repr(e)
        except TypeError:
            assert not isinstance(address, int)

    check()


@pytest.fixture
def queue_handle():
    """A live queue's handle (one local reader, a tensor arena): garbled copies of it
    point at a real ring, arena and socket."""
    mq = MessageQueue(2, 2, max_chunk_bytes=1024, max_chunks=2)
    try:
        yield mq.export_handle()
    finally:
        del mq
        gc.collect()


FIELDS = [f.name for f in dataclasses.fields(Handle)]


def _open(handle, rank):
    reader = MessageQueue.create_from_handle(handle, rank)
    del reader


def test_garbled_handles_are_refused_clearly(queue_handle):
    @FUZZ
    @given(
        changes=st.dictionaries(st.sampled_from(FIELDS), ODD, min_size=1, max_size=3),
        rank=st.one_of(st.integers(min_value=-3, max_value=4), st.integers(min_value=-(2**70), max_value=2**70)),
    )
    def check(changes, rank):
        garbled = pickle.loads(pickle.dumps(dataclasses.replace(queue_handle, **changes)))
        try:
            _open(garbled, rank)
        except CLEAR_ERRORS:
            pass

    check()


def test_unpickled_garbage_handles_are_refused_clearly(queue_handle):
    """The pickle itself garbled: what still unpickles (a Handle with odd fields, or
    another object altogether) goes to ``create_from_handle``."""
    data = pickle.dumps(queue_handle)

    @FUZZ
    @given(
        edits=st.lists(
            st.tuples(st.integers(min_value=0, max_value=len(data) - 1), st.integers(min_value=0, max_value=255)),
            min_size=1,
            max_size=4,
        ),
        rank=st.integers(min_value=-1, max_value=2),
    )
    def check(edits, rank):
        garbled = bytearray(data)
        for at, byte in edits:
            garbled[at] = byte
        try:
            obj = pickle.loads(bytes(garbled))
        except Exception:
            assume(False)  # pickle's own business, before shmq sees anything
        try:
            _open(obj, rank)
        except CLEAR_ERRORS:
            pass

    check()


# ---------------------------------------------------------------------------------
# The small fixes.


def test_access_buf_of_a_negative_address_is_a_value_error():
    ring = RingBuffer(1024, create=True)
    try:
        for address in (-1, -(2**70), 2**64, 2**80):
            with pytest.raises(ValueError, match="no chunk can be at address"):
                with ring.access_buf(address):
                    pass
        with pytest.raises(TypeError):
            with ring.access_buf("0"):
                pass
    finally:
        ring.close()


class _SerializesToNothing(MsgpackSerde):
    """A custom serde (the store writes its output as it comes) whose output is empty:
    the object's chunk holds only the store's own bytes (a chunk of 12 bytes in vLLM's
    layout)."""

    def serialize(self, value):
        return b"", 0, b"", 0


def test_an_object_too_small_for_its_framing_is_a_value_error(children):
    ring = RingBuffer(1024, create=True)
    store = ObjectStorage(100, 1, ring, serde_class=_SerializesToNothing)
    try:
        address, monotonic_id = store.put("k", 1)
        with pytest.raises(ValueError, match="too few for its framing"):
            store.get(address, monotonic_id)
        reader = ObjectStorage.create_from_handle(store.handle())
        with pytest.raises(ValueError, match="too few for its framing"):
            reader.get(address, monotonic_id, store.get_signature("k"), "k")
        reader.close()
        with pytest.raises(ValueError, match="too few for its framing"):
            MsgpackSerde().deserialize(memoryview(b"\x01"))
    finally:
        store.close()


def test_inspect_of_a_store_it_cannot_open_describes_a_store():
    ring = RingBuffer(4096, create=True)
    try:
        # The layout version (offset 8 of the segment) of another shmq.
        with open(f"/dev/shm/{ring.shared_memory.name}", "r+b") as f:
            f.seek(8)
            f.write((1).to_bytes(4, "little"))
        done = subprocess.run(
            [sys.executable, "-m", "shmq", "inspect", ring.shared_memory.name],
            capture_output=True,
            text=True,
            timeout=STEP,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        )
        assert done.returncode == 1
        assert "layout version is 1" in done.stderr, done.stderr
        assert "broadcast ring" not in done.stderr, done.stderr
    finally:
        ring.close()


def test_a_free_buf_callback_may_use_its_ring():
    # In a child: the callback once deadlocked on the ring's own lock, and a hang here
    # must fail the test, not stop it. The callback runs with the ring unlocked; the
    # loop asks only about chunks live when it started and frees only a chunk the
    # callback approved that is still the oldest.
    script = textwrap.dedent(
        """
        import threading
        from shmq import RingBuffer

        ring = RingBuffer(1024, create=True)
        a0, i0 = ring.allocate_buf(10)
        a1, i1 = ring.allocate_buf(20)

        # Reads: the ring as it is, the chunk asked about still live.
        seen = []
        def reads(i, v):
            seen.append((i, ring.monotonic_id_start, ring.data_buffer_end, dict(ring.metadata)))
            return False
        assert ring.free_buf(reads) == range(0, 0)
        assert seen == [(i0, 0, 18 + 28, {i0: a0, i1: a1})], seen

        # Allocating: the new chunks stay (not live when free_buf started).
        new = []
        def allocates(i, v):
            new.append(ring.allocate_buf(5))
            return True
        assert ring.free_buf(allocates) == range(i0, i1 + 1)
        assert [i for _, i in new] == [2, 3] and dict(ring.metadata) == {i: a for a, i in new}, (new, ring.metadata)

        # Freeing: a nested free_buf frees the chunk asked about, so the outer loop
        # does not free it again, nor the next one unasked; it returns what it freed.
        for _ in range(4):
            ring.allocate_buf(5)  # ids 4..7
        asked, inner = [], []
        def frees_the_even_ones(i, v):
            asked.append(i)
            if i % 2 == 0:
                inner.append(list(ring.free_buf(lambda j, w: True, 1)))
            return True
        assert ring.free_buf(frees_the_even_ones) == [3, 5, 7]
        assert asked == [2, 3, 4, 5, 6, 7] and inner == [[2], [4], [6]], (asked, inner)
        assert dict(ring.metadata) == {} and ring.monotonic_id_start == 8

        # Clearing: nothing is left that was live at the start, so nothing is freed.
        for _ in range(3):
            ring.allocate_buf(5)  # ids 8..10
        def clears(i, v):
            ring.clear()
            return True
        assert ring.free_buf(clears) == range(8, 8)
        assert dict(ring.metadata) == {} and ring.monotonic_id_start == ring.monotonic_id_end == 11

        # Another thread uses the ring while a callback runs: no wait (not locked).
        seen = []
        ring.allocate_buf(10)  # id 11
        t = threading.Thread(target=lambda: seen.append(ring.allocate_buf(10)[1]))
        def other_thread(i, v):
            t.start()
            t.join(10)
            return not t.is_alive()
        assert ring.free_buf(other_thread) == range(11, 12)
        assert seen == [12] and list(ring.metadata) == [12], (seen, ring.metadata)
        ring.close()
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=STEP,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

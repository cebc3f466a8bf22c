"""The object store's zero-copy ``get``: tensors and arrays come back as private
copy-on-write views of the shared memory, which keep their object from eviction (and
from ``clear()``) while they live in any process; ``copy=True`` gives owned copies.

Readers are real processes (``_processes.store_view_children.view_reader``); whether a reader got
a view or a copy is read off its ``/proc/self/maps``: a view's data lies in a mapping
of the store's segment, a copy's elsewhere.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal

import numpy as np
import pytest
import torch

from _processes import Children
from _processes.store_view_children import many_views_reader, mapping_of, view_reader
from shmq import ObjectStorage, PickleSerde, RingBuffer
from shmq.object_storage import VIEW_THRESHOLD

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
N = MiB  # float32 elements: 4 MiB objects


class ViewReader:
    def __init__(self, children: Children, store: ObjectStorage):
        self.children = children
        self.out, self.cmds = children.queue(), children.queue()
        self.proc = children.start(view_reader, self.out, pickle.dumps(store.handle()), self.cmds)
        _, self.pid, segment = children.expect(self.out, "ready")
        self.segment = "/dev/shm/" + segment

    def ask(self, *cmd):
        self.cmds.put(cmd)
        return self.children.receive(self.out)

    def get(self, tag, handle, copy=False):
        msg = self.ask("get", tag, *handle, copy)
        assert msg[0] == "got", msg
        return msg[2], msg[3]

    def check(self, tag):
        msg = self.ask("check", tag)
        assert msg[0] == "check", msg
        return msg[2]

    def stop(self):
        self.cmds.put(("stop",))
        self.children.expect(self.out, "stopped")


def store_of(n_readers: int, objects: int = 2, serde=None) -> ObjectStorage:
    """A store with room for ``objects`` 4 MiB tensors."""
    ring = RingBuffer(objects * (4 * N + 64 * 1024), create=True)
    kwargs = {} if serde is None else {"serde_class": serde}
    return ObjectStorage(5 * MiB, n_readers, ring, **kwargs)


def tensor(value: float) -> torch.Tensor:
    return torch.full((N,), value, dtype=torch.float32)


@pytest.mark.parametrize("serde", [None, PickleSerde], ids=["msgpack", "pickle"])
def test_a_view_keeps_its_object_until_the_reader_drops_it(children, serde):
    store = store_of(1, serde=serde)
    reader = ViewReader(children, store)
    a = store.put("a", {"t": tensor(1.0), "meta": "x"})
    store.put("b", tensor(2.0))
    summary, mapping = reader.get("a", a)
    assert mapping == reader.segment, f"not a view of the store: data in {mapping!r}"
    assert summary == ("tensor", "torch.float32", (N,), float(N), 1.0)
    assert store.reader_count(*a) == 1  # read: free by its count, but viewed

    with pytest.raises(MemoryError):
        store.put("c", tensor(3.0))  # would evict "a" (oldest), which a view pins
    assert store.is_cached("a")
    assert reader.check("a") == summary

    assert reader.ask("drop", "a")[0] == "dropped"
    store.put("c", tensor(3.0))  # now "a" goes
    assert not store.is_cached("a")
    reader.stop()


def test_copy_true_is_independent_of_the_store(children):
    store = store_of(1)
    reader = ViewReader(children, store)
    a = store.put("a", tensor(1.0))
    summary, mapping = reader.get("a", a, copy=True)
    assert mapping != reader.segment
    for i in range(4):  # "a" is evicted and its memory reused
        store.put(f"n{i}", tensor(10.0 + i))
        assert reader.ask("get", f"n{i}", *store.key_index[f"n{i}"], True)[0] == "got"
    assert not store.is_cached("a")
    assert reader.check("a") == summary
    reader.stop()


def test_small_parts_are_copies_and_the_threshold_is_set_per_store(children):
    store = store_of(1)
    reader = ViewReader(children, store)
    small = store.put("small", {"t": torch.arange(1000, dtype=torch.int64)})
    summary, mapping = reader.get("small", small)
    assert mapping != reader.segment and summary[3] == float(sum(range(1000)))
    assert store.view_threshold == VIEW_THRESHOLD
    # In-process, with a threshold of 0 every part is a view; the tensor's part is 8000
    # bytes, a view from a threshold of 8000 ("or more") on, a copy above.
    viewer = ObjectStorage.create_from_handle(store.handle())
    signature = list(viewer._make_signature("k", *small))
    for threshold, viewed in [(0, True), (8000, True), (8001, False)]:
        viewer.view_threshold = threshold
        t = viewer.get(*small, signature, "k")["t"]
        assert (mapping_of(t.data_ptr()) == reader.segment) == viewed, threshold
        assert torch.equal(t, torch.arange(1000, dtype=torch.int64))
    with pytest.raises(ValueError, match="view_threshold"):
        ObjectStorage(MiB, 1, RingBuffer(MiB, create=True), view_threshold=-1)
    del t, viewer
    gc.collect()
    reader.stop()


def test_a_readers_write_reaches_neither_the_writer_nor_other_readers(children):
    store = store_of(2)
    r0, r1 = ViewReader(children, store), ViewReader(children, store)
    arr = np.arange(N, dtype=np.float32)
    a = store.put("a", arr)
    s0, m0 = r0.get("a", a)
    s1, m1 = r1.get("a", a)
    assert m0 == r0.segment and m1 == r1.segment and s0 == s1
    assert r0.ask("write", "a", 7.0)[0] == "written"
    assert r0.check("a")[3] == 7.0 * N  # its own write, kept
    assert r1.check("a") == s1  # the other reader's view is unchanged
    assert np.array_equal(store.get(*a, copy=True), arr)  # and the stored object
    r0.stop()
    r1.stop()


def test_a_readers_writes_are_gone_when_its_memory_holds_the_next_object(children):
    # A reader's views come from one mapping of the store that stays: what it wrote into a
    # dropped view must not show through the object placed in the same memory next, and
    # two live views of one object are independent.
    store = store_of(1)
    reader = ViewReader(children, store)
    a = store.put("a", tensor(1.0))
    fresh, _ = reader.get("a", a)
    again, _ = reader.get("a-again", a)  # a second live view of the same object
    assert reader.ask("write", "a", 7.0)[0] == "written"
    assert reader.check("a")[3] == 7.0 * N
    assert reader.check("a-again") == again == fresh, "a write into one view reached another view"
    assert reader.ask("drop", "a")[0] == "dropped"
    assert reader.ask("drop", "a-again")[0] == "dropped"
    store.put("b", tensor(2.0))
    c = store.put("c", tensor(3.0))  # evicts "a" and takes its memory
    assert not store.is_cached("a")
    assert c[0] % store.ring_buffer.data_buffer_size == a[0] % store.ring_buffer.data_buffer_size
    summary, mapping = reader.get("c", c)
    assert mapping == reader.segment
    assert summary == ("tensor", "torch.float32", (N,), 3.0 * N, 3.0), "the reader's old write showed through"
    reader.stop()


def test_a_killed_reader_gives_its_views_back(children):
    store = store_of(1)
    reader = ViewReader(children, store)
    a = store.put("a", tensor(1.0))
    store.put("b", tensor(2.0))
    reader.get("a", a)
    with pytest.raises(MemoryError):
        store.put("c", tensor(3.0))
    os.kill(reader.pid, signal.SIGKILL)
    reader.proc.join(30)
    store.put("c", tensor(3.0))  # the kernel dropped the dead reader's pin
    assert not store.is_cached("a")


def test_clear_moves_nothing_while_a_view_lives(children):
    store = store_of(1, objects=3)
    reader = ViewReader(children, store)
    a = store.put("a", tensor(1.0))
    b = store.put("b", tensor(2.0))
    summary, _ = reader.get("b", b)
    store.clear()
    assert len(store.key_index) == 0
    # The blocks stay where they are: "a" (not viewed) is reused in turn, "b" is not.
    store.put("c", tensor(3.0))
    store.put("d", tensor(4.0))  # takes the room of "a"
    with pytest.raises(MemoryError):
        store.put("e", tensor(5.0))  # would need the room "b" holds
    assert reader.check("b") == summary
    assert torch.equal(store.get(*b), tensor(2.0))  # an old handle reads until reuse
    msg = reader.ask("get", "a", *a, False)
    assert msg[0] == "raised" and "modified or is invalid" in msg[3], msg
    assert reader.ask("drop", "b")[0] == "dropped"
    gc.collect()  # the writer's own get above made a view too
    store.put("e", tensor(5.0))
    reader.stop()


def test_views_of_a_cleared_object_are_copies(children):
    store = store_of(1)
    reader = ViewReader(children, store)
    a = store.put("a", tensor(1.0))
    store.clear()  # "a" stays readable until its memory is reused, but not viewable
    summary, mapping = reader.get("a", a)
    assert mapping != reader.segment
    assert summary[3] == float(N)
    store.put("b", tensor(5.0))
    store.put("c", tensor(6.0))
    assert reader.check("a") == summary
    reader.stop()


def _ring_address(store: ObjectStorage) -> int:
    return np.frombuffer(store.ring_buffer.shared_memory.buf, dtype=np.uint8).ctypes.data


def test_a_loaned_tensor_is_put_without_a_copy(children):
    store = store_of(1, objects=3)
    reader = ViewReader(children, store)
    t = store.loan_tensor((N,))
    t.copy_(torch.arange(N, dtype=torch.float32))  # "the model writes its output here"
    a = store.put("a", {"t": t, "meta": "loaned"})
    # The object is the loan's block: the tensor's bytes lie inside it, nothing else was
    # allocated.
    offset = t.data_ptr() - _ring_address(store)
    block_id, block_size = store.ring_buffer._core.header(a[0])
    assert block_id == a[1] and a[0] < offset < a[0] + block_size
    assert store.ring_buffer._core.live_len() == 1
    summary, mapping = reader.get("a", a)
    assert mapping == reader.segment
    assert summary == ("tensor", "torch.float32", (N,), float(N * (N - 1) // 2), 0.0)
    assert reader.ask("drop", "a")[0] == "dropped"

    # Read by the reader, but the writer's loan still pins it; once dropped, it goes.
    store.put("b", tensor(2.0))
    store.put("c", tensor(3.0))
    with pytest.raises(MemoryError):
        store.put("d", tensor(4.0))
    del t
    gc.collect()
    store.put("d", tensor(4.0))
    assert not store.is_cached("a")
    assert store.loan_fallbacks == 0
    reader.stop()


def test_a_loan_written_after_its_put_changes_no_reader_and_its_memory_is_reused_clean(children):
    """``put`` seals a loan: the writer's later writes are its own (copy-on-write), so an
    object read before or after them is what was put; and once the loan is dropped its
    memory, mapped shared again, carries the next objects correctly (20 loans through a
    ring of 3 objects reuse every block several times)."""
    store = store_of(1, objects=3)
    reader = ViewReader(children, store)
    for i in range(20):
        out = store.loan_tensor((N,))
        out.fill_(float(i))
        handle = store.put(f"k{i}", {"t": out})
        out.fill_(1000.0 + i)  # after the put: reaches nobody
        assert float(out[0]) == 1000.0 + i  # the writer sees its own write
        summary, mapping = reader.get(f"k{i}", handle)
        assert mapping == reader.segment, f"not a view of the store: data in {mapping!r}"
        assert summary == ("tensor", "torch.float32", (N,), float(N) * i, float(i)), (i, summary)
        out[1] = -1.0
        assert reader.check(f"k{i}") == summary, i
        # A second put of the same loan stores what the writer sees now (copied).
        if i == 0:
            again = store.put("again", {"t": out})
            summary2, _ = reader.get("again", again)
            assert summary2[4] == 1000.0 and summary2[3] == float(N - 1) * 1000.0 - 1.0, summary2
            assert reader.ask("drop", "again")[0] == "dropped"
        assert reader.ask("drop", f"k{i}")[0] == "dropped"
        del out
    assert store.loan_fallbacks == 0
    reader.stop()


def test_views_held_by_the_hundred_cost_the_kernel_one_lock(children):
    """A reader's views pin their objects with read locks on the store's file, and the
    kernel walks a file's whole lock list on every lock call: one entry per view made
    each get slower as views piled up (0.9 s then 13 s per 10,000 put+get). Pins are by
    object id now, so a reader holding 300 views of objects put one after another holds
    them as one run of locked bytes: one entry in ``/proc/locks``, not 300."""
    store = ObjectStorage(300 * 1024, 1, RingBuffer(300 * (256 * 1024 + 4096) + (1 << 20), create=True))
    handles = [store.put(f"k{i}", torch.full((64 * 1024,), float(i))) for i in range(300)]
    out = children.queue()
    children.start(many_views_reader, out, pickle.dumps(store.handle()), handles)
    _, in_mapping, before, holding, after = children.expect(out, "locks")
    assert in_mapping == 300, "the gets were not views"
    assert holding - before <= 2, f"{holding - before} kernel locks for 300 views"
    assert after == before
    children.join()


def test_a_dropped_loan_is_given_back_and_a_full_ring_lends_ordinary_memory():
    store = store_of(1, objects=3)
    arr = store.loan_array((2, N // 2), "float32")
    held = store.loan_tensor(N)
    assert arr.shape == (2, N // 2) and store.ring_buffer._core.live_len() == 2
    extra = store.loan_tensor(N)  # no room left for a third: ordinary memory
    assert store.loan_fallbacks == 1 and store.ring_buffer._core.live_len() == 2
    del arr
    gc.collect()
    again = store.loan_tensor(N)  # the dropped loan's room is given back
    assert store.loan_fallbacks == 1 and store.ring_buffer._core.live_len() == 2
    extra.fill_(1.0)
    with pytest.raises(MemoryError):
        store.put("extra", extra)  # copied: needs room, and both loans are held
    del held
    gc.collect()
    h = store.put("extra", extra)  # the room "held" gave back
    assert torch.equal(store.get(*h, copy=True), extra)
    with pytest.raises(RuntimeError, match="Only the writer"):
        ObjectStorage.create_from_handle(store.handle()).loan(10)
    with pytest.raises(ValueError):
        store.loan(-1)
    del again
    gc.collect()

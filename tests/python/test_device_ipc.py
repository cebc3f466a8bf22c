"""Device tensors by IPC handle through the queue and the store (issue 55, item 4):
``MessageQueue(..., ipc=True)`` and ``ObjectStorage(..., ipc=True)``, against the seam
``SHMQ_DEVICE`` names (the CPU twin here: every tensor is a "device" tensor and a handle
names a ``/dev/shm`` file; CUDA under ``scripts/gpu_check.sh``). The encoder cache's IPC
hand-off is in ``test_device_cache.py``.

What is proved, with writer and reader processes: exact data, both as the opened memory
and copied on the device; the writer keeps only the tensors a reader may still open
(the queue: its last ``max_chunks + 1`` messages; the store: the objects still in it);
a reader keeps a bounded number of allocations open; ``ipc=True`` with remote readers is
refused.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from _processes import STEP
from _processes.device_children import DEVICE, SEAM, queue_plain_reader
from shmq import MessageQueue, ObjectStorage, RingBuffer
from shmq._ipc import MAX_OPEN_HANDLES
from test_device_cache import exported_files
from test_device_seam import Reader as StoreReader
from test_device_seam import assert_same

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def values(n: int) -> list[dict]:
    return [{"t": torch.full((256, 256), k, dtype=torch.float32, device=DEVICE), "k": k} for k in range(n)]


@pytest.mark.parametrize("device", [None, DEVICE], ids=["opened", "copied"])
def test_queue_sends_device_tensors_by_handle_to_two_readers(children, device):
    n = MAX_OPEN_HANDLES + 20
    mq = MessageQueue(2, 2, max_chunk_bytes=1 * MIB, max_chunks=4, ipc=True, device_seam=SEAM)
    outs, cmds = [children.queue() for _ in range(2)], children.queue()
    for rank, out in enumerate(outs):
        children.start(queue_plain_reader, out, mq.export_handle(), rank, n, device, cmds)
    mq.wait_until_ready(timeout=STEP)
    sent = values(n)
    for v in sent:
        mq.enqueue(v, timeout=STEP)
        assert mq._exported is not None and len(mq._exported) <= 5  # max_chunks + 1
        if SEAM == "twin":
            assert len(exported_files(os.getpid())) <= 5
    for out in outs:
        _, got, open_now = children.expect(out, "got")
        assert_same(got, [{"t": v["t"].cpu(), "k": v["k"]} for v in sent])
        assert open_now == MAX_OPEN_HANDLES  # one per allocation, the oldest closed
    for _ in outs:
        cmds.put("stop")


def test_queue_with_a_remote_reader_refuses_ipc():
    with pytest.raises(ValueError, match="remote reader"):
        MessageQueue(2, 1, ipc=True, device_seam=SEAM)


def test_store_puts_device_tensors_by_handle_and_keeps_them_while_stored(children):
    store = ObjectStorage(2 * MIB, 1, RingBuffer(1 * MIB, create=True), ipc=True, device_seam=SEAM)
    try:
        reader = StoreReader(children, store)
        sent = values(3)
        refs = []
        for k, v in enumerate(sent):
            address, monotonic_id = store.put(f"k{k}", v)
            refs.append((address, monotonic_id, store.get_signature(f"k{k}"), f"k{k}"))
        for ref in refs:
            assert reader.ask("get", ref, False)[0] == "issued"
        _, got, in_flight = reader.ask("wait")
        assert in_flight == 0
        assert_same(got, [{"t": v["t"].cpu(), "k": v["k"]} for v in sent])
        assert sorted(store._exported) == ["k0", "k1", "k2"]
        # Evicted objects' tensors go at the next put; the stored ones stay.
        store.clear()
        store.put("k3", values(1)[0])
        assert sorted(store._exported) == ["k3"]
        if SEAM == "twin":
            assert len(exported_files(os.getpid())) == 1
        reader.stop()
    finally:
        store.close()
    if SEAM == "twin":
        assert exported_files(os.getpid()) == []


def test_store_reader_gets_the_opened_memory_without_a_device(children):
    store = ObjectStorage(2 * MIB, 1, RingBuffer(1 * MIB, create=True), ipc=True, device_seam=SEAM)
    try:
        out, cmds = children.queue(), children.queue()
        v = values(1)[0]
        store.put("k", v)
        children.start(store_plain_getter, out, pickle.dumps(store.handle()),
                       (*store.key_index["k"], store.get_signature("k"), "k"), cmds)
        _, got = children.expect(out, "got")
        assert_same(got, {"t": v["t"].cpu(), "k": 0})
        cmds.put("stop")
    finally:
        store.close()


def store_plain_getter(out, handle_blob, ref, cmds):
    from _processes import STEP
    from _processes.device_children import to_host
    from shmq import ObjectStorage

    store = ObjectStorage.create_from_handle(pickle.loads(handle_blob))
    out.put(("got", to_host(store.get(*ref))))
    assert cmds.get(timeout=STEP) == "stop"
    store.close()


def test_a_handle_sent_to_two_readers_leaves_nothing_once_both_are_done(children):
    """Two readers open and copy the same sent tensors; once the writer let them go (its
    window passed, the queue closed), nothing of them is left: on the twin, no exported
    file; on CUDA, the writer's allocated device memory is back where it was (torch
    counts one release per export: a handle sent to several readers must not leave the
    block in torch's limbo)."""
    import gc

    cuda = SEAM == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    mq = MessageQueue(2, 2, max_chunk_bytes=1 * MIB, max_chunks=2, ipc=True, device_seam=SEAM)
    outs, cmds = [children.queue() for _ in range(2)], children.queue()
    for rank, out in enumerate(outs):
        children.start(queue_plain_reader, out, mq.export_handle(), rank, 6, None, cmds)
    mq.wait_until_ready(timeout=STEP)
    sent = values(6)
    for v in sent:
        mq.enqueue(v, timeout=STEP)
    for out in outs:
        _, got, _ = children.expect(out, "got")
        assert_same(got, [{"t": v["t"].cpu(), "k": v["k"]} for v in sent])
    for _ in outs:
        cmds.put("stop")
    children.close()  # the readers are gone, and with them their opened handles
    del mq, sent, v
    gc.collect()
    if cuda:
        torch.cuda.ipc_collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    else:
        assert exported_files(os.getpid()) == []

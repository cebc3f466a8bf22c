"""The device seam (issue 55) and receiving into device memory: ``ObjectStorage.get(...,
device=)`` in reader processes, against the seam that ``SHMQ_DEVICE`` names — the CPU
twin here (a copy runs on a worker thread, so it is really in flight; ``hold()`` keeps it
there), CUDA under ``scripts/gpu_check.sh`` (there ``hold()`` puts a GPU sleep of about
ten seconds before the copy: in flight meanwhile, released by the clock, not by the test).

What is proved: exact data; an object is reused only after the copies from it ended; a
SIGKILLed reader gives back what it held; a refused registration takes the host path with
one log line; a reader that leaves while a copy is in flight waits for it, then
unregisters, then unmaps. The seam's own rules (refusing overlapping, unmapped and
read-only-without-the-flag ranges; IPC handles a second process opens) are tested too.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal

import numpy as np
import pytest
import torch

from _processes import Children
from _processes.device_children import DeviceChild, SEAM, device_reader, ipc_exporter
from shmq import ObjectStorage, RingBuffer
from shmq._device import DeviceRefused, address_of, device_for

pytestmark = pytest.mark.timeout(90)

MIB = 1 << 20


class Reader(DeviceChild):
    """A store reader process (``device_reader``)."""

    def __init__(self, children: Children, store: ObjectStorage):
        super().__init__(children, device_reader, pickle.dumps(store.handle()))


def handle(store: ObjectStorage, key: str, value) -> tuple:
    address, monotonic_id = store.put(key, value)
    return (address, monotonic_id, store.get_signature(key), key)


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        # Bytes compared (NaN-proof): every bit came over.
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert got == want


@pytest.fixture
def store():
    s = ObjectStorage(6 * MIB, 1, RingBuffer(7 * MIB, create=True))
    yield s
    s.close()


def big(seed: int) -> torch.Tensor:
    return torch.arange(MIB, dtype=torch.int32) * 7 + seed  # 4 MiB


# -- exact data, several readers -----------------------------------------------------------


def test_two_readers_receive_exact_data_in_device_memory(children):
    store = ObjectStorage(2 * MIB, 2, RingBuffer(8 * MIB, create=True))
    try:
        value = {
            "f32": torch.randn(300, 257),
            "bf16": torch.randn(1000).to(torch.bfloat16),
            "i64": torch.arange(70_000, dtype=torch.int64),
            "small": torch.tensor([1.5, -2.0]),
            "empty": torch.empty(0, 3),
            "nested": [(torch.full((4096,), 3, dtype=torch.uint8), "text")],
            "array": np.arange(10_000, dtype=np.float64),
            "n": 42,
        }
        readers = [Reader(children, store) for _ in range(2)]
        h = handle(store, "k", value)
        for r in readers:
            assert r.ask("get", h, False)[0] == "issued"
        for r in readers:
            _, (got,), in_flight = r.ask("wait")
            assert in_flight == 0
            assert_same(got, value)
            # Tensors came through the device path; the array stays a host view.
            assert got["f32"].device.type == "cpu"  # to_host's copy
        for r in readers:
            r.stop()
    finally:
        store.close()


# -- a range is reused only after its copy ended -------------------------------------------


def test_object_is_reused_only_after_the_copy_from_it_ended(children, store):
    reader = Reader(children, store)
    first = {"t": big(1)}
    h = handle(store, "first", first)
    # The copy stays in flight on the twin's worker: the object is read (counted) and
    # the writer wants its room back.
    assert reader.ask("get", h, True) == ("issued", 1)
    try:
        store.put("second", {"t": big(2)})  # would overwrite the range being copied
        reused_in_flight = True
    except MemoryError:
        reused_in_flight = False
    reader.ask("release")
    _, (got,), in_flight = reader.ask("wait")
    assert in_flight == 0
    assert_same(got, first)  # the copy read the object, not what came after it
    assert not reused_in_flight
    store.free_unused()
    handle(store, "third", {"t": big(3)})  # given back once the copy ended
    reader.stop()


def test_sigkilled_reader_gives_back_what_it_held(children, store):
    reader = Reader(children, store)
    h = handle(store, "first", {"t": big(1)})
    assert reader.ask("get", h, True) == ("issued", 1)
    with pytest.raises(MemoryError):
        store.put("second", {"t": big(2)})
    os.kill(reader.pid, signal.SIGKILL)
    reader.proc.join(10)
    assert reader.proc.exitcode == -signal.SIGKILL
    handle(store, "second", {"t": big(2)})


# -- a refused registration ----------------------------------------------------------------


def test_refused_registration_takes_the_host_path_with_one_log_line(children, store):
    reader = Reader(children, store)
    # The reader's mapping is already registered (by the test's own call): the store's
    # registration overlaps it and is refused, as cudaHostRegister refuses it.
    assert reader.ask("preregister")[0] == "preregistered"
    values = [{"t": big(k), "k": k} for k in range(3)]
    for k, v in enumerate(values):
        assert reader.ask("get", handle(store, f"k{k}", v), False)[0] == "issued"
        _, (got,), _ = reader.ask("wait")
        assert_same(got, v)
        store.free_unused()
    _, logs, refused = reader.ask("logs")
    assert refused is not None  # the twin: "overlaps"; CUDA: "already registered"
    assert len(logs) == 1, logs
    assert "refused to register" in logs[0][2] and "host path" in logs[0][2]
    reader.stop()


# -- unregister before unmap ---------------------------------------------------------------


def test_reader_that_leaves_while_a_copy_is_in_flight_waits_then_unregisters(children, store):
    reader = Reader(children, store)
    value = {"t": big(5)}
    assert reader.ask("get", handle(store, "k", value), True) == ("issued", 1)
    # close() on a thread: it waits for the copy held in flight.
    assert reader.ask("close_async") == ("closing", True)
    reader.ask("release")
    _, still_closing, (got,), registered = reader.ask("closed")
    assert not still_closing
    assert_same(got, value)
    assert registered == []
    handle(store, "again", {"t": big(6)})  # the reader's slot and holds are given back
    reader.proc.kill()


# -- the seam's own rules ------------------------------------------------------------------


def test_seam_refuses_overlapping_unmapped_and_read_only_without_the_flag():
    seam = device_for(SEAM)
    with mmap.mmap(-1, 4 * mmap.PAGESIZE) as m:
        view = memoryview(m)
        address = address_of(view)
        reg = seam.register(address, len(view), False)
        try:
            with pytest.raises(DeviceRefused):
                seam.register(address + mmap.PAGESIZE, mmap.PAGESIZE, False)
        finally:
            seam.unregister(reg)
        view.release()
    with pytest.raises(DeviceRefused):
        seam.register(address, mmap.PAGESIZE, False)  # unmapped now
    with open("/dev/zero", "rb") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE, mmap.MAP_PRIVATE, mmap.PROT_READ) as ro:
        view = memoryview(ro)
        assert view.readonly
        with pytest.raises(DeviceRefused):
            seam.register(address_of(view), len(view), False)
        reg = seam.register(address_of(view), len(view), True)
        seam.unregister(reg)
        view.release()


def test_ipc_handle_opens_the_same_memory_in_a_second_process(children):
    out, cmds = children.queue(), children.queue()
    proc = children.start(ipc_exporter, out, cmds)
    seam = device_for(SEAM)
    opened = seam.open_ipc(children.expect(out, "handle")[1])
    want = torch.arange(1 << 16, dtype=torch.int32)
    assert torch.equal(opened.to("cpu"), want)
    cmds.put("change")
    children.expect(out, "changed")
    assert torch.equal(opened.to("cpu"), want + 1)  # the same memory, not a copy
    seam.close_ipc(opened)
    del opened
    cmds.put("stop")
    children.expect(out, "stopped")
    proc.join(10)
    assert proc.exitcode == 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmq-twin-ipc-{proc.pid}-")]

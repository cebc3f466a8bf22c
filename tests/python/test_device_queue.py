"""Receiving into device memory from a queue (issue 55): ``MessageQueue.dequeue(...,
device=)`` in reader processes, against the seam ``SHMQ_DEVICE`` names (the CPU twin
here, CUDA under ``scripts/gpu_check.sh``; see ``test_device_seam.py`` for the seam).

A reader copies each tensor of the tensor arena from its *shared* mapping of the arena
(registered once) while it holds the tensor's lease, and gives the lease back only once
the copy ended. What is proved, with a writer and reader processes: exact data for every
kind of message (pickled objects with tensors in the arena and in the ring, typed
arrays); the writer cannot reuse an arena range while a copy from it is in flight (it
copies through the ring instead), and reuses it once the copy ended; a SIGKILLed reader's
leases come back; a refused registration takes the host path with one log line; closing
the device path while a copy is in flight waits for it, then unregisters.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from _processes import STEP, Children, wait_for
from _processes.device_children import DeviceChild, queue_device_reader
from shmq import MessageQueue
from test_device_seam import assert_same

pytestmark = pytest.mark.timeout(90)

MIB = 1 << 20


class Reader(DeviceChild):
    """A queue reader process (``queue_device_reader``) of ``rank``."""

    def __init__(self, children: Children, mq: MessageQueue, rank: int):
        super().__init__(children, queue_device_reader, mq.export_handle(), rank)


def big(seed: int) -> torch.Tensor:
    return torch.arange(MIB, dtype=torch.int32) * 7 + seed  # 4 MiB


def one_tensor_arena(n_reader: int = 1) -> MessageQueue:
    """A queue whose arena holds one 4 MiB tensor at a time."""
    return MessageQueue(n_reader, n_reader, max_chunk_bytes=1 * MIB, max_chunks=4, arena_bytes=6 * MIB)


def test_two_readers_receive_exact_data_in_device_memory(children):
    mq = MessageQueue(2, 2, max_chunk_bytes=1 * MIB, max_chunks=4, arena_bytes=64 * MIB)
    readers = [Reader(children, mq, rank) for rank in range(2)]
    mq.wait_until_ready(timeout=STEP)
    value = {
        "f32": torch.randn(1000, 1031),  # arena
        "bf16": torch.randn(3 * MIB).to(torch.bfloat16),  # arena
        "small": torch.tensor([1.5, -2.0]),  # in the ring
        "empty": torch.empty(0, 3),
        "nested": [(torch.full((2 * MIB,), 3, dtype=torch.uint8), "text")],
        "array": np.arange(300_000, dtype=np.float64),  # stays a host array
        "n": 42,
    }
    mq.enqueue(value, timeout=STEP)
    array = torch.arange(2 * MIB, dtype=torch.float32).reshape(1024, -1)
    mq.enqueue_array(array, timeout=STEP)
    mq.enqueue({"k": 1}, timeout=STEP)  # no tensor at all
    for r in readers:
        for _ in range(3):
            assert r.ask("recv", False)[0] == "issued"
    for r in readers:
        _, (got, got_array, plain), in_flight = r.ask("wait")
        assert in_flight == 0
        assert_same(got, value)
        assert_same(got_array, array)  # a typed array comes back a tensor on the device
        assert plain == {"k": 1}
        # Through the registered mapping, not the host path (which gives the same bytes).
        ((_, registered),) = r.ask("blocks")[1]
        assert registered, "no block of the arena was registered"
    for r in readers:
        r.stop()
    assert mq.arena_stats()["outstanding"] == 0


def test_arena_range_is_reused_only_after_the_copy_from_it_ended(children):
    mq = one_tensor_arena()
    reader = Reader(children, mq, 0)
    mq.wait_until_ready(timeout=STEP)
    first = {"t": big(1)}
    mq.enqueue(first, timeout=STEP)
    # The copy stays in flight on the twin's worker: the message is taken, its lease held.
    assert reader.ask("recv", True) == ("issued", 1)
    assert mq.arena_fallbacks == 0
    second = {"t": big(2)}
    mq.enqueue(second, timeout=STEP)  # the arena's one range is still being read
    assert mq.arena_fallbacks == 1, "the writer reused a range a copy still reads"
    reader.ask("release")
    assert reader.ask("recv", False)[0] == "issued"
    _, (got_first, got_second), in_flight = reader.ask("wait")
    assert in_flight == 0
    assert_same(got_first, first)  # the copy read the message, not what came after it
    assert_same(got_second, second)
    mq.enqueue({"t": big(3)}, timeout=STEP)  # given back once the copy ended
    assert mq.arena_fallbacks == 1
    assert reader.ask("recv", False)[0] == "issued"
    _, (got_third,), _ = reader.ask("wait")
    assert_same(got_third, {"t": big(3)})
    reader.stop()


def test_sigkilled_reader_gives_back_the_leases_it_held(children):
    mq = MessageQueue(2, 2, max_chunk_bytes=1 * MIB, max_chunks=4, arena_bytes=6 * MIB, on_dead_reader="drop")
    doomed, other = Reader(children, mq, 0), Reader(children, mq, 1)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue({"t": big(1)}, timeout=STEP)
    assert doomed.ask("recv", True) == ("issued", 1)
    assert other.ask("recv", False)[0] == "issued"
    other.ask("wait")
    assert mq.arena_stats()["outstanding"] == 1  # the doomed reader's copy holds it
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.proc.join(10)
    assert doomed.proc.exitcode == -signal.SIGKILL
    wait_for(lambda: mq.arena_stats()["outstanding"] == 0, STEP, "the dead reader's lease to come back")
    mq.enqueue({"t": big(2)}, timeout=STEP)
    assert mq.arena_fallbacks == 0  # through the arena again
    assert other.ask("recv", False)[0] == "issued"
    _, (got,), _ = other.ask("wait")
    assert_same(got, {"t": big(2)})
    other.stop()


def test_refused_registration_takes_the_host_path_with_one_log_line(children):
    mq = one_tensor_arena()
    reader = Reader(children, mq, 0)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue({"t": big(0)}, timeout=STEP)
    # The reader registers the arena's mapping itself first: the queue's registration
    # overlaps it and is refused, as cudaHostRegister refuses it.
    assert reader.ask("preregister")[0] == "preregistered"
    values = [{"t": big(k), "k": k} for k in range(1, 4)]
    for v in values:
        mq.enqueue(v, timeout=STEP)
        assert reader.ask("recv", False)[0] == "issued"
    _, got, _ = reader.ask("wait")
    assert_same(got, values)
    (log,) = reader.ask("logs")[1]
    assert "refused to register" in log[2] and "host path" in log[2]
    reader.stop()


def test_closing_the_device_path_while_a_copy_is_in_flight_waits_then_unregisters(children):
    mq = one_tensor_arena()
    reader = Reader(children, mq, 0)
    mq.wait_until_ready(timeout=STEP)
    value = {"t": big(5)}
    mq.enqueue(value, timeout=STEP)
    assert reader.ask("recv", True) == ("issued", 1)
    # close_device() on a thread: it waits for the copy held in flight.
    assert reader.ask("close_async") == ("closing", True)
    reader.ask("release")
    _, still_closing, (got,), registered = reader.ask("closed")
    assert not still_closing
    assert_same(got, value)
    assert registered == []
    wait_for(lambda: mq.arena_stats()["outstanding"] == 0, STEP, "the lease to come back")
    reader.stop()


def test_the_arena_is_registered_block_by_block_as_copies_read_it(children, monkeypatch):
    """Only the blocks a copy reads are registered (pinning the whole arena would fault
    in every page of it), and a tensor that spans blocks comes over whole."""
    monkeypatch.setenv("SHMQ_DEVICE_REGISTER_BLOCK", str(MIB))  # the reader's blocks: 1 MiB
    mq = MessageQueue(1, 1, max_chunk_bytes=1 * MIB, max_chunks=4, arena_bytes=64 * MIB)
    reader = Reader(children, mq, 0)
    mq.wait_until_ready(timeout=STEP)
    value = {"t": torch.arange(MIB + 12345, dtype=torch.int32)}  # 4 MiB and more: 5-6 blocks
    mq.enqueue(value, timeout=STEP)
    assert reader.ask("recv", False)[0] == "issued"
    _, (got,), _ = reader.ask("wait")
    assert_same(got, value)
    ((block, registered),) = reader.ask("blocks")[1]
    assert block == MIB
    assert 5 <= len(registered) <= 6, registered  # of the arena's 64 and more
    assert registered == list(range(registered[0], registered[0] + len(registered)))
    reader.stop()

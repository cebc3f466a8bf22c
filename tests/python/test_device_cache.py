"""Loading encoder-cache entries into device memory (issue 55): registered copies from
the consumer's shared mapping of the producer's segment, and device tensors published by
IPC handle (``EncoderCacheProducer(ipc=True)``), against the seam ``SHMQ_DEVICE`` names
(the CPU twin here, CUDA under ``scripts/gpu_check.sh``).

What is proved, with a producer and consumer processes: exact data both ways; an entry
is reused (its IPC tensor freed) only after every consumer's copy from it ended; a
SIGKILLed consumer releases what it held; many allocations keep the consumer's cache of
opened handles bounded and the producer's exported memory bounded; a consumer that
cannot open a handle reads the host copy (one log line), or finds the key missing
without one.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from _processes import STEP, Children, wait_for
from _processes.device_children import DeviceChild, DEVICE, SEAM, cache_device_consumer
from shmq import EncoderCacheProducer
from shmq._ipc import MAX_OPEN_HANDLES
from test_device_seam import assert_same

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


class Consumer(DeviceChild):
    """An encoder-cache consumer process (``cache_device_consumer``) of cache ``name``."""

    def __init__(self, children: Children, name: str):
        super().__init__(children, cache_device_consumer, name)


def embedding(seed: int, rows: int = 576, width: int = 2048) -> torch.Tensor:
    """An image's embedding (576 × 2048 bf16: 2.3 MiB), on the seam's device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g).to(torch.bfloat16).to(DEVICE)


def exported_files(pid: int) -> list[str]:
    """The twin's IPC allocations of process ``pid`` (CUDA has no files: empty)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"shmq-twin-ipc-{pid}-")]


def test_registered_copies_of_host_entries_reach_two_consumers_exactly(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=64 * MIB) as producer:
        consumers = [Consumer(children, cache_name) for _ in range(2)]
        value = {"emb": embedding(1).cpu(), "grid": torch.arange(3 * MIB, dtype=torch.int32), "n": 3}
        producer.save("img-1", value)
        producer.flush(STEP)
        for c in consumers:
            assert c.ask("get", "img-1", False)[0] == "issued"
        for c in consumers:
            _, (got,), in_flight = c.ask("wait")
            assert in_flight == 0
            assert_same(got, value)
            # Through the registered mapping, not the host path (the same bytes).
            assert c.ask("registered")[1] > 0
        producer.wait_loaded("img-1", STEP)
        for c in consumers:
            c.stop()


@pytest.mark.parametrize("host_copy", [False, True], ids=["handles", "handles+host"])
def test_ipc_entries_reach_two_consumers_exactly(children, cache_name, host_copy):
    with EncoderCacheProducer(cache_name, capacity=64 * MIB, ipc=True, ipc_host_copy=host_copy,
                              device_seam=SEAM) as producer:
        consumers = [Consumer(children, cache_name) for _ in range(2)]
        value = {"emb": embedding(2), "pos": [embedding(3, rows=4, width=16)], "n": 7}
        producer.save("img-2", value)
        producer.flush(STEP)
        assert producer.exported() == {"held": 1, "retired": 0}
        for c in consumers:
            assert c.ask("get", "img-2", False)[0] == "issued"
        for c in consumers:
            _, (got,), _ = c.ask("wait")
            assert_same(got, {"emb": value["emb"].cpu(), "pos": [value["pos"][0].cpu()], "n": 7})
            assert c.ask("opened") == ("opened", 2)  # one per allocation
        for c in consumers:
            c.stop()


def test_ipc_memory_is_freed_only_after_every_copy_from_it_ended(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=64 * MIB, ipc=True, device_seam=SEAM) as producer:
        consumer = Consumer(children, cache_name)
        value = {"emb": embedding(4)}
        producer.save("img-4", value)
        producer.flush(STEP)
        del value
        # The copy from the producer's memory stays in flight in the consumer.
        assert consumer.ask("get", "img-4", True)[:2] == ("issued", 1)
        assert producer.evict("img-4")
        producer.save("next", {"x": embedding(5)})  # sweeps what is gone for good
        assert producer.exported() == {"held": 1, "retired": 1}, "freed while a copy reads it"
        if SEAM == "twin":
            assert len(exported_files(os.getpid())) == 2
        consumer.ask("release")
        _, (got,), in_flight = consumer.ask("wait")
        assert in_flight == 0
        assert_same(got, {"emb": embedding(4).cpu()})
        wait_for(lambda: producer.exported()["retired"] == 0, STEP, "the evicted entry's memory to go")
        if SEAM == "twin":
            assert len(exported_files(os.getpid())) == 1
        consumer.stop()


def test_sigkilled_consumer_releases_what_it_held(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=64 * MIB, ipc=True, device_seam=SEAM) as producer:
        consumer = Consumer(children, cache_name)
        producer.save("img-6", {"emb": embedding(6)})
        producer.flush(STEP)
        assert consumer.ask("get", "img-6", True)[:2] == ("issued", 1)
        producer.evict("img-6")
        assert producer.exported() == {"held": 0, "retired": 1}
        os.kill(consumer.pid, signal.SIGKILL)
        consumer.proc.join(10)
        assert consumer.proc.exitcode == -signal.SIGKILL

        def freed() -> bool:
            producer._core.sweep()
            return producer.exported()["retired"] == 0

        wait_for(freed, STEP, "the dead consumer's hold to go")


def test_many_allocations_keep_open_handles_and_exported_memory_bounded(children, cache_name):
    n = MAX_OPEN_HANDLES + 36
    with EncoderCacheProducer(cache_name, capacity=8 * MIB, max_entries=16, ipc=True, device_seam=SEAM,
                              timeout=STEP) as producer:
        consumer = Consumer(children, cache_name)
        for k in range(n):
            t = torch.full((64, 64), k, dtype=torch.float32, device=DEVICE)  # an allocation each
            producer.save(f"k{k}", t)
            producer.flush(STEP)
            _, _, missing = consumer.ask("get", f"k{k}", False)
            assert missing == []
            _, (got,), _ = consumer.ask("wait")
            assert torch.equal(got, torch.full((64, 64), k, dtype=torch.float32))
            assert producer.exported()["held"] <= 16
        assert consumer.ask("opened")[1] == MAX_OPEN_HANDLES
        if SEAM == "twin":
            assert len(exported_files(os.getpid())) <= 16
        consumer.stop()


@pytest.mark.parametrize("host_copy", [True, False], ids=["host-copy", "no-host-copy"])
def test_consumer_that_cannot_open_a_handle_takes_the_host_copy_or_misses(children, cache_name, host_copy):
    with EncoderCacheProducer(cache_name, capacity=64 * MIB, ipc=True, ipc_host_copy=host_copy,
                              device_seam=SEAM) as producer:
        consumer = Consumer(children, cache_name)
        consumer.ask("break_ipc")
        values = [{"emb": embedding(10 + k)} for k in range(3)]
        for k, v in enumerate(values):
            producer.save(f"img-{k}", v)
        producer.flush(STEP)
        for k in range(3):
            _, _, missing = consumer.ask("get", f"img-{k}", False)
            assert missing == ([] if host_copy else [f"img-{k}"])
        _, got, _ = consumer.ask("wait")
        if host_copy:
            assert_same(got, [{"emb": v["emb"].cpu()} for v in values])
        else:
            assert got == [None, None, None]
        logs = [r for r in consumer.ask("logs")[1] if "IPC handle" in r[2]]
        assert len(logs) == 1, logs
        assert ("host copies are read" if host_copy else "missing here") in logs[0][2]
        consumer.stop()

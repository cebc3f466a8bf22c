"""The encoder-cache hand-off in real processes: a producer's values by key to several
consumers (every dtype, compared exactly), ``has`` from a process that loads nothing,
eviction rules (every live consumer loaded it, nobody maps it), dead consumers, a full
cache, restarted producers, late joiners, a long run in a small cache, private writes.

Every test names its caches uniquely (``cache_name``) and checks that none of their
segments is left in /dev/shm (besides the conftest check of pid-named segments).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from _processes import STEP
from _processes.encoder_cache_children import (
    MiB,
    every_kind_of_value,
    holding_consumer,
    one_mib,
    scripted,
    value_digest,
)
from _processes.tensor_children import digest
from shmq import (
    EncoderCacheConnector,
    EncoderCacheConsumer,
    EncoderCacheIndex,
    EncoderCacheMetadata,
    EncoderCacheProducer,
)
from shmq.encoder_cache import MAX_KEY_LEN

# Room for n one-MiB values (each entry is its pickle, its part table and the tensor,
# in whole pages).
ENTRY = MiB + 8192


class Scripted:
    """A child process that runs commands (see ``_processes.encoder_cache_children.scripted``)."""

    def __init__(self, children, role: str, names: list[str], **producer_options):
        self.children = children
        self.out = children.queue()
        self.commands = children.queue()
        self.proc = children.start(scripted, self.out, self.commands, role, names, producer_options)
        self.pid = children.expect(self.out, "ready")[1]

    def __call__(self, *command, expect: str, timeout: float = STEP):
        self.commands.put(command)
        return list(self.children.expect(self.out, expect, timeout)[1:])

    def exit(self):
        self.commands.put(("exit",))


def test_every_kind_of_value_reaches_two_consumers_exactly(children, cache_name):
    values = every_kind_of_value()
    assert any(k.startswith("quantized-") for k in values) and "large-bfloat16" in values
    expected = {k: value_digest(v) for k, v in values.items()}
    with EncoderCacheProducer(cache_name, capacity=64 * MiB) as producer:
        consumers = [Scripted(children, "consumer", [cache_name]) for _ in range(2)]
        for k, v in values.items():
            assert producer.save(k, v)
        producer.flush(STEP)
        for c in consumers:
            missing, got = c("load", list(values), False, expect="loaded")
            assert missing == []
            for k in values:
                assert got[k] == expected[k], f"{k!r}: sent {expected[k]}, received {got[k]}"
        for k in values:
            producer.wait_loaded(k, timeout=STEP)
        # What the producer saved is untouched, and a second save of a key copies nothing.
        assert {k: value_digest(v) for k, v in values.items()} == expected
        assert not producer.save("image", values["image"])
        # ... nor even serializes it (a value that cannot be pickled is never looked at).
        assert not producer.save("image", _Unpicklable())
        for c in consumers:
            c.exit()
        children.join()


def test_a_write_into_a_loaded_value_stays_private(children, cache_name):
    value = {"embeds": torch.randn(MiB), "ids": np.arange(1000)}
    with EncoderCacheProducer(cache_name, capacity=16 * MiB) as producer:
        a = Scripted(children, "consumer", [cache_name])
        b = Scripted(children, "consumer", [cache_name])
        producer.save("k", value)
        producer.flush(STEP)
        before, written, again, writable = a("load_and_write", "k", expect="wrote")
        assert writable, "loaded tensors and arrays are writable"
        assert written != before, "the write took"
        assert again == before, "a second load in the same process does not see the write"
        # Another consumer, loading after the write, sees the saved bytes.
        _, got = b("load", ["k"], False, expect="loaded")
        assert got["k"] == digest(value)
        assert digest(value) == before
        a.exit()
        b.exit()
        children.join()


def test_has_from_a_process_that_never_loaded_anything(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=16 * MiB) as producer:
        index = Scripted(children, "index", [cache_name])
        assert index("has", ["a", "b"], expect="has") == [[False, False]]
        producer.save("a", torch.ones(10))
        producer.save("b", torch.ones(10))
        assert index("wait_has", ["a", "b"], expect="has") == [True]
        assert index("has", ["a", "b", "unknown", "y" * (MAX_KEY_LEN + 1)], expect="has") == [
            [True, True, False, False]
        ]
        # It does not count as a consumer: a key is loaded without it.
        producer.wait_loaded("a", timeout=STEP)
        assert producer.consumers() == []
        producer.evict("a")
        assert index("has", ["a", "b"], expect="has") == [[False, True]]
        index.exit()
        children.join()


def test_eviction_only_after_every_live_consumer_loaded_a_key(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=3 * ENTRY, timeout=STEP) as producer:
        a = Scripted(children, "consumer", [cache_name])
        b = Scripted(children, "consumer", [cache_name])
        for i in (1, 2, 3):
            producer.save(f"k{i}", one_mib(i))
        producer.flush(STEP)
        assert a("load", ["k1", "k2", "k3"], False, expect="loaded")[0] == []
        assert b("ack", ["k1"], expect="acked") == [[]]
        # k1 is loaded by both: it goes to make room for k4.
        assert producer.save("k4", one_mib(4), timeout=1.0)
        producer.flush(STEP)
        assert producer.keys() == ["k2", "k3", "k4"]
        # k2 and k3 wait for b, k4 for both: no room for k5.
        t0 = time.monotonic()
        with pytest.raises(MemoryError, match="not yet loaded by every live consumer"):
            producer.save("k5", one_mib(5), timeout=0.5)
        assert time.monotonic() - t0 >= 0.4, "it waited for room first"
        assert producer.keys() == ["k2", "k3", "k4"]
        assert b("load", ["k2"], False, expect="loaded")[0] == []
        assert producer.save("k5", one_mib(5), timeout=1.0)
        producer.flush(STEP)
        assert producer.keys() == ["k3", "k4", "k5"]
        # The consumers see exactly what is held.
        assert b("has", ["k1", "k2", "k3", "k4", "k5"], expect="has") == [[False, False, True, True, True]]
        a.exit()
        b.exit()
        children.join()


def test_a_sigkilled_consumer_does_not_pin_memory(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=2 * ENTRY, timeout=STEP) as producer:
        producer.save("k1", one_mib(1))
        producer.save("k2", one_mib(2))
        producer.flush(STEP)
        out = children.queue()
        proc = children.start(holding_consumer, out, [cache_name], "k1")
        pid = children.expect(out, "holding")[1]
        other = Scripted(children, "consumer", [cache_name])
        other("ack", ["k1", "k2"], expect="acked")
        # k1 is loaded by everyone but mapped by the holder; k2 was published before the
        # holder joined, so only `other` had to load it: k2 goes, then nothing can.
        assert producer.save("k3", one_mib(3), timeout=1.0)
        other("ack", ["k3"], expect="acked")
        with pytest.raises(MemoryError, match="still mapped by a consumer"):
            producer.save("k4", one_mib(4), timeout=0.5)
        assert [c[1] for c in producer.consumers() if c[1] == pid] == [pid]
        os.kill(pid, signal.SIGKILL)
        proc.join(STEP)
        t0 = time.monotonic()
        assert producer.save("k4", one_mib(4), timeout=STEP)
        assert time.monotonic() - t0 < 10, "the dead consumer's hold went within seconds"
        assert pid not in [c[1] for c in producer.consumers()]
        producer.flush(STEP)
        assert producer.keys() == ["k3", "k4"]
        other.exit()


def test_a_full_cache_blocks_then_raises_and_wakes_when_room_comes(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=ENTRY, timeout=STEP) as producer:
        c = Scripted(children, "consumer", [cache_name])
        producer.save("k1", one_mib(1))
        producer.flush(STEP)
        t0 = time.monotonic()
        with pytest.raises(MemoryError) as err:
            producer.save("k2", one_mib(2), timeout=0.5)
        assert time.monotonic() - t0 >= 0.4
        message = str(err.value)
        assert cache_name in message and "is full" in message and "1 held entries are not yet loaded" in message
        assert not producer.has("k2"), "nothing was dropped or half-saved"
        # A save blocked on the full cache goes through as soon as the consumer loads k1.
        result = {}
        saver = threading.Thread(target=lambda: result.setdefault("ok", producer.save("k2", one_mib(2))))
        saver.start()
        saver.join(0.2)  # not synchronisation: a bounded check that the save blocks
        assert saver.is_alive(), "the save waits"
        c("load", ["k1"], False, expect="loaded")
        saver.join(STEP)
        assert result == {"ok": True}
        producer.flush(STEP)
        assert producer.keys() == ["k2"]
        # Too large for the cache at all: refused at once.
        with pytest.raises(ValueError, match="exceeds max object size"):
            producer.save("huge", torch.zeros(MiB))
        c.exit()
        children.join()


def test_a_restarted_producer_does_not_serve_stale_data(children, cache_name):
    old = Scripted(children, "producer", [cache_name], capacity=16 * MiB)
    old("save", {"old-only": one_mib(1), "same": one_mib(1)}, True, expect="saved")
    consumer = EncoderCacheConsumer(cache_name)
    index = EncoderCacheIndex(cache_name)
    held = consumer.get("same")
    assert bool(torch.all(held == 1.0))
    # A second producer of a live name is refused.
    with pytest.raises(ValueError, match="already served by a live producer"):
        EncoderCacheProducer(cache_name)
    os.kill(old.pid, signal.SIGKILL)
    old.proc.join(STEP)
    # The dead producer's keys are still intact until someone takes its name...
    assert consumer.has("old-only") and index.has("old-only")
    with EncoderCacheProducer(cache_name, capacity=16 * MiB) as new:
        # ...and never served again once the name is taken.
        assert not consumer.has("old-only") and not index.has("old-only")
        assert not consumer.has("same")
        new.save("same", one_mib(2))
        new.flush(STEP)
        assert index.has("same")
        assert bool(torch.all(consumer.get("same") == 2.0))
        assert consumer.load(["old-only"], {}) == ["old-only"]
        assert bool(torch.all(held == 1.0)), "a view of the old segment stays valid"
        new.wait_loaded("same", timeout=STEP)
    assert not consumer.has("same") and not index.has("same"), "a closed producer's keys go"
    consumer.close()
    index.close()


def test_a_late_joining_consumer_sees_held_keys_and_holds_back_only_new_ones(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=16 * MiB) as producer:
        early = Scripted(children, "consumer", [cache_name])
        producer.save("k1", one_mib(1))
        producer.save("k2", one_mib(2))
        producer.flush(STEP)
        early("ack", ["k1", "k2"], expect="acked")
        late = Scripted(children, "consumer", [cache_name])
        missing, got = late("load", ["k1", "k2"], False, expect="loaded")
        assert missing == [] and got["k2"] == digest(one_mib(2))
        # Keys saved before it joined never waited for it; new keys do.
        producer.save("k3", one_mib(3))
        producer.flush(STEP)
        early("ack", ["k3"], expect="acked")
        with pytest.raises(TimeoutError, match=f"not yet loaded by consumer\\(s\\) pid {late.pid}"):
            producer.wait_loaded("k3", timeout=0.3)
        late("ack", ["k3"], expect="acked")
        producer.wait_loaded("k3", timeout=STEP)
        early.exit()
        late.exit()
        children.join()


def test_several_producers_serve_the_same_consumers(children, cache_name):
    names = [f"{cache_name}-a", f"{cache_name}-b", f"{cache_name}-c"]
    with EncoderCacheProducer(names[0], capacity=8 * MiB) as a, EncoderCacheProducer(names[1], capacity=8 * MiB) as b:
        consumer = Scripted(children, "consumer", names)  # the third producer is not there yet
        a.save("from-a", one_mib(1))
        b.save("from-b", one_mib(2))
        a.flush(STEP)
        b.flush(STEP)
        missing, got = consumer("load", ["from-a", "from-b", "nowhere"], False, expect="loaded")
        assert missing == ["nowhere"]
        assert got == {"from-a": digest(one_mib(1)), "from-b": digest(one_mib(2))}
        a.wait_loaded("from-a", timeout=STEP)
        b.wait_loaded("from-b", timeout=STEP)
        # A producer that appears after the consumer started is found and joined at the
        # consumer's next call.
        with EncoderCacheProducer(names[2], capacity=8 * MiB) as c:
            # Not synchronisation: the consumer looks for missing producers every 0.1 s at
            # most; that interval passes, so its next call looks.
            time.sleep(0.15)
            assert consumer("has", ["from-c"], expect="has") == [[False]]
            assert len(c.consumers()) == 1
            c.save("from-c", one_mib(3))
            assert consumer("wait_has", ["from-c"], expect="has") == [True]
            assert consumer("load", ["from-c"], False, expect="loaded")[1] == {"from-c": digest(one_mib(3))}
            c.wait_loaded("from-c", timeout=STEP)
        consumer.exit()
        children.join()


def test_many_keys_over_a_long_run_stay_within_the_configured_memory(children, cache_name):
    n, capacity = 120, 6 * ENTRY
    with EncoderCacheProducer(cache_name, capacity=capacity, max_entries=8, timeout=STEP) as producer:
        consumer = Scripted(children, "consumer", [cache_name])
        consumer.commands.put(("load_sequence", n, STEP))
        for i in range(n):
            assert producer.save(f"k{i}", one_mib(i))
            stats = producer.stats()
            assert stats["reserved"] <= stats["capacity"] == capacity
            assert stats["entries"] + stats["pending"] <= 8
        producer.flush(STEP)
        assert children.expect(consumer.out, "sequence", timeout=3 * STEP)[1] == []
        seg = os.stat(f"/dev/shm/{producer.segment_name}")
        header_bytes = seg.st_size - capacity
        assert seg.st_blocks * 512 <= seg.st_size, "no more memory than the segment's size"
        assert seg.st_blocks * 512 <= header_bytes + capacity
        stats = producer.stats()
        assert stats["saves"] == n and stats["evictions"] >= n - 6
        consumer.exit()
        children.join()


def test_wait_loaded_on_loaded_and_key_errors(children, cache_name):
    with EncoderCacheProducer(cache_name, capacity=16 * MiB, min_consumers=1) as producer:
        calls = []
        done = threading.Event()

        def callback(key, loaded):
            calls.append((key, loaded))
            if len(calls) == 2:
                done.set()

        producer.save("k1", one_mib(1), on_loaded=callback)
        producer.save("gone", one_mib(2))
        producer.on_loaded("gone", callback)
        producer.flush(STEP)
        assert not producer.is_loaded("k1"), "min_consumers=1 and nobody loaded it"
        with pytest.raises(KeyError):
            producer.wait_loaded("never-saved", timeout=1)
        with pytest.raises(KeyError):
            producer.is_loaded("never-saved")
        with pytest.raises(TimeoutError, match="fewer than min_consumers=1"):
            producer.wait_loaded("k1", timeout=0.2)
        producer.evict("gone")
        c = Scripted(children, "consumer", [cache_name])
        c("load", ["k1"], False, expect="loaded")
        assert done.wait(STEP)
        assert sorted(calls) == [("gone", False), ("k1", True)]
        producer.wait_loaded("k1", timeout=STEP)
        c.exit()
        children.join()


def test_views_hold_an_evicted_entry_until_they_go(cache_name):
    with EncoderCacheProducer(cache_name, capacity=2 * ENTRY) as producer:
        consumer = EncoderCacheConsumer(cache_name)
        producer.save("k", one_mib(7))
        producer.flush(STEP)
        value = consumer.get("k")
        assert producer.evict("k") and not producer.evict("k")
        assert not consumer.has("k")
        assert producer.stats()["zombies"] == 1
        assert bool(torch.all(value == 7.0)), "the view is intact"
        del value
        gc.collect()
        # The next save frees it and reuses the room.
        producer.save("k2", one_mib(8))
        producer.save("k3", one_mib(9))
        producer.flush(STEP)
        assert producer.stats()["zombies"] == 0
        consumer.close()


def test_keys_and_arguments_are_checked(cache_name):
    with EncoderCacheProducer(cache_name, capacity=4 * MiB) as producer:
        with pytest.raises(ValueError, match="key must be 1 to 160 bytes"):
            producer.save("k" * (MAX_KEY_LEN + 1), 1)
        with pytest.raises(ValueError, match="key must be 1 to 160 bytes"):
            producer.save("", 1)
        assert producer.save("plain", {"a": 1, "b": [1, 2]})
        assert not producer.save("plain", {"a": 2})
        producer.flush(STEP)
        consumer = EncoderCacheConsumer([cache_name])
        assert consumer.get("plain") == {"a": 1, "b": [1, 2]}
        with pytest.raises(KeyError):
            consumer.get("nope")
        assert consumer.load("nope", {}) == ["nope"]
        assert consumer.load(["plain", "nope"]) == ["nope"], "acknowledge only"
        consumer.close()
        with pytest.raises(RuntimeError, match="closed"):
            consumer.has("plain")
    with pytest.raises(ValueError, match="invalid encoder cache name"):
        EncoderCacheProducer("a/b")
    with pytest.raises(ValueError, match="max_consumers"):
        EncoderCacheProducer(cache_name, max_consumers=65)
    producer2 = EncoderCacheProducer(cache_name, capacity=MiB)
    producer2.close()
    with pytest.raises(RuntimeError, match="closed"):
        producer2.save("k", 1)


def test_connector_roles(children, cache_name):
    # The deprecated EncoderCacheConnector: ShmqECConnector's behaviour (one connector,
    # shmq._ec_connector._Connector) with a role string instead of vLLM's config.
    with pytest.warns(DeprecationWarning, match=r"shmq\.vllm_ec_connector\.ShmqECConnector"):
        producer = EncoderCacheConnector("producer", name=cache_name, capacity=16 * MiB)
    with pytest.warns(DeprecationWarning):
        scheduler = EncoderCacheConnector("scheduler", producers=[cache_name])
    worker = Scripted(children, "connector", [cache_name])
    cache = {"h1": torch.randn(1000), "h2": torch.randn(2000)}
    producer.save_caches(cache, "h1")
    producer.save_caches(cache, "h2")
    producer.wait_for_save(STEP)
    assert producer.stats() == {"saved": 2, "loaded": 0}
    assert scheduler.has_cache_item("h1") and not scheduler.has_cache_item("h3")

    class Feature:
        def __init__(self, identifier):
            self.identifier = identifier

    class Request:
        mm_features = [Feature("h1"), Feature("h3")]

        def get_num_encoder_embeds(self, index):
            return 10 * (index + 1)

    scheduler.update_state_after_alloc(Request(), 0)
    scheduler.update_state_after_alloc(Request(), 1)  # not held: not loaded
    scheduler.update_state_after_alloc("h2")
    meta = scheduler.build_connector_meta(None)
    assert meta == EncoderCacheMetadata(["h1", "h2"], {"h1": 10})
    assert scheduler.build_connector_meta(None) == EncoderCacheMetadata()
    loaded, unavailable = worker("start_load", meta, expect="started")
    assert loaded == {"h1": digest(cache["h1"]), "h2": digest(cache["h2"])}
    assert unavailable == []
    # As vLLM's contract has it: nothing is held for a request (request_finished says
    # False), so no request is reported finished sending; a producer's get_finished
    # waits for its saves.
    assert producer.get_finished({"r1", "r2"}) == (None, None)
    missing = EncoderCacheMetadata(["h9"])
    assert worker("start_load", missing, expect="started") == [{}, ["h9"]]
    # A call for a side the connector is not does nothing, as vLLM makes such calls: a
    # producer's worker finds nothing (an encode-only instance always encodes) and has
    # no step to build; a scheduler saves and loads nothing.
    assert not producer.has_cache_item("h1")
    producer.update_state_after_alloc("h1")
    assert producer.build_connector_meta(None) == EncoderCacheMetadata()
    scheduler.save_caches(cache, "h3")
    scheduler.bind_connector_metadata(meta)
    scheduler.start_load_caches({})
    assert scheduler.get_finished(set()) == (None, None) and scheduler.stats() == {"saved": 0, "loaded": 0}
    worker.exit()
    children.join()
    scheduler.shutdown()
    producer.shutdown()
    producer.shutdown()  # once more: nothing left to close


def test_the_deprecated_connector_warns_once_and_imports_no_vllm(cache_name):
    import subprocess
    import sys

    code = f"""
import sys, warnings
import shmq
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    connector = shmq.EncoderCacheConnector("producer", name={cache_name!r}, capacity=1 << 20)
    connector.save_caches({{"k": b"x"}}, "k")
    connector.wait_for_save(10)
    connector.shutdown()
messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
assert len(messages) == 1 and "shmq.vllm_ec_connector.ShmqECConnector" in messages[0], messages
assert caught[0].filename == "<string>", caught[0].filename  # the caller's line
assert "vllm" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_through_shared_cpu_memory(cache_name):
    with EncoderCacheProducer(cache_name, capacity=16 * MiB) as producer:
        consumer = EncoderCacheConsumer(cache_name)
        t = torch.randn(1000, device="cuda")
        producer.save("k", {"emb": t})
        producer.flush(STEP)
        on_cpu = consumer.get("k")["emb"]
        assert on_cpu.device.type == "cpu" and torch.equal(on_cpu, t.cpu())
        on_gpu = consumer.get("k", device="cuda")["emb"]
        assert on_gpu.device.type == "cuda" and torch.equal(on_gpu, t)
        consumer.close()


class _Unpicklable:
    def __reduce__(self) -> object:
        raise AssertionError("a save of a published key serialized its value")

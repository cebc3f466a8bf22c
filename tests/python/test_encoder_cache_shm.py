"""The encoder cache when ``/dev/shm``, not its capacity, runs out (issue 18 item 7a), and
what an index shows of a producer SIGKILLed mid-save (item 11).

The cache's default capacity (1 GiB) is larger than a container's usual ``/dev/shm``.
Each ``/dev/shm`` test runs a program of its own (this file, run as a script) in a
private mount namespace whose ``/dev/shm`` is a fresh tmpfs of 256 or 64 MiB (``unshare
--mount``, as in ``test_small_shm.py``): the producer there, and a consumer process
(spawned: it shares the namespace). Running out of ``/dev/shm`` must work like a full
capacity: entries every consumer loaded are evicted and their pages given back, saves go
on; when nothing may go, ``save`` waits up to its timeout and raises ``MemoryError``
naming ``/dev/shm`` and how to raise it — never a ``SIGBUS``, which would show here as
the program's exit status.

Skipped, with the reason, where mount namespaces cannot be made (no ``unshare``, or
not permitted).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from _processes import wait_for
from _processes.private_shm import capture_shm_warnings, run_in_private_shm, shm_free, shm_total

STEP = 60.0  # bound on any one blocking call in the program
MiB = 1 << 20
ENTRY_BYTES = 8 * MiB
WARNING = "is too small"


def _in_small_shm(shm_size: str, *args: str, timeout: float = 400) -> dict:
    """Run this file as a program with ``args`` in a private /dev/shm of ``shm_size``;
    its last stdout line (JSON), once it exited 0."""
    return run_in_private_shm(__file__, list(args), shm_size, timeout)


@pytest.mark.timeout(500)
@pytest.mark.parametrize(("shm_size", "n"), [("256m", 100), ("64m", 30)])
def test_saves_go_on_when_dev_shm_runs_out_and_the_consumer_loads(shm_size, n):
    """A 1 GiB cache in a smaller /dev/shm: n saves of 8 MiB, each loaded by a consumer
    process, all succeed (entries the consumer loaded are evicted and their pages given
    back), the consumer gets every value right, and the cache leaves some /dev/shm to
    the machine's other segments."""
    got = _in_small_shm(shm_size, "loaded", str(n))
    assert got["shm_total"] == int(shm_size[:-1]) * MiB
    assert got["errors"] == [], got["errors"]
    assert got["consumer"]["error"] is None, got["consumer"]["error"]
    assert got["consumer"]["loaded"] == n
    assert got["consumer"]["bad"] == [], got["consumer"]["bad"]
    assert got["stats"]["saves"] == n + 1
    # /dev/shm, not the 1 GiB capacity, made room by evicting.
    assert got["stats"]["evictions"] > 0, got["stats"]
    assert got["stats"]["capacity"] > got["shm_total"]
    assert got["stats"]["reserved"] <= got["shm_total"], got["stats"]
    # With loaded entries to evict, a save leaves an eighth of /dev/shm to the others
    # (queues, stores) rather than take all of it.
    assert got["shm_free"] >= got["shm_total"] // 8 - MiB, got
    # One warning saying how to raise /dev/shm (once per process).
    assert got["warnings"] <= 1, got["warning_texts"]


@pytest.mark.timeout(300)
def test_save_raises_naming_dev_shm_when_nothing_can_be_evicted():
    """No entry may go (min_consumers=1 and no consumer): the cache fills the 64 MiB
    /dev/shm, then ``save`` waits its timeout and raises MemoryError naming /dev/shm and
    how to raise it; evicting a key makes room again."""
    got = _in_small_shm("64m", "stuck")
    # 7 entries of 8 MiB fit beside the segment's tables: /dev/shm filled before raising.
    assert got["saved"] >= 5, got
    text = got["error"]
    assert text is not None, got
    for needle in ("is full", "/dev/shm ran out before the cache's capacity", "--shm-size", "--ipc=host"):
        assert needle in text, text
    assert got["has_failed_key"] is False, "nothing half-saved is shown"
    assert got["saved_after_evict"] is True, got
    assert got["warnings"] == 1, got["warning_texts"]


def _reserving_producer(out, name: str) -> None:
    """Save "done" (published), reserve "unfinished" and never publish it, report, and
    wait to be killed."""
    import torch

    from shmq import EncoderCacheProducer

    p = EncoderCacheProducer(name, capacity=64 * MiB)
    p.save("done", torch.full((MiB // 4,), 1.0))
    p.flush(STEP)
    reservation = p._core.reserve("unfinished", [4096, MiB], STEP)
    assert reservation is not None
    out.put(("reserved", os.getpid()))
    time.sleep(3 * STEP)  # not synchronisation: holds the reservation until killed


def test_a_producer_sigkilled_mid_save_never_shows_the_unfinished_key(children, cache_name):
    """A producer SIGKILLed while a save is in progress: in other processes the key of
    that save is never held (an index made before the death and one made after, and a
    consumer's load), while the keys it had published stay held and load intact (their
    data is all there) until a producer of the same name replaces the segment."""
    import torch

    from shmq import EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer

    out = children.queue()
    proc = children.start(_reserving_producer, out, cache_name)
    pid = children.expect(out, "reserved")[1]
    before = EncoderCacheIndex(cache_name)
    assert before.has("done") and not before.has("unfinished")
    os.kill(pid, signal.SIGKILL)
    proc.join(STEP)
    assert proc.exitcode == -signal.SIGKILL
    after = EncoderCacheIndex(cache_name)
    consumer = EncoderCacheConsumer(cache_name)
    for index in (before, after, consumer):
        assert not index.has("unfinished")
        assert index.has("done")
    assert consumer.load(["unfinished"], {}) == ["unfinished"]
    value = consumer.get("done")
    assert bool(torch.all(value == 1.0))
    del value
    with EncoderCacheProducer(cache_name, capacity=16 * MiB):
        for index in (before, after, consumer):
            assert not index.has("done") and not index.has("unfinished")
    for index in (before, after, consumer):
        index.close()


# ------------------------------------------------------------------------------------
# The program: runs inside the private /dev/shm.


def _value(i: int):
    import torch

    return torch.full((ENTRY_BYTES // 4,), float(i))


def _loading_consumer(name: str, n: int, out) -> None:
    """Join, say so, then load k0..k{n-1} as they come, check each, drop each view."""
    import torch

    from shmq import EncoderCacheConsumer

    consumer = EncoderCacheConsumer(name)
    out.put("joined")
    bad, loaded, error = [], 0, None
    try:
        for i in range(n):
            key = f"k{i}"
            wait_for(lambda key=key: consumer.has(key), STEP, f"{key} to be held", 0.001)
            got: dict = {}
            if consumer.load([key], got):
                bad.append(i)
                continue
            if not bool(torch.all(got[key] == float(i))):
                bad.append(i)
            loaded += 1
            del got
    except Exception as e:  # reported, not lost
        error = repr(e)
    consumer.close()
    out.put({"bad": bad, "loaded": loaded, "error": error})


def run_loaded(n: int) -> dict:
    import multiprocessing as mp

    warnings = capture_shm_warnings(WARNING)
    from shmq import EncoderCacheProducer

    producer = EncoderCacheProducer(f"shm-loaded-{os.getpid()}", timeout=STEP)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_loading_consumer, args=(producer.name, n, out), daemon=True)
    proc.start()
    assert out.get(timeout=STEP) == "joined"
    errors = []
    for i in range(n):
        try:
            producer.save(f"k{i}", _value(i))
        except Exception as e:  # reported, not lost
            errors.append(f"save {i}: {e!r}")
            break
    try:
        producer.flush(STEP)
    except Exception as e:
        errors.append(f"flush: {e!r}")
    consumer = out.get(timeout=4 * STEP) if not errors else {"error": "not waited for", "bad": [], "loaded": 0}
    proc.join(STEP)
    # Every key loaded now: one more save finds the headroom cut into (it grew there
    # while nothing could go) and gives it back.
    try:
        producer.save("last", _value(n))
        producer.flush(STEP)
    except Exception as e:  # reported, not lost
        errors.append(f"last save: {e!r}")
    stats = producer.stats()
    free_now = shm_free()
    producer.close()
    return {
        "errors": errors,
        "consumer": consumer,
        "stats": stats,
        "shm_total": shm_total(),
        "shm_free": free_now,
        "warnings": len(warnings.texts),
        "warning_texts": warnings.texts,
    }


def run_stuck() -> dict:
    warnings = capture_shm_warnings(WARNING)
    from shmq import EncoderCacheProducer

    # min_consumers=1 and no consumer: no entry ever counts as loaded, none may go.
    producer = EncoderCacheProducer(f"shm-stuck-{os.getpid()}", min_consumers=1, timeout=STEP)
    saved, error, failed_key = 0, None, None
    for i in range(20):
        try:
            producer.save(f"k{i}", _value(i), timeout=1.0)
            producer.flush(STEP)
        except MemoryError as e:
            error, failed_key = str(e), f"k{i}"
            break
        saved += 1
    has_failed_key = producer.has(failed_key) if failed_key else None
    # Room again once a key goes (evicted by hand).
    producer.evict("k0")
    try:
        producer.save("again", _value(99), timeout=STEP)
        producer.flush(STEP)
        saved_after_evict = producer.has("again")
    except MemoryError:
        saved_after_evict = False
    producer.close()
    return {
        "saved": saved,
        "error": error,
        "has_failed_key": has_failed_key,
        "saved_after_evict": saved_after_evict,
        "warnings": len(warnings.texts),
        "warning_texts": warnings.texts,
    }


if __name__ == "__main__":
    what = sys.argv[1]
    started = time.monotonic()
    result = run_loaded(int(sys.argv[2])) if what == "loaded" else run_stuck()
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result))

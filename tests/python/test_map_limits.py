"""Store loans at the mapping limit (issue 32, item 5).

Every mapping and every split of one counts against a process's ``vm.max_map_count``;
a sealed store loan costs up to 3 while it lives. Before, ~23k held loans took the
process to the limit: the host's own allocations (numpy's, ``mmap``) failed, and loans
dropped there could not be mapped shared again, so their blocks stayed pinned for good
and the store wedged ("a zero-copy view of it is still held"). Now shmq counts its own
mappings and sends loans by copy once the process would pass three quarters of the
limit (``SHMQ_MAX_MAP_COUNT`` sets a lower one), and a loan dropped while the process is
out of mappings gives its block back as soon as it can.

Each test runs a program of its own (this file, run as a script) in a private tmpfs
``/dev/shm`` (``unshare --mount``); it reports on its last stdout line, as JSON.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import sys
import time

import pytest

from _processes import mapping_count
from _processes.private_shm import run_in_private_shm

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
# One page of float32: the smallest loan; its block is the loan room (64 KiB) and a page.
LOAN_ITEMS = 1024
BLOCK_BYTES = 72 * 1024


def _program(*args: str) -> dict:
    return run_in_private_shm(__file__, list(args), "1g", timeout=240)


def test_loans_leave_the_host_its_mappings_and_return_their_memory_when_dropped():
    """1000 loans are put and held (sealed: there is room); then the process has ~4000
    mappings left of its limit (a hog took the rest) and holds 3000 more: shmq seals none
    of those (the process is past three quarters of the limit), so each put is a copy
    that succeeds and the host can still map memory. Dropped with the process at the
    limit, the loans give their blocks back: the store goes on through two more fills
    of its ring."""
    got = _program("hogged", "3000")
    assert got["put_errors"] == [], got
    assert got["maps_sealed"] > 2000, got  # the first 1000 were sealed
    # shmq notices the host's growth within a 32nd of the limit of its own use.
    limit = int(open("/proc/sys/vm/max_map_count").read())
    assert got["maps_held"] <= got["maps_at_hog"] + limit // 32 + 16, got
    assert got["host_mmaps"] == 50, got
    assert got["puts_after"] == got["puts_wanted"], got
    assert got["put_after_error"] is None, got


def test_loans_fall_back_to_copies_below_a_lowered_limit_and_seal_again_once_dropped():
    """With ``SHMQ_MAX_MAP_COUNT=3000``, held loans are sealed while the process stays
    under 2250 mappings, then put by copy: the process never passes that ceiling, and
    once the loans are dropped their mappings are gone and new loans are sealed again."""
    got = _program("lowered", "2000")
    assert got["put_errors"] == [], got
    assert got["maps_held"] - got["maps_before"] > 300, got  # some were sealed
    assert got["maps_held"] <= 2250 + 8, got
    # Given back (a few splits of the ring's mapping may stay: shared again, unmerged).
    assert got["maps_after_drop"] - got["maps_before"] < (got["maps_held"] - got["maps_before"]) // 10, got
    assert got["sealed_again"] > 0, got
    assert got["puts_after"] == got["puts_wanted"], got
    assert got["put_after_error"] is None, got


# ------------------------------------------------------------------------------------
# The program: runs inside the private /dev/shm.


def _hold_loans(store, n: int, name: str = "loan") -> tuple[list, list]:
    """Loan, fill and put ``n`` arrays, keeping every loan; the loans and the errors."""
    kept, errors = [], []
    for i in range(n):
        a = store.loan_array((LOAN_ITEMS,), "float32")
        a[:] = i
        try:
            store.put(f"{name}{i}", {"a": a})
        except Exception as e:  # reported, not lost
            errors.append((i, repr(e)[:300]))
            if len(errors) > 3:
                break
        kept.append(a)
    return kept, errors


def _fill_twice(store, ring_bytes: int) -> dict:
    """Put 1 MiB objects through the ring twice over: how many of how many went in."""
    import numpy as np

    wanted = 2 * ring_bytes // MiB
    done, error = 0, None
    try:
        for i in range(wanted):
            store.put(f"after{i}", {"a": np.full(MiB // 4, i, dtype=np.float32)})
            done += 1
    except Exception as e:
        error = repr(e)[:600]
    return {"puts_after": done, "puts_wanted": wanted, "put_after_error": error}


def run_hogged(n: int) -> dict:
    from _processes.loan_seal_children import _MappingHog
    from shmq import ObjectStorage, RingBuffer

    ring_bytes = (n + 1000) * BLOCK_BYTES + 16 * MiB
    # No readers: objects go once the writer is done with them (what is tested is the
    # writer's mappings and pins).
    store = ObjectStorage(2 * MiB, 0, RingBuffer(ring_bytes, create=True))
    # 1000 loans sealed while there is room.
    sealed, errors = _hold_loans(store, 1000, "sealed")
    maps_sealed = mapping_count()
    # The host takes all but ~4000 mappings; n more loans must leave them to it.
    hog = _MappingHog(headroom=2000)
    kept, more_errors = _hold_loans(store, n, "held")
    errors += more_errors
    maps_held = mapping_count()
    host = []
    for _ in range(50):
        try:
            m = mmap.mmap(-1, MiB)
            m[0] = 1
            host.append(m)
        except OSError:
            break
    host_mmaps = len(host)
    for m in host:
        m.close()
    # The host takes every mapping, then the loans go (the sealed ones need a mapping
    # or two for a moment to be shared again): what cannot be given back now is given
    # back later, never kept pinned for good.
    maps_at_hog = hog.at_limit
    hog.release()
    hog = _MappingHog(headroom=0)
    del sealed, kept
    gc.collect()
    hog.release()
    result = {
        "put_errors": errors,
        "maps_sealed": maps_sealed,
        "maps_at_hog": maps_at_hog,
        "maps_held": maps_held,
        "host_mmaps": host_mmaps,
    }
    result.update(_fill_twice(store, ring_bytes))
    store.close()
    return result


def run_lowered(n: int) -> dict:
    os.environ["SHMQ_MAX_MAP_COUNT"] = "3000"  # read at the first seal
    from shmq import ObjectStorage, RingBuffer

    ring_bytes = n * BLOCK_BYTES + 16 * MiB
    store = ObjectStorage(2 * MiB, 0, RingBuffer(ring_bytes, create=True))
    maps_before = mapping_count()
    kept, errors = _hold_loans(store, n)
    maps_held = mapping_count()
    del kept
    gc.collect()
    maps_after_drop = mapping_count()
    # Room again: a new loan is sealed (its mappings show).
    a = store.loan_array((LOAN_ITEMS,), "float32")
    a[:] = 1
    store.put("again", {"a": a})
    sealed_again = mapping_count() - maps_after_drop
    del a
    gc.collect()
    result = {
        "put_errors": errors,
        "maps_before": maps_before,
        "maps_held": maps_held,
        "maps_after_drop": maps_after_drop,
        "sealed_again": sealed_again,
    }
    result.update(_fill_twice(store, ring_bytes))
    store.close()
    return result


if __name__ == "__main__":
    what, n = sys.argv[1], int(sys.argv[2])
    started = time.monotonic()
    result = run_hogged(n) if what == "hogged" else run_lowered(n)
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result))

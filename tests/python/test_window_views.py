"""Hostile tests of views carved out of one private mapping per reader that stays (the
*window*, ``crates/os/src/private_map.rs``): when a view goes, the pages it wrote are dropped
(``/proc/self/pagemap``, ``MADV_DONTNEED``) so the next message placed in that memory
shows through, and a view overlapping a live one gets a mapping of its own.

Real processes; every received tensor is compared exactly (``_processes.window_children.expected``:
what was sent, with the reader's own writes applied):

- a reader that writes partial pages of many views from several threads and drops them
  in random order while the writer keeps sending;
- a reader that ``os.fork()``s while it holds views: parent and child write into and
  drop their copies, and the window shows the segment again in both;
- store objects whose parts share pages, each viewed twice, written and dropped in
  random order, then their memory reused;
- encoder-cache entries loaded twice, written, dropped, evicted and their memory reused;
- a reader whose memory is locked (``mlockall``): its views map on their own, and every
  message still arrives exactly.
"""

from __future__ import annotations

import pickle
import random
import resource

import pytest

from _processes import STEP, Children, wait_for
from _processes.store_children import SIGNING_KEY
from _processes.window_children import (
    ec_window_consumer,
    expected,
    forking_reader,
    locked_reader,
    message_base,
    message_size,
    store_window_reader,
    threaded_reader,
)
from shmq import EncoderCacheProducer, MessageQueue, ObjectStorage, RingBuffer

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def test_partial_page_writes_and_drops_from_several_threads_while_the_writer_sends(children):
    # Four threads take the reader's views in random order, write a few elements (often
    # across a page boundary), check the view exactly and drop it at random, while the
    # main thread receives and the writer keeps sending into a 16 MiB arena: the arena's
    # memory goes round many times under views that live, are written and are dropped
    # side by side. A drop that discarded a live neighbour's private pages, a view that
    # showed another message's bytes or an old write, would fail the exact checks.
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=16 * MiB)
    n = 300
    out = children.queue()
    children.start(threaded_reader, out, mq.export_handle(), 0, n, 7, 4, 5)
    mq.wait_until_ready(timeout=STEP)
    for i in range(n):
        mq.enqueue({"i": i, "t": expected(message_size(i), message_base(i))}, timeout=STEP)
    _, bad, n_bad, errors, addresses = children.expect(out, "threaded", timeout=4 * STEP)
    assert not errors, errors[0]
    assert n_bad == 0, f"{n_bad} views were not exact: {bad}"
    fallbacks = mq.arena_fallbacks
    assert fallbacks < n // 2, f"{fallbacks} of {n} parts were copied: the arena was hardly used"
    # The window: the largest mapping of the arena's segment the views lay in.
    window = max(size for _, size, path in addresses if path.startswith("/dev/shm/"))
    in_window = [i for i, (_, size, path) in enumerate(addresses) if size == window and path.startswith("/dev/shm/")]
    assert len(in_window) > n // 2, f"only {len(in_window)} of {n} views came from the window"
    through = sum(4 * message_size(i) for i in in_window)
    assert through > 10 * window, "the window's memory did not go round many times"
    children.join()


def test_a_reader_that_forks_while_it_holds_views(children):
    # The reader writes all of a first message and drops it (its pagemap descriptor is
    # open from then on), receives a and b where it lay, writes partial pages and forks.
    # Each side then writes its copies: neither sees the other's writes; each drops its
    # copies and its window shows the segment there again (the child reading its own
    # pagemap, not the parent's); the child's copies release no hold; the next messages
    # in the same memory arrive exact in the parent.
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=16 * MiB)
    na, nb = MiB, 300_001  # 4 MiB, and 1.2 MiB (not whole pages)
    out = children.queue()
    children.start(forking_reader, out, mq.export_handle(), 0, na, nb)
    mq.wait_until_ready(timeout=STEP)
    mq.enqueue(expected(na, 0), timeout=STEP)
    _, z_exact, _ = children.expect(out, "z")
    assert z_exact
    mq.enqueue(expected(na, 1_000_000), timeout=STEP)
    mq.enqueue(expected(nb, 2_000_000), timeout=STEP)
    _, before, child, child_code, parent, (z_ptr, a_ptr, b_ptr) = children.expect(out, "forked")
    assert before == (True, True)
    assert child[0] == "ok", f"the forked child failed:\n{child[1]}"
    assert child_code == 0
    assert all(child[1].values()), f"in the child: {child[1]}"
    assert all(parent.values()), f"in the parent: {parent}"
    assert a_ptr == z_ptr, "a did not lie in the memory the first message had"
    # Both views are gone in the parent (the child's copies held nothing): all back.
    wait_for(lambda: mq.arena_stats()["outstanding"] == 0, STEP, "the parent's parts to come back")
    assert mq.arena_stats()["outstanding"] == 0
    mq.enqueue(expected(na, 3_000_000), timeout=STEP)
    mq.enqueue(expected(nb, 4_000_000), timeout=STEP)
    _, after, ptrs = children.expect(out, "after")
    assert after == (True, True), "a write of the parent or of its child showed through a later message"
    assert ptrs == (a_ptr, b_ptr), "the later messages did not lie in the same memory"
    assert mq.arena_fallbacks == 0
    mq.enqueue("bye", timeout=STEP)
    children.join()


class _Served:
    """A child running ``_processes.window_children._serve``'s commands."""

    def __init__(self, children: Children, target, *args):
        self.children = children
        self.out, self.cmds = children.queue(), children.queue()
        children.start(target, self.out, *args[:1], self.cmds, *args[1:])
        self.ready = children.expect(self.out, "ready")[1:]

    def ask(self, *cmd, expect: str):
        self.cmds.put(cmd)
        return self.children.expect(self.out, expect)[1:]

    def stop(self):
        self.cmds.put(("stop",))
        self.children.expect(self.out, "stopped")


def _random_rounds(rng: random.Random, reader: _Served, rounds: int, publish) -> dict:
    """``rounds`` times: publish an object (``publish(round)`` → its spec and what a get
    needs); get it, overwrite it in full and drop it; get it twice more (both live), make
    random partial-page writes and random drops (every kept part is checked exactly
    after each), then drop all but at most one part (kept into the next round, beside
    the next objects). Returns what the views were (window or own mapping, by the
    mapping's size), the window addresses used, and in how many rounds the second get
    lay where the overwritten first one had."""
    live: list[tuple[str, str, int]] = []  # (tag, name, elements)
    kinds = {"window": 0, "own": 0}
    window_addresses: list[int] = []
    window_bytes = None
    reloaded_in_place = 0
    for r in range(rounds):
        spec, get_args = publish(r)
        # Got, overwritten in full and dropped: then got again (and again), it must show
        # what was published, not the writes (the same window range, where nothing else
        # of this reader overlaps it).
        first = reader.ask("get", f"r{r}.0", spec, *get_args, expect="got")[2]
        for name, (n, _) in spec.items():
            assert reader.ask("write", f"r{r}.0", name, 0, n, -5, expect="bad")[0] == []
        for name in spec:
            assert reader.ask("drop", f"r{r}.0", name, expect="bad")[0] == []
        for copy in (1, 2):
            tag = f"r{r}.{copy}"
            exact, where = reader.ask("get", tag, spec, *get_args, expect="got")[1:]
            assert exact, f"round {r}, view {copy}: not what was published"
            if copy == 1:
                reloaded_in_place += all(where[name][0] == first[name][0] for name in spec)
            for name, (address, size, path) in where.items():
                assert path.startswith("/dev/shm/"), f"{tag}/{name} is not a view of the segment: {path!r}"
                window_bytes = window_bytes or max(size for _, size, _ in where.values())
                if size == window_bytes:
                    kinds["window"] += 1
                    window_addresses.append(address)
                else:
                    kinds["own"] += 1
                live.append((tag, name, spec[name][0]))
        for _ in range(14):
            if not live:
                break
            tag, name, n = rng.choice(live)
            if rng.random() < 0.65:
                m = rng.choice([1, 3, 1024, 1500, 4000])
                k = max(0, min(n - m, rng.choice([0, n - m, rng.randrange(0, n, 1024) - 1, rng.randrange(n)])))
                bad = reader.ask("write", tag, name, k, m, -(r * 100 + rng.randint(1, 99)), expect="bad")[0]
            else:
                live.remove((tag, name, n))
                bad = reader.ask("drop", tag, name, expect="bad")[0]
            assert bad == [], f"round {r}: kept views not exact: {bad}"
        rng.shuffle(live)
        keep = rng.randint(0, 1)
        while len(live) > keep:
            tag, name, _ = live.pop()
            assert reader.ask("drop", tag, name, expect="bad")[0] == []
    return {"kinds": kinds, "window_addresses": window_addresses, "reloaded_in_place": reloaded_in_place}


def test_store_objects_whose_parts_share_pages_viewed_twice_written_and_dropped(children):
    # Parts of an object are 64-byte aligned in the ring, so they share pages with each
    # other and with the objects beside them: a reader's views of them mix window ranges
    # and mappings of their own. Each object is viewed twice; writes land on shared
    # pages; drops come in random order; the memory is reused by the next objects.
    ring = RingBuffer(4 * MiB, create=True)
    store = ObjectStorage(MiB + 64 * 1024, 1, ring)
    reader = _Served(children, store_window_reader, pickle.dumps(store.handle()), SIGNING_KEY)
    sizes = {"p0": 70_001, "p1": 65_537, "p2": 90_001}  # 1 MiB of int32 in all, odd sizes

    def publish(r: int):
        spec = {name: (n, r * 10_000_000 + j * 1_000_000) for j, (name, n) in enumerate(sizes.items())}
        address, mid = store.put(f"o{r}", {name: expected(n, base) for name, (n, base) in spec.items()})
        return spec, (address, mid)

    seen = _random_rounds(random.Random(20261124), reader, 8, publish)
    assert seen["kinds"]["window"] and seen["kinds"]["own"], seen["kinds"]
    assert seen["reloaded_in_place"], "no object was viewed again where its written view lay"
    addresses = seen["window_addresses"]
    assert len(set(addresses)) < len(addresses), "no window memory carried two objects"
    reader.stop()


def test_encoder_cache_entries_loaded_twice_written_dropped_and_reused(children, cache_name):
    # An entry is one view (its pickle, part table and tensors); loaded again while the
    # first load lives, it is a mapping of its own. Writes into either stay in it; after
    # the drops and an eviction, the next entry in that memory arrives exact.
    name = cache_name  # the fixture checks that none of its segments is left
    sizes = {"p0": 300_001, "p1": 100_003}  # 1.6 MB of int32, odd sizes
    with EncoderCacheProducer(name, capacity=6 * MiB) as producer:
        reader = _Served(children, ec_window_consumer, [name])

        def publish(r: int):
            if r:
                producer.evict(f"k{r - 1}")
            spec = {n: (size, r * 10_000_000 + j * 1_000_000) for j, (n, size) in enumerate(sizes.items())}
            producer.save(f"k{r}", {n: expected(size, base) for n, (size, base) in spec.items()})
            producer.flush(STEP)
            return spec, (f"k{r}",)

        seen = _random_rounds(random.Random(7), reader, 8, publish)
        # The first load of an entry is one window range (both parts), the second a
        # mapping of its own.
        assert seen["kinds"]["window"] and seen["kinds"]["own"], seen["kinds"]
        assert seen["reloaded_in_place"], "no entry was loaded again where its written view lay"
        addresses = seen["window_addresses"]
        assert len(set(addresses)) < len(addresses), "no window memory carried two entries"
        reader.stop()


# ---------------------------------------------------------------------------------
# Locked memory


MCL_CURRENT, MCL_FUTURE, MCL_ONFAULT = 1, 2, 4


def _can_lock_a_lot() -> bool:
    """Whether a child may lock hundreds of MiB (CAP_IPC_LOCK, or no RLIMIT_MEMLOCK)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return True
    try:
        with open("/proc/self/status") as status:
            caps = next(line for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caps.split()[1], 16) & (1 << 14))  # CAP_IPC_LOCK


class StaleView(AssertionError):
    """A view showed what it should not."""


@pytest.mark.skipif(not _can_lock_a_lot(), reason="needs CAP_IPC_LOCK or an unlimited RLIMIT_MEMLOCK")
@pytest.mark.parametrize(
    "flags, keep",
    [(MCL_FUTURE | MCL_ONFAULT, False), (MCL_FUTURE, True)],
    ids=["onfault-writes-outlive-the-view", "populated-window-is-a-stale-copy"],
)
def test_a_reader_with_locked_memory_sees_every_message_exactly(children, flags, keep):
    # Services lock their memory (mlockall) to keep latency off the page-fault path. A
    # reader that did, and that overwrites each tensor and drops it before the next
    # (placed in the same memory), must still see every message exactly; so must one
    # that keeps every view (each message in other memory). With a mapping per view this
    # held (a locked mmap is populated with the message it shows, and munmap drops it).
    mq = MessageQueue(1, 1, max_chunk_bytes=64 * 1024, max_chunks=4, arena_bytes=16 * MiB)
    n = 3
    out = children.queue()
    children.start(locked_reader, out, mq.export_handle(), 0, n, flags, keep)
    mq.wait_until_ready(timeout=STEP)
    for i in range(n):
        mq.enqueue(expected(MiB // 4, i * 1_000_003), timeout=STEP)
        children.expect(out, "ack")
    seen = children.expect(out, "seen")[1]
    children.join()
    assert mq.arena_fallbacks == 0
    if not all(exact for exact, _ in seen):
        raise StaleView(f"(exact, address) per message: {seen}")

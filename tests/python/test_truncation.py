"""A peer of the same user truncates a live segment (``os.truncate``): the ring, the
tensor arena, the object store, the encoder cache. Before shmq's SIGBUS handler this
killed the writer and every reader with SIGBUS; now every participant lives, and the
call that finds the damage (the blocked one, or the next) raises ``ValueError`` naming
the segment and the truncation.

Every participant is a real process (``_processes/truncation_peer.py``, driven line by line); the
test process is the third party that truncates. Every blocking call has a timeout.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PEER = str(HERE / "_processes" / "truncation_peer.py")
STEP = 30.0
SHM_DIR = "/dev/shm"


class Peer:
    """A participant process: ``send`` code, ``reply`` waits for its outcome."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(
            [sys.executable, PEER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-4000:]

    def send(self, code: str) -> None:
        self.p.stdin.write(json.dumps(code) + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]

    def reply(self, timeout: float = 3 * STEP) -> dict:
        try:
            r = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"pid {self.p.pid}: no reply within {timeout} s\n{self.stderr()}") from None
        if r is None:
            self.p.wait(STEP)
            raise AssertionError(f"pid {self.p.pid} died ({self.exit_status()}):\n{self.stderr()}")
        return r

    def call(self, code: str):
        self.send(code)
        r = self.reply()
        assert "ok" in r, f"pid {self.p.pid}: {r}\n{self.stderr()}"
        return r["ok"]

    def exit_status(self) -> str:
        rc = self.p.returncode
        if rc is not None and rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exit status {rc}"

    def close(self) -> int | None:
        """End the process (stdin closed): its exit status, which must not be a signal."""
        try:
            self.p.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            return self.p.wait(STEP)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(STEP)
            return None


def segment_of(pid: int, kind: str) -> str:
    """The segment of ``kind`` (``ring``, ``arena``, ``ec``, ...) that ``pid`` created."""
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(f"shmq_{kind}_") and f"_{pid}_" in n]
    names = [n for n in names if not n.endswith(".sock")]
    assert len(names) == 1, (kind, pid, names)
    return names[0]


def assert_truncation_error(reply: dict, segment: str, who: str, kinds: tuple[str, ...] = ("ValueError",)) -> None:
    assert "raised" in reply, f"{who}: expected an error, got {reply}"
    kind, msg = reply["raised"]
    assert kind in kinds and segment in msg and "truncated" in msg, f"{who}: {kind}: {msg}"


def truncate(segment: str, how: str | int) -> None:
    """Truncate ``segment`` to nothing (``"zero"``), half its size (``"half"``), or a
    number of bytes."""
    path = os.path.join(SHM_DIR, segment)
    size = os.stat(path).st_size
    os.truncate(path, how if isinstance(how, int) else 0 if how == "zero" else size // 2)


def size_of(segment: str) -> int:
    return os.stat(os.path.join(SHM_DIR, segment)).st_size


@pytest.fixture
def peers():
    made: list[Peer] = []

    def make(n: int) -> list[Peer]:
        new = [Peer() for _ in range(n)]
        made.extend(new)
        return new

    yield make
    statuses = {p.p.pid: (p.close(), p) for p in made}
    crashed = {pid: p.exit_status() + "\n" + p.stderr() for pid, (rc, p) in statuses.items() if rc != 0}
    assert not crashed, f"participants that did not survive: {crashed}"


def open_queue(peers, n_readers: int = 2):
    """A writer and ``n_readers`` readers of one queue, all ready."""
    writer, *readers = peers(1 + n_readers)
    handle = writer.call(
        "from shmq import MessageQueue\n"
        f"mq = MessageQueue({n_readers}, {n_readers}, max_chunk_bytes=1 << 16, max_chunks=4)\n"
        "result = base64.b64encode(pickle.dumps(mq.export_handle())).decode()"
    )
    for i, r in enumerate(readers):
        r.send(
            "from shmq import MessageQueue\n"
            f"mq = MessageQueue.create_from_handle(pickle.loads(base64.b64decode({handle!r})), {i})\n"
            "mq.wait_until_ready(timeout=STEP)"
        )
    writer.call("mq.wait_until_ready(timeout=STEP)")
    for r in readers:
        assert r.reply() == {"ok": None}
    return writer, readers


# Until the error: enqueue / dequeue in a loop (each call with its timeout); `sent` and
# `got` count what went through before it.
WRITE_UNTIL_ERROR = """
sent = 0
for i in range(100):
    mq.enqueue(('message', i, b'x' * 30000), timeout=STEP)
    sent += 1
"""
READ_UNTIL_ERROR = """
got = 0
for i in range(100):
    mq.dequeue(timeout=STEP)
    got += 1
"""


@pytest.mark.parametrize("how", ["zero", "half"])
def test_ring_truncated_under_writer_and_readers(peers, how):
    writer, readers = open_queue(peers)
    ring = segment_of(writer.p.pid, "ring")
    # Fill the ring (4 chunks), so that the lost half holds messages not yet read.
    writer.call("for i in range(4): mq.enqueue(('before', i, b'x' * 30000), timeout=STEP)")
    if how == "zero":
        # Readers blocked on an empty ring: take what is there first.
        for r in readers:
            r.call("for i in range(4): mq.dequeue(timeout=STEP)")
    for r in readers:
        r.send(READ_UNTIL_ERROR)
    truncate(ring, how)
    writer.send(WRITE_UNTIL_ERROR)
    assert_truncation_error(writer.reply(), ring, "writer")
    for i, r in enumerate(readers):
        assert_truncation_error(r.reply(), ring, f"reader {i}")
    # And the next call too.
    assert_truncation_error((writer.send("mq.enqueue(1, timeout=STEP)"), writer.reply())[1], ring, "writer")
    for i, r in enumerate(readers):
        r.send("mq.dequeue(timeout=STEP)")
        assert_truncation_error(r.reply(), ring, f"reader {i}")


def test_ring_truncated_with_messages_unread_is_not_grown_back_nor_read_as_zeros(peers):
    """Issue 32 (3a): the ring is truncated to one page with three messages unread, then
    the writer sends again. Its reservation of the next chunk used to grow the file back
    (``fallocate``), so nothing faulted: no error anywhere, and the reader got message 0
    with most of its elements zeroed and "malformed message" for the next two. Now the
    reservation finds the file shorter than the segment and is the truncation error, the
    file stays short, and every dequeue of the reader is that error too."""
    writer, (reader,) = open_queue(peers, n_readers=1)
    ring = segment_of(writer.p.pid, "ring")
    writer.call(
        "import numpy as np\nfor i in range(3): mq.enqueue(np.full(4000, i + 1, dtype=np.float32), timeout=STEP)"
    )
    truncate(ring, 4096)
    writer.send("mq.enqueue(np.full(4000, 4, dtype=np.float32), timeout=STEP)")
    assert_truncation_error(writer.reply(), ring, "writer")
    assert size_of(ring) == 4096, "the writer's reservation grew the file back"
    for i in range(4):
        reader.send("mq.dequeue(timeout=STEP)")
        assert_truncation_error(reader.reply(), ring, f"reader's dequeue {i}")
    writer.send("mq.enqueue(5, timeout=STEP)")
    assert_truncation_error(writer.reply(), ring, "writer, next call")


def test_arena_truncated_under_a_held_view_fails_the_readers_next_dequeues(peers):
    """Issue 32 (3b): the arena is truncated while a reader holds a view of it; the view
    reads zeros (no SIGBUS). The reader's next dequeues, of small messages that never
    touch the arena, used to return as if nothing happened: now each is the truncation
    error (the arena's mappings here were hit)."""
    writer, (reader,) = open_queue(peers, n_readers=1)
    writer.call("import numpy as np\nmq.enqueue(np.ones(1 << 19, dtype=np.float32), timeout=STEP)")
    reader.call("kept = mq.dequeue(timeout=STEP)")
    arena = segment_of(writer.p.pid, "arena")
    truncate(arena, 4096)
    assert reader.call("result = float(kept.sum())") == 0.0
    writer.call("for i in range(3): mq.enqueue(i, timeout=STEP)")
    for i in range(3):
        reader.send("mq.dequeue(timeout=STEP)")
        assert_truncation_error(reader.reply(), arena, f"reader's dequeue {i}")
    # The writer's next large part (64 MiB, after the 2 MiB the reader holds) needs more
    # of the arena than its first reservation (64 MiB): the reservation does not grow
    # the file back, it is the error (not a silent copy).
    writer.send("mq.enqueue(np.ones(16 << 20, dtype=np.float32), timeout=STEP)")
    assert_truncation_error(writer.reply(), arena, "writer")
    assert size_of(arena) == 4096, "the writer's reservation grew the file back"


STORE_SPARSE_SETUP = """
from shmq import ObjectStorage, RingBuffer
ring = RingBuffer(64 << 20, create=True)
store = ObjectStorage(1 << 20, 1, ring)
addresses = {k: store.put(k, b'v' * 100000 + k.encode()) for k in 'abcdefgh'}
result = [base64.b64encode(pickle.dumps(store.handle())).decode(), addresses,
          {k: list(store.get_signature(k)) for k in addresses}]
"""


def test_store_truncated_refuses_put_and_reports_no_lost_object(peers):
    """Issue 32 (3c): the store is truncated to one page (its header). A ``put`` whose
    block reaches past what the writer had reserved used to grow the file back and
    succeed, and ``is_cached`` said True for the lost objects. Now ``put``,
    ``is_cached``, ``get_cached`` and every ``get`` are the truncation error, and the
    file stays short."""
    writer, reader = peers(2)
    handle, addresses, signatures = writer.call(STORE_SPARSE_SETUP)
    reader.call(f"HANDLE, ADDRESSES, SIGNATURES = {handle!r}, {addresses!r}, {signatures!r}\n" + STORE_READER)
    assert reader.call("result = len(get('a'))") == 100001
    store = segment_of(writer.p.pid, "store")
    truncate(store, 4096)
    writer.send("store.put('z', b'z' * 500000)")
    assert_truncation_error(writer.reply(), store, "writer's put")
    assert size_of(store) == 4096, "the writer's reservation grew the file back"
    for call in ["store.is_cached('a')", "store.get_cached('a')", "store.get(*addresses['a'])", "store.put('y', 1)"]:
        writer.send(call)
        assert_truncation_error(writer.reply(), store, f"writer's {call}")
    for k in "ah":
        reader.send(f"get({k!r})")
        assert_truncation_error(reader.reply(), store, f"reader's get({k!r})")


def test_arena_truncated_under_writer_and_readers(peers):
    writer, readers = open_queue(peers)
    # 2 MiB arrays go through the arena (made lazily by the first one).
    writer.call("import numpy as np\nmq.enqueue(np.ones(1 << 19, dtype=np.float32), timeout=STEP)")
    for r in readers:
        r.call("import numpy as np\nkept = mq.dequeue(timeout=STEP)\nresult = float(kept.sum())")
    arena = segment_of(writer.p.pid, "arena")
    # One more in flight: published before the truncation, read after it.
    writer.call("mq.enqueue(np.full(1 << 19, 2, dtype=np.float32), timeout=STEP)")
    truncate(arena, "zero")
    for i, r in enumerate(readers):
        # The array a reader holds reads zeros now (not a SIGBUS)...
        assert r.call("result = float(kept.sum())") == 0.0
        # ... and the message whose part lay in the arena is an error.
        r.send("mq.dequeue(timeout=STEP)")
        assert_truncation_error(r.reply(), arena, f"reader {i}")
    writer.send("mq.enqueue(np.ones(1 << 19, dtype=np.float32), timeout=STEP)")
    assert_truncation_error(writer.reply(), arena, "writer")


STORE_SETUP = """
from shmq import ObjectStorage, RingBuffer
ring = RingBuffer(1 << 20, create=True)
store = ObjectStorage(1 << 18, 2, ring)
addresses = {k: store.put(k, b'v' * 100000 + k.encode()) for k in 'abcdefgh'}
result = [base64.b64encode(pickle.dumps(store.handle())).decode(), addresses,
          {k: list(store.get_signature(k)) for k in addresses}]
"""
STORE_READER = """
from shmq import ObjectStorage
store = ObjectStorage.create_from_handle(pickle.loads(base64.b64decode(HANDLE)))
def get(k):
    return store.get(*ADDRESSES[k], SIGNATURES[k], k)
"""


@pytest.mark.parametrize("how", ["zero", "half"])
def test_store_truncated_under_writer_and_readers(peers, how):
    writer, *readers = peers(3)
    handle, addresses, signatures = writer.call(STORE_SETUP)
    for r in readers:
        r.call(f"HANDLE, ADDRESSES, SIGNATURES = {handle!r}, {addresses!r}, {signatures!r}\n" + STORE_READER)
        assert r.call("result = len(get('a'))") == 100001
    store = [n for n in os.listdir(SHM_DIR) if n.startswith("shmq_") and f"_{writer.p.pid}_" in n]
    assert len(store) == 1, store
    store = store[0]
    truncate(store, how)
    for i, r in enumerate(readers):
        # Every key in turn: the ones in the lost part (all, or the later half) fail.
        r.send("for k in 'hgfedcba': get(k)")
        assert_truncation_error(r.reply(), store, f"reader {i}")
    writer.send("for k in 'hgfedcba': store.get(*addresses[k])\nstore.put('z', b'z' * 100000)")
    assert_truncation_error(writer.reply(), store, "writer")
    writer.send("store.put('y', 1)")
    assert_truncation_error(writer.reply(), store, "writer")


def test_encoder_cache_truncated_under_producer_and_consumers(peers):
    producer, *consumers = peers(3)
    name = producer.call(
        "import numpy as np\n"
        "from shmq import EncoderCacheProducer\n"
        "p = EncoderCacheProducer(capacity=64 << 20)\n"
        "result = p.name"
    )
    for c in consumers:
        c.call(f"import numpy as np\nfrom shmq import EncoderCacheConsumer\nc = EncoderCacheConsumer({name!r})")
    producer.call("p.save('a', np.ones(1 << 20, dtype=np.float32))\np.flush()")
    for c in consumers:
        assert c.call("kept = c.get('a')\nresult = float(kept.sum())") == float(1 << 20)
    segment = producer.call("result = p.segment_name")
    producer.call("p.save('b', np.ones(1 << 20, dtype=np.float32))\np.flush()")
    truncate(segment, "zero")
    for i, c in enumerate(consumers):
        assert c.call("result = float(kept.sum())") == 0.0
        c.send("c.get('b')")
        assert_truncation_error(c.reply(), segment, f"consumer {i}")
    # The save's copy runs on the producer's copier thread: its failure comes back from
    # `flush` as the RuntimeError "an earlier save ... failed: <the ValueError>".
    producer.send("p.save('c', np.ones(1 << 20, dtype=np.float32))\np.flush()")
    assert_truncation_error(producer.reply(), segment, "producer", ("ValueError", "RuntimeError"))
    producer.send("p.save('d', np.ones(1 << 20, dtype=np.float32))")
    assert_truncation_error(producer.reply(), segment, "producer")


# -- the handler takes only shmq's faults ----------------------------------------------

FOREIGN_FAULT = """
import mmap, tempfile
f = tempfile.TemporaryFile()
f.truncate(2 * mmap.PAGESIZE)
m = mmap.mmap(f.fileno(), 2 * mmap.PAGESIZE)
f.truncate(0)
m[mmap.PAGESIZE]
"""


@pytest.mark.parametrize("faulthandler", ["none", "before", "after"])
@pytest.mark.parametrize("how", ["fault", "kill"])
def test_a_sigbus_that_is_not_shmqs_still_kills(faulthandler, how):
    """A fault in a mapping that is not shmq's, or a SIGBUS sent with kill, goes to the
    handler installed before shmq's (Python's faulthandler, or the default action): the
    process dies of SIGBUS as it would without shmq."""
    p = Peer()
    try:
        if faulthandler == "before":
            p.call("import faulthandler; faulthandler.enable()")
        p.call("from shmq import MessageQueue\nmq = MessageQueue(1, 1)")
        if faulthandler == "after":
            p.call("import faulthandler; faulthandler.enable()")
        p.send(FOREIGN_FAULT if how == "fault" else "import signal; os.kill(os.getpid(), signal.SIGBUS)")
        with pytest.raises(AssertionError, match="killed by SIGBUS"):
            p.reply()
        if faulthandler != "none":
            assert "Bus error" in p.stderr()  # faulthandler's report: it was called
    finally:
        p.close()


def test_a_handler_installed_over_shmqs_stays_and_gets_the_fault_first():
    """faulthandler.enable() after shmq mapped its segments takes SIGBUS first, for good:
    shmq no longer puts its handler back over it when it maps the next segment (issue 32:
    a library does not fight the program's handlers). faulthandler reports the fault and
    re-raises it: the process dies of it, as it would without shmq."""
    p = Peer()
    try:
        p.call(
            "import faulthandler\n"
            "from shmq import MessageQueue\n"
            "mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)\n"
            "r = MessageQueue.create_from_handle(mq.export_handle(), 0)\n"
            "mq.enqueue(0, timeout=STEP)\n"
            "assert r.dequeue(timeout=STEP) == 0\n"
            "faulthandler.enable()\n"
            "other = MessageQueue(1, 1)"
        )
        rings = [
            n
            for n in os.listdir(SHM_DIR)
            if n.startswith("shmq_ring_") and f"_{p.p.pid}_" in n and not n.endswith(".sock")
        ]
        assert len(rings) == 2, rings
        for n in rings:
            truncate(n, "zero")
        p.send("mq.enqueue(1, timeout=STEP); r.dequeue(timeout=STEP)")
        with pytest.raises(AssertionError, match="killed by SIGBUS"):
            p.reply()
        assert "Bus error" in p.stderr()  # faulthandler's report: it was called first
    finally:
        p.close()

"""Issue 44, a hostile round: what another user, or a hostile value, could do.

1. Another local user pre-creates a queue's socket directory (``<ring>.sock`` in
   ``/dev/shm``) the moment the ring appears: ``MessageQueue()`` failed ("creating the
   socket directory ... File exists"). Now the writer binds its socket in a directory of
   a fresh, unpredictable name beside it (and ring names take their random part from
   the kernel), and readers find it through the handle.
2. An empty tensor whose strides pass 2**63 - 1 (shape ``(0, 2**60)`` of float64) was
   sent, and every reader failed on it ("malformed array message"): the writer refuses
   it now.
3. ``dequeue_array(kind="memoryview")`` of an empty array, and ``enqueue_array`` of a
   neg-bit view or a sparse tensor raised raw ``TypeError``/``RuntimeError``: an empty
   one-dimensional array reads as an empty memoryview, an empty one of more dimensions
   is a ``ValueError`` that says what to use; a neg-bit view is sent with its values
   resolved; a sparse tensor is refused with a ``TypeError`` that names its layout.
4. A bad ``SHMQ_MAX_MAP_COUNT`` (``-1``, ``abc``, ``2**70``) was ignored silently: it is
   reported once, naming the variable, the value and the limit used instead.
5. Queue and store names with a bidi override, a zero-width character, a newline or a
   leading ``-`` were accepted: each is refused, naming the character.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from _processes import WaitTimeout, wait_for
from shmq import MessageQueue, ObjectStorage, RingBuffer

SHM = Path("/dev/shm")
NOBODY = 65534

# ------------------------------------------------------------------------------------
# 1. A squatter of another user.


def _squat(prefix: str, ready: int) -> None:
    """As user nobody: watch /dev/shm (inotify) and make `<ring>.sock` (0777) for every
    ring whose name starts with `prefix` as soon as it appears, before its writer can
    make its own. Says "watching" (or why not) on the pipe `ready`."""
    import ctypes
    import struct

    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init()
        if fd < 0 or libc.inotify_add_watch(fd, b"/dev/shm", 0x100) < 0:  # IN_CREATE
            raise OSError(ctypes.get_errno(), "inotify")
    except OSError as e:
        os.write(ready, f"{e}\n".encode())
        return
    os.write(ready, b"watching\n")
    while True:
        buf = os.read(fd, 65536)
        at = 0
        while at < len(buf):
            n = struct.unpack_from("iIII", buf, at)[3]
            name = buf[at + 16 : at + 16 + n].rstrip(b"\0").decode()
            at += 16 + n
            if name.startswith(prefix) and "." not in name:
                try:
                    os.mkdir(f"/dev/shm/{name}.sock", 0o777)
                except OSError:
                    pass


def _start_squatter(prefix: str) -> int:
    """The pid of a squatter (`_squat`) of user nobody, watching."""
    if os.geteuid() != 0:
        pytest.skip("the squatter runs as user nobody: the test must run as root to switch to it")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _squat(prefix, w)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline().strip()
    if line != "watching":
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.skip(f"cannot run a squatter as user nobody here: {line or 'it exited'}")
    return pid


def _foreign_socket_dirs(prefix: str) -> list[Path]:
    return [p for p in SHM.glob(f"{prefix}*.sock") if p.stat().st_uid == NOBODY]


def test_a_squatter_of_another_user_cannot_stop_queues_being_made() -> None:
    prefix = f"shmq_ring_{os.getpid()}_"
    squatter = _start_squatter(prefix)
    failures: list[str] = []
    squatted = 0
    try:
        for _ in range(30):
            try:
                mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=4)
            except OSError as e:
                failures.append(str(e))
                continue
            try:
                assert mq.handle is not None and mq.handle.buffer_handle is not None
                ring = mq.handle.buffer_handle[3]
                # Give the squatter a moment to have made its directory, if it will.
                try:
                    wait_for((SHM / f"{ring}.sock").exists, 0.5, "the squatter's directory", 0.005)
                except WaitTimeout:
                    pass  # it may not: the check below takes either
                foreign = SHM / f"{ring}.sock"
                if foreign.exists() and foreign.stat().st_uid == NOBODY:
                    squatted += 1
                    # The queue's socket is elsewhere, and it works: a message too large
                    # for a chunk goes through it.
                    addr = mq.handle.local_subscribe_addr
                    assert addr is not None and not addr.startswith(f"ipc://{foreign}/"), addr
                    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
                    mq.wait_until_ready(10)
                    reader.wait_until_ready(10)
                    big = b"x" * 100_000
                    mq.enqueue(big)
                    assert reader.dequeue(timeout=10) == big
                    reader.shutdown()
            finally:
                mq.shutdown()
                del mq
    finally:
        os.kill(squatter, 9)
        os.waitpid(squatter, 0)
        for d in _foreign_socket_dirs(prefix):
            d.rmdir()
    assert failures == [], f"{len(failures)} of 30 queues could not be made: {failures[:3]}"
    print(f"the squatter got in first for {squatted} of 30 queues")
    if squatted == 0:
        pytest.skip("the squatter never got its directory in first: nothing was shown")


# ------------------------------------------------------------------------------------
# 2 and 3. Arrays a reader could not take, and kinds that raised raw errors.


@contextlib.contextmanager
def _queue() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    """A writer and a local reader of it (this process: real shared memory)."""
    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.wait_until_ready(10)
        reader.wait_until_ready(10)
        yield writer, reader
    finally:
        reader.shutdown()
        writer.shutdown()


def test_an_array_no_reader_can_take_is_refused_by_the_writer() -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    with _queue() as (writer, reader):
        _refused_by_the_writer(torch, np, writer, reader)


def _refused_by_the_writer(torch: Any, np: Any, writer: MessageQueue, reader: MessageQueue) -> None:
    # Empty, but its first stride is 2**63 bytes: no header can carry it.
    for empty in (torch.empty((0, 2**60), dtype=torch.float64), torch.empty((0, 2**62), dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"cannot be sent: it has a stride \(in bytes\) of \d+, past 2\*\*63 - 1"):
            writer.enqueue_array(empty)
    # What can be carried still is, and the queue goes on.
    writer.enqueue_array(torch.empty((0, 2**60), dtype=torch.float32))
    got = reader.dequeue_array(timeout=10, kind="torch")
    assert got.shape == (0, 2**60) and got.dtype == torch.float32
    writer.enqueue_array(np.arange(3, dtype=np.float64))
    assert reader.dequeue_array(timeout=10).tolist() == [0.0, 1.0, 2.0]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_memoryview_reads_of_empty_arrays_neg_bit_views_and_sparse_tensors() -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    with _queue() as (writer, reader):
        _memoryview_reads(torch, np, writer, reader)


def _memoryview_reads(torch: Any, np: Any, writer: MessageQueue, reader: MessageQueue) -> None:
    # Empty, one dimension: an empty memoryview of the dtype's format.
    writer.enqueue_array(np.empty((0,), dtype=np.float32))
    got = reader.dequeue_array(timeout=10, kind="memoryview")
    assert (got.format, got.shape, got.nbytes) == ("f", (0,), 0)
    writer.enqueue_array(torch.empty((0,), dtype=torch.int16))
    got = reader.dequeue_array(timeout=10, kind="memoryview")
    assert (got.format, got.shape) == ("h", (0,))
    # Empty, more dimensions: no memoryview can have that shape; the error says what to use.
    writer.enqueue_array(np.empty((0, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"a memoryview cannot show an empty array of shape \(0, 3\).*kind='numpy'"):
        reader.dequeue_array(timeout=10, kind="memoryview")
    # A neg-bit view is sent as the values it holds.
    neg = torch.arange(4, dtype=torch.float32)._neg_view()
    assert neg.is_neg()
    writer.enqueue_array(neg)
    got = reader.dequeue_array(timeout=10, kind="memoryview")
    assert got.tolist() == [-0.0, -1.0, -2.0, -3.0]
    writer.enqueue_array(torch.arange(3, dtype=torch.int64)._neg_view())
    assert reader.dequeue_array(timeout=10, kind="torch").tolist() == [0, -1, -2]
    # A sparse tensor is refused at the writer, naming its layout and what to send.
    for sparse in (torch.eye(3).to_sparse(), torch.eye(3).to_sparse_csr()):
        with pytest.raises(TypeError, match=rf"layout is {sparse.layout}: send tensor.to_dense\(\)"):
            writer.enqueue_array(sparse)
    # Nothing above upset the queue.
    writer.enqueue_array(np.ones((2, 2), dtype=np.uint8))
    assert reader.dequeue_array(timeout=10, kind="memoryview").tolist() == [[1, 1], [1, 1]]


# ------------------------------------------------------------------------------------
# 4. A bad SHMQ_MAX_MAP_COUNT.

# Seals one store loan (the first seal reads SHMQ_MAX_MAP_COUNT), then says "sealed".
_SEAL_ONE = """
from shmq import ObjectStorage, RingBuffer
store = ObjectStorage(2 << 20, 0, RingBuffer(8 << 20, create=True))
a = store.loan_array((1024,), "float32")
a[:] = 1
store.put("k", {"a": a})
del a
store.close()
print("sealed")
"""


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("-1", 'SHMQ_MAX_MAP_COUNT="-1" is not a whole number of mappings from 0 to {kernel}'),
        ("abc", 'SHMQ_MAX_MAP_COUNT="abc" is not a whole number of mappings from 0 to {kernel}'),
        (str(2**70), f'SHMQ_MAX_MAP_COUNT="{2**70}" is not a whole number of mappings from 0 to {{kernel}}'),
        (str(10**12), "SHMQ_MAX_MAP_COUNT=1000000000000 is above the kernel's vm.max_map_count ({kernel})"),
    ],
)
def test_a_bad_max_map_count_is_reported_once_with_the_limit_used(value: str, said: str) -> None:
    kernel = int(Path("/proc/sys/vm/max_map_count").read_text())
    done = subprocess.run(
        [sys.executable, "-c", _SEAL_ONE],
        env={**os.environ, "SHMQ_MAX_MAP_COUNT": value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "sealed", done.stderr
    said = said.format(kernel=kernel)
    assert done.stderr.count(said) == 1, done.stderr
    assert f"using {kernel}" in done.stderr, done.stderr


def test_a_good_max_map_count_says_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SEAL_ONE],
        env={**os.environ, "SHMQ_MAX_MAP_COUNT": "3000"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "sealed", done.stderr
    assert "SHMQ_MAX_MAP_COUNT" not in done.stderr, done.stderr


# ------------------------------------------------------------------------------------
# 5. Names that mislead.

BAD_NAMES = [
    ("report\u202egpj.exe", "U+202E, a bidirectional-text control"),
    ("a\u2066b", "U+2066, a bidirectional-text control"),
    ("a\u200fb", "U+200F, a bidirectional-text control"),
    ("ad\u200bmin", "U+200B, a zero-width character"),
    ("a\u2060b", "U+2060, a zero-width character"),
    ("\ufeffname", "U+FEFF, a zero-width character"),
    ("line\nbreak", "U+000A, a control character"),
    ("bell\x07", "U+0007, a control character"),
    ("-rf", "starts with '-'"),
]


@pytest.mark.parametrize(("bad", "why"), BAD_NAMES)
def test_a_misleading_queue_name_is_refused_naming_the_character(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"a queue's name must be .*: .*{re.escape(why)}"):
        MessageQueue(1, 1, name=bad)


@pytest.mark.parametrize(("bad", "why"), BAD_NAMES)
def test_a_misleading_store_name_is_refused_naming_the_character(bad: str, why: str) -> None:
    before = set(os.listdir(SHM))
    with pytest.raises(ValueError, match=f"invalid shared memory name .*: .*{re.escape(why)}"):
        RingBuffer(1 << 20, name=bad, create=True)
    assert set(os.listdir(SHM)) <= before


def test_names_with_a_dash_inside_and_text_that_is_not_ascii_are_taken() -> None:
    # vLLM's stores are `vllm_mm_<urlsafe base64>`: '-' and '_' inside are fine.
    name = f"vllm_mm_-Ab_{os.getpid()}-x"
    store = ObjectStorage(1 << 20, 0, RingBuffer(2 << 20, name=name, create=True))
    try:
        assert (SHM / name).exists()
    finally:
        store.close()
    mq = MessageQueue(1, 1, name="scheduler → workers-1")
    try:
        assert mq.name == "scheduler → workers-1"
    finally:
        mq.shutdown()

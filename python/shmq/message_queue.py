"""The broadcast queue: ``ShmRingBuffer``, ``Handle`` and ``MessageQueue``.

These keep the names, signatures and errors of the engines' classes (vLLM's
``shm_broadcast``), so code written for those works unchanged. The work happens in
Rust (``shmq._core``); this module pickles objects and shapes the API.
"""

from __future__ import annotations

import os
import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from . import _core
from ._cleanup import track

__all__ = ["Handle", "MessageQueue", "PeerDiedError", "ShmRingBuffer", "sched_yield"]

PeerDiedError = _core.PeerDiedError

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_dumps = pickle.dumps
_loads = pickle.loads


def sched_yield() -> None:
    """Give the CPU to another thread or process."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()
    else:  # pragma: no cover - platforms without sched_yield
        time.sleep(0)


class _SegmentMemory:
    """The segment as ``multiprocessing.shared_memory.SharedMemory`` shows it (``name``,
    ``size``, ``buf``; vLLM's ``ShmRingBuffer.shared_memory``), without its resource
    tracker. ``buf`` maps the whole segment on first use; its layout is shmq's, not
    vLLM's: use ``get_data``/``get_metadata`` to reach chunks and flags."""

    def __init__(self, name: str):
        self.name = name
        self._buf: Optional[memoryview] = None

    @property
    def size(self) -> int:
        return os.stat(os.path.join("/dev/shm", self.name)).st_size

    @property
    def buf(self) -> memoryview:
        if self._buf is None:
            import mmap

            with open(os.path.join("/dev/shm", self.name), "r+b") as f:
                self._buf = memoryview(mmap.mmap(f.fileno(), 0))
        return self._buf

    def close(self) -> None:
        self._buf = None

    def __repr__(self) -> str:
        return f"SharedMemory(name={self.name!r})"


class ShmRingBuffer:
    """A shared-memory ring of ``max_chunks`` chunks of ``max_chunk_bytes`` bytes, each
    with one written flag and ``n_reader`` read flags.

    ``name=None`` creates a new segment, removed when this object (its creator) is
    dropped; a name opens an existing one. The object pickles as its ``handle()``, so
    unpickling in another process opens the same segment. Opening a name that does not
    exist here (a handle from another machine) does not fail; using the buffer raises
    ``FileNotFoundError``.
    """

    def __init__(self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: Optional[str] = None):
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self._open_error: Optional[BaseException] = None
        self._core: Optional[_core.Ring] = None
        if name is None:
            self._core = _core.Ring.create(n_reader, max_chunk_bytes, max_chunks)
            track(self._core)
            self.is_creator = True
        else:
            self.is_creator = False
            try:
                ring = _core.Ring.open(name)
            except FileNotFoundError as e:
                self._open_error = e
            else:
                if (ring.n_reader, ring.max_chunk_bytes, ring.max_chunks) != (n_reader, max_chunk_bytes, max_chunks):
                    raise ValueError(
                        f"shared memory segment {name!r} holds a ring of {ring.n_reader} readers and "
                        f"{ring.max_chunks} chunks of {ring.max_chunk_bytes} bytes, not {n_reader} readers and "
                        f"{max_chunks} chunks of {max_chunk_bytes} bytes"
                    )
                self._core = ring
        self.name = self._core.name if self._core is not None else name
        self._vllm_attributes()

    def _vllm_attributes(self) -> None:
        """vLLM 0.33's geometry attributes. ``data_offset``/``metadata_offset`` are what
        vLLM's layout would use; shmq's segment is laid out differently (see
        ``shared_memory``)."""
        self.metadata_size = 1 + self.n_reader
        self.total_bytes_of_buffer = (self.max_chunk_bytes + self.metadata_size) * self.max_chunks
        self.data_offset = 0
        self.metadata_offset = self.max_chunk_bytes * self.max_chunks
        self.shared_memory = _SegmentMemory(self.name)

    @classmethod
    def _wrap(cls, ring: _core.Ring) -> "ShmRingBuffer":
        self = cls.__new__(cls)
        self.n_reader, self.max_chunk_bytes, self.max_chunks = ring.n_reader, ring.max_chunk_bytes, ring.max_chunks
        self._open_error, self._core, self.is_creator, self.name = None, ring, ring.is_creator, ring.name
        if ring.is_creator:
            track(ring)
        self._vllm_attributes()
        return self

    @property
    def ring(self) -> _core.Ring:
        if self._core is None:
            raise FileNotFoundError(
                f"shared memory segment {self.name!r} does not exist on this machine "
                "(was the handle made on another node, or has its creator exited?)"
            ) from self._open_error
        return self._core

    def handle(self) -> tuple[int, int, int, str]:
        """``(n_reader, max_chunk_bytes, max_chunks, name)``."""
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    def __reduce__(self):
        return (self.__class__, self.handle())

    @contextmanager
    def get_data(self, current_idx: int) -> Iterator[memoryview]:
        """A writable view of chunk ``current_idx``'s data."""
        with memoryview(self.ring.data(current_idx)) as buf:
            yield buf

    @contextmanager
    def get_metadata(self, current_idx: int) -> Iterator[memoryview]:
        """A writable view of chunk ``current_idx``'s flags: ``[written, read_0, ...]``."""
        with memoryview(self.ring.metadata(current_idx)) as buf:
            yield buf

    def __repr__(self) -> str:
        return (
            f"ShmRingBuffer(n_reader={self.n_reader}, max_chunk_bytes={self.max_chunk_bytes}, "
            f"max_chunks={self.max_chunks}, name={self.name!r})"
        )


@dataclass
class Handle:
    """What a reader needs to join a ``MessageQueue``; picklable. The fields are vLLM
    0.33's, in its order; ``local_notify_addr`` and ``tensor_arena_handle`` are kept for
    compatibility (shmq's readers are woken through the segment)."""

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: Optional[tuple[int, int, int, str]] = None
    local_subscribe_addr: Optional[str] = None
    local_notify_addr: Optional[str] = None
    remote_subscribe_addr: Optional[str] = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: Optional[tuple] = None


class MessageQueue:
    """A broadcast queue: one writer, ``n_reader`` readers, every object to every reader.

    The constructor makes the writer. ``n_local_reader`` readers are on this machine and
    read through shared memory; the others are remote and get every message over
    ZeroMQ TCP (``connect_ip``, default this host's address). Readers are made in their
    own processes with ``MessageQueue.create_from_handle(writer.export_handle(), rank)``.

    Beyond the engines' API:

    - ``spin_us`` / ``yield_us``: how long a blocked call spins, then yields the CPU,
      before it sleeps on a futex in the segment. Defaults: spin 50 µs if the writer
      and the local readers each have a core, else not at all (spinning processes would
      take the cores the others need); yield 50 µs. The ``SHMQ_SPIN_US`` /
      ``SHMQ_YIELD_US`` environment variables set other defaults. An idle reader costs
      no CPU; the writer wakes sleepers only when there are any.
    - ``on_dead_reader``: when a local reader dies without reading a chunk the writer
      needs, the writer raises ``PeerDiedError`` naming it (``"raise"``, the default) or
      goes on without it (``"drop"``). A reader whose writer died raises
      ``PeerDiedError`` too, instead of waiting forever.
    """

    # Class-level defaults make a handle-less object fail with a clear error.
    _writer: Optional[_core.Writer] = None
    _reader: Optional[_core.Reader] = None
    buffer: Optional[ShmRingBuffer] = None
    handle: Optional[Handle] = None
    _is_writer = False
    _is_local_reader = False
    _is_remote_reader = False
    local_reader_rank = -1
    enable_shm_tensor_arena = False
    tensor_arena = None

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: Optional[list[int]] = None,
        max_chunk_bytes: int = 1024 * 1024 * 10,
        max_chunks: int = 10,
        connect_ip: Optional[str] = None,
        enable_shm_tensor_arena: bool = False,
        *,
        spin_us: Optional[float] = None,
        yield_us: Optional[float] = None,
        on_dead_reader: str = "raise",
    ):
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        else:
            local_reader_ranks = list(local_reader_ranks)
        if len(local_reader_ranks) != n_local_reader:
            raise ValueError(
                f"local_reader_ranks has {len(local_reader_ranks)} entries but n_local_reader is {n_local_reader}"
            )
        self._writer = _core.Writer(
            n_reader,
            n_local_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            spin_us=spin_us,
            yield_us=yield_us,
            on_dead_reader=on_dead_reader,
        )
        ranks, buffer_handle, local_addr, remote_addr, ipv6 = self._writer.handle()
        self.handle = Handle(
            local_reader_ranks=ranks,
            buffer_handle=buffer_handle,
            local_subscribe_addr=local_addr,
            remote_subscribe_addr=remote_addr,
            remote_addr_ipv6=ipv6,
        )
        # vLLM 0.33's opt-in zero-copy tensor arena (local readers only).
        self.enable_shm_tensor_arena = bool(enable_shm_tensor_arena)
        self.tensor_arena = None
        ring = self._writer.ring()
        self.buffer = ShmRingBuffer._wrap(ring) if ring is not None else None
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self._is_writer = True
        self.shutting_down = False

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(
        handle: Handle, rank: int, *, spin_us: Optional[float] = None, yield_us: Optional[float] = None
    ) -> "MessageQueue":
        """Open the reader of rank ``rank``: local if ``rank`` is in
        ``handle.local_reader_ranks``, remote otherwise. ``spin_us`` / ``yield_us`` as
        for the constructor."""
        self = MessageQueue.__new__(MessageQueue)
        self.handle = handle
        self._reader = _core.Reader(
            list(handle.local_reader_ranks),
            tuple(handle.buffer_handle) if handle.buffer_handle is not None else None,
            handle.local_subscribe_addr,
            handle.remote_subscribe_addr,
            bool(handle.remote_addr_ipv6),
            rank,
            spin_us=spin_us,
            yield_us=yield_us,
        )
        self._is_local_reader = self._reader.is_local
        self._is_remote_reader = not self._is_local_reader
        if self._is_local_reader:
            self.local_reader_rank = self._reader.reader_index
            self.buffer = ShmRingBuffer._wrap(self._reader.ring())
        self.n_local_reader = len(handle.local_reader_ranks)
        self.n_remote_reader = 0
        self.shutting_down = False
        return self

    @staticmethod
    def create_from_process_group(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        writer_rank: int = 0,
        external_writer_handle: Optional[Handle] = None,
        blocking: bool = True,
    ) -> "MessageQueue":
        """Collective over ``pg`` (a ``torch.distributed.ProcessGroup`` or a
        ``StatelessProcessGroup``): group rank ``writer_rank`` makes the writer, with the
        ranks on its machine (found by opening a probe segment, not by host name) as
        local readers and the rest as remote readers; the handle goes to every rank
        through ``pg`` and each other rank opens its reader. With
        ``external_writer_handle`` (vLLM 0.33), ``writer_rank`` opens that handle as a
        reader instead and passes it on. With ``blocking``, all call
        ``wait_until_ready()``. Returns this rank's queue."""
        from .group import create_message_queue_from_process_group

        return create_message_queue_from_process_group(
            pg, max_chunk_bytes, max_chunks, writer_rank, blocking, external_writer_handle
        )

    @staticmethod
    def create_from_process_group_single_reader(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_rank: int = 0,
        blocking: bool = False,
    ) -> "tuple[MessageQueue, list[Handle]]":
        """vLLM 0.33: every rank of ``pg`` makes a writer with one reader, group rank
        ``reader_rank`` (local if it shares this rank's machine, else remote), and the
        handles are gathered to ``reader_rank``. Returns this rank's writer and, on
        ``reader_rank``, the handles by rank (elsewhere ``[]``)."""
        from .group import create_single_reader_queues

        return create_single_reader_queues(pg, max_chunk_bytes, max_chunks, reader_rank, blocking)

    @property
    def dropped_readers(self) -> list[int]:
        """Writer side: local readers dropped after they died (``on_dead_reader="drop"``)."""
        return self._writer.dropped_readers if self._writer is not None else []

    @property
    def current_idx(self) -> int:
        """Index of the chunk this side uses next."""
        side = self._writer or self._reader
        return side.current_idx if side is not None else 0

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Collective: the writer waits until every reader has subscribed, then tells them
        all; each reader waits for that. After it returns no message can be lost."""
        if self._writer is not None:
            self._writer.wait_until_ready(timeout)
        elif self._reader is not None:
            self._reader.wait_until_ready(timeout)
        else:
            raise RuntimeError("this MessageQueue has no handle: make it with MessageQueue(...) or create_from_handle")

    def enqueue(self, obj: Any, timeout: Optional[float] = None) -> None:
        """Send ``obj`` (pickled) to every reader; blocks while the ring is full and raises
        ``TimeoutError`` after ``timeout`` seconds."""
        writer = self._writer
        if writer is None:
            raise RuntimeError("only the writer can enqueue: this MessageQueue is a reader")
        writer.enqueue(_dumps(obj, protocol=_PROTOCOL), timeout)

    def dequeue(self, timeout: Optional[float] = None, cancel: Any = None, indefinite: bool = False) -> Any:
        """The next object. ``TimeoutError`` after ``timeout`` seconds;
        ``RuntimeError("cancelled")`` once ``cancel`` is set or ``shutdown()`` is called.
        ``indefinite=True`` waits without logging "still waiting" warnings. vLLM 0.33's
        signature is ``dequeue(timeout, indefinite)``: a bool in second place is taken
        as ``indefinite`` (a cancel event is never a bool)."""
        if type(cancel) is bool:
            cancel, indefinite = None, cancel
        reader = self._reader
        if reader is None:
            raise RuntimeError(
                "only readers can dequeue: this MessageQueue is the writer"
                if self._writer is not None
                else "this MessageQueue has no handle: make readers with MessageQueue.create_from_handle"
            )
        return _loads(reader.dequeue(timeout, cancel, indefinite))

    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer sends ``obj`` and returns it; a reader returns what it receives."""
        if self._writer is not None:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    @contextmanager
    def acquire_write(self, timeout: Optional[float] = None) -> Iterator[memoryview]:
        """Zero-copy writing: a view of the next chunk (waiting for room); it is published
        to readers when the block ends without an exception. All readers must be local."""
        if self._writer is None:
            raise RuntimeError("only the writer can acquire_write")
        with memoryview(self._writer.acquire_write(timeout)) as buf:
            yield buf
        self._writer.commit_write()

    @contextmanager
    def acquire_read(
        self, timeout: Optional[float] = None, cancel: Any = None, indefinite: bool = False
    ) -> Iterator[memoryview]:
        """Zero-copy reading (local readers): a view of the next chunk; it is marked read
        when the block ends. As in ``dequeue``, a bool in second place is vLLM 0.33's
        ``indefinite`` (accepted; shmq's waits warn the same either way)."""
        if type(cancel) is bool:  # vLLM's acquire_read(timeout, indefinite)
            cancel = None
        if self._reader is None:
            raise RuntimeError("only readers can acquire_read")
        with memoryview(self._reader.acquire_read(timeout, cancel)) as buf:
            try:
                yield buf
            finally:
                self._reader.finish_read()

    def shutdown(self) -> None:
        """Wake calls blocked in this process with ``RuntimeError("cancelled")``; safe to
        call from another thread."""
        self.shutting_down = True
        side = self._reader or self._writer
        if side is not None:
            side.shutdown()

    def __repr__(self) -> str:
        role = "writer" if self._writer is not None else "local reader" if self._is_local_reader else "remote reader"
        return f"<MessageQueue {role} {self.handle}>"

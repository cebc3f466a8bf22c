"""The broadcast queue: ``ShmRingBuffer``, ``Handle`` and ``MessageQueue``.

These keep the names, signatures and errors of the engines' classes (vLLM's
``shm_broadcast``), so code written for those works unchanged. The work happens in
Rust (``shmq._core``); this module pickles objects and shapes the API.

Where shmq says more than the engines: the writer's ``shutdown()`` (or its normal end,
also at interpreter exit) ends the queue, and readers get every message sent before it
and then ``QueueShutDownError`` instead of waiting forever (see ``MessageQueue``);
``PeerDiedError`` when the other side died instead. A local reader's normal end (the
object dropped, or its process's interpreter exiting) leaves the queue: its writer goes
on without it rather than report a death.
"""

from __future__ import annotations

import collections
import functools
import multiprocessing.util
import os
import pickle
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, NoReturn, Optional, Sequence, Union, cast, overload

from . import _core, _ipc, _oob, group
from ._arrays import ArrayKind, from_wire, to_wire
from ._cleanup import created_segments, track_writer
from ._device import Device
from ._device_reader import DeviceSources
from ._loans import loan_memory, loaned_array, loaned_tensor
from ._segment_memory import SegmentMemory

if TYPE_CHECKING:  # for annotations only: importing shmq imports neither
    import numpy.typing as npt
    import torch

__all__ = [
    "Handle",
    "MessageKindError",
    "MessageQueue",
    "MessageLostError",
    "PeerDiedError",
    "QueueShutDownError",
    "ShmRingBuffer",
    "sched_yield",
]

PeerDiedError = _core.PeerDiedError
QueueShutDownError = _core.QueueShutDownError
MessageLostError = _core.MessageLostError

_dumps = _oob.dumps


class MessageKindError(ValueError):
    """A message of another kind than the call reads: ``dequeue()`` met raw bytes (a
    Rust writer's ``enqueue``, ``enqueue_bytes``, ``acquire_write``), ``dequeue_bytes()``
    met a pickled object (``enqueue``) or a typed array (``enqueue_array``),
    ``dequeue_array()`` met anything but a typed array. The message is consumed; the
    reader reads the next one."""


_RAW_FOR_DEQUEUE = (
    "this message was sent as raw bytes (by a Rust writer's enqueue, enqueue_bytes, or "
    "acquire_write), not as a pickled Python object; read it with dequeue_bytes() / "
    "acquire_read() (the message is consumed; the reader goes on with the next one)"
)
_PICKLED_FOR_DEQUEUE_BYTES = (
    "this message was sent as a pickled Python object (by enqueue), not as raw bytes; "
    "read it with dequeue() (the message is consumed; the reader goes on with the next one)"
)
_ARRAY_FOR_DEQUEUE_BYTES = (
    "this message was sent as a typed array (by enqueue_array), not as raw bytes; read "
    "it with dequeue() or dequeue_array() (the message is consumed; the reader goes on "
    "with the next one)"
)
_NOT_AN_ARRAY = (
    "this message was sent as {what}, not as a typed array (enqueue_array); read it with "
    "{call} (the message is consumed; the reader goes on with the next one)"
)
_loads = pickle.loads


def _to(device: Any) -> Any:
    """``tensor.to(device)``, as a function of the tensor."""
    return functools.partial(_moved, device=device)


def _moved(tensor: Any, device: Any) -> Any:
    return tensor.to(device)

# enqueue_async's pauses between tries while the ring has no room (seconds): doubling
# from the first to the last.
_ROOM_RETRY_FIRST = 0.001
_ROOM_RETRY_MAX = 0.02


def sched_yield() -> None:
    """Give the CPU to another thread or process."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()
    else:  # pragma: no cover - platforms without sched_yield
        time.sleep(0)


def _not_on_this_machine(name: str, open_error: Optional[BaseException]) -> FileNotFoundError:
    """The error of using a ring whose segment ``name`` could not be opened here."""
    e = FileNotFoundError(
        f"shared memory segment {name!r} does not exist on this machine "
        "(was the handle made on another node, or has its creator exited?)"
    )
    e.__cause__ = open_error
    return e


# This process's local readers, which leave their queues at its exit (see _leave_at_exit).
_readers: "weakref.WeakSet[MessageQueue]" = weakref.WeakSet()
_leave_hook_pid: Optional[int] = None


def _track_reader(mq: "MessageQueue") -> None:
    """Make local reader ``mq`` leave its queue at this process's exit."""
    global _leave_hook_pid
    _readers.add(mq)
    if _leave_hook_pid != os.getpid():
        # One of multiprocessing's exit finalizers: they run at the interpreter's exit
        # (multiprocessing's own atexit hook) and, in a child of any start method, once its
        # target is done, also in a forked child, which ends in os._exit (no atexit there).
        # A forked child starts without its parent's finalizers: registered again there.
        _leave_hook_pid = os.getpid()
        multiprocessing.util.Finalize(None, _leave_at_exit, exitpriority=-100)


def _leave_at_exit() -> None:
    """At this process's normal end (the end of the script, ``sys.exit``, an exception
    that ends it, a multiprocessing child's target done), its local readers leave their
    queues: each lets go of its core reader, whose end marks its slot in the ring as left,
    so that the writer goes on without it instead of reporting it dead (a reader still in
    a call, in a thread that outlives this, is not let go: it dies with the process)."""
    for mq in list(_readers):
        try:
            mq._leave()
        except Exception:  # pragma: no cover - nothing may keep the others from leaving
            pass


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
        # Each a positive int (TypeError, or ValueError naming it): the core's rule.
        n_reader = _core.count(n_reader, "n_reader", "readers")
        max_chunk_bytes = _core.count(max_chunk_bytes, "max_chunk_bytes", "bytes")
        max_chunks = _core.count(max_chunks, "max_chunks", "chunks")
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self._open_error: Optional[BaseException] = None
        self._core: Optional[_core.Ring] = None
        if name is None:
            self._core = _core.Ring.create(n_reader, max_chunk_bytes, max_chunks)
            created_segments()
            self.is_creator = True
            name = self._core.name
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
        core, name, open_error = self._core, self.name, self._open_error

        def segment() -> _core.Ring:  # not a method: the memory must not keep self alive
            if core is None:
                raise _not_on_this_machine(name, open_error)
            return core

        self.shared_memory = SegmentMemory(name, segment, core.size if core is not None else None)

    @classmethod
    def _wrap(cls, ring: _core.Ring) -> "ShmRingBuffer":
        self = cls.__new__(cls)
        self.n_reader, self.max_chunk_bytes, self.max_chunks = ring.n_reader, ring.max_chunk_bytes, ring.max_chunks
        self._open_error, self._core, self.is_creator, self.name = None, ring, ring.is_creator, ring.name
        if ring.is_creator:
            created_segments()
        self._vllm_attributes()
        return self

    @property
    def ring(self) -> _core.Ring:
        if self._core is None:
            raise _not_on_this_machine(self.name, self._open_error)
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
    #: vLLM 0.33's field, kept for compatibility (shmq's arena is ``arena_name``).
    tensor_arena_handle: Optional[tuple] = None
    #: The tensor arena's segment (large tensors and arrays, read as zero-copy views).
    arena_name: Optional[str] = None
    #: The secret remote readers prove they hold (hex), so that nobody else who reaches
    #: the writer's port counts as a reader or can feed a reader messages. It is why a
    #: handle must travel over a trusted channel; it is left out of the repr.
    remote_secret: Optional[str] = field(default=None, repr=False)

    def __str__(self) -> str:
        """The handle's one-line text form, the one the Rust crate's ``Handle`` prints and
        parses (``shmq-handle-3|ranks|ring|local addr|remote addr|ipv6|arena|secret``, see
        the guide): a handle printed here opens a Rust reader, and ``Handle.from_str``
        reads one a Rust writer printed. It carries ``remote_secret`` (64 hexadecimal
        digits): send it over a trusted channel, as the handle itself. The
        compatibility fields ``local_notify_addr`` and ``tensor_arena_handle`` are not
        in it (shmq does not use them)."""
        return _core.handle_to_text(self)

    @classmethod
    def from_str(cls, text: str) -> Handle:
        """The handle whose text form (``str(handle)``, or a Rust ``Handle``'s
        ``to_string()``) is ``text``; ``ValueError`` saying what is wrong when it is not
        one (naming only the text's first characters: the last field is the secret)."""
        if not isinstance(text, str):
            raise TypeError(f"Handle.from_str takes a str, got {type(text).__name__}")
        return cls(**_core.handle_from_text(text))


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
      take the cores the others need); yield 50 µs, grown up to 1 ms (when each has a
      core and ``yield_us`` is not given) to twice the typical recent wait of a waiter
      whose peer answers that quickly. The ``SHMQ_SPIN_US`` / ``SHMQ_YIELD_US`` /
      ``SHMQ_YIELD_MAX_US`` environment variables set other defaults. An idle reader
      costs no CPU; the writer wakes sleepers only when there are any.
    - ``on_dead_reader``: when a local reader dies without reading a chunk the writer
      needs, the writer raises ``PeerDiedError`` naming it (``"raise"``, the default) or
      goes on without it (``"drop"``). A reader whose writer died raises
      ``PeerDiedError`` too, instead of waiting forever; a remote reader as well, after
      every message that arrived: at once for a writer killed on a machine that stays
      up, within 5 s for one that hangs or whose machine or network went away (ZeroMQ's
      heartbeats, ``SHMQ_REMOTE_HEARTBEAT_TIMEOUT``), and within 5 s of ``wait_until_ready``
      for one it cannot reach at all.
    - ``on_lost_remote_reader``: a remote reader that is gone for the writer (its
      connection closed, or nothing came from it within the heartbeat bound) is left
      behind with a warning and the writer goes on with the others (``"warn"``, the
      default, whatever ``on_dead_reader`` says), or the send that finds it, and every
      later one, raises ``PeerDiedError`` naming its rank and host after the message went
      to the others (``"raise"``; the vLLM plugin's default, so that a lost worker node
      ends vLLM's engine as a dead local worker does, instead of leaving it waiting for
      that node). ``MessageQueue.default_on_lost_remote_reader`` is the default.
    - A local reader's normal end is not a death: the reader object dropped, or its
      process's interpreter exiting (the end of the script, ``sys.exit``, an exception
      that ends it, a ``multiprocessing`` child's target done, whatever its start
      method) *leaves* the queue. The writer goes on without a reader that left, whatever
      ``on_dead_reader`` says, and logs it once (INFO, logger ``shmq``: "reader 1 (rank 1)
      left queue ... going on without it"); before the queue is ready, its rank is free
      for another reader. A reader killed (a signal, ``os._exit``) or crashed in native
      code has died: ``on_dead_reader`` applies.
    - The writer's ``shutdown()``, and its normal end (the object dropped, or the
      interpreter exiting), end the queue: the writer's later calls, and one blocked in
      another thread, raise ``QueueShutDownError`` (a ``RuntimeError``); every reader,
      local or remote, gets every message sent before and then ``QueueShutDownError``
      from ``dequeue`` (not a timeout, not a hang; ``PeerDiedError`` means the writer
      died without ending the queue). It never waits for room in the ring: local readers
      learn it from the writer's slot in the ring, remote ones from a last message on
      their stream (sent within 1 s). A reader's own ``shutdown()`` (or ``cancel``)
      still ends its blocked calls with ``RuntimeError("cancelled")``.
    - Large tensors and arrays (protocol-5 out-of-band buffers of at least
      ``arena_threshold`` bytes, default 1 MiB, ``SHMQ_ARENA_THRESHOLD``) are copied once
      into a *tensor arena* beside the ring (``arena_bytes``, default 1 GiB of address
      space reserved in ``/dev/shm`` only as used, ``SHMQ_ARENA_BYTES``; 0 turns it off),
      and local readers get tensors that are zero-copy views of it. Those views are
      private: writable, and a reader's writes are never seen by the writer or another
      reader (copy-on-write pages). The bytes go back to the writer when the last view
      in the last reader is gone. With the arena full, parts are copied through the
      ring instead (``arena_fallbacks`` counts them); the writer never waits for it.
    - Remote readers prove they hold the queue's secret (in the ``Handle``) before they
      count or receive anything, one per rank, and every message to them is
      authenticated (a keyed MAC, a session and a sequence number): a stranger on the
      network, or a process that took a dead writer's port, can neither read the stream
      nor make a reader unpickle its bytes. At most ``remote_hwm`` messages (default
      1000) and ``remote_max_queued_bytes`` bytes (default 256 MiB) sent to one remote
      reader and not yet taken by it (dequeued) exist anywhere: in the writer, in the
      network buffers and in the reader together (the reader acknowledges what it took),
      so neither process's memory grows with a reader that stops reading. When it falls
      that far behind the writer waits for it (``slow_remote_reader="block"``, within the
      enqueue timeout) or stops sending to it (``"drop"``; the reader gets what was sent
      to it before, then ``ConnectionError`` saying it was dropped). A single message
      larger than ``remote_max_queued_bytes`` goes once the reader has taken everything
      before it. A remote reader says its HELLO again on every new connection until the
      writer starts it, so it joins through floods of idle connections; a rank whose
      reader went away before the queue was ready is free for another.
    - ``loan(nbytes)`` / ``loan_tensor(shape, dtype)`` / ``loan_array(shape, dtype)``:
      memory in the arena to fill in place; sending an object that holds it sends a
      reference, no copy at all.
    - ``name``: what to call the queue (1 to 63 bytes of text), shown by
      ``python -m shmq inspect`` and ``python -m shmq top`` and as the ``queue`` label of
      its metrics beside its segment's name (``shmq_ring_<pid>_<hex>``); readers on this
      machine see it as ``mq.name``.
    - ``enqueue_array`` / ``dequeue_array``: typed arrays, the format Rust readers and
      writers speak too; ``enqueue_bytes`` / ``dequeue_bytes``: raw bytes.
    - ``ipc=True`` (every reader on this machine): device tensors (CUDA; with the CPU
      twin of the device seam, ``device_seam="twin"``, every tensor) are sent by IPC
      handle, not copied to the host. A reader opens each allocation once (while it takes
      the message; a process keeps 64 open) and copies it on the device (the tensor's
      own, or ``dequeue(device=)``'s) before ``dequeue`` returns; one that cannot open
      it gets ``RuntimeError``. The writer shares its tensor, not a copy of it: change it
      only after the readers have the message.
      The writer keeps the tensors of its last ``max_chunks + 1`` messages, all a reader
      may still be opening; a reader that opened one holds the memory itself. Not yet run
      on a GPU (docs/guide.md, "The device path").
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
    name: Optional[str] = None
    enable_shm_tensor_arena = False
    tensor_arena = None
    _left = False
    _name_release: Optional[Callable[[], Any]] = None
    #: ``on_lost_remote_reader`` where the constructor is not told: ``"warn"``; the vLLM
    #: plugin makes it ``"raise"`` (a lost worker node ends vLLM's engine, as a dead local
    #: worker does).
    default_on_lost_remote_reader: Literal["warn", "raise"] = "warn"

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
        on_dead_reader: Literal["raise", "drop"] = "raise",
        arena_bytes: Optional[int] = None,
        arena_threshold: Optional[int] = None,
        remote_hwm: Optional[int] = None,
        slow_remote_reader: Literal["block", "drop"] = "block",
        remote_max_queued_bytes: Optional[int] = None,
        name: Optional[str] = None,
        on_lost_remote_reader: Optional[Literal["warn", "raise"]] = None,
        ipc: bool = False,
        device_seam: Union[None, str, Device] = None,
    ):
        # vLLM 0.33 accepts n_reader=0 (a queue that sends to nobody); shmq refuses it:
        # made by hand, a queue without readers is a mistake. (create_from_process_group
        # in a group of one process still makes one, as vLLM does: see _without_readers.)
        # The options are converted and checked once, by the core (_core.QueueOptions,
        # naming the argument); an option left None keeps the core's default.
        n_reader = _core.count(n_reader, "n_reader", "readers")
        if on_lost_remote_reader is None:
            on_lost_remote_reader = type(self).default_on_lost_remote_reader
        options = _core.QueueOptions(
            local_reader_ranks=local_reader_ranks,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            connect_ip=connect_ip,
            spin_us=spin_us,
            yield_us=yield_us,
            on_dead_reader=on_dead_reader,
            arena_bytes=arena_bytes,
            arena_threshold=arena_threshold,
            remote_hwm=remote_hwm,
            slow_remote_reader=slow_remote_reader,
            remote_max_queued_bytes=remote_max_queued_bytes,
            name=name,
            on_lost_remote_reader=on_lost_remote_reader,
        )
        if ipc and n_local_reader != n_reader:
            raise ValueError(
                f"ipc=True sends device tensors by IPC handle, which only readers on this machine can open: "
                f"this queue has {n_reader - n_local_reader} remote reader(s)"
            )
        self._start_writer(n_reader, n_local_reader, options, enable_shm_tensor_arena)
        self.device_seam = device_seam
        if ipc:
            # A reader opens a message's handles before its dequeue returns, and a sent
            # message is at most max_chunks messages ahead of one a reader is inside the
            # dequeue of (the ring has max_chunks chunks, and that reader has not read the
            # next one): the tensors of the last max_chunks + 1 messages sent are all a
            # reader may still open.
            self._exported = collections.deque(maxlen=max_chunks + 1)

    #: Writer with ``ipc=True``: the device tensors of the last messages, by message.
    _exported: "Optional[collections.deque[list[Any]]]" = None

    def _to_send(self, obj: Any) -> tuple[Any, Optional[list[Any]]]:
        """``obj`` as sent, and with ``ipc=True`` the device tensors it sends by IPC handle
        (kept by ``_sent`` once the message is sent: not before, since a send that waits
        for room must not push out the tensors a reader may be opening now)."""
        if self._exported is None:
            return obj, None
        tensors: list[Any] = []
        return _ipc.publish(obj, self.device_seam, False, tensors), tensors

    def _sent(self, tensors: Optional[list[Any]]) -> None:
        if tensors is not None and self._exported is not None:
            self._exported.append(tensors)

    def _start_writer(
        self, n_reader: int, n_local_reader: int, options: _core.QueueOptions, enable_shm_tensor_arena: bool
    ) -> None:
        """Make the writer."""
        self._writer = _core.Writer(n_reader, n_local_reader, options)
        self.handle = Handle(**self._writer.handle())
        self.name = options.name
        if self.name is not None:
            self._claim_name(self.name)
        track_writer(self._writer)  # its readers hear of its end, also at exit
        # vLLM 0.33's opt-in arena flag: accepted (shmq's own arena is on unless
        # arena_bytes=0; its views are private, so vLLM's reason to keep it off is gone).
        self.enable_shm_tensor_arena = bool(enable_shm_tensor_arena)
        self.tensor_arena = None
        ring = self._writer.ring()
        self.buffer = ShmRingBuffer._wrap(ring) if ring is not None else None
        self.n_local_reader = len(self.handle.local_reader_ranks)
        self.n_remote_reader = n_reader - self.n_local_reader
        self._is_writer = True
        self.shutting_down = False

    @staticmethod
    def _without_readers(max_chunk_bytes: int, max_chunks: int) -> "MessageQueue":
        """A writer that sends to nobody: what ``create_from_process_group`` makes in a
        group of one process, as vLLM 0.33 does there (the constructor refuses
        ``n_reader=0``). Its enqueue and wait_until_ready return at once."""
        self = MessageQueue.__new__(MessageQueue)
        options = _core.QueueOptions(local_reader_ranks=[], max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)
        self._start_writer(0, 0, options, False)
        return self

    def export_handle(self) -> Handle:
        # None only for an object made without __init__ (whose other methods raise).
        return self.handle  # type: ignore[return-value]

    def __reduce__(self) -> NoReturn:
        # Pickling would copy a writer's or reader's sockets, mappings and role in the
        # segment, which cannot be copied: another process needs the handle instead.
        raise TypeError(
            "a MessageQueue cannot be sent to another process: pass queue.export_handle() "
            "and call MessageQueue.create_from_handle(handle, rank) in the child"
        )

    @staticmethod
    def create_from_handle(
        handle: Handle, rank: int, *, spin_us: Optional[float] = None, yield_us: Optional[float] = None
    ) -> "MessageQueue":
        """Open the reader of rank ``rank``: local if ``rank`` is in
        ``handle.local_reader_ranks``, remote otherwise. ``spin_us`` / ``yield_us`` as
        for the constructor."""
        self = MessageQueue.__new__(MessageQueue)
        self.handle = handle
        self._reader = _core.Reader(handle, rank, spin_us=spin_us, yield_us=yield_us)
        self._is_local_reader = self._reader.is_local
        self._is_remote_reader = not self._is_local_reader
        if self._is_local_reader:
            index, ring = self._reader.reader_index, self._reader.ring()
            assert index is not None and ring is not None, "a local reader has an index and a ring"
            self.local_reader_rank = index
            self.buffer = ShmRingBuffer._wrap(ring)
            self.name = ring.label
            _track_reader(self)
        self.n_local_reader = len(handle.local_reader_ranks)
        self.n_remote_reader = 0
        self.shutting_down = False
        return self

    def _claim_name(self, name: str) -> None:
        """Record this writer's handle under ``name`` (see ``open``) and hold it (a lock on
        the record) until it shuts down or is dropped. ``FileExistsError`` (the writer
        ended again) when another live queue of this user holds the name."""
        from . import _names

        try:
            held = _names.claim("queue", name, {"handle": str(self.handle)})
        except BaseException:
            assert self._writer is not None
            self._writer.shutdown()
            raise
        self._name_release = weakref.finalize(self, held.release)

    @staticmethod
    def open(
        name: str, rank: int, *, spin_us: Optional[float] = None, yield_us: Optional[float] = None
    ) -> "MessageQueue":
        """Open the reader of rank ``rank`` of the queue named ``name`` on this machine
        (its writer made with ``MessageQueue(..., name=name)``), without its handle: as
        ``create_from_handle(handle, rank)`` with the handle the writer recorded under
        that name. Names are scoped to the user (another user's queue of the same name is
        not found) and held by one live writer at a time (a second one raises
        ``FileExistsError``); the name is free again once its writer shuts down, is
        dropped or dies. Whether the writer lives is told by a lock it holds on its
        record, never by its pid, so a writer in another container sharing ``/dev/shm``
        (another pid namespace) is found and its name kept. ``FileNotFoundError`` naming
        it when there is no such queue (never made, shut down, or its writer died);
        ``PermissionError`` when the user's directory of names (``/dev/shm/.shmq-names-<uid>``,
        or the one ``SHMQ_NAMES_DIR`` names) may be entered by other users. Where another
        user took that path first, the user's names live in ``.shmq-names-<uid>.1`` (or the
        next free number), found alike by all the user's processes: see ``docs/guide.md``.
        ``spin_us`` / ``yield_us`` as for the constructor."""
        from . import _names

        record = _names.lookup("queue", name)
        handle = Handle.from_str(record["handle"])
        return MessageQueue.create_from_handle(handle, rank, spin_us=spin_us, yield_us=yield_us)

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
        reader instead and passes it on. Returns this rank's queue.

        With ``blocking`` (the default) every rank has called ``wait_until_ready()`` by
        the time this returns: the queue is ready to use, no call of your own is needed
        (one returns at once). With ``blocking=False``, every rank must call it."""
        ops = group._Ops(pg)
        if not 0 <= writer_rank < ops.world_size:
            raise ValueError(f"writer_rank {writer_rank} is not in 0..{ops.world_size - 1}")
        # Looked up in shmq.group at call time, so that tests can replace it (see its module doc).
        same_node = group.in_the_same_node_as(pg, source_rank=writer_rank)
        if len(same_node) != ops.world_size:
            raise RuntimeError(f"same-machine detection returned {len(same_node)} answers for {ops.world_size} ranks")
        if ops.rank == writer_rank and external_writer_handle is not None:
            # vLLM 0.33: the queue's writer is elsewhere; this rank reads it too and hands
            # its handle on.
            mq = MessageQueue.create_from_handle(external_writer_handle, ops.rank)
            ops.broadcast(mq.export_handle(), src=writer_rank)
        elif ops.world_size == 1:
            # A group of one: a writer without readers, as vLLM 0.33 makes (the constructor
            # refuses n_reader=0, a mistake when written by hand).
            mq = MessageQueue._without_readers(max_chunk_bytes, max_chunks)
            ops.broadcast(mq.export_handle(), src=writer_rank)
        elif ops.rank == writer_rank:
            local_reader_ranks = [r for r in range(ops.world_size) if r != writer_rank and same_node[r]]
            mq = MessageQueue(
                n_reader=ops.world_size - 1,
                n_local_reader=len(local_reader_ranks),
                local_reader_ranks=local_reader_ranks,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
            )
            ops.broadcast(mq.export_handle(), src=writer_rank)
        else:
            handle = ops.broadcast(None, src=writer_rank)
            mq = MessageQueue.create_from_handle(handle, ops.rank)
        if blocking:
            mq.wait_until_ready()
        return mq

    @staticmethod
    def create_from_process_group_single_reader(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_rank: int = 0,
        blocking: bool = False,
        *,
        same_node: Optional[Sequence[bool]] = None,
    ) -> "tuple[MessageQueue, list[Handle]]":
        """vLLM 0.33: every rank of ``pg`` makes a writer with one reader, global rank
        ``reader_rank`` (local if it shares this rank's machine, else remote), and the
        handles are gathered to ``reader_rank``. Returns this rank's writer and, on
        ``reader_rank``, the handles by rank (elsewhere ``[]``).

        Which ranks share the reader's machine is the caller's to say where it knows:
        ``same_node``, one bool per group rank (the same list on every rank). Else a
        framework's rule (``shmq.group.locality_rule``): under the vLLM plugin, vLLM's
        own, as vLLM's class decides (ranks per node = the platform's device count), so
        that a worker's queue has the remote address
        vLLM's executor expects even where two of vLLM's nodes share one ``/dev/shm``.
        Otherwise shmq probes: a rank that can open a segment the reader made shares its
        machine."""
        ops = group._Ops(pg)
        reader = reader_rank if ops.stateless else ops.dist.get_group_rank(pg, reader_rank)
        if not 0 <= reader < ops.world_size:
            raise ValueError(f"reader_rank {reader_rank} is not in the process group")
        if same_node is None and not ops.stateless and group.locality_rule is not None:
            same_node = group.locality_rule(pg, reader_rank)
        if same_node is None:
            same_node = group.in_the_same_node_as(pg, source_rank=reader)
        elif len(same_node) != ops.world_size or not all(type(x) is bool for x in same_node):
            raise ValueError(
                f"same_node must hold one bool per rank of the group ({ops.world_size}), got {same_node!r}"
            )
        mq = MessageQueue(
            n_reader=1,
            n_local_reader=1 if same_node[ops.rank] else 0,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
        )
        handles = ops.all_gather(mq.export_handle())
        if blocking:
            mq.wait_until_ready()
        return mq, handles if ops.rank == reader else []

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
        """The handshake. The writer waits until every reader has subscribed (a reader
        subscribes when it is made), then tells them all; after it returns no message can
        be lost. A local reader waits for nothing: the writer's go-ahead is taken by its
        first receive, so no order of ``wait_until_ready`` calls across queues deadlocks
        (a worker's steps then results, a scheduler's ``Gather`` then steps). A remote
        reader waits only for its connection to the writer's port (the writer's welcome
        and go-ahead are taken by its first receive: no order deadlocks across machines
        either). A writer's ``TimeoutError`` names the queue and the ranks whose reader
        was not made yet. Once it has returned, later
        calls (on either side) return at once."""
        if self._writer is not None:
            self._writer.wait_until_ready(timeout)
        elif self._reader is not None:
            self._reader.wait_until_ready(timeout)
        else:
            raise RuntimeError("this MessageQueue has no handle: make it with MessageQueue(...) or create_from_handle")

    def _leave(self) -> None:
        """Let go of this reader's core reader (at the process's exit): dropped, it
        leaves the queue (its writer goes on without it), unless a call in progress in
        another thread still holds it."""
        if self._reader is not None:
            self._left = True
            self._reader = None

    def _reader_for(self, action: str) -> _core.Reader:
        """This queue's reader, for ``action``; a ``RuntimeError`` saying what this
        queue is when it is no reader."""
        if self._left:
            raise RuntimeError(f"cannot {action}: this reader left its queue when its process began to exit")
        if self._reader is None:
            raise RuntimeError(
                f"only readers can {action}: this MessageQueue is the writer"
                if self._writer is not None
                else "this MessageQueue has no handle: make readers with MessageQueue.create_from_handle"
            )
        return self._reader

    def _not_the_writer(self, action: str) -> RuntimeError:
        """The error for a writer's call made on a reader, or on an object with no role
        at all (made without ``__init__``: ``MessageQueue.__new__``, a subclass that
        skips it)."""
        if self._reader is not None:
            return RuntimeError(f"only the writer can {action}: this MessageQueue is a reader")
        return RuntimeError(
            f"only the writer can {action}: this MessageQueue has no handle, it is neither the "
            "writer nor a reader (make the writer with MessageQueue(...), readers with "
            "MessageQueue.create_from_handle)"
        )

    def enqueue(self, obj: Any, timeout: Optional[float] = None) -> None:
        """Send ``obj`` to every reader; blocks while the ring is full and raises
        ``TimeoutError`` after ``timeout`` seconds. ``obj`` is pickled with protocol 5:
        tensors and arrays travel as raw buffers, large ones through the tensor arena."""
        writer = self._writer
        if writer is None:
            raise self._not_the_writer("enqueue")
        obj, tensors = self._to_send(obj)
        body, buffers = _dumps(obj)
        # Always a message of parts (the pickle stream is its body): a reader tells it
        # from raw bytes (enqueue_bytes) by that, never by guessing from the bytes. With
        # no buffers, one part: sent as cheaply as raw bytes (only the chunk kind differs).
        if buffers:
            writer.enqueue_parts([body, *buffers], timeout)
        else:
            writer.enqueue_body(body, timeout)
        self._sent(tensors)

    async def enqueue_async(self, obj: Any, timeout: Optional[float] = None) -> None:
        """``await queue.enqueue_async(obj)``: ``enqueue`` without blocking the event loop
        while the ring is full. ``obj`` is pickled once; the send is tried at once (the
        common case: no wait, nothing more than ``enqueue``), and while the ring (or a
        remote reader's window) has no room the coroutine sleeps in the loop and tries
        again, from 1 ms apart up to 20 ms apart (the core has no doorbell a waiter thread
        could sleep on for the writer's room, as ``dequeue_async`` has for a reader's
        message). Each try sends the whole message or nothing (every wait of the core comes
        before anything is sent), so cancelling the task, or ``asyncio.wait_for``'s
        timeout, sends nothing and leaves the queue usable: the next ``enqueue`` sends
        the next message. Same errors as ``enqueue``: ``TimeoutError`` after ``timeout``
        seconds without room (naming the queue), ``QueueShutDownError`` after
        ``shutdown()``, ``PeerDiedError`` for a local reader that died (with
        ``on_dead_reader="raise"``). A try does not wait for another thread's call on
        this writer: it counts as no room."""
        import asyncio

        writer = self._writer
        if writer is None:
            raise self._not_the_writer("enqueue_async")
        obj, tensors = self._to_send(obj)
        body, buffers = _dumps(obj)
        parts: Optional[list[Any]] = [body, *buffers] if buffers else None
        loop = asyncio.get_running_loop()
        seconds = _core.timeout_seconds(timeout)
        deadline = None if seconds is None else loop.time() + seconds
        pause = _ROOM_RETRY_FIRST
        while True:
            try:
                # 0: a try, never a wait (nor for another thread's call on the writer).
                if parts is not None:
                    writer.enqueue_parts(parts, 0)
                else:
                    writer.enqueue_body(body, 0)
                self._sent(tensors)
                return
            except TimeoutError:
                pass
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"enqueue_async: no room in queue {self._queue_words()} within {timeout} s "
                    "(its readers have not read the oldest messages)"
                )
            await asyncio.sleep(pause if remaining is None else min(pause, remaining))
            pause = min(pause * 2, _ROOM_RETRY_MAX)

    def lost_remote_readers(self) -> Optional[list[tuple[int, Optional[str]]]]:
        """Writer side: the remote readers this writer no longer sends to, as
        ``(rank, host)``: gone (their connection closed, or nothing came from them within the
        heartbeat bound) or dropped as slow. Looks first for connections ZeroMQ closed
        since the last send, so that a writer that sends nothing for a while (waiting for
        its workers' answers) learns of a lost reader within the bound too. Never waits:
        ``None`` while another thread is in a call of this writer (that call does the
        same check). ``[]`` for a queue without remote readers."""
        writer = self._writer
        if writer is None:
            raise self._not_the_writer("lost_remote_readers")
        if not self.n_remote_reader:
            return []
        if writer.check_remote_peers() is None:
            return None
        return self._dropped_remote_readers()

    def wait_remote_taken(self, timeout: Optional[float] = None) -> None:
        """Writer side: wait until every remote reader still sent to has taken every
        message enqueued so far. Each acknowledges when it next reads from the stream, so
        a reader that acts on each message before it dequeues the next has acted on all of
        them when this returns (how a writer on one machine knows the other end holds what
        it sent: shmq's encoder-cache connector across nodes). Returns at once without
        remote readers; a remote reader whose connection goes meanwhile is dropped (as in
        ``enqueue``) and not waited for. ``TimeoutError`` naming the reader still behind
        after ``timeout`` seconds."""
        writer = self._writer
        if writer is None:
            raise self._not_the_writer("wait_remote_taken")
        writer.wait_remote_taken(timeout)

    def _dropped_remote_readers(self) -> list[tuple[int, Optional[str]]]:
        assert self._writer is not None
        return [(rank, host) for rank, host, dropped in self._writer.remote_peers if dropped]

    def enqueue_bytes(self, data: Any, timeout: Optional[float] = None) -> None:
        """Send the bytes of ``data`` (any contiguous bytes-like object) as they are, not
        pickled: a Rust reader's ``dequeue`` gets them as sent, a Python reader reads
        them with ``dequeue_bytes()`` (or ``acquire_read()``). Blocks while the ring is
        full, ``TimeoutError`` after ``timeout`` seconds."""
        writer = self._writer
        if writer is None:
            raise self._not_the_writer("enqueue_bytes")
        writer.enqueue(data if type(data) is bytes else bytes(data), timeout)

    def enqueue_array(self, array: Any, timeout: Optional[float] = None) -> None:
        """Send ``array`` (a numpy array, a torch tensor on the CPU, or a typed
        memoryview) as a typed array, the format Rust speaks too: its dtype, shape and
        bytes, not pickled. A Python reader's ``dequeue()`` returns a numpy array (and
        ``dequeue_array(kind=...)`` a torch tensor or a memoryview), a Rust reader's
        ``Reader::dequeue_array`` an ``Array`` it reads as a typed slice. Large arrays go
        through the tensor arena (readers get them with no copy; none at all for an
        array in a ``loan_array``/``loan_tensor``); a non-contiguous one is made
        contiguous first. Dtypes: bool, (u)int8-64, float16, bfloat16, float32, float64.
        Blocks while the ring is full, ``TimeoutError`` after ``timeout`` seconds."""
        writer = self._writer
        if writer is None:
            raise self._not_the_writer("enqueue_array")
        dtype, shape, data = to_wire(array)
        writer.enqueue_array(dtype, shape, data, timeout)

    def dequeue(
        self, timeout: Optional[float] = None, cancel: Any = None, indefinite: bool = False, *, device: Any = None
    ) -> Any:
        """The next object. ``TimeoutError`` after ``timeout`` seconds;
        ``RuntimeError("cancelled")`` once ``cancel`` is set or this reader's
        ``shutdown()`` is called; ``QueueShutDownError`` once the writer shut the queue
        down and every message it sent before has been received.
        ``indefinite=True`` waits without logging "still waiting" warnings. vLLM 0.33's
        signature is ``dequeue(timeout, indefinite)``: a bool in second place is taken
        as ``indefinite`` (a cancel event is never a bool).

        ``device`` (e.g. ``"cuda:0"``): the object's torch tensors come back in that
        device's memory (a typed array, as a torch tensor). Those in the tensor arena are
        copied from this reader's *shared* mapping of the arena, registered with the
        device block by block (as copies first read them), while the reader holds their lease; the
        lease is given back only once the copy's event says it ended (checked at each
        ``device=`` call, by ``release_device_copies()``, ``wait_device_copies()`` and
        ``close_device()``), never because a next message came, so the writer cannot
        reuse bytes a copy still reads. A mapping the device refuses (logged once), and
        tensors small enough to travel in the ring, take the host path: ``.to(device)``.
        Which device implementation: ``device_seam`` (docs/guide.md, "The device path")."""
        if type(cancel) is bool:
            cancel, indefinite = None, cancel
        reader = self._reader_for("dequeue")
        message = reader.dequeue(timeout, cancel, indefinite)
        # One object, its class the kind of message (see _core.Reader.dequeue).
        if type(message) is _core.PartsMessage:
            body, buffers = message.body, message.buffers
            if not buffers:  # a pickled object with no out-of-band buffers
                value = _loads(body)
                if _ipc.has_handles(value):  # sent with ipc=True: opened while unpickled, above
                    return self._copied_by_handle(value, device, value)
                return value if device is None else self._device_sources().to_device(value, (), device)
            value = _loads(body, buffers=buffers)
            if _ipc.has_handles(value):  # sent with ipc=True: opened while unpickled, above
                return self._copied_by_handle(value, device, (buffers, value))
            return value if device is None else self._device_sources().to_device(value, buffers, device)
        if type(message) is _core.ArrayMessage:
            # A typed array (enqueue_array): a numpy array (bfloat16, which numpy lacks,
            # a torch tensor; with a device, a torch tensor there).
            dtype, data = message.dtype, message.data
            kind: ArrayKind = "torch" if dtype == "bfloat16" or device is not None else "numpy"
            value = from_wire(dtype, message.shape, message.strides, data, kind)
            return value if device is None else self._device_sources().to_device(value, (data,), device)
        raise MessageKindError(_RAW_FOR_DEQUEUE)

    def _copied_by_handle(self, value: Any, device: Any, hold: Any) -> Any:
        """A message sent with ``ipc=True``: its opened tensors copied on ``device`` (or
        their own), and waited for before the message is returned. The writer keeps a
        sent tensor only for its next ``max_chunks`` messages, which a reader that goes
        on receiving while its copies are in flight could outrun: so a copy from the
        writer's memory ends inside the ``dequeue`` that received it."""
        sources = self._device_sources()
        try:
            value = _ipc.resolve(value, device, sources, hold, _to(device))
        except _ipc.CannotOpen as e:
            raise RuntimeError(f"dequeue: queue {self._queue_words()}: {e} (the message is lost here)") from None
        sources.wait_ipc()
        return value

    #: The device seam of ``dequeue(..., device=)`` (and, on the writer, of ``ipc=True``):
    #: ``"twin"``, ``"cuda"``, a ``Device``, or ``None`` for ``SHMQ_DEVICE`` (see
    #: ``shmq._device.device_for``). Set it before the first such call.
    device_seam: Union[None, str, Device] = None
    _device: Optional[DeviceSources] = None

    def _device_sources(self) -> DeviceSources:
        sources = self._device
        if sources is None:
            sources = self._device = DeviceSources(f"queue {self._queue_words()}", self.device_seam)
        return sources

    def release_device_copies(self) -> int:
        """Reader side: give back the leases whose copies to device memory ended (made by
        ``dequeue(..., device=)``); how many copies are still in flight."""
        return self._device.release_done() if self._device is not None else 0

    def wait_device_copies(self) -> None:
        """Reader side: wait until every copy to device memory (by
        ``dequeue(..., device=)``) ended, and give back the leases they held: the host's
        way to see their tensors complete (the device's own streams are already ordered
        after the copies)."""
        if self._device is not None:
            self._device.wait_all()

    def close_device(self) -> None:
        """Reader side: wait for the copies to device memory in flight, give back their
        leases and unregister the arena's mapping from the device (also done when the
        queue object is collected). A later ``dequeue(..., device=)`` registers it again."""
        sources, self._device = self._device, None
        if sources is not None:
            sources.close()

    async def dequeue_async(self, timeout: Optional[float] = None) -> Any:
        """``await queue.dequeue_async()``: the next object, as ``dequeue`` returns it,
        without blocking the event loop. A local reader waits through its loop's waiter
        thread (shared by every queue awaited in that loop: one thread sleeps on up to 127
        queues' doorbells at once, a second one on the next 127, and so on; no polling,
        no thread per queue; gone when no queue is awaited). A remote reader (and, rarely,
        a local one whose message larger than a chunk is still on its way, or one that
        another thread is using in a blocking call) waits in the loop's default executor,
        without taking the message: the loop takes it. Same errors as ``dequeue``:
        ``TimeoutError`` after ``timeout`` seconds, ``QueueShutDownError`` after the last
        message of a writer that shut down, ``PeerDiedError`` for a writer that died,
        ``RuntimeError("cancelled")`` after ``shutdown()``. Cancelling the task (or
        ``asyncio.wait_for``'s timeout) ends the wait at once and gives up its claim: no
        message is lost or taken by the abandoned wait, the next ``dequeue`` or
        ``dequeue_async`` gets it, and the executor thread is free within milliseconds
        (``asyncio.run`` returns). ``OSError`` where the kernel has no ``futex_waitv``
        (Linux before 5.16)."""
        import asyncio

        from . import _aio

        reader = self._reader_for("dequeue_async")
        loop = asyncio.get_running_loop()
        seconds = _core.timeout_seconds(timeout)
        deadline = None if seconds is None else loop.time() + seconds
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            if reader.is_local:
                try:
                    # 0: the loop never waits for another thread's call on this reader.
                    target = _core.ready_target(reader, 0)
                except TimeoutError:
                    target = None  # in use by another thread: wait in the executor below
                if target is not None and not target.ready():
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"dequeue_async: no message from the writer of queue {self._queue_words()} "
                            f"within {timeout} s"
                        )
                    if await _aio.wait_ready([target], remaining) and not target.ready():
                        target.check_writer()  # PeerDiedError for a writer proved dead
                    continue
            try:
                # A message here (and the reader free): taken without waiting.
                return self.dequeue(0)
            except TimeoutError:
                # Not here yet (remote, or an overflow mark whose message is still on the
                # queue's socket), or the reader is in another thread's call.
                pass
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"dequeue_async: no message from the writer of queue {self._queue_words()} within {timeout} s"
                )
            await _aio.wait_message(reader, remaining)

    def _queue_words(self) -> str:
        """The queue, in an error message: its name and segment."""
        segment = self.buffer.name if self.buffer is not None else "?"
        return f"{self.name!r} ({segment})" if self.name is not None else segment

    @overload
    def dequeue_array(
        self, timeout: Optional[float] = None, cancel: Any = None, *, kind: Literal["numpy"] = "numpy"
    ) -> npt.NDArray[Any]: ...
    @overload
    def dequeue_array(
        self, timeout: Optional[float] = None, cancel: Any = None, *, kind: Literal["torch"]
    ) -> torch.Tensor: ...
    @overload
    def dequeue_array(
        self, timeout: Optional[float] = None, cancel: Any = None, *, kind: Literal["memoryview"]
    ) -> memoryview: ...
    def dequeue_array(self, timeout: Optional[float] = None, cancel: Any = None, *, kind: ArrayKind = "numpy") -> Any:
        """The next message, a typed array (a Python writer's ``enqueue_array``, a Rust
        writer's ``Writer::enqueue`` of an ``ArrayRef``), as ``kind`` says: a numpy array, a
        torch tensor, or a memoryview of its format and shape (C-contiguous arrays of a dtype
        the struct module knows). No copy for a large array: it is a view of memory
        private to this process (writable; writes stay here). Waits as ``dequeue`` does
        (same errors); any other kind of message raises ``MessageKindError`` (consumed,
        the reader stays usable)."""
        if kind not in ("numpy", "torch", "memoryview"):
            raise ValueError(f"kind must be 'numpy', 'torch' or 'memoryview', got {kind!r}")
        reader = self._reader_for("dequeue_array")
        message = reader.dequeue(timeout, cancel, False)
        if type(message) is _core.ArrayMessage:
            return from_wire(message.dtype, message.shape, message.strides, message.data, kind)
        if type(message) is _core.BytesMessage:
            what, call = "raw bytes (enqueue_bytes, or a Rust writer's enqueue)", "dequeue_bytes()"
        else:
            what, call = "a pickled Python object (enqueue)", "dequeue()"
        raise MessageKindError(_NOT_AN_ARRAY.format(what=what, call=call))

    def dequeue_bytes(self, timeout: Optional[float] = None, cancel: Any = None) -> bytes:
        """The next message as raw ``bytes`` (a copy, owned): what a Rust writer's
        ``enqueue``, ``enqueue_bytes`` or ``acquire_write`` sent. Waits as ``dequeue``
        does (same errors). A pickled object (sent by ``enqueue``) raises
        ``MessageKindError`` (a ``ValueError``); the message is consumed and the reader
        stays usable. A chunk from ``acquire_write`` arrives whole (``max_chunk_bytes``)."""
        reader = self._reader_for("dequeue_bytes")
        message = reader.dequeue(timeout, cancel, False)
        if type(message) is _core.BytesMessage:
            return message.data
        if type(message) is _core.ArrayMessage:
            raise MessageKindError(_ARRAY_FOR_DEQUEUE_BYTES)
        raise MessageKindError(_PICKLED_FOR_DEQUEUE_BYTES)

    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer sends ``obj`` and returns it; a reader returns what it receives."""
        if self._writer is not None:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def arena_stats(self) -> Optional[dict[str, Any]]:
        """Writer side: the tensor arena's segment ``name``, ``capacity``, bytes
        ``reserved`` in ``/dev/shm`` so far, ``outstanding`` parts (still held by a
        reader, a message not yet read, or a live loan) and ``fallbacks``; ``None``
        without an arena."""
        writer = self._writer
        info = writer.arena_info() if writer is not None else None
        if writer is None or info is None:
            return None
        name, capacity, reserved, outstanding = info
        return {
            "name": name,
            "capacity": capacity,
            "reserved": reserved,
            "outstanding": outstanding,
            "fallbacks": writer.arena_fallbacks,
        }

    def reserve_arena(self, nbytes: int) -> int:
        """Writer side: take the first ``nbytes`` of the tensor arena in ``/dev/shm`` now
        (and map them in this process), so that the first tensors sent do not pay for it:
        the kernel zeroes new shared memory as it hands it out (measured: docs/performance.md,
        "How to read the tensor rows"), which otherwise falls on the first sends (and
        loans) that reach that far into the arena. Call it before ``wait_until_ready`` with what one or
        two rounds of the queue's large parts need (say, ``max_chunks`` of the largest
        tensor). Returns the bytes reserved in all (at most the arena's capacity);
        ``MemoryError`` if ``/dev/shm`` has no room for them (nothing is lost: parts that
        do not fit are copied through the queue). A queue without an arena returns 0."""
        writer = self._writer
        if writer is None:
            raise self._not_the_writer("reserve the tensor arena")
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        reserved = writer.reserve_arena(nbytes)
        return 0 if reserved is None else reserved

    @property
    def arena_fallbacks(self) -> int:
        """Writer side: buffers sent by copy because the tensor arena had no room."""
        return self._writer.arena_fallbacks if self._writer is not None else 0

    def loan(self, nbytes: int) -> memoryview:
        """Writer side: ``nbytes`` of writable memory in the tensor arena, to fill in place.
        A later ``enqueue`` of an object whose buffer lies in it (a tensor or array made
        from it, see ``loan_tensor``/``loan_array``) sends a reference, no copy, and seals
        the loan: from then on the writer's writes into it are its own (copy-on-write) and
        reach no reader; sending it again copies what the writer sees. A buffer smaller
        than ``shmq._core.LOAN_SEAL_MIN`` (2 MiB) is copied instead, where sealing would
        cost more than the copy; the loan then stays unsealed, the writer's to fill and
        send again. Dropped, it is given back. Without an arena, or with no room in it,
        this is ordinary memory (counted in ``loan_fallbacks``) and sending it copies."""
        writer = self._writer
        if writer is None:
            raise self._not_the_writer("loan memory")
        memory, fell_back = loan_memory(writer.loan, nbytes, self._arena_holds)
        self.loan_fallbacks += fell_back
        return memory

    loan_fallbacks = 0

    def _arena_holds(self) -> str:
        """What the tensor arena can hold, for a loan's error."""
        stats = self.arena_stats()
        if stats is None:
            return "this queue has no tensor arena (arena_bytes=0, or no local readers)"
        return f"the queue's tensor arena holds {stats['capacity']} bytes"

    def loan_tensor(self, shape: Any, dtype: Any = None) -> torch.Tensor:
        """A torch tensor of ``shape`` and ``dtype`` (default float32) in loaned memory,
        to fill in place and send without a copy (see ``loan``)."""
        return cast("torch.Tensor", loaned_tensor(self.loan, shape, dtype))

    def loan_array(self, shape: Any, dtype: Any = "float32") -> npt.NDArray[Any]:
        """A numpy array of ``shape`` and ``dtype`` in loaned memory, to fill in place and
        send without a copy (see ``loan``)."""
        return cast("npt.NDArray[Any]", loaned_array(self.loan, shape, dtype))

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
        when the block ends. The view is private to this process (writable, copy-on-write)
        and must not outlive the block: the writer's next message never shows through what
        was made of it. What still holds a buffer of it then (memoryview slices, arrays
        from ``numpy.frombuffer``) is given a private copy; what keeps only a pointer
        (a tensor from ``torch.frombuffer``, which lets the buffer go at once) reads zeros.
        Copy what you keep. As in ``dequeue``, a bool
        in second place is vLLM 0.33's ``indefinite`` (accepted; shmq's waits warn the same
        either way)."""
        if type(cancel) is bool:  # vLLM's acquire_read(timeout, indefinite)
            cancel = None
        if self._reader is None:
            raise RuntimeError("only readers can acquire_read")
        view = self._reader.acquire_read(timeout, cancel)
        buf = memoryview(view)
        try:
            yield buf
        finally:
            try:
                buf.release()
            except BufferError:
                pass  # something made from it holds it: finish_read detaches it
            self._reader.finish_read()

    def shutdown(self) -> None:
        """Safe to call from another thread. A reader: wake its calls blocked in this
        process with ``RuntimeError("cancelled")``. The writer: shut the queue down (see
        the class docs): its later calls, and those blocked now, raise
        ``QueueShutDownError``, and readers get it after the messages sent before."""
        self.shutting_down = True
        if self._name_release is not None:
            self._name_release()
        side = self._reader or self._writer
        if side is not None:
            side.shutdown()

    def __repr__(self) -> str:
        role = (
            "writer"
            if self._writer is not None
            else "local reader"
            if self._is_local_reader
            else "remote reader"
            if self._reader is not None
            else "without a handle"
        )
        named = f" {self.name!r}" if self.name is not None else ""
        return f"<MessageQueue{named} {role} {self.handle!r}>"  # repr: str(handle) holds the secret

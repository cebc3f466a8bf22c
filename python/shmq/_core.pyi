"""Type stubs for the Rust extension module ``shmq._core`` (``bindings/python/src/``).

Checked against the built module by ``python -m mypy.stubtest shmq._core`` in
``scripts/test.sh`` (allowlist: ``scripts/stubtest-allowlist``). Every class is a
pyo3 class: ``@final`` (it cannot be subclassed; stubtest then asks for no
``@disjoint_base``), and constructors are ``__new__`` (pyo3's ``#[new]``).
"""

import enum
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal, Optional, Protocol, TypedDict, TypeVar, final

from typing_extensions import Buffer

__all__ = [
    "Ring",
    "QueueOptions",
    "count",
    "Writer",
    "Reader",
    "BytesMessage",
    "PartsMessage",
    "ArrayMessage",
    "Relay",
    "BlockFifo",
    "ObjectStore",
    "ShmView",
    "EncoderCacheProducer",
    "EncoderCacheReservation",
    "EncoderCacheConsumer",
    "ENCODER_CACHE_MAX_KEY_LEN",
    "ReadyTarget",
    "WakeWord",
    "ready_target",
    "wait_any",
    "WorkerGroup",
    "worker_died_message",
    "LinkKind",
    "LINK_MAX_FRAME",
    "LINK_MAX_HELLO_FRAME",
    "LINK_HANDSHAKE_TIMEOUT",
    "LINK_MAX_HANDSHAKES",
    "Link",
    "LinkListener",
    "default_connect_ip",
    "auth_mac",
    "auth_check",
    "auth_message_mac",
    "auth_message_check",
    "secret_from_text",
    "new_secret_text",
    "handle_to_text",
    "handle_from_text",
    "remove_created",
    "new_janitor_socket",
    "has_janitor",
    "forget_inherited_janitor",
    "exit_with_process",
    "die_with_process",
    "become_subreaper",
    "kill_descendants",
    "timeout_seconds",
    "CancelFlag",
    "list_segments",
    "remove_orphans",
    "describe_segment",
    "segment_metrics",
    "NameClaim",
    "names_directory",
    "names_record_path",
    "names_claim",
    "names_lookup",
    "NAMES_DIRECTORY_ENV",
    "PeerDiedError",
    "QueueShutDownError",
    "MessageLostError",
    "segment_prefix",
    "SHM_DIR",
    "BLOCK_HEADER_BYTES",
    "ID_MAX",
    "COUNT_BYTES",
    "SECRET_BYTES",
    "LOAN_SEAL_MIN",
    "__version__",
]

__version__: str
segment_prefix: str
#: The directory of POSIX shared memory, where every segment is (``crates/os/src/segment.rs``).
SHM_DIR: str
#: The store's layout (``src/alloc.rs``, ``crates/core/src/storage/``): a block's ``[id][size]``
#: header, where ids wrap, the bytes vLLM counts for an object's reader flag in
#: ``max_object_size`` (the stored count word is 8 bytes: count and id tag), the
#: handle-signing secret.
BLOCK_HEADER_BYTES: int
ID_MAX: int
COUNT_BYTES: int
SECRET_BYTES: int
#: The smallest part of a loan that a queue sends by reference, sealing the loan
#: (``crates/core/src/arena/mod.rs``); a smaller one is copied.
LOAN_SEAL_MIN: int
#: The environment variable naming a directory for this user's names
#: (``crates/os/src/names_dir.rs``): ``SHMQ_NAMES_DIR``.
NAMES_DIRECTORY_ENV: str

_T = TypeVar("_T")

# (n_reader, max_chunk_bytes, max_chunks, name)
_RingTuple = tuple[int, int, int, str]

class _HandleFields(TypedDict):
    local_reader_ranks: list[int]
    buffer_handle: Optional[_RingTuple]
    local_subscribe_addr: Optional[str]
    remote_subscribe_addr: Optional[str]
    remote_addr_ipv6: bool
    arena_name: Optional[str]
    remote_secret: Optional[str]

class _HandleLike(Protocol):
    """What ``Reader`` reads off a handle, by attribute (``shmq.Handle``; ``arena_name``
    and ``remote_secret`` may be missing on handles pickled by older versions)."""

    @property
    def local_reader_ranks(self) -> list[int]: ...
    @property
    def buffer_handle(self) -> Optional[_RingTuple | list[Any]]: ...
    @property
    def local_subscribe_addr(self) -> Optional[str]: ...
    @property
    def remote_subscribe_addr(self) -> Optional[str]: ...
    @property
    def remote_addr_ipv6(self) -> bool: ...

class _CancelEvent(Protocol):
    """A ``threading.Event``-like object: a blocked call ends once ``is_set()``."""

    def is_set(self) -> bool: ...

# (name, size, kind, creator pid, creator state)
_SegmentReport = tuple[str, int, str, Optional[int], Literal["alive", "dead", "unknown"]]

class PeerDiedError(RuntimeError):
    """A process on the other side of a queue died."""

class QueueShutDownError(RuntimeError):
    """The queue was shut down by its writer: raised by the writer's later calls, and by
    a reader's dequeue once it has received every message sent before."""

class MessageLostError(RuntimeError):
    """A message was lost: the writer's process ended before a message sent over the
    queue's socket reached this reader. The next dequeue returns the messages after it."""

def auth_mac(secret: bytes, tag: bytes, parts: list[bytes]) -> bytes:
    """The keyed MAC (BLAKE3) of ``parts`` under ``secret`` (32 bytes) in the domain
    ``tag``: what the queue's remote stream and the worker handshake prove a secret with."""
def auth_check(secret: bytes, tag: bytes, parts: list[bytes], claimed: bytes) -> bool:
    """Whether ``claimed`` is ``auth_mac(secret, tag, parts)`` (constant-time)."""
def auth_message_mac(secret: bytes, tag: bytes, session: bytes, seq: int, body: list[bytes]) -> bytes:
    """The seal of message ``seq`` of ``session``: ``auth_mac(secret, tag, [session,
    seq as 8 little-endian bytes, *body])``, what the remote stream and the worker link
    put on every message after their handshake."""
def auth_message_check(
    secret: bytes, tag: bytes, session: bytes, seq: int, body: list[bytes], claimed: bytes
) -> bool:
    """Whether ``claimed`` is ``auth_message_mac(secret, tag, session, seq, body)``
    (constant-time)."""
def secret_from_text(text: str) -> bytes:
    """The 32 bytes of a secret in its text form (64 hexadecimal digits: a ``Handle``'s
    ``remote_secret``, a worker ticket's token); ``ValueError`` for anything else."""
def new_secret_text() -> str:
    """A new secret from the kernel, in its text form."""

# The worker link (``shmq::workers::link``), Rust's at both ends.
class LinkKind(enum.IntEnum):
    """The kinds of the worker link's frames (the core's ``link::Kind``, made from it at
    import): each one's byte."""

    CHALLENGE = 67
    HELLO = 72
    ANSWER = 65
    READY = 82
    LEAVING = 88
    STOP = 83
    SIBLING_FAILED = 70

LINK_MAX_FRAME: int
LINK_MAX_HELLO_FRAME: int
LINK_HANDSHAKE_TIMEOUT: float
LINK_MAX_HANDSHAKES: int

@final
class Link:
    """One admitted worker link, either end (its sends and receives release the GIL)."""

    @staticmethod
    def connect(ticket: str, rank: int, timeout: float) -> Link:
        """Join the parent of ``ticket`` as worker ``rank``, the whole handshake within
        ``timeout`` seconds (``TimeoutError``); ``PermissionError`` if refused or the
        parent cannot prove the token; ``ConnectionError`` for no shmq parent."""
    @property
    def rank(self) -> int: ...
    def send(self, kind: int, payload: bytes) -> None:
        """One sealed frame of ``kind`` (any byte); ``ValueError`` for one over the limit."""
    def send_ready(self, payload: bytes) -> None: ...
    def send_leaving(self, exitcode: int, stderr: list[str]) -> None: ...
    def send_stop(self, grace: float) -> None: ...
    def recv(self) -> tuple[LinkKind, Any]:
        """The peer's next message: ``(STOP, grace)``, ``(SIBLING_FAILED, notice)`` at a
        worker's end, ``(READY, payload)``, ``(LEAVING, (exitcode, lines))`` at the
        parent's; ``EOFError``/``OSError`` (lost) or ``ValueError`` (not the peer's)."""
    def shutdown(self) -> None: ...

@final
class LinkListener:
    """The parent's end alone: ``accept`` admits one worker (any rank) in the calling
    thread."""

    def __new__(cls, host: str, port: int) -> LinkListener: ...
    @property
    def ticket(self) -> str: ...
    def accept(self) -> Link: ...

def default_connect_ip() -> str:
    """The IP remote readers should connect to (``SHMQ_HOST_IP``, else the host's)."""

def handle_to_text(handle: _HandleLike) -> str:
    """The handle's one-line text form (``shmq-handle-3|...``), as Rust's ``Handle``
    prints it, secret included."""

def handle_from_text(text: str) -> _HandleFields:
    """The fields of the handle whose text form is ``text``; ``ValueError`` saying what
    is wrong when it is not one."""

@final
class NameClaim:
    """A name held by this process (``shmq::names::NameClaim``): its record is removed and
    the name let go by ``release()``, when collected, or when the process ends."""

    def release(self) -> None:
        """Remove the record (if it is still this one) and let the name go. Idempotent; a
        no-op in a forked child."""
    @property
    def is_held(self) -> bool:
        """Whether the name is still held by this process."""
    @property
    def kind(self) -> str:
        """``"queue"`` or ``"store"``."""
    @property
    def name(self) -> str:
        """The name held."""
    @property
    def path(self) -> str:
        """Where its record is."""

def names_directory(create: bool = False) -> Optional[str]:
    """This user's directory of names (made if missing and ``create``); None when there is
    none yet. ``PermissionError`` when it may be entered by others."""

def names_record_path(kind: str, name: str, create: bool = False) -> Optional[str]:
    """Where the record of the ``kind`` (``"queue"``, ``"store"``) named ``name`` is (or
    would be); None when this user has no directory of names yet and not ``create``."""

def names_claim(kind: str, name: str, details: str) -> NameClaim:
    """Hold ``name`` for this process, recording ``details`` (a JSON object's text) under
    it; ``FileExistsError`` when a live writer holds it (or one of unknown liveness)."""

def names_lookup(kind: str, name: str) -> str:
    """The record (JSON text) of the live writer of the ``kind`` named ``name``;
    ``FileNotFoundError`` when there is none, or its writer died."""

def remove_created() -> int:
    """Remove every segment and socket directory this process created that is still there
    (the exit hook); returns how many there were."""

def new_janitor_socket() -> int:
    """Make this process's janitor socket: the names of the segments it created and still
    has go to it now, later ones as they come. Returns the janitor's end (close-on-exec):
    pass it to the janitor process (``shmq._janitor``), then close it here."""

def has_janitor() -> bool:
    """Whether this process has a janitor (one inherited through ``fork`` does not count)."""

def forget_inherited_janitor() -> None:
    """Close a janitor socket inherited through ``fork``."""

def exit_with_process(pid: int) -> None:
    """Once process ``pid`` has exited, a thread of this process (no GIL needed) kills this
    process's descendants, removes what this process created and SIGKILLs it; at once if
    ``pid`` is gone already, or if it was this process's parent and stopped being it
    while the watch was set up. ``OSError`` without pidfds (Linux before 5.3)."""

def die_with_process(pid: int, signal: int) -> None:
    """Make this process get ``signal`` when process ``pid`` exits, even by SIGKILL: the
    kernel sends it when ``pid`` is this process's parent (``PR_SET_PDEATHSIG``; now, if
    the parent died already), else a thread of this process watches ``pid``'s pidfd.
    ``OSError`` where neither is available."""

def become_subreaper() -> None:
    """Adopt this process's orphaned descendants (``PR_SET_CHILD_SUBREAPER``).
    ``OSError`` where the kernel refuses."""

def kill_descendants() -> int:
    """SIGKILL every running descendant of this process; returns how many were signalled."""

def timeout_seconds(timeout: Optional[float]) -> Optional[float]:
    """``timeout`` as the core takes it: seconds, or None for no timeout (None, inf, or
    more than 10⁹ s); ``ValueError`` for a negative number or NaN."""

@final
class CancelFlag:
    """A cancel event checked without the GIL (every few milliseconds, without letting
    go of the object's lock): any blocking call's ``cancel`` takes it, as it takes a
    ``threading.Event``. ``shmq._aio`` sets it when the coroutine whose wait runs in an
    executor thread is cancelled."""

    def __new__(cls) -> CancelFlag: ...
    def set(self) -> None:
        """End the waits given this flag (within a few milliseconds), now and from now on."""
    def is_set(self) -> bool: ...

# (name, rank, pid, exitcode, stderr_tail, host, before_ready, how, stderr_captured,
# stderr_from_start): WorkerDiedError's arguments.
_Death = tuple[str, int, Optional[int], Optional[int], list[str], str, bool, Optional[str], bool, bool]

def worker_died_message(
    name: str,
    rank: int,
    pid: Optional[int],
    exitcode: Optional[int],
    stderr_tail: list[str],
    host: str,
    before_ready: bool,
    how: Optional[str],
    stderr_captured: bool,
    stderr_from_start: bool,
) -> str:
    """``WorkerDiedError``'s message (the core's wording)."""

@final
class WorkerGroup:
    """The core's supervision of a group of workers (``crates/workers/src/``): a native thread
    watches each adopted worker's pidfd, ready pipe and stderr pipe. Waits release the GIL
    and check for signals every 50 ms; they return ``("done", None)``,
    ``("failed", rank)`` or ``("timeout", None)``."""

    def __new__(
        cls,
        n_local: int,
        n_remote: int,
        name_prefix: str,
        stderr_tail_lines: int,
        forward_stderr: bool,
        new_process_group: bool,
        grace: float,
    ) -> WorkerGroup: ...
    def adopt(
        self,
        rank: int,
        pid: int,
        own_child: bool,
        ready_fd: Optional[int],
        stderr_fd: Optional[int],
        stderr_from_start: bool,
    ) -> None:
        """Watch local worker ``rank``; the fds are duplicated (the caller keeps its own)."""
    def admit_remote(self, host: str, port: int) -> str:
        """Admit the remote workers from the core's threads, listening on ``host``:``port``;
        the ticket's text."""
    def stop_remote(self, grace: float) -> None:
        """Ask every admitted remote worker to stop within ``grace`` seconds."""
    def tell_siblings(self) -> None:
        """Tell the admitted remote workers of the first failure (once)."""
    def report_exit(self, rank: int, exitcode: Optional[int], stderr_tail: list[str], how: Optional[str]) -> None: ...
    def status(self) -> list[tuple[str, int, Optional[int], str, bool, bool, Optional[int]]]:
        """(name, rank, pid, host, ready, exited, exitcode) of every worker, by rank."""
    def exit_order(self) -> list[int]: ...
    def ready_payloads(self) -> list[Optional[bytes]]: ...
    def failures(self) -> list[_Death]: ...
    def death_or_exit(self, rank: int) -> _Death: ...
    def describe(self, rank: int) -> Optional[str]: ...
    def not_ready(self, waited: float) -> tuple[str, list[str]]: ...
    @property
    def closing(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def exit_unrecorded(self) -> bool: ...
    def wait_ready(self, timeout: Optional[float] = None) -> tuple[str, Optional[int]]: ...
    def wait_any(self, timeout: Optional[float] = None) -> Optional[int]: ...
    def wait_all_exited(self, timeout: Optional[float] = None) -> tuple[str, Optional[int]]: ...
    def wait_failures(self, seen: int, timeout: Optional[float] = None) -> int: ...
    def close_begin(self) -> bool: ...
    def wait_exits(self, timeout: float) -> bool: ...
    def close_finish(self) -> None: ...

def list_segments() -> list[_SegmentReport]:
    """Every shmq segment in /dev/shm."""

def remove_orphans(dry_run: bool = False, force: bool = False) -> list[_SegmentReport]:
    """Remove (or list) the segments whose creator is proved dead (``force``: or unknown)."""

def describe_segment(name: str) -> str:
    """A human-readable description of a segment's state."""

def segment_metrics(name: str) -> dict[str, Any]:
    """The live metrics of a segment as a dict (see `shmq.metrics`): `kind` and, by kind,
    its counters; a ring's `writer` and `readers` are dicts of their own."""

@final
class ShmView:
    """A window into mapped memory; wrap it in ``memoryview``. Keeps the mapping alive."""

    def __len__(self) -> int: ...
    def shared_source(self) -> Optional[tuple[ShmView, int]]:
        """``(mapping, offset)``: this process's shared read-only mapping of the segment
        the bytes lie in (a read-only view of all of it) and where they lie in it; None
        for bytes with no such mapping."""
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

# -- broadcast queue (bindings/python/src/broadcast.rs) ---------------------------------------

@final
class Ring:
    """A broadcast ring segment (``ShmRingBuffer``)."""

    @staticmethod
    def create(n_reader: int, max_chunk_bytes: int, max_chunks: int, name: Optional[str] = None) -> Ring: ...
    @staticmethod
    def open(name: str) -> Ring: ...
    @property
    def name(self) -> str: ...
    @property
    def n_reader(self) -> int: ...
    @property
    def max_chunk_bytes(self) -> int: ...
    @property
    def max_chunks(self) -> int: ...
    @property
    def is_creator(self) -> bool: ...
    @property
    def creator_pid(self) -> int: ...
    @property
    def label(self) -> Optional[str]:
        """The queue's name its writer gave it (``MessageQueue(name=...)``), if any."""
    @property
    def overflow_count(self) -> int: ...
    def slot(self, reader: Optional[int] = None) -> tuple[Optional[int], bool, bool, int]:
        """``(pid, alive, dropped, messages)`` of the writer's slot or reader ``reader``'s."""
    def unlink(self) -> None:
        """Remove the segment's name now if this process created it."""
    @property
    def size(self) -> int:
        """The segment's bytes (``buf()``'s length)."""
    def buf(self) -> ShmView:
        """The whole segment (reserved in /dev/shm first); shmq's layout."""
    def handle(self) -> _RingTuple: ...
    def data(self, i: int) -> ShmView: ...
    def metadata(self, i: int) -> ShmView: ...
    def metadata_snapshot(self, i: int) -> bytes: ...

@final
class QueueOptions:
    """A queue's options, each checked when given; one not given (``None``) keeps the
    core's default, which the attributes show."""

    #: The options' names, in the constructor's order (one table in the binding:
    #: tests/python/test_queue_options_table.py checks this stub and ``MessageQueue``).
    OPTIONS: ClassVar[tuple[str, ...]]
    def __new__(
        cls,
        *,
        local_reader_ranks: Optional[Iterable[int]] = None,
        max_chunk_bytes: Optional[int] = None,
        max_chunks: Optional[int] = None,
        connect_ip: Optional[str] = None,
        spin_us: Optional[float] = None,
        yield_us: Optional[float] = None,
        on_dead_reader: Optional[Literal["raise", "drop"]] = None,
        arena_bytes: Optional[int] = None,
        arena_threshold: Optional[int] = None,
        remote_hwm: Optional[int] = None,
        slow_remote_reader: Optional[Literal["block", "drop"]] = None,
        remote_max_queued_bytes: Optional[int] = None,
        name: Optional[str] = None,
        on_lost_remote_reader: Optional[Literal["warn", "raise"]] = None,
    ) -> QueueOptions: ...
    @property
    def local_reader_ranks(self) -> Optional[list[int]]: ...
    @property
    def max_chunk_bytes(self) -> int: ...
    @property
    def max_chunks(self) -> int: ...
    @property
    def connect_ip(self) -> Optional[str]: ...
    @property
    def spin_us(self) -> Optional[float]: ...
    @property
    def yield_us(self) -> Optional[float]: ...
    @property
    def on_dead_reader(self) -> Literal["raise", "drop"]: ...
    @property
    def arena_bytes(self) -> int: ...
    @property
    def arena_threshold(self) -> int: ...
    @property
    def remote_hwm(self) -> int: ...
    @property
    def slow_remote_reader(self) -> Literal["block", "drop"]: ...
    @property
    def remote_max_queued_bytes(self) -> int: ...
    @property
    def name(self) -> Optional[str]: ...
    @property
    def on_lost_remote_reader(self) -> Literal["warn", "raise"]: ...

def count(value: Any, name: str, unit: str, minimum: int = 1, maximum: int = 9223372036854775807) -> int:
    """A count or size argument as an int of at least ``minimum`` and at most
    ``maximum``: ``TypeError`` for anything but an int (a bool included), ``ValueError``
    naming the argument and ``unit`` for one out of range."""

@final
class Writer:
    """The writing side of a broadcast queue."""

    def __new__(cls, n_reader: int, n_local_reader: int, options: Optional[QueueOptions] = None) -> Writer: ...
    def handle(self) -> _HandleFields:
        """The fields of the queue's ``shmq.Handle``, by name."""
    def ring(self) -> Optional[Ring]: ...
    @property
    def current_idx(self) -> int: ...
    @property
    def overflow_count(self) -> int: ...
    @property
    def arena_fallbacks(self) -> int: ...
    @property
    def dropped_readers(self) -> list[int]: ...
    @property
    def remote_dropped_count(self) -> int: ...
    @property
    def remote_peers(self) -> list[tuple[int, Optional[str], bool]]: ...
    def check_remote_peers(self) -> Optional[int]: ...
    def arena_info(self) -> Optional[tuple[str, int, int, int]]:
        """``(name, capacity, reserved, outstanding)`` of the tensor arena."""
    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Wait for every reader, then tell them the queue is ready; later calls return at once."""
    def wait_remote_taken(self, timeout: Optional[float] = None) -> None:
        """Wait until every remote reader still sent to has taken every message sent so far."""
    def enqueue(self, data: bytes, timeout: Optional[float] = None) -> None:
        """Send ``data`` as raw bytes (one frame): a reader's ``dequeue`` returns ``(data,)``."""
    def enqueue_body(self, body: bytes, timeout: Optional[float] = None) -> None:
        """Send ``body`` (a pickle stream, no out-of-band buffers) as a message of one part,
        as cheaply as ``enqueue``: a reader's ``dequeue`` returns it as ``bytes``."""
    def enqueue_parts(self, parts: list[Buffer], timeout: Optional[float] = None) -> None:
        """Send a body and its out-of-band buffers; large ones through the tensor arena.
        A reader's ``dequeue`` returns ``(body, buffers)`` (just ``body``, ``bytes``, when
        there are no buffers)."""
    def enqueue_array(
        self, dtype: str, shape: list[int], data: Buffer, timeout: Optional[float] = None
    ) -> None:
        """Send a typed array: ``dtype`` by name (``"float32"``...), its C-contiguous
        ``shape`` and its bytes (exactly as many as the shape says). A reader's
        ``dequeue`` returns ``(dtype, shape, strides, data)``."""
    def reserve_arena(self, nbytes: int) -> Optional[int]: ...
    def loan(self, nbytes: int) -> Optional[ShmView]:
        """Writable memory in the tensor arena, sent by reference (None: no room)."""
    def acquire_write(self, timeout: Optional[float] = None) -> ShmView: ...
    def commit_write(self) -> None: ...
    def shutdown(self) -> None: ...
    @property
    def shutting_down(self) -> bool: ...

@final
class BytesMessage:
    """Raw bytes (a writer's ``enqueue``, ``acquire_write``) as ``Reader.dequeue`` returns them."""

    @property
    def data(self) -> bytes: ...

@final
class PartsMessage:
    """A message of parts (a pickled object) as ``Reader.dequeue`` returns it: its body and
    the out-of-band buffers it refers to (bytearray copies of small ones, writable
    memoryviews of private memory for large ones; none for ``enqueue_body``)."""

    @property
    def body(self) -> bytes: ...
    @property
    def buffers(self) -> tuple[bytearray | memoryview, ...]: ...

@final
class ArrayMessage:
    """A typed array (``enqueue_array``) as ``Reader.dequeue`` returns it."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def data(self) -> bytearray | memoryview: ...

# A received message (Reader.dequeue): one object, its class the kind of message.
_Message = BytesMessage | PartsMessage | ArrayMessage

@final
class Reader:
    """The reading side of a broadcast queue (local through shared memory, or remote)."""

    def __new__(
        cls, handle: _HandleLike, rank: int, spin_us: Optional[float] = None, yield_us: Optional[float] = None
    ) -> Reader: ...
    @property
    def is_local(self) -> bool: ...
    @property
    def reader_index(self) -> Optional[int]: ...
    @property
    def current_idx(self) -> int: ...
    @property
    def shutting_down(self) -> bool: ...
    def ring(self) -> Optional[Ring]: ...
    def wait_until_ready(self, timeout: Optional[float] = None, cancel: Optional[_CancelEvent] = None) -> None:
        """A local reader: nothing to wait for (the writer's go-ahead is taken by the first
        receive); a remote one: its connection to the writer's port. Later calls return
        at once."""
    def dequeue(
        self, timeout: Optional[float] = None, cancel: Optional[_CancelEvent] = None, indefinite: bool = False
    ) -> _Message:
        """The next message, one object whose class is its kind: a message of parts (a
        pickled object: ``enqueue_body``, ``enqueue_parts``) a ``PartsMessage``, raw bytes
        (``enqueue``, ``acquire_write``) a ``BytesMessage``, a typed array
        (``enqueue_array``) an ``ArrayMessage``. A reader that another thread is using is
        waited for within ``timeout``."""
    def wait_message(self, timeout: Optional[float] = None, cancel: Optional[_CancelEvent] = None) -> None:
        """Wait until the next message can be taken at once (``dequeue(0)``) without taking
        it: a wait that ends early (timeout, ``cancel``, ``shutdown()``) loses nothing."""
    def acquire_read(self, timeout: Optional[float] = None, cancel: Optional[_CancelEvent] = None) -> ShmView | bytes:
        """A view of the next chunk (bytes for an overflow message); then ``finish_read``."""
    def finish_read(self) -> None: ...
    def shutdown(self) -> None: ...

# -- one wait for several readers (bindings/python/src/wait_any.rs) ---------------------------

@final
class ReadyTarget:
    """What tells whether a local reader's next call returns at once, watched without the
    reader (taken with ``ready_target(reader)`` before each wait)."""

    def ready(self) -> bool:
        """A message, the writer's shutdown, or the reader cancelled."""
    def check_writer(self) -> None:
        """Raise the reader's ``PeerDiedError`` if its writer is proved dead."""
    @property
    def queue(self) -> str: ...

@final
class WakeWord:
    """A waiter's wake word: ``wake()`` ends a ``wait_any`` given a value ``current()``
    returned before."""

    def __new__(cls) -> WakeWord: ...
    def current(self) -> int: ...
    def wake(self) -> None: ...

def ready_target(reader: Reader, timeout: Optional[float] = None) -> Optional[ReadyTarget]:
    """The target of ``reader``'s next message; ``None`` for a remote reader. A reader that
    another thread is using is waited for at most ``timeout`` seconds (``TimeoutError``;
    0: not at all)."""

def wait_any(
    targets: list[ReadyTarget], wake: WakeWord, wake_seen: int, timeout: Optional[float] = None
) -> list[int]:
    """Sleep (GIL released) until one of ``targets`` is ready or its writer is proved dead,
    ``wake`` no longer holds ``wake_seen``, or ``timeout`` seconds pass: the indices of the
    targets ready (empty: woken, or timed out). ``OSError`` without ``futex_waitv``."""

# -- object store (bindings/python/src/storage.rs) --------------------------------------------

@final
class Relay:
    """One copy of a remote stream per node (``shmq.Relay``)."""

    def __new__(
        cls, upstream: str, rank: int, n_local_reader: int, options: Optional[QueueOptions] = None
    ) -> Relay: ...
    def handle_text(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def forwarded(self) -> tuple[int, int]: ...
    @property
    def stopped(self) -> bool: ...
    def wait_until_ready(self, timeout: Optional[float] = None) -> None: ...
    def run(self) -> bool: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...

@final
class BlockFifo:
    """The object store's ring segment (``RingBuffer``); the creator is its writer."""

    @staticmethod
    def create(capacity: int, name: Optional[str] = None) -> BlockFifo: ...
    @staticmethod
    def open(name: str, capacity: Optional[int] = None) -> BlockFifo: ...
    @property
    def name(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def size(self) -> int:
        """``buf()``'s bytes: the capacity."""
    @property
    def is_writer(self) -> bool: ...
    @property
    def creator_pid(self) -> int: ...
    def state(self) -> Optional[tuple[int, int, int, int]]:
        """``(start, end, id_start, id_end)`` on the writer; None on a reader."""
    def live(self) -> dict[int, int]: ...
    def block_address(self, id: int) -> Optional[int]: ...
    def live_len(self) -> int: ...
    def allocate(self, size: int) -> tuple[int, int]: ...
    def header(self, address: int) -> tuple[int, int]: ...
    def data(self, address: int) -> ShmView: ...
    def buf(self) -> ShmView:
        """The whole ring (reserved in /dev/shm first: ``MemoryError`` without room)."""
    def free(self, is_free: Callable[[int, memoryview], object], nbytes: Optional[int] = None) -> range | list[int]: ...
    def clear(self) -> None: ...
    def secret(self) -> bytes: ...
    def unlink(self) -> None: ...

@final
class ObjectStore:
    """Key → object index over a ``BlockFifo``; payloads are serialized parts."""

    def __new__(
        cls,
        ring: BlockFifo,
        max_object_size: int,
        n_readers: int,
        count_writer_reads: bool = False,
        on_dead_reader: str = "raise",
    ) -> ObjectStore:
        """A reader takes a reader slot; ``on_dead_reader`` is the writer's policy."""
    def put(self, key: str, parts: list[Buffer], align_from: int) -> tuple[int, int]:
        """``MemoryError`` when full, ``PeerDiedError`` when a dead reader holds the room."""
    def get(
        self,
        address: int,
        id: int,
        signature: Optional[list[int]],
        key: Optional[str],
        deserialize: Callable[[Any], _T],
        split: bool,
        view_from: Optional[int] = None,
    ) -> _T:
        """``deserialize`` gets a memoryview of the object (``split``: a list, one per part;
        with ``view_from``, parts after the first are the callee's to keep: private views
        of those of ``view_from`` bytes or more, copies of the others)."""
    def loan(self, nbytes: int) -> Optional[ShmView]:
        """Writer: a block's buffer to fill in place and ``put`` without a copy."""
    def touch(self, key: object, address: int, id: int, signature: Optional[list[int]]) -> None: ...
    def verify_signature(self, key: Optional[str], address: int, id: int, signature: Optional[list[int]]) -> None: ...
    def get_signature(self, key: str) -> list[int]: ...
    def _sign(self, key: str, address: int, id: int) -> list[int]: ...
    def release_touches(self) -> None: ...
    def touched(self) -> list[int]: ...
    def reader_count(self, address: int, id: int) -> int: ...
    def is_cached(self, key: str) -> bool: ...
    def get_cached(self, key: str) -> tuple[int, int]: ...
    def free_unused(self) -> range | list[int]: ...
    def clear(self) -> None: ...
    def entry(self, key: str) -> Optional[tuple[int, int, int]]:
        """``(address, id, handouts)``."""
    def key_of(self, id: int) -> Optional[str]: ...
    def __len__(self) -> int: ...
    def increment_writer_flag(self, id: int) -> None: ...
    def is_free(self, id: int, buf: Buffer) -> bool: ...
    def entries(self) -> dict[str, tuple[int, int, int]]: ...
    @property
    def max_object_size(self) -> int: ...
    @property
    def n_readers(self) -> int: ...
    @property
    def is_writer(self) -> bool: ...
    @property
    def on_dead_reader(self) -> str: ...
    @property
    def reader_slot(self) -> Optional[int]: ...
    def dropped_readers(self) -> list[int]: ...
    def readers(self) -> list[tuple[int, Optional[int], str, int]]:
        """``(slot, pid or None, status, reads)`` of each reader slot."""
    def close(self) -> None:
        """A reader gives its slot back."""

# -- encoder-cache hand-off (bindings/python/src/encoder_cache.rs; API in shmq.encoder_cache) --

ENCODER_CACHE_MAX_KEY_LEN: int

@final
class EncoderCacheReservation:
    """Room for one entry: fill it and publish it (from any thread), or drop it."""

    @property
    def parts(self) -> list[tuple[int, int]]: ...
    def fill_and_publish(self, parts: list[Buffer]) -> bool: ...
    def abandon(self) -> None: ...

@final
class EncoderCacheProducer:
    """The producer side of an encoder cache (one segment, this process its only writer)."""

    def __new__(
        cls,
        name: Optional[str] = None,
        capacity: int = ...,
        max_entries: int = ...,
        max_consumers: int = ...,
        min_consumers: int = 0,
    ) -> EncoderCacheProducer: ...
    @property
    def name(self) -> str: ...
    @property
    def segment_name(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_entries(self) -> int: ...
    def reserve(
        self, key: str, part_lens: list[int], timeout: Optional[float] = None
    ) -> Optional[EncoderCacheReservation]: ...
    def save(self, key: str, parts: list[Buffer], timeout: Optional[float] = None) -> bool: ...
    def has(self, key: str) -> bool: ...
    def keys(self) -> list[str]: ...
    def evict(self, key: str) -> bool: ...
    def load_state(self, key: str) -> Literal["loaded", "pending", "unknown"]: ...
    def wait_loaded(self, key: str, timeout: Optional[float] = None) -> None: ...
    def wait_any_loaded(
        self, keys: list[str], timeout: Optional[float] = None
    ) -> list[tuple[str, Literal["loaded", "pending", "unknown"]]]: ...
    def sweep(self) -> None: ...
    def consumers(self) -> list[tuple[int, int, bool, int]]:
        """``(slot, pid, alive, keys loaded)`` of each consumer."""
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def unlink(self) -> None: ...

@final
class EncoderCacheConsumer:
    """A consumer of one or more producers (``index_only``: ``has`` only, joins nothing)."""

    def __new__(cls, producers: list[str], index_only: bool = False) -> EncoderCacheConsumer: ...
    def has(self, key: str) -> bool: ...
    def load(self, key: str) -> Optional[list[memoryview]]: ...
    def acknowledge(self, key: str) -> bool: ...
    def producers(self) -> list[tuple[str, bool]]: ...
    def close(self) -> None: ...

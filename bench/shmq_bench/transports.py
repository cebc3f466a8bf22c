"""Transports: the ways to move objects from one writer process to reader processes
that the benchmark compares (shmq's ``MessageQueue``, ``multiprocessing.Queue``, pyzmq
PUB/SUB, vLLM's ``MessageQueue`` with and without its tensor arena when vLLM is
importable, ``torch.multiprocessing`` queues when torch is, and iceoryx2's
publish-subscribe when it is installed)."""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

from .common import MAX_CHUNK_BYTES, MAX_CHUNKS, PROTOCOL, SYNC_TIMEOUT, torch_missing

#: What the vLLM columns need.
VLLM_HINT = (
    "needs vLLM 0.33: pip install --no-deps vllm==0.33.0 "
    "and the small packages in tests/python/vllm-requirements.txt"
)


def _nothing() -> None:
    pass


@dataclass
class Endpoint:
    """One side of a channel, as a role sees it.

    ``io`` is ``send(obj)`` on a writer and ``recv() -> obj`` on a reader; roles call it
    in their hot loop, so it is the transport's own callable where possible.
    ``ready()`` is the transport's handshake (after it, nothing sent can be lost);
    ``close()`` releases the endpoint once every process is done.
    """

    io: Callable[..., Any]
    ready: Callable[[], None] = _nothing
    close: Callable[[], None] = _nothing
    #: Writer side, transports that can lend memory: ``loan(numel, lib)`` returns a
    #: float32 array of ``lib`` ("torch" or "numpy") to fill in place and send without a
    #: copy.
    loan: Optional[Callable[[int, str], Any]] = None
    #: Writer side, with ``loan``: how many loans so far were ordinary memory (no room
    #: in the transport's memory), so that sending them copied.
    loan_fallbacks: Callable[[], int] = lambda: 0
    #: Writer side, with ``loan``: the large parts sent so far, ``(by reference, copied)``
    #: (shmq's queue counters: a loan too small to seal is copied).
    parts: Callable[[], tuple[int, int]] = lambda: (0, 0)
    #: Writer side, transports whose shared memory is taken as it is first used:
    #: ``reserve(nbytes)`` takes it ahead (outside the clock), as their users are told to.
    reserve: Callable[[int], Any] = lambda nbytes: None


class Transport(ABC):
    """A way to move pickled objects from one writer process to reader processes.

    The parent calls :meth:`make_channel`; the result is passed (pickled by ``spawn``)
    to the children, which call :meth:`open_writer` / :meth:`open_reader` on it.
    ``open_reader`` may wait until the channel's writer is open (shmq hands its handle
    over then), so a process opens its writers before its readers.
    """

    name = "?"
    #: What a reader of the table must know about this column (printed above it).
    note = ""

    def unavailable(self) -> Optional[str]:
        """Why this transport cannot run here, or ``None`` when it can."""
        return None

    @abstractmethod
    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> Any:
        """A channel for one writer and ``n_readers`` readers (made in the parent)."""

    @abstractmethod
    def open_writer(self, channel: Any) -> Endpoint:
        """The writing end of ``channel`` (in a child)."""

    @abstractmethod
    def open_reader(self, channel: Any, rank: int) -> Endpoint:
        """Reader ``rank``'s end of ``channel`` (in a child)."""


@dataclass
class _ShmqChannel:
    n_readers: int
    handles: Any  # multiprocessing.Queue: the writer puts its Handle once per reader


class ShmqTransport(Transport):
    """shmq's ``MessageQueue``; the writer passes its ``Handle`` to the readers through
    a ``multiprocessing.Queue`` made with the channel. With ``remote``, every reader is a
    remote one (the authenticated TCP stream on 127.0.0.1)."""

    name = "shmq"

    def __init__(self, remote: bool = False, n_local: Optional[int] = None):
        #: ``n_local``: that many of the readers (the first ranks) are local, the rest
        #: remote (as vLLM's executor on two nodes makes it); else all are, or none
        #: (``remote``).
        self.remote = remote
        self.n_local = n_local

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> _ShmqChannel:
        return _ShmqChannel(n_readers, ctx.Queue())

    def open_writer(self, channel: _ShmqChannel) -> Endpoint:
        from shmq import MessageQueue

        n_local = self.n_local if self.n_local is not None else 0 if self.remote else channel.n_readers
        mq = MessageQueue(
            channel.n_readers,
            n_local,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            max_chunks=MAX_CHUNKS,
            connect_ip="127.0.0.1" if n_local < channel.n_readers else None,
        )
        for _ in range(channel.n_readers):
            channel.handles.put(mq.export_handle())

        def loan(numel: int, lib: str) -> Any:
            return mq.loan_tensor((numel,)) if lib == "torch" else mq.loan_array((numel,))

        def parts() -> tuple[int, int]:
            from shmq import metrics

            if mq.buffer is None:  # remote readers only: no ring, no arena, no loans
                return 0, 0
            m = metrics.collect([mq.buffer.name])[0]
            return m["loaned_parts"], m["arena_parts"]

        return Endpoint(
            mq.enqueue,
            partial(mq.wait_until_ready, SYNC_TIMEOUT),
            loan=loan,
            loan_fallbacks=lambda: mq.loan_fallbacks,
            parts=parts,
            reserve=mq.reserve_arena,
        )

    def open_reader(self, channel: _ShmqChannel, rank: int) -> Endpoint:
        from shmq import MessageQueue

        mq = MessageQueue.create_from_handle(channel.handles.get(timeout=SYNC_TIMEOUT), rank)
        return Endpoint(mq.dequeue, partial(mq.wait_until_ready, SYNC_TIMEOUT))


def _without_torch_reductions() -> None:
    """Give this process's ``multiprocessing`` its plain pickling of tensors back.

    Importing torch registers ``torch.multiprocessing``'s reductions with
    ``ForkingPickler``, so that a ``multiprocessing.Queue`` in a process that imports
    torch moves a tensor's storage to shared memory and sends a handle: that is the
    ``torch.mp`` column. The ``mp.Queue`` column shows the queue itself (tensors
    pickled through its pipe), so its writer drops those reductions."""
    if "torch" not in sys.modules:
        return
    from multiprocessing.reduction import ForkingPickler

    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    for cls, reduce in list(reducers.items()):
        if getattr(reduce, "__module__", "").startswith("torch.multiprocessing"):
            del reducers[cls]


class MpQueueTransport(Transport):
    """``multiprocessing.Queue``: one queue per reader, the writer puts into each.
    Tensors are pickled through the queue's pipe (see ``_without_torch_reductions``)."""

    name = "mp.Queue"
    note = (
        "multiprocessing.Queue per reader, tensors pickled through its pipe (a process that imports "
        "torch would move them through torch's shared memory instead: the torch.mp column)"
    )

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> list:
        return [ctx.Queue() for _ in range(n_readers)]

    def open_writer(self, channel: list) -> Endpoint:
        _without_torch_reductions()
        return _queue_writer(channel)

    def open_reader(self, channel: list, rank: int) -> Endpoint:
        return Endpoint(channel[rank].get)


def _queue_writer(channel: list) -> Endpoint:
    """The writer of one ``multiprocessing`` queue per reader: it puts into each."""
    send: Callable[[Any], None]
    if len(channel) == 1:
        send = channel[0].put
    else:
        puts = [q.put for q in channel]

        def send(obj: Any) -> None:
            for put in puts:
                put(obj)

    def close() -> None:
        for q in channel:
            q.close()
            q.join_thread()

    return Endpoint(send, close=close)


class TorchMpTransport(Transport):
    """``torch.multiprocessing`` queues (spawn context), one per reader, the writer puts
    into each: a tensor's storage is moved to shared memory when it is first sent (a
    copy), then each reader gets a handle to it (a file descriptor) and maps it."""

    name = "torch.mp"
    note = (
        "torch.multiprocessing queue (spawn) per reader: a tensor's storage is moved to shared memory at its "
        "first send (a copy), readers map it; in the hand-over-only rows it is handed a tensor already in "
        "shared memory after the first send (no copy at all then)"
    )

    def unavailable(self) -> Optional[str]:
        return torch_missing()

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> list:
        import torch.multiprocessing as tmp

        spawn = tmp.get_context("spawn")
        return [spawn.Queue() for _ in range(n_readers)]

    def open_writer(self, channel: list) -> Endpoint:
        import torch.multiprocessing  # noqa: F401 (its reductions are what this column measures)

        return _queue_writer(channel)

    def open_reader(self, channel: list, rank: int) -> Endpoint:
        import torch.multiprocessing  # noqa: F401

        return Endpoint(channel[rank].get)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _ZmqChannel:
    n_readers: int
    pub_addr: str  # ipc:// address of the writer's PUB socket
    ready_addr: str  # ipc:// address of the writer's PULL socket (readers report in)


class ZmqTransport(Transport):
    """pyzmq PUB/SUB over ``ipc://``, objects pickled with the highest protocol, high
    water marks 0 (never drop).

    Handshake, so that nothing is lost to the slow joiner: the writer publishes
    ``hello`` until every reader has answered on a PUSH/PULL pair, then publishes
    ``start``; a reader answers its first ``hello`` and skips everything up to
    ``start``. Control messages cannot be confused with data (a pickle starts with
    ``0x80``).
    """

    name = "pyzmq"
    _HELLO = b"hello"
    _START = b"start"
    _ids = itertools.count()

    def __init__(self, tcp: bool = False):
        self.tcp = tcp

    def unavailable(self) -> Optional[str]:
        try:
            import zmq  # noqa: F401
        except ImportError:
            return "needs pyzmq: pip install pyzmq"
        return None

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> _ZmqChannel:
        i = next(self._ids)
        if self.tcp:
            pub, ready = _free_port(), _free_port()
            return _ZmqChannel(n_readers, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{ready}")
        return _ZmqChannel(n_readers, f"ipc://{workdir}/{i}.pub", f"ipc://{workdir}/{i}.ready")

    def open_writer(self, channel: _ZmqChannel) -> Endpoint:
        import zmq

        zctx = zmq.Context()
        pub = zctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(channel.pub_addr)
        pull = zctx.socket(zmq.PULL)
        pull.bind(channel.ready_addr)

        def ready() -> None:
            deadline = time.monotonic() + SYNC_TIMEOUT
            answered = 0
            while answered < channel.n_readers:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{answered} of {channel.n_readers} zmq readers answered")
                pub.send(self._HELLO)
                while answered < channel.n_readers and pull.poll(10):
                    pull.recv()
                    answered += 1
            pub.send(self._START)

        raw_send, dumps = pub.send, pickle.dumps

        def send(obj: Any) -> None:
            raw_send(dumps(obj, PROTOCOL))

        return Endpoint(send, ready, partial(zctx.destroy, linger=0))

    def open_reader(self, channel: _ZmqChannel, rank: int) -> Endpoint:
        import zmq

        zctx = zmq.Context()
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(channel.pub_addr)
        push = zctx.socket(zmq.PUSH)
        push.connect(channel.ready_addr)

        def control() -> bytes:
            if not sub.poll(int(SYNC_TIMEOUT * 1000)):
                raise TimeoutError("the zmq writer sent nothing during the handshake")
            msg = sub.recv()
            if msg not in (self._HELLO, self._START):
                raise RuntimeError(f"zmq reader got {msg[:20]!r} before the handshake ended")
            return msg

        def ready() -> None:
            if control() != self._HELLO:
                raise RuntimeError("zmq reader got 'start' before 'hello'")
            push.send(b"ready")
            while control() != self._START:
                pass

        raw_recv, loads = sub.recv, pickle.loads

        def recv() -> Any:
            return loads(raw_recv())

        return Endpoint(recv, ready, partial(zctx.destroy, linger=0))


def vllm_missing() -> Optional[str]:
    """``None`` when vLLM 0.33's queue can be imported here, else what its rows need."""
    torch_reason = torch_missing()
    if torch_reason is not None:
        return f"{torch_reason}; then vLLM 0.33 ({VLLM_HINT.removeprefix('needs vLLM 0.33: ')})"
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: F401
    except Exception as e:  # ImportError, or anything its import chain raises
        return f"{VLLM_HINT} (importing it failed here: {type(e).__name__}: {e})"
    return None


@dataclass
class _VllmChannel:
    n_readers: int
    handles: Any  # multiprocessing.Queue, as for shmq


class VllmTransport(Transport):
    """vLLM's own ``MessageQueue`` (``vllm.distributed.device_communicators.
    shm_broadcast``), as vLLM builds it, optionally with its tensor arena
    (``enable_shm_tensor_arena=True``); needs vLLM importable (``pip install --no-deps
    vllm`` and the few small packages its import needs)."""

    def __init__(self, arena: bool, n_local: Optional[int] = None):
        self.arena = arena
        #: ``n_local``: that many of the readers (the first ranks) are local, the rest
        #: remote (its plain ZeroMQ PUB socket on 127.0.0.1); else all are local.
        self.n_local = n_local
        self.name = "vLLM arena" if arena else "vLLM"

    def unavailable(self) -> Optional[str]:
        return vllm_missing()

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> _VllmChannel:
        return _VllmChannel(n_readers, ctx.Queue())

    def open_writer(self, channel: _VllmChannel) -> Endpoint:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        n_local = channel.n_readers if self.n_local is None else self.n_local
        mq = MessageQueue(
            channel.n_readers,
            n_local,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            max_chunks=MAX_CHUNKS,
            enable_shm_tensor_arena=self.arena,
            connect_ip="127.0.0.1" if n_local < channel.n_readers else None,
        )
        for _ in range(channel.n_readers):
            channel.handles.put(mq.export_handle())
        return Endpoint(mq.enqueue, mq.wait_until_ready)

    def open_reader(self, channel: _VllmChannel, rank: int) -> Endpoint:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        mq = MessageQueue.create_from_handle(channel.handles.get(timeout=SYNC_TIMEOUT), rank)
        return Endpoint(mq.dequeue, mq.wait_until_ready)


#: What the iceoryx2 column needs.
ICEORYX2_HINT = "needs iceoryx2: pip install iceoryx2 (in shmq's [bench] extra)"

#: The largest message an iceoryx2 publisher's first data segment holds (64 KiB: the
#: small object and the step); a larger one grows the segment to fit it exactly
#: (``AllocationStrategy.BestFit``), once per new size, in the warm-up messages.
ICEORYX2_INITIAL_SLICE = 64 * 1024

#: This process's iceoryx2 node while it has endpoints open: [pid, node, open
#: endpoints] (one node per process, as iceoryx2 recommends; the pid tells a forked
#: child to make its own).
_iceoryx2_node: Optional[list] = None


def _iceoryx2() -> tuple[Any, Any]:
    """The ``iceoryx2`` module and this process's node, for one more endpoint (its log
    at errors only: it says at info level that it found no config file)."""
    global _iceoryx2_node
    import iceoryx2 as iox  # type: ignore[import-untyped]

    if _iceoryx2_node is None or _iceoryx2_node[0] != os.getpid():
        iox.set_log_level_from_env_or(iox.LogLevel.Error)
        node = (
            iox.NodeBuilder.new()
            .signal_handling_mode(iox.SignalHandlingMode.Disabled)  # SIGTERM/SIGINT as without it
            .create(iox.ServiceType.Ipc)
        )
        _iceoryx2_node = [os.getpid(), node, 0]
    _iceoryx2_node[2] += 1
    return iox, _iceoryx2_node[1]


def _iceoryx2_release() -> None:
    """One endpoint fewer: after the last, let go of the node, so that it is removed
    (from /tmp/iceoryx2 and /dev/shm) once the endpoints' services are dropped too, at
    the latest when the role returns: a forked child ends in ``os._exit``, where no
    finalizer would run."""
    global _iceoryx2_node
    if _iceoryx2_node is not None and _iceoryx2_node[0] == os.getpid():
        _iceoryx2_node[2] -= 1
        if _iceoryx2_node[2] <= 0:
            _iceoryx2_node = None


def _wait_for(what: str, done: Callable[[], bool]) -> None:
    """Poll ``done()`` every millisecond until it is true (a handshake, not a hot path);
    ``TimeoutError`` after SYNC_TIMEOUT."""
    deadline = time.monotonic() + SYNC_TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"iceoryx2: no {what} after {SYNC_TIMEOUT:g} s")
        time.sleep(0.001)


@dataclass
class _Iceoryx2Channel:
    n_readers: int
    name: str  # the service name, unique per channel (its publish-subscribe and event services)


class Iceoryx2Transport(Transport):
    """iceoryx2 (Eclipse iceoryx2, PyPI ``iceoryx2``): a publish-subscribe service
    whose payload is a dynamic ``u8`` slice, objects pickled in Python as its users
    must: the writer pickles (protocol 5, in-band), loans a slice of that length from
    its data segment, copies the bytes in and sends it; a reader receives the sample
    and unpickles from the slice's ``memoryview`` (a copy out of shared memory), then
    releases it.

    No message is lost: safe overflow off and ``BackpressureStrategy.RetryUntilDelivered``
    (a writer whose reader's buffer is full retries until there is room), a subscriber
    buffer of MAX_CHUNKS samples (the depth of the shmq and vLLM rings), no history.
    A reader that finds nothing blocks: an event service of the same name, whose
    ``Notifier`` the writer notifies after each send and whose ``Listener`` the reader
    waits on (``blocking_wait``, which lets go of the GIL). Handshake: the writer waits
    until all its subscribers are there, a reader until the publisher is, and then
    connects its end of the publisher's connection (``has_samples``): a publisher
    whose subscriber's buffer is full and whose connection that subscriber has not yet
    opened drops the sample for it rather than wait, so the first messages could be
    lost to a reader that is slow to start.
    """

    name = "iceoryx2"
    note = (
        "iceoryx2 publish-subscribe, dynamic u8 slice: the writer pickles, loans a slice and copies the pickle in; "
        "readers unpickle from the sample's memoryview (a copy); the writer notifies an event service after "
        "each send and a reader with nothing to read blocks on its listener; no loss (no safe overflow, "
        f"retry until delivered), subscriber buffers of {MAX_CHUNKS} samples"
    )

    def unavailable(self) -> Optional[str]:
        try:
            import iceoryx2  # type: ignore[import-untyped]  # noqa: F401
        except ImportError:
            return ICEORYX2_HINT
        except Exception as e:  # noqa: BLE001 - a broken install says why
            return f"{ICEORYX2_HINT} (importing it failed here: {type(e).__name__}: {e})"
        return None

    def make_channel(self, ctx: Any, n_readers: int, workdir: str) -> _Iceoryx2Channel:
        return _Iceoryx2Channel(n_readers, f"shmq-bench/{os.getpid()}/{uuid.uuid4().hex}")

    @staticmethod
    def _services(channel: _Iceoryx2Channel) -> tuple[Any, Any, Any]:
        """The module, and the channel's publish-subscribe and event services (opened,
        or created by whichever end comes first, with the same settings)."""
        import ctypes

        iox, node = _iceoryx2()
        n = channel.n_readers
        name = iox.ServiceName.new(channel.name)
        pubsub = (
            node.service_builder(name)
            .publish_subscribe(iox.Slice[ctypes.c_uint8])
            .max_publishers(1)
            .max_subscribers(n)
            .max_nodes(n + 1)
            .history_size(0)
            .subscriber_max_buffer_size(MAX_CHUNKS)
            .subscriber_max_borrowed_samples(1)
            .enable_safe_overflow(False)
            .open_or_create()
        )
        event = node.service_builder(name).event().max_notifiers(1).max_listeners(n).max_nodes(n + 1).open_or_create()
        return iox, pubsub, event

    def open_writer(self, channel: _Iceoryx2Channel) -> Endpoint:
        import ctypes

        iox, pubsub, event = self._services(channel)
        publisher = (
            pubsub.publisher_builder()
            .initial_max_slice_len(ICEORYX2_INITIAL_SLICE)
            .allocation_strategy(iox.AllocationStrategy.BestFit)
            .backpressure_strategy(iox.BackpressureStrategy.RetryUntilDelivered)
            .create()
        )
        notifier = event.notifier_builder().create()
        n_readers = channel.n_readers

        def ready() -> None:
            _wait_for(f"{n_readers} subscribers", lambda: pubsub.dynamic_config.number_of_subscribers >= n_readers)
            publisher.update_connections()

        dumps, loan, memmove, notify = pickle.dumps, publisher.loan_slice_uninit, ctypes.memmove, notifier.notify

        def send(obj: Any) -> None:
            data = dumps(obj, PROTOCOL)
            sample = loan(len(data))
            memmove(sample.payload_ptr, data, len(data))
            if sample.assume_init().send() != n_readers:  # how many subscribers it reached
                raise RuntimeError(f"iceoryx2 delivered a message to fewer than {n_readers} readers")
            notify()

        def close() -> None:
            publisher.delete()
            notifier.delete()
            _iceoryx2_release()

        return Endpoint(send, ready, close)

    def open_reader(self, channel: _Iceoryx2Channel, rank: int) -> Endpoint:
        _, pubsub, event = self._services(channel)
        # The listener first: once the writer sees this subscriber, its notifications reach us.
        listener = event.listener_builder().create()
        subscriber = pubsub.subscriber_builder().buffer_size(MAX_CHUNKS).create()

        def ready() -> None:
            _wait_for("publisher", lambda: pubsub.dynamic_config.number_of_publishers >= 1)
            # Connect our end of the publisher's connection now (a subscriber does so
            # only when it looks for samples): until it is connected, a publisher whose
            # buffer to us is full drops the sample for us instead of retrying.
            subscriber.has_samples()

        receive, wait, loads = subscriber.receive, listener.blocking_wait, pickle.loads

        def recv() -> Any:
            sample = receive()
            while sample is None:
                # Sent after our receive found nothing: its notification wakes us (the
                # listener keeps it until we wait); one from a message already read
                # wakes us once for nothing.
                wait()
                sample = receive()
            obj = loads(sample.payload().as_memory_view())
            sample.delete()
            return obj

        def close() -> None:
            subscriber.delete()
            listener.delete()
            _iceoryx2_release()

        return Endpoint(recv, ready, close)


#: The transports, in table column order (vLLM's are shown only where it is importable).
TRANSPORTS: list[Transport] = [
    ShmqTransport(),
    MpQueueTransport(),
    ZmqTransport(),
    VllmTransport(arena=False),
    VllmTransport(arena=True),
    TorchMpTransport(),
    Iceoryx2Transport(),
]

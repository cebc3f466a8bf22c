"""The public API of ``shmq`` as a type checker sees it (after pydantic-core's
``tests/test_typing.py``).

``scripts/test.sh`` checks this file with ``mypy --strict``: every call below must
type-check against the annotations of ``shmq`` (and ``shmq/_core.pyi``) with the types
written on the left, so a signature that changes or loses its annotations fails the
check. pytest also runs it, and the ``isinstance`` checks hold the annotations to what
the code really returns. Everything runs in this process (one spawned worker aside),
with small segments, and is closed at the end.
"""

from __future__ import annotations

import pickle
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Optional, assert_type

import numpy as np
import numpy.typing as npt
import pytest
import torch

import shmq
from shmq import (
    EncoderCacheConnector,
    EncoderCacheConsumer,
    EncoderCacheIndex,
    EncoderCacheMetadata,
    EncoderCacheProducer,
    Handle,
    MessageQueue,
    MsgpackSerde,
    ObjectSerde,
    ObjectStorage,
    ObjectStorageHandle,
    PeerDiedError,
    PickleSerde,
    RingBuffer,
    ShmObjectStorageHandle,
    ShmRingBuffer,
    SingleWriterShmObjectStorage,
    SingleWriterShmRingBuffer,
    StatelessProcessGroup,
    WorkerDiedError,
    WorkerProcesses,
    WorkersNotReadyError,
    report_ready,
    sched_yield,
)
from shmq import admin


def test_the_engines_names_are_the_same_classes() -> None:
    storage_class: type[ObjectStorage] = SingleWriterShmObjectStorage
    handle_class: type[ObjectStorageHandle] = ShmObjectStorageHandle
    ring_class: type[RingBuffer] = SingleWriterShmRingBuffer
    assert (storage_class, handle_class, ring_class) == (ObjectStorage, ObjectStorageHandle, RingBuffer)
    version: str = shmq.__version__
    names: list[str] = shmq.__all__
    assert version and "MessageQueue" in names
    died: type[RuntimeError] = PeerDiedError
    not_ready: type[TimeoutError] = WorkersNotReadyError
    worker_died: type[RuntimeError] = WorkerDiedError
    assert issubclass(died, RuntimeError) and issubclass(not_ready, TimeoutError) and issubclass(worker_died, Exception)
    sched_yield()


def test_message_queue_writer_reader_and_loans() -> None:
    writer: MessageQueue = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4, arena_bytes=1 << 22)
    handle: Handle = writer.export_handle()
    ranks: list[int] = handle.local_reader_ranks
    buffer_handle: Optional[tuple[int, int, int, str]] = handle.buffer_handle
    assert ranks == [0] and buffer_handle is not None
    copied: Handle = pickle.loads(pickle.dumps(handle))
    handle_text: str = str(handle)
    parsed: Handle = Handle.from_str(handle_text)
    assert parsed == handle
    reader: MessageQueue = MessageQueue.create_from_handle(copied, 0)

    def ready() -> None:
        reader.wait_until_ready(timeout=30)

    t = threading.Thread(target=ready)
    t.start()
    writer.wait_until_ready(timeout=30)
    t.join()

    writer.enqueue({"step": 1}, timeout=10)
    got: Any = reader.dequeue(timeout=10)
    assert got == {"step": 1}
    sent: Any = writer.broadcast_object([1, 2])
    received: Any = reader.broadcast_object()
    assert sent == received == [1, 2]

    loan: memoryview = writer.loan(64)
    loan[:3] = b"abc"
    # Loans are typed (not Any): assert_type fails the check if they lose their types.
    array = writer.loan_array((4,), "int32")
    assert_type(array, npt.NDArray[Any])
    tensor = writer.loan_tensor((2, 3), torch.int64)
    assert_type(tensor, torch.Tensor)
    assert isinstance(array, np.ndarray) and isinstance(tensor, torch.Tensor)
    assert tensor.shape == (2, 3) and tensor.dtype == torch.int64
    del tensor
    array[:] = 7
    writer.enqueue((bytes(loan[:3]), array), timeout=10)
    text, numbers = reader.dequeue(timeout=10)
    assert text == b"abc" and list(numbers) == [7, 7, 7, 7]
    # Typed arrays: the kind chosen gives the type.
    writer.enqueue_array(np.arange(3, dtype=np.int64), timeout=10)
    writer.enqueue_array(torch.ones(2), timeout=10)
    writer.enqueue_array(np.zeros(2, dtype=np.uint8), timeout=10)
    as_numpy = reader.dequeue_array(timeout=10)
    assert_type(as_numpy, npt.NDArray[Any])
    as_torch = reader.dequeue_array(timeout=10, kind="torch")
    assert_type(as_torch, torch.Tensor)
    as_view = reader.dequeue_array(timeout=10, kind="memoryview")
    assert_type(as_view, memoryview)
    assert list(as_numpy) == [0, 1, 2] and as_torch.tolist() == [1.0, 1.0] and as_view.tolist() == [0, 0]
    writer.enqueue_bytes(b"raw", timeout=10)
    raw: bytes = reader.dequeue_bytes(timeout=10)
    assert raw == b"raw"
    name: Optional[str] = writer.name
    assert name is None
    stats: Optional[dict[str, Any]] = writer.arena_stats()
    fallbacks: int = writer.arena_fallbacks
    assert stats is not None and fallbacks == 0

    with writer.acquire_write(timeout=10) as chunk:
        written: memoryview = chunk
        written[:2] = b"hi"
    with reader.acquire_read(timeout=10) as view:
        read: memoryview = view
        assert bytes(read[:2]) == b"hi"

    index: int = writer.current_idx
    dropped: list[int] = writer.dropped_readers
    assert index >= 0 and dropped == []
    ring: Optional[ShmRingBuffer] = reader.buffer
    assert ring is not None
    ring_handle: tuple[int, int, int, str] = ring.handle()
    with ring.get_metadata(0) as flags:
        flag_view: memoryview = flags
        assert len(flag_view) == ring.n_reader + 1
    assert ring_handle[3] == ring.name

    reader.shutdown()
    with pytest.raises(RuntimeError, match="cancelled"):
        reader.dequeue(timeout=10)
    down: bool = reader.shutting_down
    assert down


def test_object_storage_with_signed_handles() -> None:
    ring: RingBuffer = RingBuffer(1 << 20, create=True)
    writer: ObjectStorage = ObjectStorage(1 << 16, 1, ring)
    address, monotonic_id = writer.put("key", {"tokens": [1, 2, 3]})
    handle_pair: tuple[int, int] = (address, monotonic_id)
    signature: list[int] = writer.get_signature("key")
    writer.verify_signature("key", address, monotonic_id, signature)
    cached: bool = writer.is_cached("key")
    again: tuple[int, int] = writer.get_cached("key")
    assert cached and again == handle_pair and len(signature) == 32
    key_index: Optional[Mapping[str, tuple[int, int]]] = writer.key_index
    assert key_index is not None and key_index["key"] == handle_pair

    store_handle: ObjectStorageHandle = writer.handle()
    serde_class: type[ObjectSerde] = store_handle.serde_class
    assert serde_class is MsgpackSerde
    reader: ObjectStorage = ObjectStorage.create_from_handle(pickle.loads(pickle.dumps(store_handle)))
    value: Any = reader.get(address, monotonic_id, signature=signature, key="key")
    assert value == {"tokens": [1, 2, 3]}
    reader.touch("key", address, monotonic_id, signature)
    count: int = reader.reader_count(address, monotonic_id)
    assert count == 1

    freed: Sequence[int] = writer.free_unused()
    assert list(freed) == []
    writer.clear()
    reader.close()
    writer.close()


def test_ring_buffer_allocator() -> None:
    ring: RingBuffer = RingBuffer(4096, create=True)
    address, monotonic_id = ring.allocate_buf(100)
    with ring.access_buf(address) as (data, header):
        view: memoryview = data
        chunk_id: int = header[0]
        chunk_size: int = header[1]
        assert len(view) == 100 and chunk_id == monotonic_id and chunk_size == 108

    def is_free(chunk: int, buf: memoryview) -> bool:
        return True

    freed: Sequence[int] = ring.free_buf(is_free)
    assert list(freed) == [monotonic_id]
    handle: tuple[int, str] = ring.handle()
    live: Mapping[int, int] = ring.metadata
    start: int = ring.data_buffer_start
    secret: bytes = ring.get_auth_secret()
    assert handle[0] == 4096 and len(live) == 0 and start >= 0 and len(secret) == 32
    memory_buf: Optional[memoryview] = ring.shared_memory.buf
    assert memory_buf is not None and len(memory_buf) == 4096
    memory_buf.release()
    ring.close()


def _round_trip(serde: ObjectSerde, value: Any) -> Any:
    """``value`` through ``serialize`` and ``deserialize``, laid out as the store does."""
    data, nbytes, metadata, metadata_nbytes = serde.serialize(value)
    parts: list[bytes | bytearray | memoryview] = data if isinstance(data, list) else [data]
    stored = bytes(metadata) + b"".join(bytes(p) for p in parts)
    assert len(stored) == nbytes + metadata_nbytes
    return serde.deserialize(memoryview(stored))


def test_serdes() -> None:
    serdes: list[ObjectSerde] = [MsgpackSerde(), PickleSerde()]
    for serde in serdes:
        value: Any = _round_trip(serde, {"a": np.arange(3)})
        assert list(value["a"]) == [0, 1, 2]

    def encode(t: _Celsius) -> bytes:
        return str(t.degrees).encode()

    def decode(b: bytes) -> _Celsius:
        return _Celsius(float(b))

    MsgpackSerde.register(_Celsius, 41, encode, decode)  # a code no other test uses
    assert _round_trip(MsgpackSerde(), {"t": _Celsius(21.5)})["t"].degrees == 21.5


class _Celsius:
    def __init__(self, degrees: float):
        self.degrees = degrees


def test_stateless_process_group_of_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    pg: StatelessProcessGroup = StatelessProcessGroup.create("127.0.0.1", port, 0, 1, store_timeout=30)
    rank: int = pg.rank
    world_size: int = pg.world_size
    everyone: list[Any] = pg.all_gather_obj("hello")
    same: Any = pg.broadcast_obj({"x": 1}, src=0)
    assert (rank, world_size, everyone, same) == (0, 1, ["hello"], {"x": 1})
    pg.barrier(timeout=30)
    pg.expire_data()
    queue: MessageQueue = MessageQueue.create_from_process_group(pg, 1 << 12, 2)
    assert queue.export_handle().local_reader_ranks == []


def _worker(rank: int, tag: str) -> None:
    report_ready(f"{tag}{rank}")


def test_worker_processes() -> None:
    with WorkerProcesses(_worker, 1, args=("worker-",), grace=5) as workers:
        infos: list[Any] = workers.wait_until_ready(timeout=60)
        codes: dict[str, Optional[int]] = workers.join(timeout=60)
        names: list[str] = workers.names
        failures: list[WorkerDiedError] = workers.failures
    closed: bool = workers.closed
    assert infos == ["worker-0"] and codes == {"Worker_0": 0} and names == ["Worker_0"]
    assert failures == [] and closed


def test_encoder_cache() -> None:
    with EncoderCacheProducer(capacity=1 << 20, max_entries=16) as producer:
        name: str = producer.name
        with EncoderCacheConsumer(name) as consumer:
            saved: bool = producer.save("image-1", {"embedding": np.ones(4, dtype=np.float32)})
            producer.flush(timeout=30)
            into: dict[str, Any] = {}
            missing: list[str] = consumer.load(["image-1", "image-2"], into)
            held: bool = consumer.has("image-1")
            assert saved and held and missing == ["image-2"] and list(into["image-1"]["embedding"]) == [1.0] * 4
            producer.wait_loaded("image-1", timeout=30)
            loaded: bool = producer.is_loaded("image-1")
            keys: list[str] = producer.keys()
            stats: dict[str, int] = producer.stats()
            assert loaded and keys == ["image-1"] and stats["entries"] == 1
        index: EncoderCacheIndex = EncoderCacheIndex(name)
        not_there: list[str] = index.missing(["image-1", "image-3"])
        assert not_there == ["image-3"]
        index.close()
        with pytest.warns(DeprecationWarning):  # ShmqECConnector is the one
            scheduler: EncoderCacheConnector = EncoderCacheConnector("scheduler", producers=name)
        cached: bool = scheduler.has_cache_item("image-1")
        meta: EncoderCacheMetadata = scheduler.build_connector_meta()
        assert cached and meta.mm_hashes == []
        scheduler.shutdown()


def test_admin() -> None:
    ring: RingBuffer = RingBuffer(4096, create=True)
    segments: list[admin.SegmentInfo] = admin.list_segments()
    mine: list[admin.SegmentInfo] = [s for s in segments if s.name == ring.shared_memory.name]
    assert len(mine) == 1
    state: str = mine[0].creator_state
    alive: bool = mine[0].creator_alive
    assert state == "alive" and alive
    description: str = admin.inspect(ring.shared_memory.name)
    would_remove: list[admin.SegmentInfo] = admin.cleanup(dry_run=True)
    assert description and ring.shared_memory.name not in [s.name for s in would_remove]
    ring.close()

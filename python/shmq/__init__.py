"""shmq: shared-memory IPC for model-serving engines, with a Rust core.

- A broadcast queue (one writer, many readers; remote readers over ZeroMQ) with the API
  of the engines' ``MessageQueue``.
- A single-writer object store (FIFO allocator over shared memory) with the API of the
  engines' ``SingleWriterShmObjectStorage``.
- Worker processes around them (``WorkerProcesses``, ``report_ready``): start, ready
  handshake with a deadline, supervision, shutdown of whole process trees.
- ``Gather``: many writers to one reader (workers' results back to a scheduler), one
  wait for all their queues; ``await queue.dequeue_async()`` for asyncio.
- The encoder-cache hand-off: tensors by key from an encoder process to every worker,
  as zero-copy views, with ``has(key)`` from any process (``shmq.encoder_cache``).

The engines' names are kept as aliases, so shmq replaces them without code changes.
"""

from ._core import __version__
from .encoder_cache import (
    EncoderCacheConnector,  # deprecated, with EncoderCacheMetadata: shmq.vllm_ec_connector.ShmqECConnector
    EncoderCacheConsumer,
    EncoderCacheIndex,
    EncoderCacheMetadata,
    EncoderCacheProducer,
)
from .gather import Gather
from .group import StatelessProcessGroup
from .message_queue import (
    Handle,
    MessageKindError,
    MessageLostError,
    MessageQueue,
    PeerDiedError,
    QueueShutDownError,
    ShmRingBuffer,
    sched_yield,
)
from .object_storage import (
    ObjectRef,
    ObjectStorage,
    ObjectStorageHandle,
    ReaderSlotInfo,
    RingBuffer,
    StoreReaderDiedError,
)
from .relay import Relay
from .serde import MsgpackSerde, ObjectSerde, PickleSerde
from .workers import WorkerDiedError, WorkerProcesses, WorkersNotReadyError, report_ready

# The engines' names.
SingleWriterShmObjectStorage = ObjectStorage
ShmObjectStorageHandle = ObjectStorageHandle
SingleWriterShmRingBuffer = RingBuffer

__all__ = [
    "EncoderCacheConnector",
    "EncoderCacheConsumer",
    "EncoderCacheIndex",
    "EncoderCacheMetadata",
    "EncoderCacheProducer",
    "Gather",
    "Handle",
    "MessageKindError",
    "MessageLostError",
    "MessageQueue",
    "MsgpackSerde",
    "ObjectRef",
    "ObjectSerde",
    "ObjectStorage",
    "ObjectStorageHandle",
    "PeerDiedError",
    "QueueShutDownError",
    "ReaderSlotInfo",
    "Relay",
    "PickleSerde",
    "RingBuffer",
    "ShmObjectStorageHandle",
    "ShmRingBuffer",
    "SingleWriterShmObjectStorage",
    "SingleWriterShmRingBuffer",
    "StatelessProcessGroup",
    "StoreReaderDiedError",
    "WorkerDiedError",
    "WorkerProcesses",
    "WorkersNotReadyError",
    "__version__",
    "report_ready",
    "sched_yield",
]

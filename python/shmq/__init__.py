"""shmq: shared-memory IPC for model-serving engines, with a Rust core.

A broadcast queue (one writer, many readers; remote readers over ZeroMQ) with the API
of the engines' ``MessageQueue``, so it replaces them without code changes.
"""

from ._core import __version__
from .message_queue import Handle, MessageQueue, ShmRingBuffer, sched_yield

__all__ = [
    "Handle",
    "MessageQueue",
    "ShmRingBuffer",
    "__version__",
    "sched_yield",
]

"""``shared_memory``: a segment's memory shaped like Python's
``multiprocessing.shared_memory.SharedMemory``, for vLLM's ``ShmRingBuffer`` and
``SingleWriterShmRingBuffer`` attributes of that name.

One class for both: the core object that maps the segment (``_core.Ring``,
``_core.BlockFifo``) says what ``buf`` covers (its ``buf()``, ``size`` bytes), and
removes the name (``unlink()``). There is no resource tracker: the core cleans up.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class SegmentMemory:
    """``name``, ``size``, ``buf``, ``close()`` and ``unlink()`` of the segment the core
    object that ``core()`` returns maps (``core`` may raise, e.g. ``FileNotFoundError``
    for a ring that is not on this machine: then so do ``size``, ``buf`` and
    ``unlink()``)."""

    def __init__(self, name: str, core: Callable[[], Any], size: Optional[int] = None):
        self.name = name
        self._core: Optional[Callable[[], Any]] = core
        self._size = size

    @property
    def size(self) -> int:
        """The bytes ``buf`` has (still known after ``close()`` once read)."""
        if self._size is None:
            if self._core is None:
                raise ValueError("the shared memory has been closed")
            self._size = int(self._core().size)
        return self._size

    @property
    def buf(self) -> Optional[memoryview]:
        """A zero-copy view of the memory; ``None`` once closed. Views made before
        ``close()`` keep the mapping alive. The first one in a process reserves the
        whole segment in ``/dev/shm`` (``MemoryError`` when there is no room)."""
        if self._core is None:
            return None
        return memoryview(self._core().buf())

    def close(self) -> None:
        """Drop this object's hold on the mapping (views made before keep it alive)."""
        self._core = None

    def unlink(self) -> None:
        """Remove the segment's name now if this process created it."""
        if self._core is not None:
            self._core().unlink()

    def __repr__(self) -> str:
        size = "" if self._size is None else f", size={self._size}"
        return f"SharedMemory(name={self.name!r}{size})"

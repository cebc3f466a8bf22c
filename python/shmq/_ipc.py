"""Device tensors by IPC handle (issue 55): what the encoder cache, the queue and the store
send in place of a device tensor when asked to (``ipc=True``), and how a receiver opens
it.

- The sender replaces each device tensor of a value (a CUDA tensor; with the CPU twin of
  the device seam, every tensor) by a ``ByHandle``: the seam's name, the handle of the
  tensor's allocation (``Device.export_ipc``) and, optionally, a host copy. The sender
  keeps the tensors (``exported``) for as long as its protocol says a receiver may still
  open or copy from them (below).
- A receiver opens the handle while it unpickles the value (so within the hold its
  protocol gives a read: the store's pin, the cache's entry pin, the queue's read of the
  message), through one cache per process of opened allocations (``MAX_OPEN_HANDLES``,
  least recently used closed first). A handle that cannot be opened is logged once per
  process and left unopened: ``resolve`` then gives the host copy, or ``CannotOpen``.
- ``resolve`` turns the opened tensors into copies on the device the caller asked for
  (or the opened tensor's own), each holding what the caller passes until it ended
  (``DeviceSources.copy_device``): never the opened tensor itself, the sender's memory.
- The sender's memory is kept by the sender's protocol (the encoder cache: until the
  entry is evicted and unheld; the queue: its last ``max_chunks + 1`` messages; the store:
  while the object is in it), never by torch's IPC reference counts: torch counts one
  release per export, and a handle sent to several receivers is released by each. So
  on CUDA the sender's block may stay in torch's "limbo" after the sender dropped it
  (a leak of device memory per sent tensor with several receivers) until a GPU run
  settles it (issue 55; ``scripts/gpu_check.sh`` checks ``memory_allocated``).
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional

from ._device import device_for

log = logging.getLogger("shmq.device")

#: Allocations a process keeps open (one per allocation), least recently used closed first.
MAX_OPEN_HANDLES = 64


class CannotOpen(ValueError):
    """An IPC handle that cannot be opened here, in a value without a host copy of it (what
    the store's `get` raises; the queue raises `RuntimeError`, the encoder cache misses)."""


class ByHandle:
    """A device tensor by IPC handle: the seam that exported it, the handle, and a host
    copy (a tensor) or None. Unpickled, it opens the handle (``opened``)."""

    __slots__ = ("seam", "handle", "host", "tensor")

    def __init__(self, seam: str, handle: Any, host: Any, tensor: Any = None):
        self.seam, self.handle, self.host, self.tensor = seam, handle, host, tensor

    def __reduce__(self) -> Any:
        return (opened, (self.seam, self.handle, self.host))


def publish(value: Any, seam_choice: Any, host_copy: bool, exported: list[Any]) -> Any:
    """``value`` with each device tensor replaced by a ``ByHandle`` (CUDA tensors with the
    CUDA seam; every tensor with the twin's); the tensors go into ``exported``."""
    import torch

    seam = device_for(seam_choice)

    def by_handle(t: Any) -> Any:
        if seam.name == "cuda" and not t.is_cuda:
            return t
        t = t.detach().contiguous()
        handle = seam.export_ipc(t)
        exported.append(t)
        return ByHandle(seam.name, handle, t.cpu() if host_copy else None)

    return _map_tensors(value, torch.Tensor, by_handle)


class _Opened:
    """This process's opened allocations, and whether it logged a refusal."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tensors: OrderedDict[Any, tuple[Any, Any]] = OrderedDict()  # key -> (seam, tensor)
        self.refused: Optional[str] = None

    def open(self, seam_name: str, handle: Any) -> Any:
        seam = device_for(seam_name)
        try:
            key: Any = (seam_name, pickle.dumps(handle))
        except Exception:
            key = (seam_name, id(handle))
        with self.lock:
            found = self.tensors.get(key)
            if found is not None:
                self.tensors.move_to_end(key)
                return found[1]
        tensor = seam.open_ipc(handle)
        with self.lock:
            self.tensors[key] = (seam, tensor)
            while len(self.tensors) > MAX_OPEN_HANDLES:
                _, (old_seam, old) = self.tensors.popitem(last=False)
                old_seam.close_ipc(old)
        return tensor


_opened = _Opened()


#: Whether this process has unpickled a ``ByHandle``: until it has, ``has_handles`` (on
#: every receive of the queue, the store and the encoder cache) answers without a walk.
_seen = False


def opened(seam: str, handle: Any, host: Any) -> ByHandle:
    """A ``ByHandle`` unpickled: its handle opened (through this process's cache), or,
    where it cannot be opened, left unopened (logged once per process)."""
    global _seen
    _seen = True
    try:
        return ByHandle(seam, handle, host, _opened.open(seam, handle))
    except Exception as e:
        if _opened.refused is None:
            _opened.refused = str(e)
            log.warning(
                "shmq: cannot open a sender's IPC handle (%s); the values' host copies are read where they have "
                "one, and values without one are missing here",
                e,
            )
        return ByHandle(seam, handle, host)


def open_handles() -> int:
    """Allocations open in this process now (at most ``MAX_OPEN_HANDLES``)."""
    return len(_opened.tensors)


def has_handles(value: Any) -> bool:
    """Whether ``value`` holds a ``ByHandle`` (in its dicts, lists and tuples); at once
    False in a process that never received one."""
    return _seen and _holds_handles(value)


def _holds_handles(value: Any) -> bool:
    if isinstance(value, ByHandle):
        return True
    if type(value) is dict:
        return any(_holds_handles(v) for v in value.values())
    if type(value) in (list, tuple):
        return any(_holds_handles(v) for v in value)
    return False


def _map_tensors(value: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn(x)`` for each ``kind`` in its dicts, lists and tuples. Not a
    closure that calls itself: that cycle would keep what ``fn`` holds (exported tensors,
    views, pins) until the garbage collector ran."""
    if isinstance(value, kind):
        return fn(value)
    if type(value) is dict:
        return {k: _map_tensors(v, kind, fn) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_map_tensors(v, kind, fn) for v in value)
    return value


def resolve(value: Any, device: Any, sources: Any, hold: Any, host_to_device: Callable[[Any], Any]) -> Any:
    """``value`` with each ``ByHandle`` replaced by a copy of the opened tensor on
    ``device`` (without one, on the opened tensor's own device), ``hold`` kept until the
    copy ended (``sources.copy_device``): never the opened tensor itself, the sender's
    memory, which it reuses once its protocol lets it. An unopened one by its host copy
    (``host_to_device(host)`` with a device); ``CannotOpen`` for an unopened one without
    a host copy."""

    def one(ref: ByHandle) -> Any:
        if ref.tensor is None:
            if ref.host is None:
                raise CannotOpen(f"an IPC handle of the {ref.seam!r} seam that cannot be opened here")
            return ref.host if device is None else host_to_device(ref.host)
        return sources.copy_device(ref.tensor, ref.tensor.device if device is None else device, hold)

    return _map_tensors(value, ByHandle, one)

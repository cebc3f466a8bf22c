"""Receiving into device memory from a shared mapping (issue 55): what a reader of the
store, of a queue's tensor arena and of the encoder cache does above the device seam.

- The reader's *shared* mapping of the segment is registered in aligned blocks (16 MiB,
  ``SHMQ_DEVICE_REGISTER_BLOCK``), each once, on the first copy that reads it, never per
  message and never the whole segment at once; a registration the device refuses is
  remembered and logged once, and every later ``device=`` read of that mapping takes the
  host path (a host view, then ``.to(device)``).
- A copy reads the shared mapping at the range's offset while the reader *holds* the
  range (the store's pin on the object: a private view of one of its parts), and the hold
  is kept with the copy's event: it is given back only once the event says the copy
  ended (checked at each device read, by ``release_done()``, and at ``close()``, which
  waits) — never because a next read came.
- ``close()`` waits for every copy in flight, gives back the holds, unregisters, and
  only then lets the mapping go (unregister before unmap).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Optional, Union

from ._device import Device, DeviceRefused, Registration, address_of, device_for

log = logging.getLogger("shmq.device")


#: The default of ``SHMQ_DEVICE_REGISTER_BLOCK``: 16 MiB, below the arena's and the
#: encoder cache's steps of taking ``/dev/shm`` pages, so that a block pins no page they
#: have not taken.
REGISTER_BLOCK = 16 << 20


def _register_block() -> int:
    """Bytes of a mapping registered at once (``SHMQ_DEVICE_REGISTER_BLOCK``, rounded down
    to the page size; default ``REGISTER_BLOCK``)."""
    page = mmap.PAGESIZE
    try:
        n = int(os.environ.get("SHMQ_DEVICE_REGISTER_BLOCK", REGISTER_BLOCK))
    except ValueError:
        n = REGISTER_BLOCK
    return max(page, n // page * page)


#: Mappings whose unregistration failed: kept mapped for good (a registered range must
#: never be unmapped).
_never_unmapped: list[Any] = []


class DeviceReader:
    """One reader's registrations of one shared mapping, and its copies in flight.

    The mapping is registered in aligned blocks of ``block`` bytes (``REGISTER_BLOCK``), each on the first
    copy that reads it, never all at once: pinning a whole segment would fault in (and,
    for ``/dev/shm``, allocate) every page of it, where the arena and the encoder cache
    take their pages only as they use them. A copy that spans blocks is copied in one
    piece per block, into one tensor, with one event."""

    def __init__(self, mapping: Callable[[], memoryview], what: str, seam: Union[None, str, Device] = None):
        self._mapping_of = mapping
        self._what = what
        self._seam_choice = seam
        self.seam: Optional[Device] = None
        self._mapping: Optional[memoryview] = None
        self._base = self._nbytes = 0
        self.block = _register_block()
        #: Block index -> its registration.
        self.registrations: dict[int, Registration] = {}
        self.refused: Optional[str] = None
        #: ``(event, hold)`` of each copy whose range is still held.
        self.pending: list[tuple[Any, Any]] = []
        #: Guards ``pending`` and ``registrations`` (a store is read from several threads).
        self._lock = threading.RLock()

    def usable(self) -> bool:
        """Whether copies may be tried (the mapping is found on the first call); False
        once the device refused a registration (logged once): the caller takes the host
        path."""
        if self.refused is not None:
            return False
        if self._mapping is None:
            self.seam = device_for(self._seam_choice)
            mapping = self._mapping_of()
            self._mapping = mapping  # kept while any block of it is registered
            self._base, self._nbytes = address_of(mapping), mapping.nbytes
        return True

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``address`` lie in the mapping."""
        return self._base <= address and address + nbytes <= self._base + self._nbytes

    def _pieces(self, address: int, nbytes: int) -> Optional[list[tuple[Registration, int, int]]]:
        """The registered pieces of the range, registering the blocks it needs; None when
        the device refused one (logged once; later copies take the host path)."""
        seam, mapping, block = self.seam, self._mapping, self.block
        assert seam is not None and mapping is not None
        pieces = []
        at, end = address, address + nbytes
        while at < end:
            index = (at - self._base) // block
            reg = self.registrations.get(index)
            if reg is None:
                start = self._base + index * block
                size = min(block, self._base + self._nbytes - start)
                try:
                    reg = seam.register(start, size, mapping.readonly)
                except DeviceRefused as e:
                    self.refused = str(e)
                    log.warning("shmq: %s: the %s device refused to register the mapping (%s); reads "
                                "with device= take the host path", self._what, seam.name, e)
                    return None
                self.registrations[index] = reg
            n = min(end, reg.address + reg.nbytes) - at
            pieces.append((reg, at - reg.address, n))
            at += n
        return pieces

    def copy(self, address: int, nbytes: int, dtype: Any, shape: tuple[int, ...], device: Any, hold: Any) -> Any:
        """Copy ``nbytes`` at ``address`` (inside the mapping) into a new device tensor;
        ``hold`` (what keeps the range from reuse) is kept until the copy ended. None when
        the device refused to register the range (the caller takes the host path)."""
        with self._lock:
            pieces = self._pieces(address, nbytes) if self.usable() else None
            if pieces is None:
                return None
            assert self.seam is not None
            tensor, event = self.seam.copy_to_device(pieces, dtype, shape, device)
            self.pending.append((event, hold))
            return tensor

    def track(self, event: Any, hold: Any) -> None:
        """Keep ``hold`` until ``event`` (a copy of this reader's seam) ended."""
        with self._lock:
            self.pending.append((event, hold))

    def release_done(self) -> int:
        """Give back the ranges whose copies ended; how many are still in flight."""
        with self._lock:
            seam = self.seam
            if seam is not None and self.pending:
                self.pending = [(e, h) for e, h in self.pending if not seam.event_done(e)]
            return len(self.pending)

    def wait_all(self) -> None:
        """Wait for the copies in flight and give back their ranges."""
        with self._lock:
            seam = self.seam
            if seam is not None:
                for event, _ in self.pending:
                    seam.wait_event(event)
            self.pending = []

    def close(self) -> None:
        """Wait for the copies in flight, give back their ranges, unregister every block;
        then the mapping may go."""
        with self._lock:
            seam = self.seam
            self.wait_all()
            failed = None
            while self.registrations:
                _, reg = self.registrations.popitem()
                assert seam is not None
                try:
                    seam.unregister(reg)
                except Exception as e:  # every block is tried; the mapping then stays
                    failed = e
            if failed is not None:
                _never_unmapped.append(self._mapping)
                self._mapping = None
                raise failed
            self._mapping = None


class DeviceSources:
    """The device readers of one receiver (a queue's reader, an encoder-cache consumer):
    one ``DeviceReader`` per shared mapping its received views lie in (the arena's, or
    each producer's segment), found through each view's ``shared_source()`` (the
    binding's ``ShmView``). Made empty; each mapping is registered on the first copy from
    it. Closed by ``close()`` or, if the owner forgot, when it is collected: either way
    the copies in flight are waited for and every mapping unregistered before it can go
    (unregister before unmap)."""

    def __init__(self, what: str, seam: Union[None, str, Device] = None):
        self._what = what
        self.seam_choice = seam
        self._readers: dict[int, DeviceReader] = {}  # the mapping's first byte -> reader
        self._lock = threading.Lock()
        #: Device-to-device copies (of opened IPC tensors): ``(event, hold)``, in a reader
        #: of no mapping.
        self._ipc = DeviceReader(_no_mapping, what, seam)
        self._finalize = weakref.finalize(self, _close_all, self._readers, self._ipc)

    @property
    def seam(self) -> Device:
        """The device seam these copies use."""
        if self._ipc.seam is None:
            self._ipc.seam = device_for(self.seam_choice)
        return self._ipc.seam

    def copy_device(self, tensor: Any, device: Any, hold: Any) -> Any:
        """A copy of ``tensor`` (device memory of another process, opened by IPC) into a
        new tensor on ``device``; ``hold`` is kept until the copy ended."""
        with self._lock:
            copied, event = self.seam.copy_device(tensor, device)
            self._ipc.track(event, hold)
            return copied

    def to_device(self, value: Any, views: Iterable[Any], device: Any) -> Any:
        """``value`` with each tensor that lies in one of the received ``views``
        (memoryviews from the binding) copied to ``device`` from the view's shared mapping;
        the views are held until their copies ended. A tensor elsewhere (a copied small
        buffer, a mapping the device refused) takes the host path, ``.to(device)``."""
        views = list(views)
        with self._lock:
            for reader in self._readers.values():
                reader.release_done()
            self._ipc.release_done()
            spans: list[tuple[int, int, DeviceReader, int]] = []  # view, bytes, reader, shared
            for view in views:
                source = getattr(getattr(view, "obj", None), "shared_source", None)
                if source is None or not isinstance(view, memoryview) or not view.nbytes:
                    continue
                if address_of(view) != address_of(memoryview(view.obj)):
                    continue  # a slice: its offset in the mapping is not the view's
                found = source()
                if found is None:
                    continue
                mapping, offset = found
                mapping = memoryview(mapping)
                base = address_of(mapping)
                of_mapping = self._readers.get(base)
                if of_mapping is None:
                    of_mapping = self._readers[base] = DeviceReader(
                        functools.partial(_same, mapping), f"{self._what} (mapping at {base:#x})", self.seam_choice
                    )
                if of_mapping.usable() and of_mapping.contains(base + offset, view.nbytes):
                    spans.append((address_of(view), view.nbytes, of_mapping, base + offset))
            if not spans:
                return tensor_leaves(value, lambda t: t.to(device))
            hold = (views, value)

            def copy(t: Any) -> Any:
                nbytes = t.numel() * t.element_size()
                if nbytes and t.is_contiguous():
                    ptr = t.data_ptr()
                    for at, size, reader, shared in spans:
                        if at <= ptr and ptr + nbytes <= at + size:
                            copied = reader.copy(shared + (ptr - at), nbytes, t.dtype, tuple(t.shape), device, hold)
                            if copied is not None:
                                return copied
                            break
                return t.to(device)

            return tensor_leaves(value, copy)

    def wait_ipc(self) -> None:
        """Wait for the device-to-device copies (of opened IPC tensors) in flight."""
        self._ipc.wait_all()

    def release_done(self) -> int:
        """Give back the views whose copies ended; how many copies are still in flight."""
        with self._lock:
            return sum(r.release_done() for r in self._readers.values()) + self._ipc.release_done()

    def wait_all(self) -> None:
        """Wait for every copy in flight and give back the views it held."""
        with self._lock:
            for reader in self._readers.values():
                reader.wait_all()
            self._ipc.wait_all()

    def close(self) -> None:
        """Wait for the copies in flight, give back their views, unregister every mapping."""
        with self._lock:
            self._finalize()


def _same(mapping: memoryview) -> memoryview:
    return mapping


def _no_mapping() -> memoryview:
    raise AssertionError("the reader of IPC copies registers nothing")


def _close_all(readers: dict[int, DeviceReader], ipc: DeviceReader) -> None:
    ipc.wait_all()
    while readers:
        _, reader = readers.popitem()
        try:
            reader.close()
        except Exception as e:  # a collected owner: say so, never raise from a finalizer
            log.warning("shmq: closing a device registration failed: %s", e)


def tensor_leaves(value: Any, replace: Callable[[Any], Any]) -> Any:
    """``value`` with each torch tensor in its dicts, lists and tuples replaced by
    ``replace(tensor)`` (the shapes the built-in serdes give back)."""
    import torch

    if isinstance(value, torch.Tensor):
        return replace(value)
    if type(value) is dict:
        return {k: tensor_leaves(v, replace) for k, v in value.items()}
    if type(value) is list:
        return [tensor_leaves(v, replace) for v in value]
    if type(value) is tuple:
        return tuple(tensor_leaves(v, replace) for v in value)
    return value

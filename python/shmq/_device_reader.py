"""Receiving into device memory from a shared mapping (issue 55): what a reader of the
store, of a queue's tensor arena and of the encoder cache does above the device seam.

- The reader's *shared* mapping of the segment is registered once, on the first
  ``get(..., device=)``, never per message; a mapping the device refuses is remembered
  and logged once, and every later ``device=`` read takes the host path (a host view,
  then ``.to(device)``).
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
import threading
import weakref
from typing import Any, Callable, Iterable, Optional, Union

from ._device import Device, DeviceRefused, Registration, address_of, device_for

log = logging.getLogger("shmq.device")


class DeviceReader:
    """One reader's registration of one shared mapping, and its copies in flight."""

    def __init__(self, mapping: Callable[[], memoryview], what: str, seam: Union[None, str, Device] = None):
        self._mapping_of = mapping
        self._what = what
        self._seam_choice = seam
        self.seam: Optional[Device] = None
        self._mapping: Optional[memoryview] = None
        self.registration: Optional[Registration] = None
        self.refused: Optional[str] = None
        #: ``(event, hold)`` of each copy whose range is still held.
        self.pending: list[tuple[Any, Any]] = []

    def registered(self) -> Optional[Registration]:
        """The registration (made on the first call), or ``None`` when the device refused
        it (logged once) and the caller takes the host path."""
        if self.registration is not None or self.refused is not None:
            return self.registration
        self.seam = device_for(self._seam_choice)
        mapping = self._mapping_of()
        try:
            self.registration = self.seam.register(address_of(mapping), mapping.nbytes, mapping.readonly)
        except DeviceRefused as e:
            self.refused = str(e)
            log.warning("shmq: %s: the %s device refused to register the mapping (%s); reads "
                        "with device= take the host path", self._what, self.seam.name, e)
            return None
        self._mapping = mapping  # keeps the mapping while it is registered
        return self.registration

    def copy(self, address: int, nbytes: int, dtype: Any, shape: tuple[int, ...], device: Any, hold: Any) -> Any:
        """Copy ``nbytes`` at ``address`` (inside the registered mapping) into a new device
        tensor; ``hold`` (what keeps the range from reuse) is kept until the copy ended."""
        reg, seam = self.registration, self.seam
        assert reg is not None and seam is not None
        tensor, event = seam.copy_to_device(reg, address - reg.address, nbytes, dtype, shape, device)
        self.pending.append((event, hold))
        return tensor

    def release_done(self) -> int:
        """Give back the ranges whose copies ended; how many are still in flight."""
        seam = self.seam
        if seam is not None and self.pending:
            self.pending = [(e, h) for e, h in self.pending if not seam.event_done(e)]
        return len(self.pending)

    def wait_all(self) -> None:
        """Wait for the copies in flight and give back their ranges."""
        seam, pending = self.seam, self.pending
        if seam is not None:
            for event, _ in pending:
                seam.wait_event(event)
        self.pending = []

    def close(self) -> None:
        """Wait for the copies in flight, give back their ranges, unregister; then the
        mapping may go."""
        seam = self.seam
        self.wait_all()
        if seam is not None and self.registration is not None:
            seam.unregister(self.registration)
        self.registration = None
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
            self._ipc.pending.append((event, hold))
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
                registration = of_mapping.registered()
                if registration is not None and registration.contains(base + offset, view.nbytes):
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
                            return reader.copy(shared + (ptr - at), nbytes, t.dtype, tuple(t.shape), device, hold)
                return t.to(device)

            return tensor_leaves(value, copy)

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

"""The device seam: the only operations shmq's GPU path uses, in two implementations.

- ``CudaDevice``: torch's own CUDA calls, nothing else (``cudaHostRegister`` through
  ``torch.cuda.cudart()``, ``Tensor.copy_(non_blocking=True)`` on a side stream with a
  ``torch.cuda.Event`` (also for a device-to-device copy of an opened IPC tensor), and
  the storage IPC calls of ``torch.multiprocessing.reductions``).
  No GPU has run it yet (issue 55): ``scripts/gpu_check.sh`` is the command for one.
- ``TwinDevice``: a CPU twin with the same contract, used by the tests on every machine.
  "Device memory" is process memory (CPU torch tensors); a registration is recorded and
  an overlapping or unmapped range (or a read-only one registered without the read-only
  flag) is refused, as CUDA refuses it; a copy runs on a worker thread, so it really is
  in flight when ``copy_to_device`` returns, and its event is set when it ends; an IPC
  handle names a file in ``/dev/shm`` that a second process maps.

Which one: ``device_for(None)`` reads ``SHMQ_DEVICE`` (``twin`` or ``cuda``; unset: CUDA
when torch sees a GPU, else the twin); an explicit ``"twin"``/``"cuda"`` or a ``Device``
instance wins. torch is imported only when a device is used.

The protocol the callers follow (``object_storage.ObjectStorage.get(..., device=)``):
register a *shared* mapping (in blocks, each once, on the first copy that reads it: see
``shmq._device_reader``); copy a range of it only while the range is held (a pin);
give the range back only once ``event_done`` says the copy ended; before the mapping goes,
wait for its copies, then ``unregister``.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Optional, Protocol, Union

__all__ = ["CudaDevice", "Device", "DeviceRefused", "Registration", "TwinDevice", "address_of", "device_for"]

log = logging.getLogger("shmq.device")

#: ``cudaHostRegisterReadOnly``: the flag that lets CUDA register a ``PROT_READ`` mapping.
CUDA_HOST_REGISTER_READ_ONLY = 8
#: ``cudaHostRegisterPortable``: pinned for every CUDA context, not only the current one.
CUDA_HOST_REGISTER_PORTABLE = 1


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a call that failed on purpose (a refused
    registration): torch's binding returns the code but leaves the error set, and the
    next kernel launch would raise it in unrelated code. torch binds no
    ``cudaGetLastError``, so it is called in the libcudart this process has loaded."""
    global _cuda_get_last_error
    if _cuda_get_last_error is None:
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in name:
                    path = name
                    break
        if path is None:
            return
        _cuda_get_last_error = ctypes.CDLL(path).cudaGetLastError
    _cuda_get_last_error()


_cuda_get_last_error: Any = None


class DeviceRefused(RuntimeError):
    """The device refused to register a range (the caller falls back to the host path)."""


class Registration:
    """A range of this process's memory registered with a device."""

    __slots__ = ("address", "nbytes", "read_only")

    def __init__(self, address: int, nbytes: int, read_only: bool):
        self.address, self.nbytes, self.read_only = address, nbytes, read_only

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def __repr__(self) -> str:
        return f"<Registration {self.address:#x}+{self.nbytes}{' read-only' if self.read_only else ''}>"


class Device(Protocol):
    """What the GPU path needs of a device, and nothing else."""

    name: str

    def register(self, address: int, nbytes: int, read_only: bool) -> Registration: ...
    def unregister(self, registration: Registration) -> None: ...
    def copy_to_device(
        self, pieces: list[tuple[Registration, int, int]], dtype: Any, shape: tuple[int, ...], device: Any
    ) -> tuple[Any, Any]: ...
    def copy_device(self, tensor: Any, device: Any) -> tuple[Any, Any]: ...
    def event_done(self, event: Any) -> bool: ...
    def wait_event(self, event: Any) -> None: ...
    def export_ipc(self, tensor: Any) -> Any: ...
    def open_ipc(self, handle: Any) -> Any: ...
    def close_ipc(self, tensor: Any) -> None: ...


def address_of(view: memoryview) -> int:
    """The address of a (C-contiguous) buffer's first byte, read-only buffers included."""
    obj = ctypes.py_object(view)
    buf = (ctypes.c_char * 96)()  # a Py_buffer (80 bytes on 64-bit CPython), with room
    if ctypes.pythonapi.PyObject_GetBuffer(obj, buf, 0) != 0:  # PyBUF_SIMPLE
        raise BufferError("cannot address this buffer")
    try:
        return ctypes.c_void_p.from_buffer(buf).value or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(buf)


def _host_tensor(address: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A CPU tensor over ``nbytes`` at ``address`` (no copy; the caller keeps it mapped)."""
    import torch

    raw = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


# -- CUDA ----------------------------------------------------------------------------------


class CudaDevice:
    """The seam through torch's CUDA calls (not yet run on a GPU: see the module doc)."""

    name = "cuda"

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._streams: dict[Any, Any] = {}
        self._hold_cycles = 0

    # test hook: CUDA cannot hold a copy until told, so a held copy waits behind a
    # GPU sleep of about ten seconds instead (what the tests need: in flight meanwhile).
    def hold(self) -> None:
        self._hold_cycles = 10 * 2_000_000_000

    def release(self) -> None:
        self._hold_cycles = 0

    def register(self, address: int, nbytes: int, read_only: bool) -> Registration:
        torch = self._torch
        # Portable: pinned for every device's copies, not only the current one's.
        flags = CUDA_HOST_REGISTER_PORTABLE | (CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))
        except torch.cuda.CudaError as e:
            _clear_last_cuda_error()
            raise DeviceRefused(f"cudaHostRegister({address:#x}, {nbytes}, {flags}): {e}") from None
        return Registration(address, nbytes, read_only)

    def unregister(self, registration: Registration) -> None:
        torch = self._torch
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(registration.address))
        except torch.cuda.CudaError:
            _clear_last_cuda_error()
            raise

    def copy_to_device(
        self, pieces: list[tuple[Registration, int, int]], dtype: Any, shape: tuple[int, ...], device: Any
    ) -> tuple[Any, Any]:
        torch = self._torch
        device = torch.device(device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        dst = torch.empty(shape, dtype=dtype, device=device)
        raw = dst.view(-1).view(torch.uint8) if dst.numel() else dst
        # The copy waits for what the caller's stream did with `dst`'s memory before.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if self._hold_cycles:
                torch.cuda._sleep(self._hold_cycles)
            at = 0
            try:
                for registration, offset, nbytes in pieces:  # one per registered block it spans
                    src = _host_tensor(registration.address + offset, nbytes, torch.uint8, (nbytes,))
                    raw[at : at + nbytes].copy_(src, non_blocking=True)
                    at += nbytes
            except BaseException:
                stream.synchronize()  # the pieces issued end before the caller lets the range go
                raise
            event = torch.cuda.Event()
            event.record(stream)
        dst.record_stream(stream)
        # The caller's stream sees the data; the host learns of the end by `event_done`.
        torch.cuda.current_stream(device).wait_event(event)
        return dst, event

    def copy_device(self, tensor: Any, device: Any) -> tuple[Any, Any]:
        torch = self._torch
        # On the current stream of the opened tensor's device: torch's rebuild of an IPC
        # handle made that stream wait for the sender's event (its writes), so the copy
        # reads what the sender wrote. The event tells the host when it ended.
        with torch.cuda.device(tensor.device):
            stream = torch.cuda.current_stream(tensor.device)
            if self._hold_cycles:
                torch.cuda._sleep(self._hold_cycles)
            dst = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            dst.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        if torch.device(device) != tensor.device:
            torch.cuda.current_stream(device).wait_event(event)
        return dst, event

    def event_done(self, event: Any) -> bool:
        return bool(event.query())

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    def export_ipc(self, tensor: Any) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(tensor)

    def open_ipc(self, handle: Any) -> Any:
        rebuild, args = handle
        return rebuild(*args)

    def close_ipc(self, tensor: Any) -> None:
        """Nothing to call: dropping the last reference to the opened tensor closes the
        handle (torch's storage deleter); the caller drops it."""


# -- the CPU twin --------------------------------------------------------------------------


def _mapped_ranges() -> list[tuple[int, int, bool]]:
    """``(start, end, writable)`` of this process's mappings."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split(None, 2)[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            out.append((start, end, perms[1] == "w"))
    return out


def _mapped(address: int, nbytes: int) -> Optional[bool]:
    """``None`` if some byte of the range is not mapped; else whether all of it is writable."""
    at, end, writable = address, address + nbytes, True
    for start, stop, w in _mapped_ranges():
        if start <= at < stop:
            writable = writable and w
            at = stop
            if at >= end:
                return writable
    return None


def _process_memory(device: Any) -> None:
    """The twin's device memory is process memory: a copy "to cuda:0" would silently
    land on the CPU, so it is refused."""
    import torch

    if torch.device(device).type != "cpu":
        raise ValueError(
            f"the CPU twin of the device seam copies into process memory (device 'cpu'), not {device!r}: "
            "set SHMQ_DEVICE=cuda (or device_seam='cuda') on a machine whose torch sees a GPU"
        )


class _TwinEvent:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class TwinDevice:
    """The CPU twin of ``CudaDevice`` (see the module doc). ``hold()`` is the test hook:
    copies issued while it is held stay in flight on the worker until ``release()``."""

    name = "twin"
    _names = itertools.count()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered: list[Registration] = []
        self._in_flight: dict[int, int] = {}  # id(registration) -> copies not ended
        self._gate = threading.Event()
        self._gate.set()
        self._work: list[tuple[Any, Any, Optional[_TwinEvent], Optional[Registration]]] = []
        self._wake = threading.Condition(self._lock)
        self._worker: Optional[threading.Thread] = None

    # test hook
    def hold(self) -> None:
        """Keep the copies issued from now on in flight until ``release()``."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def register(self, address: int, nbytes: int, read_only: bool) -> Registration:
        if nbytes <= 0:
            raise DeviceRefused(f"register({address:#x}, {nbytes}): empty range")
        writable = _mapped(address, nbytes)
        if writable is None:
            raise DeviceRefused(f"register({address:#x}, {nbytes}): not mapped")
        if not writable and not read_only:
            raise DeviceRefused(f"register({address:#x}, {nbytes}): read-only memory without the read-only flag")
        with self._lock:
            for r in self._registered:
                if address < r.address + r.nbytes and r.address < address + nbytes:
                    raise DeviceRefused(f"register({address:#x}, {nbytes}): overlaps {r!r}")
            reg = Registration(address, nbytes, read_only)
            self._registered.append(reg)
        return reg

    def unregister(self, registration: Registration) -> None:
        with self._lock:
            if registration not in self._registered:
                raise RuntimeError(f"unregister of {registration!r}: not registered")
            if self._in_flight.get(id(registration)):
                raise RuntimeError(f"unregister of {registration!r} while a copy from it is in flight")
            self._registered.remove(registration)
        if _mapped(registration.address, registration.nbytes) is None:
            raise RuntimeError(f"unregister of {registration!r} after its memory was unmapped")

    def copy_to_device(
        self, pieces: list[tuple[Registration, int, int]], dtype: Any, shape: tuple[int, ...], device: Any
    ) -> tuple[Any, Any]:
        import torch

        _process_memory(device)
        dst = torch.empty(shape, dtype=dtype)
        raw = dst.view(-1).view(torch.uint8) if dst.numel() else dst
        event = _TwinEvent()
        total = sum(n for _, _, n in pieces)
        if not pieces or total != raw.numel():
            raise RuntimeError(f"copy of {total} bytes in {len(pieces)} pieces into a tensor of {raw.numel()}")
        with self._lock:
            for registration, offset, nbytes in pieces:
                address = registration.address + offset
                if registration not in self._registered or not registration.contains(address, nbytes):
                    raise RuntimeError(f"copy of {nbytes} bytes at {address:#x}: not in {registration!r}")
            at = 0
            for registration, offset, nbytes in pieces:
                address = registration.address + offset
                src = _host_tensor(address, nbytes, torch.uint8, (nbytes,))
                self._in_flight[id(registration)] = self._in_flight.get(id(registration), 0) + 1
                self._work.append((raw[at : at + nbytes], src, event if at + nbytes == raw.numel() else None,
                                   registration))
                at += nbytes
            self._start_worker()
            self._wake.notify()
        return dst, event

    def copy_device(self, tensor: Any, device: Any) -> tuple[Any, Any]:
        """A copy of a "device" tensor (one opened by ``open_ipc``) into a new one, run
        on the worker like every copy: in flight after the call returns."""
        import torch

        _process_memory(device)
        dst = torch.empty(tensor.shape, dtype=tensor.dtype)
        event = _TwinEvent()
        with self._lock:
            self._work.append((dst, tensor, event, None))
            self._start_worker()
            self._wake.notify()
        return dst, event

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="shmq-device-twin", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._work:
                    self._wake.wait()
                dst, src, event, registration = self._work.pop(0)
            self._gate.wait()
            try:
                dst.copy_(src)  # the source is read now, as a DMA engine reads it
            except BaseException as e:  # noqa: BLE001 - the worker goes on; the copy says so
                log.error("shmq: the device twin's copy failed: %s", e)
            finally:
                if registration is not None:
                    with self._lock:
                        self._in_flight[id(registration)] -= 1
                if event is not None:  # the last piece of a copy: its pieces ran in order
                    event.done.set()

    def event_done(self, event: Any) -> bool:
        return bool(event.done.is_set())

    def wait_event(self, event: Any) -> None:
        event.done.wait()

    def export_ipc(self, tensor: Any) -> Any:
        """Move ``tensor``'s data into a named ``/dev/shm`` file (as CUDA memory is
        shareable where it lies) and name it; the file goes with the exporter's tensor."""
        import torch

        if not tensor.is_contiguous():
            raise ValueError("export_ipc: the tensor must be contiguous")
        name = f"shmq-twin-ipc-{os.getpid()}-{next(self._names)}"
        nbytes = max(tensor.numel() * tensor.element_size(), 1)
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        shared = torch.frombuffer(mapping, dtype=torch.uint8)[: tensor.numel() * tensor.element_size()]
        shared = shared.view(tensor.dtype).reshape(tensor.shape)
        shared.copy_(tensor)
        tensor.set_(shared.untyped_storage(), 0, tensor.shape, tensor.stride())
        weakref.finalize(mapping, os.unlink, f"/dev/shm/{name}")
        return (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    def open_ipc(self, handle: Any) -> Any:
        import torch

        name, dtype, shape = handle
        if not isinstance(name, str) or not name.startswith("shmq-twin-ipc-") or "/" in name:
            raise ValueError(f"not a twin IPC handle: {name!r}")
        # Never another user's file, nor a link planted under the name.
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise PermissionError(f"/dev/shm/{name} belongs to uid {st.st_uid}, not this user")
            mapping = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        dt = getattr(torch, dtype)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        return torch.frombuffer(mapping, dtype=torch.uint8)[:n].view(dt).reshape(shape)

    def close_ipc(self, tensor: Any) -> None:
        del tensor  # the mapping goes with the last tensor over it


# -- choosing one --------------------------------------------------------------------------

_devices: dict[str, Device] = {}
_devices_lock = threading.Lock()


def device_for(choice: Union[None, str, Device] = None) -> Device:
    """The seam to use: ``choice`` (a ``Device``, ``"twin"`` or ``"cuda"``), else
    ``SHMQ_DEVICE``, else CUDA when torch sees a GPU and the twin otherwise. One of each
    kind per process (registrations are per process)."""
    if choice is not None and not isinstance(choice, str):
        return choice
    kind = choice or os.environ.get("SHMQ_DEVICE", "").strip().lower()
    if not kind:
        import torch

        kind = "cuda" if torch.cuda.is_available() else "twin"
    if kind not in ("twin", "cuda"):
        raise ValueError(f"SHMQ_DEVICE must be 'twin' or 'cuda', got {kind!r}")
    with _devices_lock:
        device = _devices.get(kind)
        if device is None:
            device = _devices[kind] = TwinDevice() if kind == "twin" else CudaDevice()
    return device

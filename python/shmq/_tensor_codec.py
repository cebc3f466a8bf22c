"""Tensors and numpy arrays as dtype name + shape + raw bytes, and back: the one codec of
the queue's protocol-5 pickler (``_oob``, which the encoder cache uses too) and the
store's serdes (``serde``).

Every dtype works: bytes are moved as ``uint8`` (bfloat16 and float8 need nothing from
numpy), and a strided tensor is copied contiguous as an integer type of its element
size (copying works for those where copying the dtype itself is not implemented:
int1..int7, float4, ...). Conjugate and negative bits are resolved first.

What each user does with tensors it cannot describe exactly (other devices, sparse,
quantized, subclasses) is its own: the queue leaves them to torch's pickling
(``reduce_tensor``), the store moves other devices' tensors to the CPU and pickles the
rest (``tensor_raw``).
"""

from __future__ import annotations

import logging
import pickle
import sys
from typing import Any, Optional

__all__ = [
    "array_raw",
    "dtype_name",
    "rebuild_array",
    "rebuild_tensor",
    "reduce_tensor",
    "tensor_bytes",
    "tensor_raw",
    "tensor_types",
]

# The store's logger: its warnings come from the store's reduction (`tensor_raw`).
logger = logging.getLogger("shmq.serde")

#: The integer dtype of each element size, to copy any dtype's elements as.
SAME_SIZE_INT_NAMES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def tensor_types() -> Optional[tuple[type, type]]:
    """``(torch.Tensor, torch.nn.Parameter)`` once torch is imported, else ``None``."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):
        return None
    return torch.Tensor, torch.nn.Parameter


def dtype_name(t: Any) -> str:
    """``t``'s dtype as the attribute of ``torch`` that names it (``"bfloat16"``)."""
    return str(t.dtype).removeprefix("torch.")


def tensor_bytes(t: Any) -> Any:
    """The bytes of CPU tensor ``t`` as a flat buffer (C order), copied once if ``t`` is
    not contiguous: a numpy ``uint8`` array, or without numpy a ctypes array; either keeps
    the bytes alive as long as it lives."""
    import torch

    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        # Reinterpret as an integer type of the same size first: every dtype can be
        # viewed so (keeping its strides), and copying integers works where copying the
        # dtype itself is not implemented (int1..int7, float4, ...).
        int_name = SAME_SIZE_INT_NAMES.get(t.element_size())
        t = (t.view(getattr(torch, int_name)) if int_name is not None else t).contiguous()
    flat = t.reshape(-1).view(torch.uint8)
    np = sys.modules.get("numpy")
    if np is not None:
        # A numpy view keeps `flat` (and so the bytes) alive as long as the buffer lives.
        return flat.numpy()
    import ctypes

    holder = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    holder._tensor = flat  # keep the storage alive with the buffer
    return holder


def rebuild_tensor(
    buf: Any, dtype: str, shape: Any, requires_grad: bool = False, parameter: bool = False
) -> Any:
    """The tensor of dtype name ``dtype`` and ``shape`` over ``buf``'s bytes (a writable
    buffer the tensor may keep: a private bytearray, or a zero-copy view of private
    memory)."""
    import torch

    dt = getattr(torch, dtype)
    if memoryview(buf).nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def reduce_tensor(t: Any, parameter: bool) -> Any:
    """The queue's reduction: ``(rebuild_tensor, args)`` for a plain CPU tensor (its bytes
    one out-of-band buffer; ``requires_grad`` and ``Parameter`` kept), or
    ``NotImplemented`` to let torch pickle it (its own way keeps what this cannot: other
    devices, layouts, non-leaf tensors that require grad...)."""
    if t.device.type != "cpu" or t.layout is not sys.modules["torch"].strided or t.is_quantized:
        return NotImplemented
    if t.requires_grad and not t.is_leaf:
        return NotImplemented
    try:
        raw = tensor_bytes(t.detach())
    except RuntimeError:
        return NotImplemented
    return rebuild_tensor, (pickle.PickleBuffer(raw), dtype_name(t), tuple(t.shape), t.requires_grad, parameter)


def _byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_warned_devices: set[str] = set()


def tensor_raw(obj: Any) -> Optional[tuple[str, list[int], memoryview]]:
    """The store's reduction: a plain tensor's dtype name, shape and C-order bytes (a
    tensor on another device is copied to the CPU, logged once per device type); ``None``
    for what this cannot describe exactly (quantized, sparse, subclasses), which gets
    pickled."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is None or np is None or type(obj) is not torch.Tensor:
        return None
    if obj.layout != torch.strided or obj.is_quantized:
        return None
    t = obj.detach()
    if t.device.type != "cpu":
        if t.device.type not in _warned_devices:
            _warned_devices.add(t.device.type)
            logger.warning("shmq: %s tensors are copied to the CPU to be stored", t.device.type)
        t = t.cpu()
    return dtype_name(t), list(t.shape), _byte_view(tensor_bytes(t))


def array_raw(obj: Any) -> Optional[tuple[str, list[int], memoryview]]:
    """A plain numpy array's dtype string (byte order included), shape and C-order bytes;
    ``None`` for object or structured arrays and subclasses, which get pickled."""
    np = sys.modules.get("numpy")
    if np is None or type(obj) is not np.ndarray or obj.dtype.hasobject or obj.dtype.fields is not None:
        return None
    a = obj if obj.flags.c_contiguous else obj.copy(order="C")
    return obj.dtype.str, list(obj.shape), _byte_view(a.reshape(-1).view(np.uint8))


def rebuild_array(buf: Any, dtype: str, shape: Any) -> Any:
    """The array of dtype string ``dtype`` and ``shape`` over ``buf`` (writable, kept)."""
    import numpy as np

    return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)

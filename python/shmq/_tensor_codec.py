"""Tensors and numpy arrays as dtype name + shape + raw bytes, and back: the one codec of
shmq's one protocol-5 pickler (``_oob``: the queue's, the store's ``PickleSerde``, the
encoder cache's) and the store's ``MsgpackSerde``.

Every dtype works: bytes are moved as ``uint8`` (bfloat16 and float8 need nothing from
numpy), and a strided tensor is copied contiguous as an integer type of its element
size (copying works for those where copying the dtype itself is not implemented:
int1..int7, float4, ...). Conjugate and negative bits are resolved first.

**Tensors on other devices (CUDA...)**: one policy, here (:func:`reduce_tensor`), in one
of two flavours that each user names:

- the queue (``to_cpu=False``): torch's own pickling, which copies the storage through
  the CPU and rebuilds the tensor on its device in the reader, as vLLM's queue does;
  non-leaf tensors that require grad likewise (torch refuses them);
- the object store and the encoder cache (``to_cpu=True``): copied to the CPU
  (detached; a leaf keeps ``requires_grad``), subclasses included, and stored as CPU
  tensors; they come back on the CPU (the encoder cache's ``load``
  takes a ``device=``). Logged once per process and device type (a cost the caller may
  not expect).

Sparse and quantized tensors and subclasses keep torch's pickling everywhere.
"""

from __future__ import annotations

import logging
import pickle
import sys
from typing import Any, Literal, Optional

__all__ = [
    "array_raw",
    "array_type",
    "dtype_name",
    "on_cpu",
    "plain_dtype",
    "rebuild_array",
    "rebuild_tensor",
    "reduce_array",
    "reduce_tensor",
    "same",
    "tensor_bytes",
    "tensor_raw",
    "tensor_types",
]

# The store's logger: the one warning here is the store's (a tensor copied to the CPU).
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


def reduce_tensor(t: Any, parameter: bool, to_cpu: bool) -> Any:
    """The one reduction of a tensor: ``(rebuild_tensor, args)`` for a strided tensor
    (its bytes one out-of-band buffer; ``requires_grad`` of a leaf and ``Parameter``
    kept), or ``NotImplemented`` to let torch pickle it. ``to_cpu`` picks the flavour for
    tensors on other devices and non-leaf tensors that require grad (see the module
    docs): copied to the CPU and detached (a copy from another device logged once per
    device type; a leaf keeps ``requires_grad``), or left to torch's pickling (which
    keeps their device). What this cannot describe of a CPU copy (sparse, quantized) is
    torch's pickling of the copy, never of the original."""
    torch = sys.modules["torch"]
    original = t
    requires_grad = t.requires_grad and t.is_leaf
    if t.device.type != "cpu" or (t.requires_grad and not t.is_leaf):
        if not to_cpu:
            return NotImplemented
        t = on_cpu(t)
    # Torch's own pickling for what this cannot describe: of the CPU copy, if one was made.
    theirs = NotImplemented if t is original else (same, (t,))
    if t.layout is not torch.strided or t.is_quantized:
        return theirs
    try:
        raw = tensor_bytes(t.detach())
    except RuntimeError:
        return theirs
    return rebuild_tensor, (pickle.PickleBuffer(raw), dtype_name(t), tuple(t.shape), requires_grad, parameter)


def same(obj: Any) -> Any:
    """``obj`` itself: a reduction ``(same, (copy,))`` pickles ``copy`` in place of the
    object reduced (a tensor's CPU copy in place of the tensor)."""
    return obj


_warned_devices: set[str] = set()


def on_cpu(t: Any) -> Any:
    """``t`` detached, on the CPU: copied there from another device (logged once per
    process and device type)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t
    if t.device.type not in _warned_devices:
        _warned_devices.add(t.device.type)
        logger.warning("shmq: %s tensors are copied to the CPU to be stored", t.device.type)
    return t.cpu()


def _byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def tensor_raw(obj: Any) -> Optional[tuple[str, list[int], memoryview]]:
    """The msgpack serde's reduction: a plain tensor's dtype name, shape and C-order
    bytes (the ``to_cpu`` flavour of the module docs: on the CPU, detached; logged);
    ``None`` for what this cannot describe exactly (quantized, sparse, subclasses), which
    gets pickled."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is None or np is None or type(obj) is not torch.Tensor:
        return None
    if obj.layout != torch.strided or obj.is_quantized:
        return None
    t = on_cpu(obj)
    return dtype_name(t), list(t.shape), _byte_view(tensor_bytes(t))


_plain_dtypes: dict[Any, bool] = {}


def plain_dtype(dt: Any) -> bool:
    """Whether numpy dtype ``dt`` is described exactly by its string ``dt.str`` (byte
    order included): not object, structured, empty, with metadata, or a user-defined
    dtype (numpy's test ``rational``, ml_dtypes' ``bfloat16``...), whose string is only
    ``'V<size>'``. Those keep numpy's own pickling. Remembered per dtype."""
    plain = _plain_dtypes.get(dt)
    if plain is None:
        import numpy as np

        try:
            plain = (
                not dt.hasobject
                and dt.fields is None
                and dt.itemsize > 0
                and dt.metadata is None
                and np.dtype(dt.str) == dt
            )
        except TypeError:
            plain = False
        if len(_plain_dtypes) < 1024:  # a bound for programs that make dtypes without end
            _plain_dtypes[dt] = plain
    return plain


def array_raw(obj: Any) -> Optional[tuple[str, list[int], memoryview]]:
    """A plain numpy array's dtype string (byte order included), shape and C-order bytes;
    ``None`` for subclasses and arrays whose dtype is not plain (:func:`plain_dtype`),
    which get pickled."""
    np = sys.modules.get("numpy")
    if np is None or type(obj) is not np.ndarray or not plain_dtype(obj.dtype):
        return None
    a = obj if obj.flags.c_contiguous else obj.copy(order="C")
    return obj.dtype.str, list(obj.shape), _byte_view(a.reshape(-1).view(np.uint8))


def rebuild_array(buf: Any, dtype: str, shape: Any, order: Literal["C", "F"] = "C") -> Any:
    """The array of dtype string ``dtype``, ``shape`` and memory ``order`` (``"C"`` or
    ``"F"``) over ``buf`` (writable if ``buf`` is, kept)."""
    import numpy as np

    return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape, order=order)


def array_type() -> Optional[type]:
    """``numpy.ndarray`` once numpy is imported (not half-way, in another thread), else
    ``None``."""
    np = sys.modules.get("numpy")
    return None if np is None else getattr(np, "ndarray", None)


def reduce_array(a: Any) -> Any:
    """The pickler's reduction of a plain numpy array: ``(rebuild_array, args)`` with its
    bytes as one out-of-band buffer (C- or Fortran-contiguous ones as they are, others
    copied C-contiguous once), its dtype string (byte order included) and memory order;
    ``NotImplemented`` where the dtype is not plain (:func:`plain_dtype`: object,
    structured, user-defined...): numpy's own pickling."""
    if not plain_dtype(a.dtype):
        return NotImplemented
    import numpy as np

    if a.flags.c_contiguous:
        flat, order = a, "C"
    elif a.flags.f_contiguous:
        flat, order = a.T, "F"  # the transpose of a Fortran-ordered array is C-ordered
    else:
        flat, order = np.ascontiguousarray(a), "C"
    raw = flat.reshape(-1).view(np.uint8)
    return rebuild_array, (pickle.PickleBuffer(raw), a.dtype.str, a.shape, order)

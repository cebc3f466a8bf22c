"""Typed arrays, the message format Python and Rust both speak for numbers.

``MessageQueue.enqueue_array`` sends a numpy array, a CPU torch tensor or a typed
memoryview as a dtype (by name), a shape and the bytes; a reader gets them back as a
numpy array, a torch tensor or a typed memoryview over the bytes it received (a private
view of the tensor arena or of the frame it came in for a large array: no copy). A Rust
writer's ``Writer::enqueue`` of an ``ArrayRef`` and reader's ``Reader::dequeue_array`` speak the same
format (``shmq::broadcast::array``). Neither numpy nor torch is needed to import this.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

__all__ = ["DTYPES", "ArrayKind", "from_wire", "to_wire"]

ArrayKind = Literal["numpy", "torch", "memoryview"]

# The dtypes an array message carries, by the name both languages use, with the
# struct-module format of each (for a memoryview; bfloat16 has none).
DTYPES: dict[str, str | None] = {
    "bool": "?",
    "uint8": "B",
    "int8": "b",
    "uint16": "H",
    "int16": "h",
    "uint32": "I",
    "int32": "i",
    "uint64": "Q",
    "int64": "q",
    "float16": "e",
    "bfloat16": None,
    "float32": "f",
    "float64": "d",
}
# A memoryview's format (as struct writes it, native sizes on Linux) -> dtype name.
_FORMATS = {fmt: name for name, fmt in DTYPES.items() if fmt is not None}
_FORMATS.update({"c": "uint8", "l": "int64", "L": "uint64", "n": "int64", "N": "uint64"})
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2,
    "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8,
}  # fmt: skip


def _unsupported(what: Any) -> TypeError:
    return TypeError(
        f"enqueue_array sends a numpy array, a torch tensor on the CPU or a typed memoryview "
        f"of dtype {', '.join(DTYPES)}; got {what}"
    )


def to_wire(array: Any) -> tuple[str, list[int], Any]:
    """``(dtype name, shape, contiguous buffer)`` of ``array``. A non-contiguous (or
    big-endian) array is copied into a contiguous little-endian one first; a contiguous
    one is sent from its own memory (no copy if it lies in a loan of the writer)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        if array.device.type != "cpu":
            raise ValueError(
                f"enqueue_array sends CPU memory; this tensor is on {array.device}: send "
                f"tensor.cpu(), or the tensor with enqueue() (pickled)"
            )
        name = str(array.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise _unsupported(f"a tensor of {array.dtype}")
        if array.layout != torch.strided:
            raise TypeError(
                f"enqueue_array sends dense tensors; this one's layout is {array.layout}: send "
                f"tensor.to_dense(), or the tensor with enqueue() (pickled)"
            )
        shape = list(array.shape)
        # A neg-bit view (torch's lazy negation: `x._neg_view()`, the imaginary part of a
        # conjugate) holds its values negated: resolved, its bytes are the values.
        flat = array.detach().resolve_neg().contiguous().reshape(-1)
        # Bytes as numpy sees them (numpy has no bfloat16: the bytes are what travels).
        return name, shape, flat.view(torch.uint8).numpy() if flat.numel() else b""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(array, numpy.ndarray):
        name = array.dtype.name
        if name not in DTYPES or array.dtype.hasobject:
            raise _unsupported(f"a numpy array of dtype {array.dtype}")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return name, list(array.shape), numpy.ascontiguousarray(array)
    try:
        view = memoryview(array)
    except TypeError:
        raise _unsupported(type(array).__name__) from None
    fmt = view.format.lstrip("@=<")
    if fmt not in _FORMATS:
        raise _unsupported(f"a memoryview of format {view.format!r}")
    if not view.c_contiguous:
        view = memoryview(view.tobytes()).cast(fmt, view.shape or ())  # type: ignore[call-overload]
    return _FORMATS[fmt], list(view.shape or ()), view


def from_wire(dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], data: Any, kind: ArrayKind) -> Any:
    """The array the reader received, as ``kind`` says, over ``data`` (no copy)."""
    if kind == "numpy":
        import numpy

        if dtype == "bfloat16":
            raise TypeError(
                "numpy has no bfloat16: read this array with dequeue_array(kind='torch') (or "
                "kind='memoryview' for its bytes)"
            )
        return numpy.ndarray(shape, dtype=numpy.dtype(dtype), buffer=data, strides=strides)
    if kind == "torch":
        import torch

        torch_dtype = getattr(torch, dtype)
        itemsize = _ITEMSIZE[dtype]
        if any(s % itemsize for s in strides):
            raise ValueError(f"strides {strides} are not whole elements of {dtype}: torch cannot view them")
        if len(data) < itemsize or 0 in shape:
            return torch.empty(shape, dtype=torch_dtype)
        flat = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype)
        return flat.as_strided(shape, [s // itemsize for s in strides])
    if kind == "memoryview":
        fmt = DTYPES[dtype]
        contiguous = _contiguous_strides(dtype, shape)
        if fmt is None or (strides != contiguous and 0 not in shape):
            raise ValueError(
                f"a memoryview cannot show this array ({dtype}, strides {strides}): read it "
                f"with kind='numpy' or kind='torch'"
            )
        if 0 in shape:
            if len(shape) == 1:
                return memoryview(b"").cast(fmt)  # type: ignore[call-overload]
            # memoryview.cast refuses a 0 in a shape of more than one dimension.
            raise ValueError(
                f"a memoryview cannot show an empty array of shape {tuple(shape)} (Python's "
                f"memoryview has no empty shape of more than one dimension): read it with "
                f"kind='numpy' or kind='torch'"
            )
        n = _ITEMSIZE[dtype]
        for d in shape:
            n *= d
        return memoryview(data)[:n].cast("B").cast(fmt, shape)  # type: ignore[call-overload]
    raise ValueError(f"kind must be 'numpy', 'torch' or 'memoryview', got {kind!r}")


def _contiguous_strides(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = _ITEMSIZE[dtype]
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))

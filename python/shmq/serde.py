"""Serialization for the object store.

A serde turns a value into ``(data, nbytes, metadata, metadata_nbytes)``; the store
writes ``[metadata][data...]`` into shared memory and later hands the same bytes back
to ``deserialize`` as one memoryview. Both serdes here frame the parts the same way:
``metadata`` is the number of parts and their lengths, so raw buffers (tensor and
array data) are stored as separate segments, copied once and never pickled.

``deserialize`` must copy whatever it keeps: the store may reuse the memory as soon as
the call returns (shmq checks this and raises if a view is kept).
"""

from __future__ import annotations

import logging
import pickle
import struct
import sys
from abc import ABC, abstractmethod
from typing import Any, Callable, Union

import msgpack

__all__ = ["MsgpackSerde", "ObjectSerde", "PickleSerde"]

logger = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]

_COUNT = struct.Struct("<I")


def _frame(parts: list[Buffer]) -> bytes:
    """Metadata for ``parts``: their count, then each length."""
    return _COUNT.pack(len(parts)) + struct.pack(f"<{len(parts)}Q", *[memoryview(p).nbytes for p in parts])


def _unframe(view: memoryview) -> list[memoryview]:
    """The parts framed by ``_frame``, as views into ``view``."""
    (n,) = _COUNT.unpack_from(view, 0)
    if n > (len(view) - 4) // 8:
        raise ValueError("corrupt object: bad part count")
    lengths = struct.unpack_from(f"<{n}Q", view, 4)
    at = 4 + 8 * n
    parts = []
    for length in lengths:
        if at + length > len(view):
            raise ValueError("corrupt object: a part runs past the end")
        parts.append(view[at : at + length])
        at += length
    return parts


def _byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class ObjectSerde(ABC):
    """Turns values into bytes for the object store and back."""

    @abstractmethod
    def serialize(self, value: Any) -> tuple[Union[Buffer, list[Buffer]], int, bytes, int]:
        """``(data, nbytes, metadata, metadata_nbytes)``: ``data`` is one buffer or a list
        of buffers stored one after another after ``metadata``."""

    @abstractmethod
    def deserialize(self, data_view: memoryview) -> Any:
        """The value stored from ``serialize``'s output; ``data_view`` is
        ``[metadata][data...]``. Must not keep references into ``data_view``."""


def _result(parts: list[Buffer]) -> tuple[Union[Buffer, list[Buffer]], int, bytes, int]:
    metadata = _frame(parts)
    nbytes = sum(memoryview(p).nbytes for p in parts)
    return (parts[0] if len(parts) == 1 else parts), nbytes, metadata, len(metadata)


class PickleSerde(ObjectSerde):
    """Pickle protocol 5 for everything; large buffers (numpy arrays, bytearrays, ...) go
    out of band as separate segments instead of through the pickle stream."""

    def serialize(self, value: Any) -> tuple[Union[Buffer, list[Buffer]], int, bytes, int]:
        buffers: list[pickle.PickleBuffer] = []
        body = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        try:
            raws = [b.raw() for b in buffers]
        except BufferError:  # a non-contiguous buffer: keep it in band
            raws, body = [], pickle.dumps(value, protocol=5)
        return _result([body, *raws])

    def deserialize(self, data_view: memoryview) -> Any:
        body, *raws = _unframe(data_view)
        return pickle.loads(body, buffers=[bytearray(r) for r in raws])


# Extension type codes of MsgpackSerde; 16..127 are free for registered types.
_EXT_NDARRAY = 1
_EXT_TENSOR = 2
_EXT_TUPLE = 3
_EXT_PICKLE = 4
_FIRST_USER_CODE = 16


class MsgpackSerde(ObjectSerde):
    """msgpack for multimodal items: nested dicts, lists and tuples of torch tensors and
    numpy arrays with str/bytes/int/float/bool/None leaves. Tensor and array data are
    stored as raw segments (not pickled) with their dtype and shape; anything else is
    pickled inside the msgpack stream. Every torch dtype (bfloat16, float8...) round-trips
    exactly; non-contiguous tensors are stored contiguous, and tensors on other devices
    are moved to the CPU (logged once). More types: ``MsgpackSerde.register``.
    """

    _registry: dict[type, tuple[int, Callable[[Any], bytes]]] = {}
    _decoders: dict[int, Callable[[bytes], Any]] = {}
    _warned_devices: set[str] = set()

    @classmethod
    def register(cls, type_: type, code: int, encode: Callable[[Any], bytes], decode: Callable[[bytes], Any]) -> None:
        """Store instances of ``type_`` (exactly that type) as ``encode(obj)`` bytes under
        extension ``code`` (16..127), read back with ``decode(bytes)``."""
        if not _FIRST_USER_CODE <= code <= 127:
            raise ValueError(f"extension codes for registered types are {_FIRST_USER_CODE}..127, got {code}")
        if code in cls._decoders and cls._registry.get(type_, (None,))[0] != code:
            raise ValueError(f"extension code {code} is already registered")
        cls._registry[type_] = (code, encode)
        cls._decoders[code] = decode

    def serialize(self, value: Any) -> tuple[Union[Buffer, list[Buffer]], int, bytes, int]:
        buffers: list[Buffer] = []

        def default(obj: Any) -> msgpack.ExtType:
            kind = type(obj)
            if kind is tuple:
                return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
            registered = self._registry.get(kind)
            if registered is not None:
                return msgpack.ExtType(registered[0], registered[1](obj))
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(obj, torch.Tensor):
                ext = self._encode_tensor(torch, obj, buffers)
                if ext is not None:
                    return ext
            np = sys.modules.get("numpy")
            if np is not None and kind is np.ndarray and not obj.dtype.hasobject and obj.dtype.fields is None:
                array = np.ascontiguousarray(obj)
                buffers.append(_byte_view(array.reshape(-1).view(np.uint8)))
                return msgpack.ExtType(_EXT_NDARRAY, pack([array.dtype.str, list(array.shape), len(buffers)]))
            return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=5))

        def pack(obj: Any) -> bytes:
            return msgpack.packb(obj, default=default, use_bin_type=True, strict_types=True)

        try:
            tree = pack(value)
        except (OverflowError, TypeError, ValueError):
            # msgpack refused a leaf it handles itself (e.g. an int over 64 bits): pickle all.
            buffers.clear()
            tree = msgpack.packb(msgpack.ExtType(_EXT_PICKLE, pickle.dumps(value, protocol=5)))
        return _result([tree, *buffers])

    def _encode_tensor(self, torch: Any, tensor: Any, buffers: list[Buffer]) -> Any:
        np = sys.modules.get("numpy")
        if np is None or tensor.layout != torch.strided or tensor.is_quantized or type(tensor) is not torch.Tensor:
            return None  # pickled instead
        t = tensor.detach()
        if t.device.type != "cpu":
            if t.device.type not in self._warned_devices:
                self._warned_devices.add(t.device.type)
                logger.warning("shmq MsgpackSerde: %s tensors are copied to the CPU to be stored", t.device.type)
            t = t.cpu()
        t = t.contiguous()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        dtype = str(t.dtype).removeprefix("torch.")
        buffers.append(_byte_view(t.reshape(-1).view(torch.uint8).numpy()))
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb([dtype, list(t.shape), len(buffers)]))

    def deserialize(self, data_view: memoryview) -> Any:
        tree, *raws = _unframe(data_view)

        def ext_hook(code: int, data: bytes) -> Any:
            if code == _EXT_TUPLE:
                return tuple(unpack(data))
            if code == _EXT_PICKLE:
                return pickle.loads(data)
            if code == _EXT_NDARRAY:
                import numpy as np

                dtype, shape, index = msgpack.unpackb(data)
                return np.frombuffer(bytearray(raws[index - 1]), dtype=np.dtype(dtype)).reshape(shape)
            if code == _EXT_TENSOR:
                import torch

                dtype_name, shape, index = msgpack.unpackb(data)
                dtype = getattr(torch, dtype_name)
                raw = raws[index - 1]
                if len(raw) == 0:
                    return torch.empty(shape, dtype=dtype)
                return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
            decode = self._decoders.get(code)
            if decode is None:
                raise ValueError(f"unknown msgpack extension code {code}: register its type with MsgpackSerde.register")
            return decode(data)

        def unpack(data: Buffer) -> Any:
            return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False, use_list=True)

        return unpack(tree)

"""Serialization for the object store.

A serde turns a value into ``(data, nbytes, metadata, metadata_nbytes)``; the store
writes ``[metadata][data...]`` into shared memory and later hands the same bytes back
to ``deserialize`` as one memoryview. Both serdes here frame the parts the same way:
``metadata`` is the number of parts and their lengths, so raw buffers (tensor and
array data) are stored as separate segments, copied once and never pickled.
``PickleSerde`` pickles with shmq's one pickler (``_oob``, the queue's and the encoder
cache's too); ``MsgpackSerde`` describes tensors and arrays (dtype, shape, bytes) with
the same tensor codec (``_tensor_codec``), whose one policy for tensors on other devices
the store shares with the encoder cache: copied to the CPU.

Inside the store the built-in serdes skip that framing: ``ObjectStorage`` asks them for
their parts (``_store_parts``), lays them out itself with the raw buffers on 64-byte
boundaries of shared memory, and hands them back as one view per part
(``_load_parts``). Any other serde is used through ``serialize``/``deserialize`` alone.

``deserialize`` must copy whatever it keeps: the store may reuse the memory as soon as
the call returns (shmq checks this and raises if a view is kept). The built-in serdes
need not: ``ObjectStorage.get`` gives ``_load_parts`` raw segments that are its to keep
(``raws_owned``): private copy-on-write views of large ones, which keep the object from
eviction while they live, and copies of small ones.
"""

from __future__ import annotations

import pickle
import struct
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Union

import msgpack

from ._oob import dumps_to_cpu
from ._tensor_codec import array_raw, rebuild_array, rebuild_tensor, tensor_raw

__all__ = ["MsgpackSerde", "ObjectSerde", "PickleSerde", "store_codec"]

Buffer = Union[bytes, bytearray, memoryview]

_COUNT = struct.Struct("<I")
_ONE_PART = struct.Struct("<IQ")


def _frame(parts: list[Buffer]) -> bytes:
    """Metadata for ``parts``: their count, then each length."""
    if len(parts) == 1 and type(parts[0]) is bytes:  # the common case, made cheap
        return _ONE_PART.pack(1, len(parts[0]))
    return _COUNT.pack(len(parts)) + struct.pack(f"<{len(parts)}Q", *[memoryview(p).nbytes for p in parts])


def _unframe(view: memoryview) -> list[memoryview]:
    """The parts framed by ``_frame``, as views into ``view``; ``ValueError`` for bytes
    that are not such a frame (too short for its part count, say: an object stored by
    another serde), never ``struct.error``."""
    if len(view) < _COUNT.size:
        raise ValueError(
            f"corrupt object: {len(view)} bytes, too few for its framing (was it stored by another serde?)"
        )
    (n,) = _COUNT.unpack_from(view, 0)
    if n == 1 and len(view) >= _ONE_PART.size:
        length = _ONE_PART.unpack_from(view, 0)[1]
        if _ONE_PART.size + length <= len(view):
            return [view[_ONE_PART.size : _ONE_PART.size + length]]
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
    if len(parts) == 1 and type(parts[0]) is bytes:
        return parts[0], len(parts[0]), metadata, len(metadata)
    nbytes = sum(memoryview(p).nbytes for p in parts)
    return parts, nbytes, metadata, len(metadata)


class PickleSerde(ObjectSerde):
    """Pickle protocol 5 for everything. Tensor and array data, and other large buffers
    (bytearrays, ...), go out of band as separate segments instead of through the pickle
    stream."""

    def serialize(self, value: Any) -> tuple[Union[Buffer, list[Buffer]], int, bytes, int]:
        return _result(self._store_parts(value))

    def deserialize(self, data_view: memoryview) -> Any:
        return self._load_parts(_unframe(data_view))

    def _store_parts(self, value: Any) -> list[Buffer]:
        """``[pickle stream, *out-of-band buffers]``: the parts the store lays out itself
        (the buffers 64-byte aligned). shmq's one pickler (``_oob``), in the flavour
        that copies tensors on other devices to the CPU."""
        body, buffers = dumps_to_cpu(value)
        return [body, *buffers]

    def _load_parts(self, parts: list[memoryview], raws_owned: bool = False) -> Any:
        body, *raws = parts
        if raws_owned:
            return pickle.loads(body, buffers=raws)
        return pickle.loads(body, buffers=[bytearray(r) for r in raws])


def store_codec(serde: Any) -> Optional[tuple[Callable[[Any], list[Buffer]], Callable[..., Any]]]:
    """For a built-in serde (not a subclass that changes how it serializes), or one
    whose class sets ``shmq_store_parts = True`` and has the two methods: its
    ``(value → parts, (parts, raws_owned=False) → value)`` pair, which the store uses to frame and align the
    parts itself. ``None`` for any other serde: the store then writes its
    ``[metadata][data...]`` as they come and hands ``deserialize`` one view of them."""
    cls = type(serde)
    if getattr(cls, "shmq_store_parts", False):  # a serde that gives the store its parts
        return serde._store_parts, serde._load_parts
    for base in (MsgpackSerde, PickleSerde):
        if isinstance(serde, base) and all(
            getattr(cls, name) is getattr(base, name)
            for name in ("serialize", "deserialize", "_store_parts", "_load_parts")
        ):
            return serde._store_parts, serde._load_parts
    return None


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
    pickled inside the msgpack stream. Every torch dtype (bfloat16, float8...) and numpy
    dtype (byte order included) round-trips exactly; non-contiguous data is stored
    contiguous, and tensors on other devices are moved to the CPU (logged once). More
    types: ``MsgpackSerde.register``.

    ``bytearray`` and ``memoryview`` leaves come back as ``bytes``: msgpack stores them as
    its binary type without asking (use ``PickleSerde`` to keep the exact type).
    """

    _registry: dict[type, tuple[int, Callable[[Any], bytes]]] = {}
    _decoders: dict[int, Callable[[bytes], Any]] = {}

    def __init__(self) -> None:
        self._encoders = threading.local()

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
        return _result(self._store_parts(value))

    def deserialize(self, data_view: memoryview) -> Any:
        return self._load_parts(_unframe(data_view))

    def _store_parts(self, value: Any) -> list[Buffer]:
        """``[msgpack tree, *raw segments]``: the parts the store lays out itself (the
        raw tensor and array data 64-byte aligned)."""
        encoder = getattr(self._encoders, "encoder", None)
        if encoder is None:
            encoder = self._encoders.encoder = _MsgpackEncoder(self._registry)
        return encoder.encode(value)

    def _load_parts(self, parts: list[memoryview], raws_owned: bool = False) -> Any:
        if len(parts) == 1:
            return _PLAIN_DECODER.unpack(parts[0])
        tree, *raws = parts
        try:
            return _MsgpackDecoder(raws, self._decoders, raws_owned).unpack(tree)
        finally:
            # The parts are views of shared memory: let none outlive this call.
            raws.clear()


class _MsgpackEncoder:
    """Encodes values for one thread: a reused ``msgpack.Packer`` (cheaper than
    ``packb``) whose ``default`` collects the raw segments of the value being encoded."""

    def __init__(self, registry: dict[type, tuple[int, Callable[[Any], bytes]]]):
        self.registry = registry
        self.buffers: list[Buffer] = []
        self.packer = msgpack.Packer(default=self.default, use_bin_type=True, strict_types=True)

    def encode(self, value: Any) -> list[Buffer]:
        """``[tree, *raw segments]``."""
        self.buffers = []
        try:
            tree = self.packer.pack(value)
        except (OverflowError, TypeError, ValueError):
            # msgpack refused a leaf it handles itself (e.g. an int over 64 bits): pickle all.
            self.packer.reset()
            self.buffers = []
            tree = msgpack.packb(msgpack.ExtType(_EXT_PICKLE, pickle.dumps(value, protocol=5)))
        return [tree, *self.buffers]

    def default(self, obj: Any) -> msgpack.ExtType:
        kind = type(obj)
        if kind is tuple:
            # A packer of its own: `self.packer` is in the middle of a pack.
            packed = msgpack.packb(list(obj), default=self.default, use_bin_type=True, strict_types=True)
            return msgpack.ExtType(_EXT_TUPLE, packed)
        registered = self.registry.get(kind)
        if registered is not None:
            return msgpack.ExtType(registered[0], registered[1](obj))
        raw = tensor_raw(obj)
        if raw is not None:
            self.buffers.append(raw[2])
            return msgpack.ExtType(_EXT_TENSOR, msgpack.packb([raw[0], raw[1], len(self.buffers)]))
        raw = array_raw(obj)
        if raw is not None:
            self.buffers.append(raw[2])
            return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb([raw[0], raw[1], len(self.buffers)]))
        return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=5))


class _MsgpackDecoder:
    """Decodes one stored object; ``raws`` are its raw segments (tensor and array data)."""

    def __init__(self, raws: list[Any], decoders: dict[int, Callable[[bytes], Any]], raws_owned: bool = False):
        self.raws = raws
        self.decoders = decoders
        #: Whether the raw segments are the caller's to keep (private views or copies).
        self.raws_owned = raws_owned

    def unpack(self, data: Buffer) -> Any:
        return msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == _EXT_PICKLE:
            return pickle.loads(data)
        if code in (_EXT_NDARRAY, _EXT_TENSOR):
            dtype, shape, index = msgpack.unpackb(data)
            rebuild = rebuild_array if code == _EXT_NDARRAY else rebuild_tensor
            raw = self.raws[index - 1]
            return rebuild(raw if self.raws_owned else bytearray(raw), dtype, shape)
        decode = self.decoders.get(code)
        if decode is None:
            raise ValueError(f"unknown msgpack extension code {code}: register its type with MsgpackSerde.register")
        return decode(data)


#: Decodes objects without raw segments (the common small case) without a new decoder.
_PLAIN_DECODER = _MsgpackDecoder([], MsgpackSerde._decoders)

"""shmq's one pickler: protocol 5 with out-of-band buffers, for the queue, the object
store's ``PickleSerde`` and the encoder cache.

``dumps(obj)`` (the queue's) and ``dumps_to_cpu(obj)`` (the store's and the encoder
cache's) return the pickle stream and the raw buffers it refers to; the caller stores or
sends them as separate parts (large ones through the tensor arena or 64-byte aligned in
the store, read as zero-copy views), and ``pickle.loads(body, buffers=...)`` rebuilds the
object on the other side.

- numpy arrays (plain ones: ``_tensor_codec.plain_dtype``) are reduced by the tensor codec
  (``_tensor_codec.reduce_array``): dtype (byte order included), shape, memory order and
  their bytes as one buffer, made contiguous once. (numpy's own protocol-5 pickling
  pickles a non-contiguous array in band and loses a non-native byte order on the
  way.) ``pickle.PickleBuffer`` objects give their buffers to protocol 5 themselves
  (contiguous ones; others are pickled in band).
- torch's own tensor pickling copies the storage through ``torch.save`` into the stream
  (several copies, never out of band), so tensors (``torch.Tensor`` and
  ``torch.nn.Parameter``) are reduced by the tensor codec instead
  (``_tensor_codec.reduce_tensor``): dtype, shape, ``requires_grad`` and their bytes as
  one buffer, made contiguous once. Every dtype works. Tensors on other devices follow
  the codec's one policy, in the flavour of each ``dumps``: the queue leaves them to
  torch's pickling (they come back on their device), the store and the encoder cache
  copy them to the CPU. Sparse and quantized tensors and subclasses keep torch's own
  pickling.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Callable, Optional, Sequence

from ._tensor_codec import array_type, on_cpu, reduce_array, reduce_tensor, same, tensor_types

__all__ = ["dumps", "dumps_to_cpu", "loads"]

_PROTOCOL = 5
_modules = sys.modules


class _Sink:
    """Where a pickler writes: ``write`` appends to a list (the C pickler writes a small
    pickle in one call at the end of ``dump``; a large one in frames of ~64 KiB)."""

    __slots__ = ("write",)

    def __init__(self, out: list[bytes]) -> None:
        self.write = out.append


class _Pickler(pickle.Pickler):
    """A reusable protocol-5 pickler that collects out-of-band buffers.

    It costs little more than ``pickle.dumps`` (docs/performance.md, "Small messages")
    because nothing Python runs per object pickle has a fast path for (dicts, lists, str, int...):
    ``reducer_override`` is called only for the rest, and the output goes to a list, not a
    ``BytesIO`` to rewind and copy out.
    """

    def __init__(self, to_cpu: bool) -> None:
        self.to_cpu = to_cpu
        self.out: list[bytes] = []
        self.buffers: list[memoryview] = []
        self._tensor: Optional[type] = None
        self._parameter: Optional[type] = None
        self._ndarray: Optional[type] = None
        super().__init__(_Sink(self.out), protocol=_PROTOCOL, buffer_callback=self._take)

    def _take(self, pb: pickle.PickleBuffer) -> bool:
        try:
            raw = pb.raw()
        except BufferError:
            return True  # not contiguous: pickled in band
        if raw.nbytes == 0:
            return True
        self.buffers.append(raw)
        return False

    def reducer_override(self, obj: Any) -> Any:
        # Called only for objects pickle has no fast path for (not dicts, lists, ints...).
        kind = type(obj)
        if kind is self._tensor:
            return reduce_tensor(obj, False, self.to_cpu)
        if kind is self._parameter:
            return reduce_tensor(obj, True, self.to_cpu)
        if kind is self._ndarray:
            return reduce_array(obj)
        # torch or numpy imported since this pickler last looked? (A dict lookup: this
        # runs for every object without a fast path, dataclasses and classes included.)
        if (self._tensor is None and "torch" in _modules) or (self._ndarray is None and "numpy" in _modules):
            return self._imported_since(obj)
        return NotImplemented

    def _imported_since(self, obj: Any) -> Any:
        """``reducer_override`` again once numpy's or torch's types are there."""
        found = False
        if self._ndarray is None:
            self._ndarray = array_type()
            found = self._ndarray is not None
        if self._tensor is None:
            types = tensor_types()
            if types is not None:
                self._tensor, self._parameter = types
                found = True
        return self.reducer_override(obj) if found else NotImplemented


class _CpuPickler(_Pickler):
    """The ``to_cpu`` flavour's pickler: also tensor subclasses on other devices go to
    the CPU (as their CPU copy, pickled by torch)."""

    def reducer_override(self, obj: Any) -> Any:
        tensor = self._tensor
        if tensor is not None and type(obj) is not tensor and isinstance(obj, tensor):
            if obj.device.type != "cpu":  # type: ignore[attr-defined]
                return same, (on_cpu(obj),)
        return super().reducer_override(obj)


_NO_BUFFERS: tuple = ()


def _dumper(to_cpu: bool) -> Callable[[Any], tuple[bytes, Sequence[memoryview]]]:
    """A ``dumps`` of the flavour ``to_cpu``, with its own picklers ready for reuse."""
    # Popped and pushed back: atomic under the GIL, so threads that dump at the same time
    # each get their own.
    picklers: list[_Pickler] = []

    def dumps(obj: Any) -> tuple[bytes, Sequence[memoryview]]:
        try:
            p = picklers.pop()
        except IndexError:
            p = _CpuPickler(True) if to_cpu else _Pickler(False)
        # A pickler whose dump raised is dropped, not reused (its output and buffers
        # would need clearing: the error path does not have to be fast).
        p.dump(obj)
        # The memo holds the objects just pickled (tensors included): let them go.
        p.clear_memo()
        out = p.out
        body = b"".join(out)  # the one piece itself when there is one
        out.clear()
        buffers = p.buffers
        if buffers:
            p.buffers = []
        else:
            buffers = _NO_BUFFERS  # type: ignore[assignment]
        if len(picklers) < 8:
            picklers.append(p)
        return body, buffers

    return dumps


#: ``obj`` pickled with protocol 5 for the queue: the stream and its out-of-band buffers
#: (tensors on other devices keep torch's pickling).
dumps = _dumper(to_cpu=False)
#: The same for the store and the encoder cache: tensors on other devices are copied to
#: the CPU (logged once per device type).
dumps_to_cpu = _dumper(to_cpu=True)

loads = pickle.loads

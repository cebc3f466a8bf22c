"""Pickling for the queue: protocol 5 with out-of-band buffers.

``dumps(obj)`` returns the pickle stream and the raw buffers it refers to; the queue
sends them as separate parts (large ones through the tensor arena, read as zero-copy
views), and ``pickle.loads(body, buffers=...)`` rebuilds the object on the other side.

- numpy arrays and ``pickle.PickleBuffer`` objects give their buffers to protocol 5
  themselves (contiguous ones; others are pickled in band).
- torch's own tensor pickling copies the storage through ``torch.save`` into the stream
  (several copies, never out of band), so plain CPU tensors (``torch.Tensor`` and
  ``torch.nn.Parameter``) are reduced by the tensor codec instead
  (``_tensor_codec.reduce_tensor``): dtype, shape, ``requires_grad`` and their bytes as
  one buffer, made contiguous once. Every dtype works. Other tensors (other devices,
  sparse, quantized, subclasses, non-leaf tensors that require grad) keep torch's own
  pickling.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional, Sequence

from ._tensor_codec import reduce_tensor, tensor_types

__all__ = ["dumps", "loads"]

_PROTOCOL = 5


class _Sink:
    """Where a pickler writes: ``write`` appends to a list (the C pickler writes a small
    pickle in one call at the end of ``dump``; a large one in frames of ~64 KiB)."""

    __slots__ = ("write",)

    def __init__(self, out: list[bytes]) -> None:
        self.write = out.append


class _Pickler(pickle.Pickler):
    """A reusable protocol-5 pickler that collects out-of-band buffers.

    It costs what ``pickle.dumps`` costs (the small object: within ~0.1 µs) because
    nothing Python runs per object pickle has a fast path for (dicts, lists, str, int...):
    ``reducer_override`` is called only for the rest, and the output goes to a list, not a
    ``BytesIO`` to rewind and copy out.
    """

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.buffers: list[memoryview] = []
        self._tensor: Optional[type] = None
        self._parameter: Optional[type] = None
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
            return reduce_tensor(obj, False)
        if kind is self._parameter:
            return reduce_tensor(obj, True)
        if self._tensor is None:
            types = tensor_types()  # torch imported since this pickler was made?
            if types is not None:
                self._tensor, self._parameter = types
                return self.reducer_override(obj)
        return NotImplemented


# Picklers ready for reuse (popped and pushed back: atomic under the GIL, so threads that
# enqueue at the same time each get their own).
_picklers: list[_Pickler] = []
_NO_BUFFERS: tuple = ()


def dumps(obj: Any) -> tuple[bytes, Sequence[memoryview]]:
    """``obj`` pickled with protocol 5: the stream and its out-of-band buffers."""
    try:
        p = _picklers.pop()
    except IndexError:
        p = _Pickler()
    # A pickler whose dump raised is dropped, not reused (its output and buffers would
    # need clearing: the error path does not have to be fast).
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
    if len(_picklers) < 8:
        _picklers.append(p)
    return body, buffers


loads = pickle.loads

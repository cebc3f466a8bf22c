"""Tensors and arrays in loaned memory: shared by ``MessageQueue`` and ``ObjectStorage``,
whose ``loan(nbytes)`` gives a writable memoryview of shared memory to fill in place."""

from __future__ import annotations

import math
import operator
import sys
from typing import Any, Callable, Optional

__all__ = ["loan_memory", "loaned_array", "loaned_tensor"]


def loan_memory(loan: Callable[[int], Optional[Any]], nbytes: Any, holds: Callable[[], str]) -> tuple[memoryview, bool]:
    """``nbytes`` of memory from a core ``loan`` (a writer's or a store's): the loaned
    shared memory, or ordinary memory when it has no room. Returns
    ``(memory, fell_back)``; ``ValueError`` unless ``nbytes`` is an int >= 0; ``MemoryError`` saying
    the size asked and what the shared memory holds (``holds()``, e.g. "the queue's
    tensor arena holds 1073741824 bytes") when ordinary memory cannot have it either."""
    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if nbytes == 0:
        return memoryview(bytearray()), False
    # More than an index can count is no loan (the core's size is a 64-bit number).
    view = loan(nbytes) if nbytes <= sys.maxsize else None
    if view is None:
        try:
            return memoryview(bytearray(nbytes)), True
        except (MemoryError, OverflowError):
            raise MemoryError(
                f"cannot loan {nbytes} bytes: {holds()}, and this process cannot allocate "
                f"that much ordinary memory instead"
            ) from None
    return memoryview(view), False


def _shape(shape: Any) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


def loaned_tensor(loan: Callable[[int], memoryview], shape: Any, dtype: Any = None) -> Any:
    """A torch tensor of ``shape`` and ``dtype`` (default float32) in ``loan(nbytes)``."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    shape = _shape(shape)
    # The dtype's own size, not a tensor made to ask it (about 2 µs a loan).
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(loan(nbytes), dtype=torch.uint8).view(dtype).reshape(shape)


def loaned_array(loan: Callable[[int], memoryview], shape: Any, dtype: Any = "float32") -> Any:
    """A numpy array of ``shape`` and ``dtype`` in ``loan(nbytes)``."""
    import numpy as np

    dtype = np.dtype(dtype)
    shape = _shape(shape)
    # Python ints: numpy's product of a huge shape wraps around (to 0, or negative).
    nbytes = math.prod(operator.index(d) for d in shape) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(loan(nbytes), dtype=dtype).reshape(shape)

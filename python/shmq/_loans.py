"""Tensors and arrays in loaned memory: shared by ``MessageQueue`` and ``ObjectStorage``,
whose ``loan(nbytes)`` gives a writable memoryview of shared memory to fill in place."""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["loan_memory", "loaned_array", "loaned_tensor"]


def loan_memory(loan: Callable[[int], Optional[Any]], nbytes: Any) -> tuple[memoryview, bool]:
    """``nbytes`` of memory from a core ``loan`` (a writer's or a store's): the loaned
    shared memory, or ordinary memory when it has no room. Returns ``(memory,
    fell_back)``; ``ValueError`` unless ``nbytes`` is an int >= 0."""
    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if nbytes == 0:
        return memoryview(bytearray()), False
    view = loan(nbytes)
    if view is None:
        return memoryview(bytearray(nbytes)), True
    return memoryview(view), False


def _shape(shape: Any) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


def loaned_tensor(loan: Callable[[int], memoryview], shape: Any, dtype: Any = None) -> Any:
    """A torch tensor of ``shape`` and ``dtype`` (default float32) in ``loan(nbytes)``."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    shape = _shape(shape)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(loan(nbytes), dtype=torch.uint8).view(dtype).reshape(shape)


def loaned_array(loan: Callable[[int], memoryview], shape: Any, dtype: Any = "float32") -> Any:
    """A numpy array of ``shape`` and ``dtype`` in ``loan(nbytes)``."""
    import numpy as np

    dtype = np.dtype(dtype)
    shape = _shape(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(loan(nbytes), dtype=dtype).reshape(shape)

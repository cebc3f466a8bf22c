"""Test objects: a deterministic stream of nested objects, exact comparison, a digest."""

from __future__ import annotations

import math
import random
from typing import Any, Iterator

import numpy as np

from .harness import STEP  # noqa: F401

_DTYPES = [
    "float64",
    "float32",
    "float16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint64",
    "bool",
    "complex64",
    "complex128",
    ">i4",  # non-native byte order must survive too
]
_KEYS = ["input_ids", "positions", "kv", "meta", "scheduler", "a", "b", "c", "é", "日本"]


def _random_array(rnd: random.Random, rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    """An array of ``lo..hi`` bytes (a zero-size one when ``hi`` is 0)."""
    dtype = np.dtype(rnd.choice(_DTYPES))
    n = rnd.randint(lo, hi) // dtype.itemsize
    ndim = rnd.randint(1, 3)
    if n == 0:
        shape = tuple([0] + [rnd.randint(1, 4) for _ in range(ndim - 1)])
    else:
        shape = [n]
        if ndim >= 2:
            for d in (2, 3, 4, 5, 7):
                if n % d == 0:
                    shape = [n // d, d]
                    break
        if ndim == 3 and len(shape) == 2 and shape[0] % 2 == 0:
            shape = [2, shape[0] // 2, shape[1]]
        shape = tuple(shape)
    size = int(np.prod(shape))
    if dtype.kind == "b":
        a = rng.integers(0, 2, size=size).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size=size, dtype=dtype.newbyteorder("="), endpoint=True)
    elif dtype.kind == "f":
        a = rng.standard_normal(size) * 1000
    else:
        a = rng.standard_normal(size) + 1j * rng.standard_normal(size)
    a = a.astype(dtype).reshape(shape)
    if a.ndim == 2 and rnd.random() < 0.3:
        a = np.asfortranarray(a)
    return a


def _random_str(rnd: random.Random, n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 _-éüß日本語🙂\n\t\\\"'"
    return "".join(rnd.choice(alphabet) for _ in range(n))


def _random_leaf(rnd: random.Random, rng: np.random.Generator) -> Any:
    k = rnd.randrange(9)
    if k == 0:
        return None
    if k == 1:
        return rnd.randint(-(2**70), 2**70)
    if k == 2:
        return rnd.uniform(-1e9, 1e9)
    if k == 3:
        return _random_str(rnd, rnd.randint(0, 40))
    if k == 4:
        return rnd.randbytes(rnd.randint(0, 64))
    if k == 5:
        return rnd.random() < 0.5
    if k == 6:
        return np.float32(rnd.uniform(-10, 10))
    if k == 7:
        return _random_array(rnd, rng, 0, 256)
    return (rnd.randint(0, 9), _random_str(rnd, 3))


def _random_nested(rnd: random.Random, rng: np.random.Generator, depth: int) -> Any:
    if depth == 0 or rnd.random() < 0.3:
        return _random_leaf(rnd, rng)
    if rnd.random() < 0.5:
        return [_random_nested(rnd, rng, depth - 1) for _ in range(rnd.randint(0, 5))]
    return {rnd.choice(_KEYS) + str(i): _random_nested(rnd, rng, depth - 1) for i in range(rnd.randint(0, 5))}


def iter_objects(seed: int, n: int, big: int = 64 * 1024) -> Iterator[Any]:
    """A deterministic stream of ``n`` objects of mixed types; about one in eight is
    larger than ``big`` bytes once pickled. Writer and readers each regenerate it from
    ``seed``, so a reader knows exactly what its ``i``-th object must be."""
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    for _ in range(n):
        k = rnd.randrange(16)
        if k == 0:
            yield None
        elif k == 1:
            yield _random_str(rnd, rnd.randint(0, 2000))
        elif k == 2:
            yield rnd.randbytes(rnd.randint(0, 4000))
        elif k in (3, 4, 5):
            yield _random_array(rnd, rng, 0, 16 * 1024)
        elif k in (6, 7, 8):
            yield _random_nested(rnd, rng, 4)
        elif k in (9, 10):
            yield {
                "step": rnd.randint(0, 10**6),
                "tokens": [rnd.randint(0, 50_000) for _ in range(rnd.randint(0, 300))],
                "hidden": _random_array(rnd, rng, 1, 8 * 1024),
                "prompt": _random_str(rnd, rnd.randint(0, 200)),
            }
        elif k == 11:
            yield rnd.randint(-(2**40), 2**40)
        elif k == 12:
            yield _random_array(rnd, rng, big + 1, 4 * big)  # overflows a chunk
        elif k == 13:
            yield rnd.randbytes(rnd.randint(big + 1, 3 * big))  # overflows a chunk
        elif k == 14:
            yield [_random_array(rnd, rng, 1, big // 2), _random_str(rnd, rnd.randint(big // 4, big))]
        else:
            yield (rnd.random(), _random_leaf(rnd, rng))


def same(a: Any, b: Any) -> bool:
    """Exact equality: same types all the way down; arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (float, np.floating)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def describe(obj: Any) -> str:
    if isinstance(obj, np.ndarray):
        return f"ndarray(dtype={obj.dtype}, shape={obj.shape})"
    return f"{type(obj).__name__}: {obj!r:.120}"


def digest_update(h: Any, obj: Any) -> None:
    """Feed a canonical encoding of ``obj`` (type, structure, exact values) into ``h``."""
    h.update(type(obj).__name__.encode() + b"\0")
    if isinstance(obj, np.ndarray):
        h.update(f"{obj.dtype.str}{obj.shape}".encode())
        h.update(obj.tobytes())
    elif isinstance(obj, dict):
        h.update(str(len(obj)).encode() + b"{")
        for k, v in obj.items():
            digest_update(h, k)
            digest_update(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(str(len(obj)).encode() + b"[")
        for v in obj:
            digest_update(h, v)
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        h.update(str(len(data)).encode() + b":" + data)
    elif isinstance(obj, bytes):
        h.update(str(len(obj)).encode() + b":" + obj)
    else:
        h.update(repr(obj).encode())
    h.update(b";")

"""Child processes of the encoder-cache tests (``test_encoder_cache.py``) and the values
both sides build the same way.

A *scripted* child runs commands sent by the test over a multiprocessing queue and
reports after each, so a test can interleave what several processes do. Every
blocking call has a timeout (``STEP``).
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import Any

import numpy as np
import torch

from _processes.harness import STEP, wait_for
from _processes.tensor_children import digest, scribble, tensors_in
from shmq import EncoderCacheConnector, EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer

MiB = 1 << 20

#: Every dtype this torch has (sub-byte, bit, float8/float4 and quantized ones included).
TORCH_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)


def _quantized(dtype: torch.dtype) -> bool:
    return str(dtype).startswith(("torch.qint", "torch.quint"))


def value_digest(value: Any) -> Any:
    """``digest`` of a value (the same for values without quantized tensors, which have
    no raw byte view: they are compared by their integers, scale and zero point)."""
    if isinstance(value, torch.Tensor) and value.is_quantized:
        return ("quantized", str(value.dtype), value.q_scale(), value.q_zero_point(), digest(value.int_repr()))
    if isinstance(value, dict):
        return ("dict", [(k, value_digest(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [value_digest(v) for v in value])
    return digest(value)


def filled(nbytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``nbytes`` of ``dtype`` with varied bits (made from random bytes)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return raw.view(torch.bool) & True  # valid bools only
    return raw.view(dtype)


def every_kind_of_value() -> dict[str, Any]:
    """Keys and values that cover what an encoder produces and more: every torch dtype
    (small and large), 0-d, empty and non-contiguous tensors, numpy arrays, nested
    structures of them with plain values."""
    values: dict[str, Any] = {}
    for i, dt in enumerate(TORCH_DTYPES):
        name = str(dt).removeprefix("torch.")
        if _quantized(dt):
            g = torch.Generator().manual_seed(i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized dtypes
                values[f"quantized-{name}"] = torch.quantize_per_tensor(torch.randn(256, 64, generator=g), 0.05, 3, dt)
            continue
        values[f"small-{name}"] = filled(256, dt, i)
        values[f"large-{name}"] = filled(MiB, dt, 100 + i).reshape(64, -1)
    base = torch.arange(MiB // 4, dtype=torch.float32).reshape(512, -1)
    values.update(
        {
            "zero-d": torch.tensor(3.5),
            "empty": torch.empty(0, 5),
            "transposed": base.t(),
            "strided": base[::3, 1::2],
            "numpy": np.arange(24, dtype=np.float64).reshape(4, 6),
            "numpy-big-endian": np.arange(10, dtype=">i4"),
            "image": {
                "embeds": filled(2 * MiB, torch.bfloat16, 7).reshape(-1, 1024),
                "grid": (torch.tensor([1, 24, 24]), [np.ones((2, 2)), "patch"]),
                "meta": {"ids": list(range(5)), "name": "img", "none": None},
            },
            "tuple": (torch.ones(3), torch.zeros(2, dtype=torch.int64)),
            # A content-hash key (the engines' mm_hash) of the longest allowed length.
            "x" * 160: torch.full((10,), 1.5),
        }
    )
    return values


def one_mib(i: int) -> torch.Tensor:
    """A 1 MiB float32 tensor that tells ``i`` apart."""
    return torch.full((MiB // 4,), float(i))


def scripted(out: Any, commands: Any, role: str, names: list[str], producer_options: dict | None = None) -> None:
    """Run commands from the test: ``role`` is "consumer", "index" or "producer".
    Each command is ``(name, *args)``; each is answered with one report."""
    if role == "consumer":
        side: Any = EncoderCacheConsumer(names)
    elif role == "index":
        side = EncoderCacheIndex(names)
    elif role == "connector":
        side = EncoderCacheConnector("consumer", producers=names)
    else:
        side = EncoderCacheProducer(names[0], **(producer_options or {}))
    held: list[Any] = []
    out.put(("ready", os.getpid()))
    while True:
        cmd, *args = commands.get(timeout=3 * STEP)
        if cmd == "exit":
            break
        if cmd == "wait_has":  # (keys): poll until every key is held
            (keys,) = args
            wait_for(lambda keys=keys: all(side.has(k) for k in keys), STEP, f"keys {keys}")
            out.put(("has", True))
        elif cmd == "has":  # (keys): has() of each now
            out.put(("has", [side.has(k) for k in args[0]]))
        elif cmd == "load":  # (keys, hold): load, report missing keys and digests
            keys, hold = args
            got: dict = {}
            missing = side.load(keys, got)
            out.put(("loaded", missing, {k: value_digest(v) for k, v in got.items()}))
            if hold:
                held.append(got)
            del got
            gc.collect()
        elif cmd == "ack":  # (keys): acknowledge without loading
            out.put(("acked", side.load(args[0])))
        elif cmd == "load_and_write":  # (key): load, write into it, report before/after
            (key,) = args
            got = {}
            assert not side.load([key], got)
            before = digest(got[key])
            scribble(got[key])
            written = digest(got[key])
            again: dict = {}
            side.load([key], again)
            out.put(("wrote", before, written, digest(again[key]), all(_writable(t) for t in tensors_in(got[key]))))
            held.append(got)
        elif cmd == "load_sequence":  # (n, timeout): keys k0..k{n-1} as they come
            n, timeout = args
            bad = []
            for i in range(n):
                key = f"k{i}"
                wait_for(lambda key=key: side.has(key), timeout, f"key {key}")
                got = {}
                assert not side.load([key], got), key
                if not bool(torch.all(got[key] == float(i))):
                    bad.append(i)
                del got
            out.put(("sequence", bad))
        elif cmd == "release":
            held.clear()
            gc.collect()
            out.put(("released",))
        elif cmd == "save":  # producer: (values, flush)
            values, flush = args
            saved = [side.save(k, v) for k, v in values.items()]
            if flush:
                side.flush(STEP)
            out.put(("saved", saved))
        elif cmd == "start_load":  # connector: (metadata): load the step's keys
            (meta,) = args
            cache: dict = {}
            side.bind_connector_metadata(meta)
            side.start_load_caches(cache)
            side.clear_connector_metadata()
            out.put(("started", {k: digest(v) for k, v in cache.items()}, sorted(side.take_unavailable())))
        else:
            raise ValueError(f"unknown command {cmd!r}")
    if role == "connector":
        side.shutdown()
    else:
        side.close()


def _writable(t: Any) -> bool:
    if isinstance(t, np.ndarray):
        return bool(t.flags.writeable) or t.size == 0
    return True


def holding_consumer(out: Any, names: list[str], key: str) -> None:
    """Load ``key``, keep it, report, then wait to be killed."""
    c = EncoderCacheConsumer(names)
    wait_for(lambda: c.has(key), STEP, f"key {key}")
    got: dict = {}
    assert not c.load([key], got)
    out.put(("holding", os.getpid()))
    time.sleep(3 * STEP)  # not synchronisation: holds the entry until killed

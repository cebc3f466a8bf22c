"""What every part of the benchmark shares: the objects sent, the queue geometry, the
shared clock, timing helpers, the arrays the tensor rows send (torch tensors, or numpy
arrays where torch is not installed), and the errors a run raises (``BenchError``: it
failed; ``Skip``: it cannot run here, and the message says what it needs)."""

from __future__ import annotations

import math
import pickle
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

#: The checkout of shmq this tree sits in (``bench/shmq_bench/`` in it): the scenarios that
#: need one (engine, cross-language) find its scripts, tests and Cargo.toml there.
ROOT = Path(__file__).resolve().parents[2]

#: The object every scenario sends (a scheduler step's batch, in miniature).
SMALL_OBJECT = {"req_ids": list(range(16)), "tokens": [[1, 2, 3, 4]] * 8, "flag": True, "name": "scheduler-output"}


def _step_object(n_requests: int = 64) -> dict:
    """A dict shaped like a decode step's scheduler output for ``n_requests`` requests:
    per request an id string, one new token id, a 16-entry block table (ids past 65535,
    as in a large KV cache) and sampling params; a dict of scheduled token counts; an
    empty set of finished requests. 64 requests: 12,986 bytes pickled."""
    ids = [f"cmpl-{i:032x}-0" for i in range(n_requests)]
    requests = [
        {
            "req_id": req_id,
            "new_token_ids": [1000 + 37 * i],
            "block_ids": list(range(70_000 + 16 * i, 70_000 + 16 * i + 16)),
            "num_computed_tokens": 512 + i,
            "sampling_params": {
                "temperature": 0.5 + i / 128,
                "top_p": 0.9 + i / 1280,
                "top_k": 50,
                "max_tokens": 1024,
                "seed": None,
                "stop_token_ids": [2],
            },
        }
        for i, req_id in enumerate(ids)
    ]
    return {
        "scheduled_cached_reqs": requests,
        "num_scheduled_tokens": {req_id: 1 for req_id in ids},
        "total_num_scheduled_tokens": n_requests,
        "finished_req_ids": set(),
    }


#: A step-sized message: a decode step's scheduler output for 64 requests (~12.7 KB).
STEP_OBJECT = _step_object(64)

#: The objects the ping-pong and throughput roles send, by name.
OBJECTS = {"small": SMALL_OBJECT, "step": STEP_OBJECT}

MiB = 1 << 20
#: Queue geometry of every shmq queue in the benchmark (24 MiB x 10 chunks: large enough
#: for a 16 MiB tensor in one chunk, as the project's performance targets assume).
MAX_CHUNK_BYTES = 24 * MiB
MAX_CHUNKS = 10

#: Seconds a child waits for a handle, a handshake or the other processes at a barrier.
SYNC_TIMEOUT = 30.0

PROTOCOL = pickle.HIGHEST_PROTOCOL

#: What a row that needs torch says when torch cannot be imported.
TORCH_HINT = "needs torch: pip install 'shmq[torch]'"


def now_ns() -> int:
    """A clock that every process on the machine shares (``CLOCK_MONOTONIC``)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class BenchError(RuntimeError):
    """A benchmark run failed; the message says which process and why."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class Skip(Exception):
    """A row (or cell) that cannot run on this machine: the message says what it needs
    (e.g. :data:`TORCH_HINT`). Not a failure."""


@dataclass(frozen=True)
class NotMeasured:
    """A floor's metric that was not measured: skipped (``failed`` False: ``reason`` says
    what it needs) or failed (``reason`` is the error)."""

    reason: str
    failed: bool = False


def torch_missing() -> Optional[str]:
    """``None`` when torch can be imported here, else what a row that needs it says."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return TORCH_HINT
    return None


def need_torch() -> None:
    """Raise :class:`Skip` unless torch can be imported."""
    reason = torch_missing()
    if reason is not None:
        raise Skip(reason)


def measure_parts(keys: Sequence[str], measure: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """``measure()``, or a :class:`NotMeasured` for each of ``keys`` when it skips or
    fails: one part of a floor must not take the floor's other rows with it."""
    try:
        return measure()
    except Skip as e:
        return {k: NotMeasured(str(e)) for k in keys}
    except Exception as e:  # noqa: BLE001 - shown in the table, the run goes on
        return {k: NotMeasured(f"{type(e).__name__}: {e}", failed=True) for k in keys}


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def time_per_call_us(fn: Callable[[], Any], calls: int, batch: int = 100) -> float:
    """Median time of one ``fn()`` in µs, over batches of ``batch`` calls (timing each
    batch, so the clock itself is not what is measured)."""
    clock = time.perf_counter_ns
    per_call = []
    for _ in range(max(10, calls // batch)):
        t0 = clock()
        for _ in range(batch):
            fn()
        per_call.append((clock() - t0) / batch / 1000)
    return statistics.median(per_call)


def array_lib() -> str:
    """What the tensor rows send here: ``"torch"`` tensors, or ``"numpy"`` arrays where
    torch cannot be imported (the transports move both the same way: protocol-5 buffers)."""
    return "torch" if torch_missing() is None else "numpy"


class Arrays:
    """One-dimensional float32 arrays of one library (``"torch"`` or ``"numpy"``): what a
    tensor role makes, fills, copies and checks, whichever library it was given.
    Made in a child, it keeps torch's intra-op threads at 1 (the machine's cores are
    the processes')."""

    def __init__(self, lib: str):
        self.lib = lib
        if lib == "torch":
            import torch

            torch.set_num_threads(1)
            self._torch = torch
        elif lib == "numpy":
            import numpy

            self._np = numpy
        else:
            raise ValueError(f"unknown array library {lib!r}")

    def full(self, numel: int, value: float) -> Any:
        """A new array of ``numel`` elements, each ``value``."""
        if self.lib == "torch":
            return self._torch.full((numel,), value)
        return self._np.full(numel, value, dtype=self._np.float32)

    def ones(self, numel: int) -> Any:
        return self.full(numel, 1.0)

    def empty(self, numel: int) -> Any:
        if self.lib == "torch":
            return self._torch.empty(numel)
        return self._np.empty(numel, dtype=self._np.float32)

    def fill(self, a: Any, value: float) -> None:
        if self.lib == "torch":
            a.fill_(value)
        else:
            a.fill(value)

    def copy(self, dst: Any, src: Any) -> None:
        """Every byte of ``src`` into ``dst`` (same size)."""
        if self.lib == "torch":
            dst.copy_(src)
        else:
            self._np.copyto(dst, src)

    def from_buffer(self, buf: Any) -> Any:
        """A float32 view of the writable buffer ``buf`` (no copy)."""
        if self.lib == "torch":
            return self._torch.frombuffer(buf, dtype=self._torch.float32)
        return self._np.frombuffer(buf, dtype=self._np.float32)

    @staticmethod
    def check(a: Any, value: float, who: str) -> None:
        """``a`` holds ``value`` at both ends (what a reader that consumed it checks)."""
        first, last = float(a[0]), float(a[-1])
        if first != value or last != value:
            raise RuntimeError(f"{who} read {first:g}...{last:g}, expected {value:g} (a wrong or torn message)")

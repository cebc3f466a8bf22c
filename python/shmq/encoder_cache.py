"""The encoder-cache hand-off: a producer's tensors, by key, to every consumer process.

An encoder process saves each image's embeddings under a content hash with
:class:`EncoderCacheProducer`; language-model workers load them by key as zero-copy
views with :class:`EncoderCacheConsumer`; a scheduler asks which keys are ready with
:class:`EncoderCacheIndex` (``has(key)`` only, from any process).
:mod:`shmq.vllm_ec_connector` is vLLM's encoder-cache connector over them (the
deprecated :class:`EncoderCacheConnector` is the same connector without vLLM's config).
Values are anything picklable; tensors and arrays travel as raw buffers.
All processes are on one machine::

    producer = EncoderCacheProducer("epd", capacity=256 << 20)   # encoder process
    producer.save(mm_hash, embedding)      # returns once room is reserved

    EncoderCacheIndex("epd").has(mm_hash)  # scheduler

    consumer = EncoderCacheConsumer("epd")                       # each worker
    missing = consumer.load([mm_hash], into=encoder_cache)       # views, no copy

A key is evicted, oldest first, once every live consumer has loaded it; when nothing
can go, ``save`` waits up to ``timeout`` and raises ``MemoryError``. More in
docs/guide.md ("Encoder cache"); what consumers that come and go, CUDA tensors and a
killed producer do: docs/design.md ("The encoder cache from Python"); the segment,
key index, pins and acknowledgements: ``crates/core/src/encoder_cache/``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import pickle
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from . import _core, _ipc, _oob
from ._ec_connector import _Connector
from ._device_reader import DeviceSources
from ._cleanup import created_segments

__all__ = [
    "EncoderCacheConnector",
    "EncoderCacheConsumer",
    "EncoderCacheIndex",
    "EncoderCacheMetadata",
    "EncoderCacheProducer",
    "MAX_KEY_LEN",
]

log = logging.getLogger(__name__)

#: Longest key, in bytes of UTF-8.
MAX_KEY_LEN: int = _core.ENCODER_CACHE_MAX_KEY_LEN


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every torch tensor in it (through dicts, lists and
    tuples); the same object when nothing changed."""
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        new = {k: _map_tensors(v, fn) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else new
    if isinstance(obj, (list, tuple)):
        new_items = [_map_tensors(v, fn) for v in obj]
        if all(a is b for a, b in zip(new_items, obj, strict=True)):
            return obj
        if isinstance(obj, list):
            return new_items
        return type(obj)(*new_items) if hasattr(obj, "_fields") else type(obj)(new_items)
    return obj


def _names(producers: str | Iterable[str]) -> list[str]:
    return [producers] if isinstance(producers, str) else list(producers)


class EncoderCacheProducer:
    """The producer of an encoder cache: one shared-memory segment that this process
    alone writes, named ``name`` (default: a fresh unique name; see :attr:`name`).

    - ``capacity``: bytes of entry data (address space; ``/dev/shm`` pages are reserved
      as they are first used, and never more than this). When ``/dev/shm`` runs out
      first, it is handled as a full capacity: loaded keys are evicted and their pages
      given back to ``/dev/shm``; ``save`` waits, then raises ``MemoryError`` naming
      ``/dev/shm``. While loaded keys may go, an eighth of ``/dev/shm`` (at most 64 MiB)
      is left free for other segments;
    - ``max_entries``: most keys held at once; ``max_consumers``: most consumers (≤ 64);
    - ``min_consumers``: a key counts as loaded only once at least this many consumers
      loaded it (besides every live consumer that joined before it was saved). With the
      default 0, keys saved while no consumer is joined are evictable at once;
    - ``timeout``: default seconds ``save`` waits for room (then ``MemoryError``);
    - ``max_pending``: saves whose copy may be queued at once (``save`` waits for one to
      finish beyond that);
    - ``ipc``: device tensors are published by IPC handle instead of being copied into
      the cache (CUDA tensors through CUDA IPC; with the CPU twin of the device seam,
      every tensor: see ``device_seam``). The entry holds the handles (and, with
      ``ipc_host_copy``, a host copy for consumers that cannot open them); each consumer
      opens a handle once per allocation (cached, bounded) and copies from it into its
      own device memory on ``load(..., device=)``. This process keeps each published
      tensor until its entry is evicted and no consumer holds it any more (a consumer
      that dies holds nothing). Off by default: no GPU has run this path yet (issue 55);
    - ``ipc_host_copy``: with ``ipc``, also copy each tensor into the cache, so that a
      consumer that cannot open a handle (another GPU's process, no GPU) reads the host
      copy (one log line); without it such a consumer finds the key missing (logged
      once) and the entry is published as soon as its handles are, with no copy;
    - ``device_seam``: ``"cuda"``, ``"twin"``, a ``Device`` or ``None`` (``SHMQ_DEVICE``),
      see docs/guide.md ("The device path").

    Starting a producer under the name of one that died replaces its segment; under the
    name of a live one raises ``ValueError``.
    """

    def __init__(
        self,
        name: Optional[str] = None,
        *,
        capacity: int = 1 << 30,
        max_entries: int = 4096,
        max_consumers: int = 16,
        min_consumers: int = 0,
        timeout: float = 60.0,
        max_pending: int = 4,
        ipc: bool = False,
        ipc_host_copy: bool = False,
        device_seam: Any = None,
    ):
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        _core.timeout_seconds(timeout)  # a bad one is refused here, not at the first save
        self._core = _core.EncoderCacheProducer(name, capacity, max_entries, max_consumers, min_consumers)
        created_segments()
        self.timeout = timeout
        self._slots = threading.BoundedSemaphore(max_pending)
        self._copier = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"shmq-encoder-cache-{self._core.name}"
        )
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future] = set()
        self._error: Optional[BaseException] = None
        self._callbacks: dict[str, list[Callable[[str, bool], Any]]] = {}
        self._wake_monitor = threading.Event()
        self._monitor: Optional[threading.Thread] = None
        self._closed = False
        self.ipc, self.ipc_host_copy, self.device_seam = bool(ipc), bool(ipc_host_copy), device_seam
        #: Tensors published by IPC handle, by key: kept until the entry is gone for good.
        self._exported: dict[str, list[Any]] = {}
        #: Of those, the keys evicted whose memory a consumer may still hold.
        self._retired: dict[str, list[Any]] = {}
        #: Keys whose save is still being copied (not in ``keys()`` yet): how many saves.
        self._publishing: dict[str, int] = {}

    @property
    def name(self) -> str:
        """The name consumers open this cache by."""
        return self._core.name

    @property
    def segment_name(self) -> str:
        """The segment in ``/dev/shm`` (``shmq_ec_<name>``)."""
        return self._core.segment_name

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError(f"encoder cache producer {self.name!r} is closed")
        with self._lock:  # the copier thread sets it under the same lock
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"an earlier save to encoder cache {self.name!r} failed: {error}") from error

    def save(
        self,
        key: str,
        value: Any,
        *,
        timeout: Optional[float] = None,
        on_loaded: Optional[Callable[[str, bool], Any]] = None,
    ) -> bool:
        """Save ``value`` (a tensor, or any picklable structure of tensors, arrays and
        plain values) under ``key``. Returns once room is reserved; the copy runs on a
        background thread, and the key is visible to consumers (``has``) once it is
        published. Returns False if the key is held already (keys name their content,
        so nothing is copied into the cache; a key already published is not even
        serialized).

        When the cache (or ``/dev/shm``) is full it evicts the oldest keys every live
        consumer has loaded; if none can go it waits up to ``timeout`` seconds (default:
        the producer's) and raises ``MemoryError``. Do not change the tensors until the save is published
        (:meth:`flush`): the copy reads them. CUDA tensors are copied to the CPU first.
        ``on_loaded``: see :meth:`on_loaded`.
        """
        self._check()
        reservation = None
        # A key already published (the common case for repeated images): no work at all.
        if not self._core.has(key):
            # As the core takes it (None: no limit, also for inf or more than 10⁹ s):
            # the semaphore's own timeout overflows where the core's does not.
            timeout = _core.timeout_seconds(self.timeout if timeout is None else timeout)
            exported: list[Any] = []
            if self.ipc:
                self._sweep_exported()
                value = _ipc.publish(value, self.device_seam, self.ipc_host_copy, exported)
            body, buffers = _oob.dumps_to_cpu(value)
            if not self._slots.acquire(timeout=timeout):
                raise TimeoutError(
                    f"encoder cache {self.name!r}: earlier saves are still being copied after {timeout} s"
                )
            try:
                reservation = self._core.reserve(key, [len(body), *(b.nbytes for b in buffers)], timeout)
            except BaseException:
                self._slots.release()
                raise
            if reservation is None:  # held already (its copy still running)
                self._slots.release()
            else:
                with self._lock:
                    self._publishing[key] = self._publishing.get(key, 0) + 1
                    if exported:
                        self._exported[key] = exported
                future = self._copier.submit(self._copy, key, reservation, [body, *buffers])
                with self._lock:
                    self._pending.add(future)
                future.add_done_callback(self._done)
        if on_loaded is not None:
            self.on_loaded(key, on_loaded)
        return reservation is not None

    def _sweep_exported(self) -> None:
        """Let go of the tensors of entries that are gone for good: evicted (or never
        published) and held by no consumer (the cache has no evicted entry still mapped;
        coarse: while any is, every evicted entry's tensors are kept)."""
        with self._lock:
            if not self._exported and not self._retired:
                return
            keys = set(self._core.keys()) | set(self._publishing)
            for key in [k for k in self._exported if k not in keys]:
                # A key saved again after an eviction: both generations' tensors wait.
                self._retired.setdefault(key, []).extend(self._exported.pop(key))
            if self._retired:
                self._core.sweep()  # frees the evicted entries no consumer maps any more
                if self._core.stats()["zombies"] == 0:
                    self._retired.clear()

    def exported(self) -> dict[str, int]:
        """``held`` (entries whose tensors are published by IPC handle) and ``retired``
        (evicted, kept until no consumer holds them)."""
        self._sweep_exported()
        with self._lock:
            return {"held": len(self._exported), "retired": len(self._retired)}

    def _copy(self, key: str, reservation: Any, parts: list) -> None:
        try:
            reservation.fill_and_publish(parts)
        except BaseException as e:  # surfaced by the next call (never dropped)
            log.error("shmq: a save to encoder cache %r failed: %s", self.name, e)
            with self._lock:
                if self._error is None:
                    self._error = e
            raise
        finally:
            with self._lock:
                left = self._publishing.pop(key) - 1
                if left:
                    self._publishing[key] = left
            self._slots.release()

    def _done(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every save so far is published (``TimeoutError`` after
        ``timeout``); raises if one of them failed."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = concurrent.futures.wait(pending, timeout=_core.timeout_seconds(timeout))
        if not_done:
            raise TimeoutError(f"encoder cache {self.name!r}: {len(not_done)} saves not published after {timeout} s")
        if not self._closed:
            self._check()

    def has(self, key: str) -> bool:
        """Whether ``key`` is held and published."""
        return self._core.has(key)

    def keys(self) -> list[str]:
        """The keys held, oldest first."""
        return self._core.keys()

    def evict(self, key: str) -> bool:
        """Evict ``key`` now, loaded or not: consumers stop seeing it at once; views they
        hold stay valid (its memory is reused only after the last one is gone). A save
        still being copied is dropped. Whether the key was held."""
        return self._core.evict(key)

    def is_loaded(self, key: str) -> bool:
        """Whether every live consumer that joined before ``key`` was saved has loaded
        it (and at least ``min_consumers`` did). ``KeyError`` for a key not held."""
        state = self._core.load_state(key)
        if state == "unknown":
            raise KeyError(key)
        return state == "loaded"

    def wait_loaded(self, key: str, timeout: Optional[float] = None) -> None:
        """Wait until every live consumer that joined before ``key`` was saved has
        loaded it (and at least ``min_consumers`` did). Consumers that die stop counting.
        ``TimeoutError`` (naming who has not loaded it) after ``timeout`` seconds;
        ``KeyError`` for a key not held (or evicted before it was loaded)."""
        self._core.wait_loaded(key, timeout)

    def on_loaded(self, key: str, callback: Callable[[str, bool], Any]) -> None:
        """Call ``callback(key, True)`` (on a background thread) once ``key`` is loaded
        as in :meth:`wait_loaded`, or ``callback(key, False)`` if it goes (evicted, or
        never saved) before that."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"encoder cache producer {self.name!r} is closed")
            self._callbacks.setdefault(key, []).append(callback)
            if self._monitor is None:
                self._monitor = threading.Thread(
                    target=self._watch, name=f"shmq-encoder-cache-{self.name}-loaded", daemon=True
                )
                self._monitor.start()
        self._wake_monitor.set()

    def _watch(self) -> None:
        """The callbacks' thread: sleeps on the consumers' doorbell while keys are
        pending (waking at least every 0.2 s)."""
        while not self._closed:
            with self._lock:
                keys = list(self._callbacks)
            if not keys:
                self._wake_monitor.wait(0.5)
                self._wake_monitor.clear()
                continue
            try:
                done = self._core.wait_any_loaded(keys, 0.2)
            except Exception as e:  # closed meanwhile
                if not self._closed:
                    log.error("shmq: encoder cache %r: watching loads failed: %s", self.name, e)
                return
            for key, state in done:
                with self._lock:
                    callbacks = self._callbacks.pop(key, [])
                for cb in callbacks:
                    try:
                        cb(key, state == "loaded")
                    except Exception:
                        log.exception("shmq: encoder cache %r: on_loaded callback for %r failed", self.name, key)

    def consumers(self) -> list[tuple[int, int, bool, int]]:
        """``(slot, pid, alive, keys loaded)`` of each consumer joined now."""
        return self._core.consumers()

    def stats(self) -> dict[str, int]:
        """``entries``, ``pending`` (saves being copied), ``zombies`` (evicted, still
        mapped by a consumer), ``bytes_in_use``, ``reserved`` (bytes of ``/dev/shm`` it
        holds now), ``capacity``, ``saves``, ``evictions``."""
        return self._core.stats()

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Publish the saves in progress (waiting up to ``timeout``), then stop serving:
        consumers stop seeing the keys, views they hold stay valid, and the segment's
        name is removed. Idempotent."""
        if self._closed:
            return
        try:
            self.flush(timeout)
            if self._exported or self._retired:
                # Published device tensors stay until no consumer holds their entry (a
                # copy from one may be in flight), at most `timeout`.
                for key in self._core.keys():
                    self._core.evict(key)
                seconds = _core.timeout_seconds(timeout)
                deadline = None if seconds is None else time.monotonic() + seconds
                while self.exported()["retired"] and (deadline is None or time.monotonic() < deadline):
                    self._core.sweep()
                    time.sleep(0.005)
        finally:
            with self._lock:
                self._closed = True
                self._exported.clear()
                self._retired.clear()
            self._wake_monitor.set()
            self._copier.shutdown(wait=False)
            self._core.close()

    def __enter__(self) -> "EncoderCacheProducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EncoderCacheProducer(name={self.name!r})"


def _decode(parts: list) -> Any:
    body, *buffers = parts
    return pickle.loads(body, buffers=buffers)


class EncoderCacheConsumer:
    """A consumer of one or more producers (their names). It joins each producer now, so
    each waits for it to load what is saved from then on; a producer that is not there
    yet is looked for (every 0.1 s at most) by the consumer's calls, and joined by the
    first one after it appears.
    ``device``: where :meth:`load` puts tensors by default (``None``: zero-copy CPU
    views)."""

    def __init__(self, producers: str | Iterable[str], *, device: Any = None, device_seam: Any = None):
        self._core = _core.EncoderCacheConsumer(_names(producers))
        self.device = device
        #: The device seam of ``load(..., device=)`` (docs/guide.md, "The device path").
        self.device_seam = device_seam
        self._device: Optional[DeviceSources] = None

    def has(self, key: str) -> bool:
        """Whether some producer holds ``key`` now."""
        return self._core.has(key)

    def load(self, keys: str | Iterable[str], into: Optional[dict] = None, device: Any = None) -> list[str]:
        """Load ``keys`` into the dict ``into`` and return the keys no producer holds.

        Values come back as saved; their tensors are views of shared memory (no copy),
        writable, and private to this process (copy-on-write), unless ``device`` (default:
        the consumer's) is given: then they are copied onto it, from this process's
        *shared* mapping of the producer's segment (registered with the device block by block, per
        producer), and the entry is held until each copy's event says it ended (checked
        at each ``device=`` load, by ``release_device_copies()``,
        ``wait_device_copies()`` and ``close()``). A tensor published by IPC handle
        (``EncoderCacheProducer(ipc=True)``) is opened once per allocation and copied on
        the device; one that cannot be opened takes the entry's host copy, or, without
        one, makes its key missing (logged once). The key's memory stays held while any
        of the views lives. Each key loaded is acknowledged to its producer. With
        ``into=None`` the keys are only acknowledged (for a consumer that has them
        already or does not need them), without mapping anything.
        """
        device = self.device if device is None else device
        missing = []
        for key in [keys] if isinstance(keys, str) else keys:
            if into is None:
                if not self._core.acknowledge(key):
                    missing.append(key)
                continue
            parts = self._core.load(key)
            if parts is None:
                missing.append(key)
                continue
            value = _decode(parts)
            if _ipc.has_handles(value):
                sources = self._sources()
                host_to_device = functools.partial(sources.to_device, views=parts[1:], device=device)
                try:
                    value = _ipc.resolve(value, device, sources, (parts, value), host_to_device)
                except _ipc.CannotOpen:
                    missing.append(key)
                    continue
            elif device is not None and (str(device) != "cpu" or self.device_seam is not None):
                value = self._sources().to_device(value, parts[1:], device)
            del parts
            into[key] = value
        return missing

    def _sources(self) -> DeviceSources:
        if self._device is None:
            self._device = DeviceSources(f"encoder cache {self._core.producers()!r}", self.device_seam)
        return self._device

    def release_device_copies(self) -> int:
        """Give back the entries whose copies to device memory ended; how many copies are
        still in flight."""
        return self._device.release_done() if self._device is not None else 0

    def wait_device_copies(self) -> None:
        """Wait until every copy to device memory ended, and give back the entries they held."""
        if self._device is not None:
            self._device.wait_all()

    def opened_handles(self) -> int:
        """IPC allocations open in this process now (at most ``shmq._ipc.MAX_OPEN_HANDLES``,
        shared by every receiver of the process)."""
        return _ipc.open_handles()

    def get(self, key: str, device: Any = None) -> Any:
        """The value of ``key`` (as :meth:`load` gives it); ``KeyError`` if no producer
        holds it."""
        out: dict = {}
        if self.load([key], out, device):
            raise KeyError(key)
        return out[key]

    def producers(self) -> list[tuple[str, bool]]:
        """``(segment name, open now)`` for each producer."""
        return self._core.producers()

    def close(self) -> None:
        """Wait for the copies to device memory in flight and leave every producer
        (views already loaded stay valid until they go)."""
        sources, self._device = self._device, None
        if sources is not None:
            sources.close()
        self._core.close()

    def __enter__(self) -> "EncoderCacheConsumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class EncoderCacheIndex:
    """``has(key)`` for the keys of one or more producers, from any process (e.g. the
    scheduler): a lookup in their key indexes in shared memory. It loads nothing and
    joins nothing, so no producer waits for it."""

    def __init__(self, producers: str | Iterable[str]):
        self._core = _core.EncoderCacheConsumer(_names(producers), index_only=True)

    def has(self, key: str) -> bool:
        """Whether some producer holds ``key`` now."""
        return self._core.has(key)

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The keys of ``keys`` that no producer holds now."""
        has = self._core.has
        return [k for k in keys if not has(k)]

    def close(self) -> None:
        self._core.close()


@dataclass
class EncoderCacheMetadata:
    """Deprecated with :class:`EncoderCacheConnector`, whose step's metadata it is: the
    keys (``mm_hash``) to load, with their number of encoder tokens when known.
    Picklable."""

    mm_hashes: list[str] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, mm_hash: str, num_tokens: Optional[int] = None) -> None:
        if mm_hash not in self.mm_hashes:
            self.mm_hashes.append(mm_hash)
        if num_tokens is not None:
            self.num_tokens[mm_hash] = num_tokens


class EncoderCacheConnector(_Connector):
    """Deprecated (warns when made): :class:`shmq.vllm_ec_connector.ShmqECConnector` is
    shmq's encoder-cache connector; outside vLLM, use the cache's classes
    (:class:`shmq.encoder_cache.EncoderCacheProducer`, ``EncoderCacheConsumer``,
    ``EncoderCacheIndex``). This is that connector, each call the same, with its side
    named by ``role`` instead of vLLM's config and :class:`EncoderCacheMetadata` for the
    step's metadata:

    - ``"scheduler"``: the scheduler side of a consumer of ``producers``;
    - ``"producer"``: an encoder worker, saving into a producer named ``name`` (default:
      a fresh one) made with ``producer_options``;
    - ``"consumer"``: a language-model worker loading from ``producers`` (tensors onto
      ``device``).
    """

    ROLES = ("scheduler", "producer", "consumer")

    def __init__(
        self,
        role: str,
        *,
        producers: str | Sequence[str] = (),
        name: Optional[str] = None,
        device: Any = None,
        **producer_options: Any,
    ):
        warnings.warn(
            "shmq.EncoderCacheConnector is deprecated: use shmq.vllm_ec_connector.ShmqECConnector (the same "
            "connector, as vLLM loads it), or EncoderCacheProducer, EncoderCacheConsumer and EncoderCacheIndex",
            DeprecationWarning,
            stacklevel=2,
        )
        if role not in self.ROLES:
            raise ValueError(f"role must be one of {self.ROLES}, got {role!r}")
        if role != "producer" and not _names(producers):
            raise ValueError(f"the {role} role needs the producers' names")
        self.role = role
        producer = EncoderCacheProducer(name, **producer_options) if role == "producer" else None
        super().__init__(
            producer.name if producer is not None else ", ".join(_names(producers)),
            is_producer=role == "producer",
            is_consumer=role != "producer",
            index=EncoderCacheIndex(producers) if role == "scheduler" else None,
            producer=producer,
            consumer=EncoderCacheConsumer(producers, device=device) if role == "consumer" else None,
        )

    def _metadata(self, to_load: dict[str, Optional[int]]) -> EncoderCacheMetadata:
        return EncoderCacheMetadata(list(to_load), {k: n for k, n in to_load.items() if n is not None})
